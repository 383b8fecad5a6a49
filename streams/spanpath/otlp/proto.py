"""OTLP protobuf bytes -> list[SpanRecord]: the ingest hot path, so the span loops are
written flat (local bindings, string fast path for attribute values, no per-span helper
calls) and everything unusual goes through slower, careful helpers. Every malformed input
raises exactly `DecodeError`, naming the source and the reason (positions and keys, never
attribute values)."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any, Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from streams.errors import DecodeError
from streams.spanpath import native
from streams.spanpath.otlp.common import ANY_VALUE_KINDS, SPAN_ID_BYTES, TRACE_ID_BYTES, _at, _Bad
from streams.spanpath.spans import SpanEvent, SpanRecord

# ---------------------------------------------------------------------------------------
# Protobuf
# ---------------------------------------------------------------------------------------


def _pb_array(v: Any) -> list[Any]:
    out = []
    for x in v.array_value.values:
        s = x.string_value
        out.append(s if s else _pb_any(x))
    return out


def _pb_kvlist(v: Any) -> dict[str, Any]:
    return _pb_attrs(v.kvlist_value.values)


def _pb_strindex(v: Any) -> Any:
    raise _Bad("value uses string_value_strindex (dictionary references are profiles-only)")


def _pb_none(v: Any) -> None:
    return None


def _build_pb_dispatch() -> dict[str | None, Callable[[Any], Any]]:
    special: dict[str, Callable[[Any], Any]] = {
        "array": _pb_array,
        "kvlist": _pb_kvlist,
        "string_strindex": _pb_strindex,
    }
    table: dict[str | None, Callable[[Any], Any]] = {None: _pb_none}  # AnyValue with no kind
    for k in ANY_VALUE_KINDS:
        table[k.proto_field] = special.get(k.kind) or attrgetter(k.proto_field)
    return table


_PB_DISPATCH: Final = _build_pb_dispatch()


def _pb_any(v: Any) -> Any:
    """AnyValue message -> Python value (slow path: everything but non-empty strings)."""
    return _PB_DISPATCH[v.WhichOneof("value")](v)


def _pb_attrs(kvs: Any) -> dict[str, Any]:
    """repeated KeyValue -> dict (resource, event and kvlist attributes)."""
    out: dict[str, Any] = {}
    conv = _pb_any
    for kv in kvs:
        v = kv.value
        s = v.string_value
        if s:
            out[kv.key] = s
        else:
            try:
                out[kv.key] = conv(v)
            except _Bad as e:
                raise _Bad(f"attribute {kv.key!r}: {e}") from None
    return out


def _pb_events(evs: Any) -> list[SpanEvent]:
    out = []
    for i, e in enumerate(evs):
        try:
            attrs = _pb_attrs(e.attributes)
        except _Bad as err:
            raise _Bad(f"event {i}: {err}") from None
        out.append(SpanEvent(e.name, e.time_unix_nano, attrs))
    return out


_ZERO_TRACE: Final = bytes(TRACE_ID_BYTES)
_ZERO_SPAN: Final = bytes(SPAN_ID_BYTES)


def _pb_id_problem(tid: bytes, sid: bytes, pid: bytes) -> str:
    for name, value, size in (
        ("traceId", tid, TRACE_ID_BYTES),
        ("spanId", sid, SPAN_ID_BYTES),
        ("parentSpanId", pid, SPAN_ID_BYTES),
    ):
        if not value:
            if name != "parentSpanId":
                return f"missing {name}"
        elif len(value) != size:
            return f"has {name} of {len(value)} bytes, expected {size}"
    return "has an all-zero (invalid) traceId or spanId"


def decode_proto_py(data: bytes, source: str = "record") -> list[SpanRecord]:
    """Decode one serialized ExportTraceServiceRequest / TracesData (protobuf): the
    pure-Python (upb) decoder, the fallback and the reference for the native one."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"{source}: expected bytes for otlp_proto, got {type(data).__name__}")
    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(data)
    except Exception as e:  # upb raises google.protobuf.message.DecodeError
        reason = str(e).rpartition(": ")[2] or type(e).__name__
        raise DecodeError(f"{source}: truncated or corrupt protobuf: {reason}") from None

    out: list[SpanRecord] = []
    append = out.append
    record = SpanRecord
    conv = _pb_any
    pb_events = _pb_events
    zero_trace = _ZERO_TRACE
    zero_span = _ZERO_SPAN
    where = ""
    try:
        for ri, rs in enumerate(req.resource_spans):
            where = f"resourceSpans[{ri}].resource"
            resource = _pb_attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                scope_name = ss.scope.name
                for sp in ss.spans:
                    where = ""
                    tid = sp.trace_id
                    sid = sp.span_id
                    pid = sp.parent_span_id
                    if (
                        len(tid) != 16
                        or len(sid) != 8
                        or (pid and len(pid) != 8)
                        or tid == zero_trace
                        or sid == zero_span
                    ):
                        raise _Bad(_pb_id_problem(tid, sid, pid))
                    attrs: dict[str, Any] = {}
                    for kv in sp.attributes:
                        v = kv.value
                        s = v.string_value
                        if s:
                            attrs[kv.key] = s
                        else:
                            try:
                                attrs[kv.key] = conv(v)
                            except _Bad as e:
                                raise _Bad(f"attribute {kv.key!r}: {e}") from None
                    evs = sp.events
                    st = sp.status
                    append(
                        record(
                            tid.hex(),
                            sid.hex(),
                            pid.hex() if pid and pid != zero_span else None,
                            sp.name,
                            sp.kind,
                            sp.start_time_unix_nano,
                            sp.end_time_unix_nano,
                            st.code,
                            st.message,
                            attrs,
                            resource,
                            pb_events(evs) if evs else [],
                            scope_name,
                        )
                    )
    except _Bad as e:
        raise DecodeError(f"{source}: {_at(where or f'span {len(out)}', str(e))}") from None
    return out


def _decode_native(data: bytes, source: str = "record") -> list[SpanRecord]:
    """The compiled decoder (loopwatch_native): the same records and messages as
    `decode_proto_py` for `bytes`; other buffer types take the Python path."""
    if type(data) is not bytes:
        return decode_proto_py(data, source)
    return _NATIVE_DECODE(data, source, SpanRecord, SpanEvent, DecodeError)  # type: ignore[no-any-return]


if native.EXT is not None:
    _NATIVE_DECODE: Final = native.EXT.decode_proto
    decode_proto = _decode_native
else:
    decode_proto = decode_proto_py
