"""Test helper: OTLP export messages from decoded spans (tests/spankit.py) and from the
example files, as the collector's kafkaexporter would put them on Kafka.

* `encode_request(spans)`: one serialized ExportTraceServiceRequest (protobuf) of SpanRecords,
  grouped by resource as an SDK exporter does.
* `file_messages(path)`: the export messages of a fileexporter file (`.pb` length-prefixed
  protobuf, `.jsonl` OTLP JSON lines), as protobuf bytes.
* `replay_messages(messages, policy)`: what `loopwatch replay` computes from the same
  exports: (events, summaries).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from detectors.fingerprint import Fingerprinter
from detectors.policy import Policy
from streams.replay.runs import Replay
from streams.spanpath.otlp import decode_record, json_to_proto_bytes, proto_to_json_bytes
from streams.spanpath.spans import SpanRecord

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _any(value: Any) -> AnyValue:
    v = AnyValue()
    if isinstance(value, bool):
        v.bool_value = value
    elif isinstance(value, int):
        v.int_value = value
    elif isinstance(value, float):
        v.double_value = value
    elif isinstance(value, bytes):
        v.bytes_value = value
    elif isinstance(value, list | tuple):
        v.array_value.values.extend(_any(x) for x in value)
    elif isinstance(value, dict):
        v.kvlist_value.values.extend(_kv(k, x) for k, x in value.items())
    else:
        v.string_value = str(value)
    return v


def _kv(key: str, value: Any) -> KeyValue:
    return KeyValue(key=key, value=_any(value))


def encode_request(spans: Iterable[SpanRecord], *, trace_id_bytes: int | None = None) -> bytes:
    """Serialized ExportTraceServiceRequest. `trace_id_bytes` truncates the trace ids (to
    build an invalid export, e.g. 6-byte ids)."""
    req = ExportTraceServiceRequest()
    by_resource: dict[str, Any] = {}
    for span in spans:
        rkey = json.dumps(span.resource, sort_keys=True, default=str)
        scope_spans = by_resource.get(rkey)
        if scope_spans is None:
            rs = req.resource_spans.add()
            rs.resource.attributes.extend(_kv(k, v) for k, v in span.resource.items())
            scope_spans = rs.scope_spans.add()
            scope_spans.scope.name = span.scope_name or "tests.otlp_build"
            by_resource[rkey] = scope_spans
        pb = scope_spans.spans.add()
        tid = bytes.fromhex(span.trace_id)
        pb.trace_id = tid[:trace_id_bytes] if trace_id_bytes else tid
        pb.span_id = bytes.fromhex(span.span_id)
        if span.parent_span_id:
            pb.parent_span_id = bytes.fromhex(span.parent_span_id)
        pb.name = span.name
        pb.kind = Span.SpanKind.ValueType(span.kind)
        pb.start_time_unix_nano = span.start_ns
        pb.end_time_unix_nano = span.end_ns
        pb.status.code = Status.StatusCode.ValueType(span.status_code)
        if span.status_message:
            pb.status.message = span.status_message
        pb.attributes.extend(_kv(k, v) for k, v in span.attributes.items())
        for ev in span.events:
            e = pb.events.add()
            e.name = ev.name
            e.time_unix_nano = ev.time_ns
            e.attributes.extend(_kv(k, v) for k, v in ev.attributes.items())
    return bytes(req.SerializeToString())


def file_messages(path: Path) -> Iterator[bytes]:
    """Export messages of one fileexporter file, as protobuf bytes."""
    data = path.read_bytes()
    if path.suffix in (".pb", ".binpb"):
        i = 0
        while i < len(data):
            (n,) = struct.unpack(">I", data[i : i + 4])
            i += 4
            yield data[i : i + n]
            i += n
    else:
        for line in data.splitlines():
            if line.strip():
                yield json_to_proto_bytes(line)


def example_files() -> list[Path]:
    return sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".pb", ".jsonl"))


def to_json(message: bytes) -> bytes:
    """protobuf export -> one OTLP JSON line (the otlp_json encoding)."""
    return proto_to_json_bytes(message)


def trace_key(message: bytes) -> bytes | None:
    """The kafkaexporter's key with partition_traces_by_id: the lowercase hex trace id (the
    exporter splits batches per trace; a message here holds one trace)."""
    spans = decode_record(message, "otlp_proto", "key")
    ids = {s.trace_id for s in spans}
    return ids.pop().encode() if len(ids) == 1 else None


def replay_messages(
    messages: Iterable[bytes], policy: Policy, key: bytes | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`loopwatch replay` over export messages."""
    events: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    replay = Replay(policy, Fingerprinter(key), events.append, summaries.append)
    for message in messages:
        replay.feed(decode_record(message, "otlp_proto", "replay"))
    replay.close()
    return events, summaries
