"""OTLP JSON (as the Collector's fileexporter and kafkaexporter write it: hex ids, int64 as
strings, integer enums; the proto3 JSON spellings accepted too) -> list[SpanRecord]. Every
malformed input raises exactly `DecodeError`, naming the source and the reason (positions
and keys, never attribute values)."""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any, Final

from streams.errors import DecodeError
from streams.spanpath import native
from streams.spanpath.otlp.common import (
    _I32_MAX,
    _I32_MIN,
    _I64_MAX,
    _I64_MIN,
    _U64_MAX,
    ANY_VALUE_KINDS,
    MAX_VALUE_DEPTH,
    SPAN_KINDS,
    STATUS_CODES,
    _at,
    _Bad,
)
from streams.spanpath.spans import SpanEvent, SpanRecord

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
        try:
            return float(x)
        except OverflowError:  # beyond the double range: inf, as float("1e999") is
            return math.inf if x > 0 else -math.inf
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


def decode_json_py(data: bytes | str, source: str = "record") -> list[SpanRecord]:
    """Decode one OTLP JSON TracesData / ExportTraceServiceRequest document: the pure-Python
    decoder, the fallback and the reference for the native one."""
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


# The native decoder leaves documents nested deeper than this to the reference: there the
# reference's outcome (a RecursionError turned into a message) depends on Python's recursion
# limit and on how deep the caller's stack already is. Valid OTLP needs about 270 levels
# (64 nested kvlist values); 400 keeps clear of the default limit of 1000 frames.
NATIVE_MAX_DEPTH: Final = min(400, sys.getrecursionlimit() * 2 // 5)
# CPython 3.13's json names a trailing comma ("Illegal trailing comma before end of ...").
TRAILING_COMMA_MSGS: Final = sys.version_info >= (3, 13)


def _decode_native(data: bytes | str, source: str = "record") -> list[SpanRecord]:
    """The compiled decoder (loopwatch_native): the same records and messages as
    `decode_json_py` for `bytes`; `str` and other buffer types take the Python path, and so
    do documents nested deeper than the native decoder decides (it returns None)."""
    if type(data) is not bytes:
        return decode_json_py(data, source)
    out = _NATIVE_DECODE(
        data,
        source,
        SpanRecord,
        SpanEvent,
        DecodeError,
        NATIVE_MAX_DEPTH,
        sys.get_int_max_str_digits(),
        TRAILING_COMMA_MSGS,
    )
    return decode_json_py(data, source) if out is None else out


if native.EXT is not None:
    _NATIVE_DECODE: Final = native.EXT.decode_json
    decode_json = _decode_native
else:
    decode_json = decode_json_py
