"""The native OTLP JSON decoder (loopwatch_native.decode_json) against the Python reference.

One behaviour, two implementations: for every input, `json_decode.decode_json_py` (CPython's
json module, then the dict walk) and the native decoder must give identical SpanRecords (same
types, same float bits, the resource dict shared per ResourceSpans) or the same DecodeError
message. Inputs: hypothesis-built OTLP JSON documents (camelCase and snake_case, every value
kind, ids, enums and int64s in each spelling the reference accepts or refuses), the same
documents damaged at the text level (cut, spliced with JSON tokens, escapes, surrogates,
invalid UTF-8, duplicate keys), token soup for the scanner, random bytes; every JSON message
in examples/ and tests/fixtures/, and every protobuf fixture transcoded to JSON.

Runs whenever the extension is built, whichever path is active (LOOPWATCH_NATIVE=0 only
changes what `decode_json` points at).
"""

from __future__ import annotations

import base64
import json
import math
import os
import struct
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from streams.errors import DecodeError
from streams.replay.files import iter_payloads
from streams.spanpath import native
from streams.spanpath.otlp import (
    SPAN_KINDS,
    STATUS_CODES,
    decode_record,
    json_decode,
    proto_to_json_bytes,
)
from streams.spanpath.spans import SpanEvent, SpanRecord
from tests.paths import REPO

ROOT = REPO

try:
    import loopwatch_native
except ImportError:  # pragma: no cover - the fallback-only installation
    loopwatch_native = None

pytestmark = pytest.mark.skipif(
    loopwatch_native is None, reason="loopwatch_native is not built (cargo missing?)"
)

DIFF = settings(
    max_examples=int(os.environ.get("LOOPWATCH_DIFF_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

MAX_DEPTH = json_decode.NATIVE_MAX_DEPTH


def native_decode(data: bytes, source: str = "record") -> list[SpanRecord]:
    """The extension itself (not the wrapper): it must decide every input below MAX_DEPTH."""
    assert loopwatch_native is not None
    out: list[SpanRecord] | None = loopwatch_native.decode_json(
        data,
        source,
        SpanRecord,
        SpanEvent,
        DecodeError,
        MAX_DEPTH,
        sys.get_int_max_str_digits(),
        json_decode.TRAILING_COMMA_MSGS,
    )
    assert out is not None, "the native decoder left a shallow document to the reference"
    return out


# --------------------------------------------------------------------------- comparison


def canon(x: Any) -> Any:
    """A value with its exact type: True != 1, 1 != 1.0, floats by their bits (NaN too)."""
    if x is None:
        return None
    if isinstance(x, SpanRecord | SpanEvent):
        return (type(x).__name__, *(canon(getattr(x, f)) for f in x.__slots__))
    if isinstance(x, float):
        return ("float", struct.pack("<d", x).hex())
    if isinstance(x, list):
        return ("list", [canon(v) for v in x])
    if isinstance(x, dict):
        return ("dict", [(canon(k), canon(v)) for k, v in x.items()])
    return (type(x).__name__, x)


def outcome(decode: Callable[[bytes, str], list[SpanRecord]], data: bytes) -> Any:
    try:
        records = decode(data, "diff/x.jsonl:1")
    except Exception as e:  # any other exception class is a difference too
        return ("error", type(e).__name__, str(e))
    firsts: dict[int, int] = {}
    sharing = [firsts.setdefault(id(r.resource), i) for i, r in enumerate(records)]
    return ("ok", [canon(r) for r in records], sharing)


def same(data: bytes) -> Any:
    want = outcome(json_decode.decode_json_py, data)
    got = outcome(native_decode, data)
    assert got == want, f"{len(data)} bytes: {data[:300]!r}"
    return want


# --------------------------------------------------------------------------- documents

TID = "0af7651916cd43dd8448eb211c80319c"
SID = "b7ad6b7169203331"

texts = st.one_of(
    st.sampled_from(["", "k", "gen_ai.tool.name", "a'b\"c", "\u00e9\u4e2d\U0001f600", "\\", "\n"]),
    st.text(max_size=10),
)
enum_names = st.sampled_from([*SPAN_KINDS, *STATUS_CODES, "SPAN_KIND_BOGUS", "Client", "X" * 41])
big_ints = st.sampled_from(
    [0, 1, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1]
    + [2**64 - 1, 2**64, 10**30, -(10**30), 10**400]
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    big_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 1e16, 1.5, 1e300, 2.0**64, 2.0**63, -(2.0**63)]),
    texts,
    enum_names,
)
int_spellings = st.one_of(
    scalars,
    big_ints.map(str),
    st.sampled_from(
        ["", "-", "-0", "007", "1.0", "1e3", " 1", "+1", "\uff11", "99999999999999999999"]
    ),
    st.integers(min_value=0, max_value=2**64 + 5).map(str),
)
hex_ids = st.one_of(
    st.sampled_from([TID, SID, TID.upper(), "0" * 32, "0" * 16, "", "xyz", TID[:-1] + "g"]),
    st.text(alphabet="0123456789abcdefABCDEF\u00e9", min_size=0, max_size=34),
    scalars,
)
b64_texts = st.one_of(
    st.binary(max_size=12).map(lambda b: base64.b64encode(b).decode()),
    st.binary(max_size=12).map(lambda b: base64.urlsafe_b64encode(b).decode().rstrip("=")),
    st.text(alphabet="AQab+/-_=\u00e9 ", max_size=10),
)
# a structural value where a list / object / string was expected
junk = st.one_of(scalars, st.just([]), st.just({}), st.just([1, "a"]), st.just({"a": [None]}))


def maybe_snake(camel: str, snake: str) -> st.SearchStrategy[str]:
    return st.sampled_from([camel, snake])


@st.composite
def any_value(draw: st.DrawFn, depth: int = 0) -> Any:
    kinds = ["stringValue", "boolValue", "intValue", "doubleValue", "bytesValue"]
    if depth < 3:
        kinds += ["arrayValue", "kvlistValue"]
    kind = draw(st.sampled_from([*kinds, "stringValueStrindex", "other", "empty", "none", "junk"]))
    snake = draw(st.booleans())
    name = kind if not snake else "".join("_" + c.lower() if c.isupper() else c for c in kind)
    if kind == "empty":
        return {}
    if kind == "none":
        return None
    if kind == "junk":
        return draw(junk)
    if kind == "other":
        return {"unknownValue": draw(scalars)}
    if kind == "stringValue":
        v: Any = draw(st.one_of(texts, scalars))
    elif kind == "boolValue":
        v = draw(st.one_of(st.booleans(), scalars))
    elif kind == "intValue":
        v = draw(int_spellings)
    elif kind == "doubleValue":
        v = draw(
            st.one_of(
                scalars,
                st.sampled_from(["NaN", "Infinity", "-Infinity", "nan", "1.", ".5", "-.5e3", "1e"]),
                st.floats().map(repr),
            )
        )
    elif kind == "bytesValue":
        v = draw(st.one_of(b64_texts, scalars))
    elif kind == "stringValueStrindex":
        v = draw(st.integers(0, 9))
    elif kind == "arrayValue":
        values = draw(st.lists(any_value(depth + 1), max_size=3))
        v = draw(st.sampled_from([{"values": values}, {}, {"values": None}, values, "x"]))
    else:
        kvs = draw(attributes(depth + 1))
        v = draw(st.sampled_from([{"values": kvs}, {}, {"values": None}, kvs, 3]))
    out = {name: v}
    if draw(st.integers(0, 9)) == 0:  # a second kind (or a null one)
        out[draw(st.sampled_from(["boolValue", "int_value", "arrayValue"]))] = draw(
            st.one_of(st.none(), st.booleans())
        )
    return out


@st.composite
def attributes(draw: st.DrawFn, depth: int = 0) -> Any:
    n = draw(st.integers(0, 4))
    out = []
    for _ in range(n):
        shape = draw(st.integers(0, 12))
        if shape == 0:
            out.append(draw(junk))
            continue
        kv: dict[str, Any] = {}
        if shape != 1:
            kv["key"] = draw(texts) if shape != 2 else draw(scalars)
        kv["value"] = draw(any_value(depth))
        out.append(kv)
    return out


@st.composite
def span(draw: st.DrawFn) -> Any:
    sp: dict[str, Any] = {}
    wild = draw(st.integers(0, 3)) == 0  # one span in four gets unusual fields

    def put(camel: str, snake: str, good: Any, bad: st.SearchStrategy[Any]) -> None:
        if wild and draw(st.integers(0, 3)) == 0:
            sp[draw(maybe_snake(camel, snake))] = draw(bad)
        elif draw(st.integers(0, 9)):
            sp[draw(maybe_snake(camel, snake)) if wild else camel] = good

    put("traceId", "trace_id", TID, hex_ids)
    put("spanId", "span_id", SID if draw(st.booleans()) else "00f067aa0ba902b7", hex_ids)
    put("parentSpanId", "parent_span_id", "53995c3f42cd8ad8", hex_ids)
    put("name", "name", draw(texts), junk)
    put("kind", "kind", draw(st.integers(0, 5)), st.one_of(scalars, enum_names))
    put("startTimeUnixNano", "start_time_unix_nano", "1700000000000000000", int_spellings)
    put("endTimeUnixNano", "end_time_unix_nano", 1700000000500000000, int_spellings)
    if draw(st.booleans()):
        if wild and draw(st.booleans()):
            sp["status"] = draw(
                st.one_of(
                    junk,
                    st.fixed_dictionaries(
                        {}, optional={"code": st.one_of(scalars, enum_names), "message": junk}
                    ),
                )
            )
        else:
            sp["status"] = {"code": draw(st.integers(0, 2)), "message": draw(texts)}
    if draw(st.booleans()):
        sp["attributes"] = draw(attributes()) if not (wild and draw(st.booleans())) else draw(junk)
    if draw(st.integers(0, 3)) == 0:
        evs: Any = []
        for _ in range(draw(st.integers(0, 2))):
            if wild and draw(st.integers(0, 4)) == 0:
                evs.append(draw(junk))
                continue
            ev: dict[str, Any] = {"name": draw(st.one_of(texts, junk) if wild else texts)}
            ev[draw(maybe_snake("timeUnixNano", "time_unix_nano"))] = draw(
                int_spellings if wild else st.just("1700000000100000000")
            )
            ev["attributes"] = draw(attributes())
            evs.append(ev)
        sp["events"] = evs if not (wild and draw(st.integers(0, 5)) == 0) else draw(junk)
    return sp


@st.composite
def request(draw: st.DrawFn) -> Any:
    rss = []
    for _ in range(draw(st.integers(0, 2))):
        if draw(st.integers(0, 15)) == 0:
            rss.append(draw(junk))
            continue
        rs: dict[str, Any] = {}
        if draw(st.booleans()):
            rs["resource"] = (
                {"attributes": draw(attributes())} if draw(st.integers(0, 7)) else draw(junk)
            )
        sss = []
        for _ in range(draw(st.integers(0, 2))):
            if draw(st.integers(0, 15)) == 0:
                sss.append(draw(junk))
                continue
            ss: dict[str, Any] = {}
            scope_key = draw(st.sampled_from(["scope", "instrumentationLibrary", "scope"]))
            if draw(st.booleans()):
                ss[scope_key] = {"name": draw(texts)} if draw(st.integers(0, 7)) else draw(junk)
            ss["spans"] = (
                draw(st.lists(span(), max_size=3)) if draw(st.integers(0, 15)) else draw(junk)
            )
            sss.append(ss)
        key = draw(
            st.sampled_from(
                ["scopeSpans", "scope_spans", "instrumentationLibrarySpans", "scopeSpans"]
            )
        )
        rs[key] = sss if draw(st.integers(0, 15)) else draw(junk)
        if draw(st.integers(0, 7)) == 0:  # both spellings, the old one behind an empty new one
            rs["scopeSpans"] = []
            rs["instrumentationLibrarySpans"] = sss
        rss.append(rs)
    key = draw(st.sampled_from(["resourceSpans", "resource_spans", "resourceSpans"]))
    return {key: rss if draw(st.integers(0, 20)) else draw(junk)}


def dumps(doc: Any, ascii_only: bool) -> bytes:
    return json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@DIFF
@given(request(), st.booleans())
def test_generated_documents(doc: Any, ascii_only: bool) -> None:
    same(dumps(doc, ascii_only))


# text-level damage: what json.dumps never writes
TOKENS = [
    b",",
    b"]",
    b"}",
    b"[",
    b"{",
    b":",
    b'"',
    b"\\",
    b"\\u",
    b"\\ud800",
    b"\\udc00",
    b"\\ud83d\\ude00",
    b"\\ud83d\\u0041",
    b"\\x",
    b"\\n",
    b"0",
    b"-",
    b"-0",
    b"1e",
    b"1.",
    b".5",
    b"1e999",
    b"1E+2",
    b"01",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"-Inf",
    b"nul",
    b"true",
    b"tru",
    b"null",
    b" ",
    b"\t",
    b"\n",
    b"\r",
    b"\x0c",
    b"\x00",
    b"\x1f",
    b"\x7f",
    b"\xc3\xa9",
    b"\xe2\x82",
    b"\xff",
    b"\xed\xa0\x80",
    b"\xef\xbb\xbf",
    b"\xf0\x9f\x98\x80",
    b'"traceId":1,',
    b'"name":"dup",',
    b'"key":"k","key":',
    b"9" * 30,
    b"1" * 4301,
    b"-" + b"1" * 4300,
]


@DIFF
@given(request(), st.booleans(), st.data())
def test_generated_documents_damaged(doc: Any, ascii_only: bool, draw: st.DataObject) -> None:
    data = dumps(doc, ascii_only)
    for _ in range(draw.draw(st.integers(1, 3))):
        i = draw.draw(st.integers(0, len(data)))
        op = draw.draw(st.integers(0, 3))
        if op == 0:
            data = data[:i]
        elif op == 1:
            j = draw.draw(st.integers(i, min(len(data), i + 8)))
            data = data[:i] + data[j:]
        else:
            data = data[:i] + draw.draw(st.sampled_from(TOKENS)) + data[i:]
    same(data)


@DIFF
@given(
    st.lists(st.sampled_from(TOKENS + [b'"a"', b'"resourceSpans"', b"12", b"-3.5e-2"]), max_size=14)
)
def test_token_soup(tokens: list[bytes]) -> None:
    same(b"".join(tokens))
    same(b'{"resourceSpans":' + b"".join(tokens) + b"}")


@DIFF
@given(st.binary(max_size=64))
def test_random_bytes(data: bytes) -> None:
    same(data)


@DIFF
@given(st.text(alphabet="AQZaz09+/-_=\u00e9 .", max_size=11))
def test_bytes_values_base64(text: str) -> None:
    # binascii's strict mode, exactly: padding, excess data, the URL-safe alphabet
    attr = {"key": "b", "value": {"bytesValue": text}}
    same(json.dumps({"resourceSpans": [{"resource": {"attributes": [attr]}}]}).encode())
    span_doc = {"traceId": TID, "spanId": SID, "attributes": [attr]}
    same(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span_doc]}]}]}).encode())


# --------------------------------------------------------------------------- explicit cases


def one_span(**fields: Any) -> bytes:
    sp = {"traceId": TID, "spanId": SID, **fields}
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [sp]}]}]}).encode()


def nested_value(depth: int, kind: str = "arrayValue") -> Any:
    v: Any = {"stringValue": "x"}
    for _ in range(depth):
        v = (
            {"arrayValue": {"values": [v]}}
            if kind == "arrayValue"
            else {"kvlistValue": {"values": [{"key": "k", "value": v}]}}
        )
    return v


EXPLICIT = [
    b"",
    b"   ",
    b"\xef\xbb\xbf{}",
    b"\xef\xbb\xbf\xef\xbb\xbf{}",
    b"{}\n",
    b"{} x",
    b'{"a":1,}',
    b"[1,]",
    b"[]",
    b'"\\ud800"',
    b'{"\\ud800":1}',
    b'{"a":"\\ud800","a":"ok"}',
    b'{"resourceSpans":[],"x":"\\ud83d\\ude00"}',
    b'{"x":"\\ud800\\u12"}',
    b'{"x":"\\ud800\\u12\xc3\xa9\xc3\xa9"}',
    b'{"x":"\\ud800\\udc\xc3\xa9\xc3\xa9"}',
    b'{"x":"\\u12',
    b'{"x":"abc',
    b'{"x":"a\\',
    b'{\n"x":\n  [1,\n  2 3]}',
    b'{"x":\xc3\xa9}',
    b"\xc3\xa9\n\xc3\xa9",
    b"[" + b"1" * 4300 + b"]",
    b"[" + b"1" * 4301 + b"]",
    b"[-" + b"1" * 4300 + b"]",
    b"[1" + b"0" * 400 + b"]",
    one_span(attributes=[{"key": "d", "value": {"doubleValue": 10**400}}]),
    one_span(attributes=[{"key": "d", "value": {"doubleValue": -(10**400)}}]),
    one_span(attributes=[{"key": "d", "value": {"doubleValue": int("-0")}}]),
    b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"'
    + TID.encode()
    + b'","spanId":"'
    + SID.encode()
    + b'","attributes":[{"key":"d","value":{"doubleValue":-0}}]}]}]}]}',
    one_span(startTimeUnixNano=[1, 2.5, {"a": "b"}, None, True, "x" * 50]),
    one_span(startTimeUnixNano={"\u00e9\U0001f600\n": 1e16}),
    one_span(startTimeUnixNano=1e-5),
    one_span(startTimeUnixNano=float("nan")),
    one_span(startTimeUnixNano=float("-inf")),
    one_span(startTimeUnixNano="SPAN_KIND_X"),
    one_span(startTimeUnixNano=2.0**64),
    one_span(startTimeUnixNano=-1.0),
    one_span(kind="SPAN_KIND_CLIENT", status={"code": "STATUS_CODE_ERROR"}),
    one_span(kind=2**31),
    one_span(kind=1.0),
    one_span(attributes=[{"key": "v", "value": nested_value(63)}]),
    one_span(attributes=[{"key": "v", "value": nested_value(64)}]),
    one_span(attributes=[{"key": "v", "value": nested_value(63, "kvlistValue")}]),
    one_span(attributes=[{"key": "v", "value": nested_value(64, "kvlistValue")}]),
    one_span(attributes=[{"key": str(i), "value": {"intValue": i}} for i in range(40)] * 2),
    json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": TID}]}]}]}).encode(),
]


@pytest.mark.parametrize("data", EXPLICIT, ids=range(len(EXPLICIT)))
def test_explicit(data: bytes) -> None:
    same(data)


@example(b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"' + TID.encode() + b'"}]}]}]}')
@given(st.just(b"{}"))
def test_wide_object_duplicates(data: bytes) -> None:
    # past 16 keys the object gets a hash index: duplicates keep the first place, last value
    keys = b",".join(b'"k%d":%d' % (i % 20, i) for i in range(50))
    same(b'{"resourceSpans":[],' + keys + b"}")
    attrs = b",".join(
        b'"%s":{"stringValue":"%d"}' % (b"key" if i % 7 else b"value", i) for i in range(40)
    )
    same(b'{"resourceSpans":[{"resource":{"attributes":[{' + attrs + b"}]}}]}")
    same(data)


def test_double_beyond_range_is_infinite_in_the_reference() -> None:
    # float(10**400) raises OverflowError: the reference answers inf, as for "1e999"
    records = json_decode.decode_json_py(
        one_span(attributes=[{"key": "d", "value": {"doubleValue": 10**400}}])
    )
    assert records[0].attributes["d"] == math.inf


@pytest.fixture
def wrapper(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, str], list[SpanRecord]]:
    """json_decode._decode_native bound to the extension, also when LOOPWATCH_NATIVE=0."""
    assert loopwatch_native is not None
    monkeypatch.setattr(json_decode, "_NATIVE_DECODE", loopwatch_native.decode_json, raising=False)
    return json_decode._decode_native


def test_deep_documents_go_to_the_reference(
    wrapper: Callable[[bytes, str], list[SpanRecord]],
) -> None:
    assert loopwatch_native is not None
    deep = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    args = (SpanRecord, SpanEvent, DecodeError, MAX_DEPTH, sys.get_int_max_str_digits(), False)
    assert loopwatch_native.decode_json(deep, "s", *args) is None
    shallow = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    with pytest.raises(DecodeError, match="top-level JSON value is not an object"):
        loopwatch_native.decode_json(shallow, "s", *args)
    # through the wrapper, the reference's answer
    for data in (deep, b"[" * 5000, b'{"a":' * 5000):
        assert outcome(wrapper, data) == outcome(json_decode.decode_json_py, data)


def test_enum_tables_match_the_descriptors() -> None:
    assert loopwatch_native is not None
    kinds, codes = loopwatch_native.json_enums()
    assert dict(kinds) == SPAN_KINDS
    assert dict(codes) == STATUS_CODES


# --------------------------------------------------------------------------- corpus files


def corpus_messages() -> Iterator[tuple[str, bytes]]:
    """Every JSON message in examples/ and tests/fixtures/, and every protobuf one as JSON."""
    paths = sorted(
        p
        for base in (ROOT / "examples", ROOT / "tests/fixtures")
        for p in base.rglob("*")
        if p.suffix in (".json", ".jsonl", ".pb")
    )
    for payload in iter_payloads(paths):
        if payload.encoding == "otlp_proto":
            yield f"{payload.source}(as JSON)", proto_to_json_bytes(payload.data)
        else:
            yield payload.source, payload.data


CORPUS = list(corpus_messages())


def test_corpus_is_there() -> None:
    assert sum(1 for n, _ in CORPUS if "(as JSON)" in n) >= 20
    assert sum(1 for n, _ in CORPUS if ".jsonl:" in n) >= 20


@pytest.mark.parametrize(("name", "data"), CORPUS, ids=[n for n, _ in CORPUS])
def test_corpus_message(name: str, data: bytes) -> None:
    same(data)
    # a spread of cuts and byte changes
    step = max(1, len(data) // 24)
    for cut in range(0, len(data), step):
        same(data[:cut])
        for b in (b"\x00", b"}", b'"', b"\xff"):
            same(data[:cut] + b + data[cut + 1 :])


# --------------------------------------------------------------------------- wiring


def test_decode_json_uses_the_active_path() -> None:
    if native.ACTIVE == "native":
        assert json_decode.decode_json is json_decode._decode_native
    else:
        assert json_decode.decode_json is json_decode.decode_json_py
    data = next(d for n, d in CORPUS if ".jsonl:" in n)
    assert outcome(lambda d, s: decode_record(d, "otlp_json", s), data) == outcome(
        json_decode.decode_json_py, data
    )


def test_str_and_other_buffers_take_the_python_path(
    wrapper: Callable[[Any, str], list[SpanRecord]],
) -> None:
    data = next(d for n, d in CORPUS if ".jsonl:" in n)
    want = json_decode.decode_json_py(data)
    assert wrapper(data, "s") == json_decode.decode_json_py(data, "s")
    assert wrapper(data.decode(), "record") == want
    assert wrapper(bytearray(data), "record") == want


def test_fileexporter_lines_reach_the_decoder_as_bytes() -> None:
    payloads = list(iter_payloads([ROOT / "examples/negative__clean_run.jsonl"]))
    assert payloads and all(type(p.data) is bytes for p in payloads)
