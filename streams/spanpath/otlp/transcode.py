"""Conversion between the two OTLP encodings (for `loopwatch produce`): JSON with hex ids
(Collector style) <-> a serialized ExportTraceServiceRequest. Both directions validate with
the decoders first, so a conversion fails with the decoders' messages."""

from __future__ import annotations

import base64
import json
from typing import Any, Final

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from streams.errors import DecodeError
from streams.spanpath.otlp.common import SPAN_ID_BYTES, TRACE_ID_BYTES, _Bad
from streams.spanpath.otlp.json_decode import (
    _HEX,
    _get,
    _json_list,
    _json_load,
    _json_obj,
    _scope_of,
    _scope_spans_of,
    decode_json,
)
from streams.spanpath.otlp.proto import decode_proto

# ---------------------------------------------------------------------------------------
# Dispatch and conversion between the two encodings
# ---------------------------------------------------------------------------------------


_ID_FIELDS: Final = (
    ("traceId", "trace_id", TRACE_ID_BYTES),
    ("spanId", "span_id", SPAN_ID_BYTES),
    ("parentSpanId", "parent_span_id", SPAN_ID_BYTES),
)


def _ids_hex_to_b64(obj: dict[str, Any], where: str) -> None:
    for camel, snake, size in _ID_FIELDS:
        for key in (camel, snake):
            x = obj.get(key)
            if x is None:
                continue
            if type(x) is not str or len(x) not in (0, 2 * size) or not _HEX(x):
                raise _Bad(f"{where} {camel} is not {size} bytes of hex")
            obj[key] = base64.b64encode(bytes.fromhex(x)).decode("ascii")


def _ids_b64_to_hex(obj: dict[str, Any]) -> None:
    for camel, _snake, _size in _ID_FIELDS:
        x = obj.get(camel)
        if x is not None:
            obj[camel] = base64.b64decode(x).hex()


def json_to_proto_bytes(data: bytes | str, source: str = "record") -> bytes:
    """OTLP JSON (hex ids, Collector style) -> serialized ExportTraceServiceRequest."""
    decode_json(data, source)  # validates with our error messages
    doc = _json_load(data, source, for_parse_dict=True)
    try:
        for ri, rs in enumerate(_json_list(_get(doc, "resourceSpans", "resource_spans"), "")):
            ss_list = _scope_spans_of(rs)
            for key in (
                "instrumentationLibrarySpans",
                "instrumentation_library_spans",
                "scope_spans",
            ):
                rs.pop(key, None)
            rs["scopeSpans"] = ss_list
            for si, ss in enumerate(ss_list):
                scope = _scope_of(ss)
                for key in ("instrumentationLibrary", "instrumentation_library"):
                    ss.pop(key, None)
                if scope:
                    ss["scope"] = scope
                for pi, sp in enumerate(_json_list(ss.get("spans"), "spans")):
                    where = f"resourceSpans[{ri}].scopeSpans[{si}].spans[{pi}]"
                    _ids_hex_to_b64(sp, where)
                    for li, link in enumerate(_json_list(sp.get("links"), "links")):
                        _ids_hex_to_b64(_json_obj(link, "link"), f"{where}.links[{li}]")
    except _Bad as e:
        raise DecodeError(f"{source}: {e}") from None
    msg = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(doc, msg, ignore_unknown_fields=True)
    except Exception as e:  # ParseError text may quote values: name the class only
        raise DecodeError(
            f"{source}: cannot convert to protobuf ({type(e).__name__}: a field outside what "
            "the decoder checks, e.g. links, scope attributes or dropped counts, is invalid)"
        ) from None
    return bytes(msg.SerializeToString())


def proto_to_json_bytes(data: bytes, source: str = "record") -> bytes:
    """Serialized ExportTraceServiceRequest -> one line of OTLP JSON as the Collector writes it."""
    decode_proto(data, source)  # validates with our error messages
    msg = ExportTraceServiceRequest.FromString(data)
    doc = json_format.MessageToDict(msg, use_integers_for_enums=True)
    for rs in doc.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for sp in ss.get("spans", ()):
                _ids_b64_to_hex(sp)
                for link in sp.get("links", ()):
                    _ids_b64_to_hex(link)
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
