"""OTLP trace decoding: protobuf and Collector-style JSON bytes -> list[SpanRecord].

Three parts: the protobuf decoder (`proto`, the ingest hot path), the JSON decoder
(`json_decode`) and the conversion between the two encodings (`transcode`, for `loopwatch
produce`); `common` holds what they share. Every malformed input raises exactly
`DecodeError`, whose message names the source and the reason (positions and keys, never
attribute values).
"""

from __future__ import annotations

from collections.abc import Callable

from streams.errors import DecodeError
from streams.spanpath.otlp.common import (
    ANY_VALUE_KINDS,
    ENCODINGS,
    OTLP_JSON,
    OTLP_PROTO,
    SPAN_KINDS,
    STATUS_CODES,
    AnyValueKind,
)
from streams.spanpath.otlp.json_decode import _show, decode_json, decode_json_py
from streams.spanpath.otlp.proto import decode_proto, decode_proto_py
from streams.spanpath.otlp.transcode import json_to_proto_bytes, proto_to_json_bytes
from streams.spanpath.spans import SpanRecord

__all__ = [
    "ANY_VALUE_KINDS",
    "ENCODINGS",
    "OTLP_JSON",
    "OTLP_PROTO",
    "SPAN_KINDS",
    "STATUS_CODES",
    "AnyValueKind",
    "decode_json",
    "decode_proto",
    "decode_record",
    "decode_record_py",
    "json_to_proto_bytes",
    "proto_to_json_bytes",
]


def decode_record(value: bytes, encoding: str, source: str) -> list[SpanRecord]:
    """Decode one Kafka record value / file message in the named kafkaexporter encoding
    (the native decoders when the extension is built)."""
    return _decode(value, encoding, source, decode_proto, decode_json)


def decode_record_py(value: bytes, encoding: str, source: str) -> list[SpanRecord]:
    """`decode_record` with the pure-Python decoders (the reference)."""
    return _decode(value, encoding, source, decode_proto_py, decode_json_py)


def _decode(
    value: bytes,
    encoding: str,
    source: str,
    proto: Callable[[bytes, str], list[SpanRecord]],
    json: Callable[[bytes, str], list[SpanRecord]],
) -> list[SpanRecord]:
    if value is None:
        raise DecodeError(f"{source}: record has no value")
    if encoding == OTLP_PROTO:
        return proto(value, source)
    if encoding == OTLP_JSON:
        return json(value, source)
    raise DecodeError(
        f"{source}: unknown encoding {_show(encoding)} (expected one of {', '.join(ENCODINGS)})"
    )
