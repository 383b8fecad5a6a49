"""OTLP trace decoding: protobuf and Collector-style JSON bytes -> list[SpanRecord].

Small pure functions plus lookup tables; this is the ingest hot path, so the span loops
are written flat (local bindings, string fast path for attribute values, no per-span
helper calls) and everything unusual goes through slower, careful helpers.

Every malformed input raises exactly `DecodeError`, whose message names the source and
the reason (positions and keys, never attribute values).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Final, NamedTuple

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as _PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as _PbStatus

from streams.errors import DecodeError
from streams.spans import SpanEvent, SpanRecord

__all__ = [
    "ANY_VALUE_KINDS",
    "ENCODINGS",
    "OTLP_JSON",
    "OTLP_PROTO",
    "AnyValueKind",
    "decode_json",
    "decode_proto",
    "decode_record",
    "json_to_proto_bytes",
    "proto_to_json_bytes",
]

OTLP_PROTO: Final = "otlp_proto"
OTLP_JSON: Final = "otlp_json"
ENCODINGS: Final = (OTLP_PROTO, OTLP_JSON)

TRACE_ID_BYTES: Final = 16
SPAN_ID_BYTES: Final = 8
MAX_VALUE_DEPTH: Final = 64  # nesting of array/kvlist values (upb itself stops at 100)

_U64_MAX: Final = (1 << 64) - 1
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1
_I32_MIN: Final = -(1 << 31)
_I32_MAX: Final = (1 << 31) - 1


class _Bad(Exception):
    """Internal: a decoding problem; callers prepend the position, the API raises DecodeError."""


def _at(where: str, reason: str) -> str:
    """Join a position and a reason: "span 4 has traceId of ...", "span 4: attribute ..."."""
    if reason.startswith(("has ", "missing ", "is ")):
        return f"{where} {reason}"
    return f"{where}: {reason}"


# ---------------------------------------------------------------------------------------
# The attribute value kinds (OTLP AnyValue oneof), one row each.
# ---------------------------------------------------------------------------------------


class AnyValueKind(NamedTuple):
    kind: str  # short name
    proto_field: str  # AnyValue oneof member
    json_key: str  # OTLP JSON key (lowerCamelCase); the proto field name is accepted too
    python_type: type | None  # what the decoder produces; None = not valid in traces


ANY_VALUE_KINDS: Final[tuple[AnyValueKind, ...]] = (
    AnyValueKind("string", "string_value", "stringValue", str),
    AnyValueKind("bool", "bool_value", "boolValue", bool),
    AnyValueKind("int", "int_value", "intValue", int),
    AnyValueKind("double", "double_value", "doubleValue", float),
    AnyValueKind("array", "array_value", "arrayValue", list),
    AnyValueKind("kvlist", "kvlist_value", "kvlistValue", dict),
    AnyValueKind("bytes", "bytes_value", "bytesValue", bytes),
    # dictionary references exist only in the profiles signal; a span carrying one is invalid
    AnyValueKind("string_strindex", "string_value_strindex", "stringValueStrindex", None),
)

SPAN_KINDS: Final[dict[str, int]] = dict(_PbSpan.SpanKind.items())  # "SPAN_KIND_CLIENT": 3, ...
STATUS_CODES: Final[dict[str, int]] = dict(_PbStatus.StatusCode.items())  # "STATUS_CODE_ERROR": 2


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


def decode_proto(data: bytes, source: str = "record") -> list[SpanRecord]:
    """Decode one serialized ExportTraceServiceRequest / TracesData (protobuf)."""
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


# ---------------------------------------------------------------------------------------
# JSON (as the Collector writes it: hex ids, int64 as strings, integer enums)
# ---------------------------------------------------------------------------------------

_LOWER_HEX_32 = re.compile(r"[0-9a-f]{32}").fullmatch
_LOWER_HEX_16 = re.compile(r"[0-9a-f]{16}").fullmatch
_HEX = re.compile(r"[0-9a-fA-F]*").fullmatch
_INT_STR = re.compile(r"-?[0-9]{1,20}").fullmatch
_FLOAT_STR = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?").fullmatch
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]").search
_URLSAFE_TO_STD: Final = str.maketrans("-_", "+/")
_SPECIAL_DOUBLES: Final = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _show(x: Any) -> str:
    """A short rendering of a structural (non-attribute) value for an error message."""
    try:
        text = json.dumps(x)
    except (TypeError, ValueError):
        text = type(x).__name__
    return text if len(text) <= 40 else text[:37] + "..."


_ENUM_LIKE = re.compile(r"[A-Z][A-Z0-9_]{0,39}").fullmatch


def _show_payload(x: Any) -> str:
    """Like _show, for a value read from the payload: only enum-like names are quoted,
    never free text (it may be customer text from a broken or hostile producer)."""
    if isinstance(x, str) and not _ENUM_LIKE(x):
        return f"a string of {len(x)} characters"
    return _show(x)


def _json_type(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "boolean"
    if isinstance(x, int | float):
        return "number"
    if isinstance(x, str):
        return "string"
    if isinstance(x, list):
        return "array"
    return "object"


def _json_int(x: Any, name: str, lo: int, hi: int, show: bool = True) -> int:
    """int64/uint64/fixed64 as a decimal string or a number (integral), range-checked."""
    if x is None:
        return 0
    if type(x) is int:
        n = x
    elif (type(x) is str and _INT_STR(x)) or (
        type(x) is float and math.isfinite(x) and x.is_integer()
    ):
        n = int(x)
    else:
        what = f": {_show_payload(x)}" if show else f" ({_json_type(x)})"
        raise _Bad(f"{name} is not an integer{what}")
    if n < lo:
        raise _Bad(f"{name} is negative" if lo == 0 else f"{name} is out of range")
    if n > hi:
        raise _Bad(f"{name} is out of range")
    return n


def _json_uint64(x: Any, name: str) -> int:
    # fast path: a plain decimal string of at most 19 digits is always < 2**64
    if type(x) is str and len(x) < 20 and x.isdigit() and x.isascii():
        return int(x)
    return _json_int(x, name, 0, _U64_MAX)


def _json_enum(x: Any, names: dict[str, int], name: str) -> int:
    if x is None:
        return 0
    if type(x) is int:
        if _I32_MIN <= x <= _I32_MAX:
            return x
        raise _Bad(f"{name} is out of range")
    if type(x) is str:
        n = names.get(x)
        if n is not None:
            return n
        raise _Bad(f"{name} is not a known enum value: {_show_payload(x)}")
    raise _Bad(f"{name} is not an enum integer or name ({_json_type(x)})")


def _json_str(x: Any, name: str) -> str:
    if x is None:
        return ""
    if type(x) is str:
        return x
    raise _Bad(f"{name} is not a string ({_json_type(x)})")


def _json_list(x: Any, name: str) -> list[Any]:
    if x is None:
        return []
    if type(x) is list:
        return x
    raise _Bad(f"{name} is not a list ({_json_type(x)})")


def _json_obj(x: Any, name: str) -> dict[str, Any]:
    if x is None:
        return {}
    if type(x) is dict:
        return x
    raise _Bad(f"{name} is not an object ({_json_type(x)})")


def _get(d: dict[str, Any], camel: str, snake: str) -> Any:
    x = d.get(camel)
    return d.get(snake) if x is None else x


def _json_id(x: Any, nbytes: int, name: str) -> str:
    """Slow path for a required hex id (accepts uppercase)."""
    low = _json_opt_id(x, nbytes, name)
    if low is None:
        raise _Bad(f"missing {name}" if x is None or x == "" else f"{name} is all zeros (invalid)")
    return low


def _json_opt_id(x: Any, nbytes: int, name: str) -> str | None:
    """Slow path for a hex id: accepts uppercase; '' / absent / all zeros -> None."""
    if x is None or x == "":
        return None
    if type(x) is not str:
        raise _Bad(f"{name} is not a string ({_json_type(x)})")
    if len(x) != 2 * nbytes:
        raise _Bad(f"has {name} of {len(x)} hex characters, expected {2 * nbytes}")
    if not _HEX(x):
        raise _Bad(f"{name} is not hexadecimal")
    low: str = x.lower()
    return None if low == "0" * (2 * nbytes) else low


# AnyValue JSON converters: (value, depth) -> Python value


def _jv_string(x: Any, depth: int) -> str:
    if type(x) is str:
        return x
    raise _Bad(f"stringValue is not a string ({_json_type(x)})")


def _jv_bool(x: Any, depth: int) -> bool:
    if type(x) is bool:
        return x
    raise _Bad(f"boolValue is not a boolean ({_json_type(x)})")


def _jv_int(x: Any, depth: int) -> int:
    return _json_int(x, "intValue", _I64_MIN, _I64_MAX, show=False)


def _jv_double(x: Any, depth: int) -> float:
    t = type(x)
    if t is float:
        return float(x)
    if t is int:
        return float(x)
    if t is str:
        special = _SPECIAL_DOUBLES.get(x)
        if special is not None:
            return special
        if _FLOAT_STR(x):
            return float(x)
    raise _Bad(f"doubleValue is not a number ({_json_type(x)})")


def _jv_bytes(x: Any, depth: int) -> bytes:
    if type(x) is not str:
        raise _Bad(f"bytesValue is not a base64 string ({_json_type(x)})")
    if "-" in x or "_" in x:  # the URL-safe alphabet, which proto3 JSON also allows
        x = x.translate(_URLSAFE_TO_STD)
    try:
        return base64.b64decode(x + "=" * (-len(x) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise _Bad("bytesValue is not valid base64") from None


def _jv_array(x: Any, depth: int) -> list[Any]:
    if depth >= MAX_VALUE_DEPTH:
        raise _Bad(f"value nesting deeper than {MAX_VALUE_DEPTH}")
    values = _json_list(_json_obj(x, "arrayValue").get("values"), "arrayValue.values")
    out = []
    for i, v in enumerate(values):
        try:
            out.append(_json_any(v, depth + 1))
        except _Bad as e:
            raise _Bad(f"[{i}]: {e}") from None
    return out


def _jv_kvlist(x: Any, depth: int) -> dict[str, Any]:
    if depth >= MAX_VALUE_DEPTH:
        raise _Bad(f"value nesting deeper than {MAX_VALUE_DEPTH}")
    values = _json_list(_json_obj(x, "kvlistValue").get("values"), "kvlistValue.values")
    return _json_attrs(values, depth + 1)


def _jv_strindex(x: Any, depth: int) -> Any:
    raise _Bad("value uses stringValueStrindex (dictionary references are profiles-only)")


def _build_json_dispatch() -> dict[str, Callable[[Any, int], Any]]:
    by_kind: dict[str, Callable[[Any, int], Any]] = {
        "string": _jv_string,
        "bool": _jv_bool,
        "int": _jv_int,
        "double": _jv_double,
        "array": _jv_array,
        "kvlist": _jv_kvlist,
        "bytes": _jv_bytes,
        "string_strindex": _jv_strindex,
    }
    table = {}
    for k in ANY_VALUE_KINDS:
        table[k.json_key] = table[k.proto_field] = by_kind[k.kind]
    return table


_JSON_DISPATCH: Final = _build_json_dispatch()


def _json_any(v: Any, depth: int = 0) -> Any:
    """AnyValue JSON object -> Python value. {} / null -> None; unknown keys ignored."""
    if v is None:
        return None
    if type(v) is not dict:
        raise _Bad(f"value is not an object ({_json_type(v)})")
    found = False
    result = None
    for key, x in v.items():
        conv = _JSON_DISPATCH.get(key)
        if conv is None or x is None:
            continue
        if found:
            raise _Bad("value has more than one kind")
        result = conv(x, depth)
        found = True
    return result


def _json_attr_into(out: dict[str, Any], kv: Any, kvs: list[Any], depth: int) -> None:
    """Careful path for one {"key", "value"} entry (the span loop inlines the common cases)."""
    if type(kv) is not dict:
        raise _Bad(f"attribute {_index(kvs, kv)} is not an object ({_json_type(kv)})")
    key = kv.get("key")
    if key is None:
        key = ""  # proto3 JSON omits a default (empty) key
    elif type(key) is not str:
        raise _Bad(f"attribute {_index(kvs, kv)} key is not a string ({_json_type(key)})")
    try:
        out[key] = _json_any(kv.get("value"), depth)
    except _Bad as e:
        raise _Bad(f"attribute {key!r}: {e}") from None


def _index(seq: list[Any], item: Any) -> int:
    return next((i for i, x in enumerate(seq) if x is item), -1)


def _json_attrs(kvs: Any, depth: int = 0) -> dict[str, Any]:
    """A JSON list of {"key", "value"} -> dict (null / absent -> {})."""
    if type(kvs) is not list:
        kvs = _json_list(kvs, "attributes")
    out: dict[str, Any] = {}
    for kv in kvs:
        if type(kv) is dict:
            key = kv.get("key")
            v = kv.get("value")
            if type(key) is str and type(v) is dict and len(v) == 1:
                s = v.get("stringValue")
                if type(s) is str:
                    out[key] = s
                    continue
        _json_attr_into(out, kv, kvs, depth)
    return out


def _json_events(evs: Any) -> list[SpanEvent]:
    out = []
    for i, e in enumerate(_json_list(evs, "events")):
        try:
            if type(e) is not dict:
                raise _Bad(f"is not an object ({_json_type(e)})")
            out.append(
                SpanEvent(
                    _json_str(e.get("name"), "name"),
                    _json_uint64(_get(e, "timeUnixNano", "time_unix_nano"), "timeUnixNano"),
                    _json_attrs(e.get("attributes")),
                )
            )
        except _Bad as err:
            raise _Bad(f"event {i}: {err}") from None
    return out


def _json_text(data: bytes | bytearray | memoryview | str, source: str) -> str:
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DecodeError(
                f"{source}: JSON text has an unpaired surrogate (character {e.start})"
            ) from None
        text = data
    elif isinstance(data, bytes | bytearray | memoryview):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError(
                f"{source}: JSON is not valid UTF-8 (byte offset {e.start})"
            ) from None
    else:
        raise DecodeError(
            f"{source}: expected bytes or str for otlp_json, got {type(data).__name__}"
        )
    return text[1:] if text.startswith("\ufeff") else text


def _quoted_non_finite(text: str) -> float | str:
    """parse_float/parse_constant hook for ParseDict, which wants "NaN"/"Infinity" quoted."""
    x = float(text)
    if math.isfinite(x):
        return x
    return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")


def _json_load(
    data: bytes | bytearray | memoryview | str, source: str, for_parse_dict: bool = False
) -> dict[str, Any]:
    text = _json_text(data, source)
    try:
        if for_parse_dict:
            doc = json.loads(
                text, parse_float=_quoted_non_finite, parse_constant=_quoted_non_finite
            )
        else:
            doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise DecodeError(
            f"{source}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    except RecursionError:
        raise DecodeError(f"{source}: invalid JSON: nested too deeply") from None
    except ValueError:  # e.g. an integer literal beyond the int-string conversion limit
        raise DecodeError(f"{source}: invalid JSON: number too large") from None
    if _SURROGATE_ESCAPE(text):
        try:
            json.dumps(doc, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, RecursionError, ValueError):
            raise DecodeError(
                f"{source}: invalid JSON: string with an unpaired surrogate escape"
            ) from None
    if type(doc) is not dict:
        raise DecodeError(f"{source}: top-level JSON value is not an object ({_json_type(doc)})")
    return doc


def _scope_spans_of(rs: dict[str, Any]) -> list[Any]:
    ss = _get(rs, "scopeSpans", "scope_spans")
    if ss is None or ss == []:
        old = _get(rs, "instrumentationLibrarySpans", "instrumentation_library_spans")
        if old is not None:
            return _json_list(old, "instrumentationLibrarySpans")
    return _json_list(ss, "scopeSpans")


def _scope_of(ss: dict[str, Any]) -> dict[str, Any]:
    scope = ss.get("scope")
    if scope is None:
        scope = _get(ss, "instrumentationLibrary", "instrumentation_library")
    return _json_obj(scope, "scope")


def decode_json(data: bytes | str, source: str = "record") -> list[SpanRecord]:
    """Decode one OTLP JSON TracesData / ExportTraceServiceRequest document."""
    doc = _json_load(data, source)
    out: list[SpanRecord] = []
    append = out.append
    record: Any = SpanRecord
    hex32 = _LOWER_HEX_32
    hex16 = _LOWER_HEX_16
    json_id = _json_id
    uint64 = _json_uint64
    attr_into = _json_attr_into
    x: Any
    seen_traces: set[str] = set()
    kinds = SPAN_KINDS
    codes = STATUS_CODES
    try:
        rss = _json_list(_get(doc, "resourceSpans", "resource_spans"), "resourceSpans")
    except _Bad as e:
        raise DecodeError(f"{source}: {e}") from None
    path = ""
    try:
        for ri, rs in enumerate(rss):
            path = f"resourceSpans[{ri}]"
            if type(rs) is not dict:
                raise _Bad(f"is not an object ({_json_type(rs)})")
            path = f"resourceSpans[{ri}].resource"
            res = _json_obj(rs.get("resource"), "resource")
            resource = _json_attrs(res.get("attributes"))
            path = f"resourceSpans[{ri}]"
            for si, ss in enumerate(_scope_spans_of(rs)):
                path = f"resourceSpans[{ri}].scopeSpans[{si}]"
                if type(ss) is not dict:
                    raise _Bad(f"is not an object ({_json_type(ss)})")
                scope_name = _json_str(_scope_of(ss).get("name"), "scope.name")
                spans = ss.get("spans")
                if type(spans) is not list:
                    spans = _json_list(spans, "spans")
                for sp in spans:
                    path = ""
                    if type(sp) is not dict:
                        raise _Bad(f"is not an object ({_json_type(sp)})")
                    g = sp.get
                    # ids: lowercase hex is the fast path, everything else the careful one
                    tid = g("traceId")
                    if tid is None:
                        tid = g("trace_id")
                    if type(tid) is not str or tid not in seen_traces:  # spans share traces
                        if type(tid) is not str or not hex32(tid) or tid == "0" * 32:
                            tid = json_id(tid, 16, "traceId")
                        seen_traces.add(tid)
                    sid = g("spanId")
                    if sid is None:
                        sid = g("span_id")
                    if type(sid) is not str or not hex16(sid) or sid == "0000000000000000":
                        sid = json_id(sid, 8, "spanId")
                    pid = g("parentSpanId")
                    if pid is None:
                        pid = g("parent_span_id")
                    if type(pid) is not str or not hex16(pid) or pid == "0000000000000000":
                        pid = _json_opt_id(pid, 8, "parentSpanId")
                    name = g("name")
                    if type(name) is not str:
                        name = _json_str(name, "name")
                    kind = g("kind")
                    if type(kind) is not int or not 0 <= kind <= 5:
                        kind = _json_enum(kind, kinds, "kind")
                    t = g("startTimeUnixNano")
                    if type(t) is str and len(t) < 20 and t.isdigit() and t.isascii():
                        start = int(t)  # at most 19 digits: always < 2**64
                    else:
                        if t is None:
                            t = g("start_time_unix_nano")
                        start = uint64(t, "startTimeUnixNano")
                    t = g("endTimeUnixNano")
                    if type(t) is str and len(t) < 20 and t.isdigit() and t.isascii():
                        end = int(t)
                    else:
                        if t is None:
                            t = g("end_time_unix_nano")
                        end = uint64(t, "endTimeUnixNano")
                    code: Any
                    message: Any
                    st = g("status")
                    if st is None:
                        code = 0
                        message = ""
                    elif type(st) is dict:
                        code = st.get("code")
                        if type(code) is not int or not 0 <= code <= 2:
                            code = _json_enum(code, codes, "status.code")
                        message = st.get("message")
                        if type(message) is not str:
                            message = _json_str(message, "status.message")
                    else:
                        raise _Bad(f"status is not an object ({_json_type(st)})")
                    attrs: dict[str, Any] = {}
                    al = g("attributes")
                    if al is not None:
                        if type(al) is not list:
                            raise _Bad(f"attributes is not a list ({_json_type(al)})")
                        for kv in al:
                            if type(kv) is dict:
                                key = kv.get("key")
                                v = kv.get("value")
                                if type(key) is str and type(v) is dict and len(v) == 1:
                                    x = v.get("stringValue")
                                    if type(x) is str:
                                        attrs[key] = x
                                        continue
                                    x = v.get("intValue")
                                    if (
                                        type(x) is str
                                        and len(x) < 19
                                        and x.isdigit()
                                        and x.isascii()
                                    ):
                                        attrs[key] = int(x)
                                        continue
                                    x = v.get("boolValue")
                                    if type(x) is bool:
                                        attrs[key] = x
                                        continue
                            attr_into(attrs, kv, al, 0)
                    evs = g("events")
                    append(
                        record(
                            tid,
                            sid,
                            pid,
                            name,
                            kind,
                            start,
                            end,
                            code,
                            message,
                            attrs,
                            resource,
                            [] if evs is None else _json_events(evs),
                            scope_name,
                        )
                    )
    except _Bad as e:
        raise DecodeError(f"{source}: {_at(path or f'span {len(out)}', str(e))}") from None
    except RecursionError:
        raise DecodeError(f"{source}: value nesting too deep") from None
    return out


# ---------------------------------------------------------------------------------------
# Dispatch and conversion between the two encodings
# ---------------------------------------------------------------------------------------


def decode_record(value: bytes, encoding: str, source: str) -> list[SpanRecord]:
    """Decode one Kafka record value / file message in the named kafkaexporter encoding."""
    if value is None:
        raise DecodeError(f"{source}: record has no value")
    if encoding == OTLP_PROTO:
        return decode_proto(value, source)
    if encoding == OTLP_JSON:
        return decode_json(value, source)
    raise DecodeError(
        f"{source}: unknown encoding {_show(encoding)} (expected one of {', '.join(ENCODINGS)})"
    )


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
