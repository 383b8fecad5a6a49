"""The compiled span path (loopwatch_native) against the pure-Python reference.

One behaviour, two implementations: for every input, `decode_proto_py` (upb via the protobuf
package) and the native decoder must give identical SpanRecords (same types, same float
bits, the same resource dict shared per ResourceSpans) or the same DecodeError message.
Inputs: every examples/ and tests/fixtures/frameworks message, their truncations and byte
flips, hypothesis-built requests written at the wire level (duplicate and merged fields,
oneof switches, wrong wire types, unknown fields and groups, bad ids, strindex values, deep
nesting), random bytes.

Skipped (with the reason) when the extension is not built: the fallback is then the only
path, and the rest of the suite tests it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streams.errors import DecodeError
from streams.spanpath import native
from streams.spanpath.otlp import proto
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

# LOOPWATCH_DIFF_EXAMPLES=20000 for a long hunt; 300 keeps the unit tier fast
DIFF = settings(
    max_examples=int(os.environ.get("LOOPWATCH_DIFF_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def native_decode(data: bytes, source: str = "record") -> list[SpanRecord]:
    assert loopwatch_native is not None
    out: list[SpanRecord] = loopwatch_native.decode_proto(
        data, source, SpanRecord, SpanEvent, DecodeError
    )
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
        records = decode(data, "diff/x.pb#1")
    except Exception as e:  # any other exception class is a difference too
        return ("error", type(e).__name__, str(e))
    firsts: dict[int, int] = {}
    sharing = [firsts.setdefault(id(r.resource), i) for i, r in enumerate(records)]
    return ("ok", [canon(r) for r in records], sharing)


def same(data: bytes) -> Any:
    want = outcome(proto.decode_proto_py, data)
    got = outcome(native_decode, data)
    assert got == want, f"{len(data)} bytes: {data.hex()[:160]}"
    return want


# --------------------------------------------------------------------------- a wire writer


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def tag(field: int, wt: int) -> bytes:
    return varint(field << 3 | wt)


def ld(field: int, body: bytes) -> bytes:
    return tag(field, 2) + varint(len(body)) + body


def vi(field: int, n: int) -> bytes:
    return tag(field, 0) + varint(n)


def f64(field: int, n: int) -> bytes:
    return tag(field, 1) + struct.pack("<Q", n & ((1 << 64) - 1))


def f32(field: int, n: int) -> bytes:
    return tag(field, 5) + struct.pack("<I", n & 0xFFFFFFFF)


def group(field: int, body: bytes = b"") -> bytes:
    return tag(field, 3) + body + tag(field, 4)


def wrap_span(span: bytes) -> bytes:
    return ld(1, ld(2, ld(2, span)))


IDS = bytes.fromhex("0af7651916cd43dd8448eb211c80319c"), bytes.fromhex("b7ad6b7169203331")


def ok_span(*extra: bytes) -> bytes:
    return ld(1, IDS[0]) + ld(2, IDS[1]) + b"".join(extra)


# --------------------------------------------------------------------------- strategies

texts = st.one_of(
    st.sampled_from(["", "k", "gen_ai.tool.name", "tool", "a'b\"c", "\u00e9\u4e2d\U0001f600"]),
    st.text(max_size=12),
)
u64s = st.one_of(
    st.sampled_from([0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]), st.integers(0, (1 << 64) - 1)
)
ints = st.one_of(
    st.sampled_from([0, -1, 1, 1 << 31, -(1 << 63)]), st.integers(-(1 << 63), (1 << 64) - 1)
)
# wire noise a known message must skip: unknown fields, wrong wire types for known fields
noise = st.one_of(
    st.builds(vi, st.integers(1, 40), ints),
    st.builds(ld, st.integers(1, 40), st.binary(max_size=6)),
    st.builds(f64, st.integers(1, 40), u64s),
    st.builds(f32, st.integers(1, 40), st.integers(0, 0xFFFFFFFF)),
    st.builds(group, st.integers(1, 40), st.sampled_from([b"", vi(1, 5), group(2, ld(1, b"x"))])),
)


def any_value(kv: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    member = st.one_of(
        st.builds(lambda s: ld(1, s.encode()), texts),
        st.builds(lambda b: vi(2, b), st.integers(0, 3)),
        st.builds(lambda n: vi(3, n), ints),
        st.builds(lambda d: tag(4, 1) + struct.pack("<d", d), st.floats()),
        st.builds(lambda n: f64(4, n), u64s),  # NaN payloads, denormals
        st.builds(lambda b: ld(7, b), st.binary(max_size=8)),
        st.builds(lambda n: vi(8, n), st.integers(0, 5)),
        st.builds(
            lambda xs: ld(5, b"".join(ld(1, x) for x in xs)),
            st.lists(st.deferred(lambda: values), max_size=3),
        ),
        st.builds(lambda xs: ld(6, b"".join(ld(1, x) for x in xs)), st.lists(kv, max_size=3)),
        noise,
    )
    return st.lists(member, max_size=3).map(b"".join)


keyvalues: st.SearchStrategy[bytes] = st.deferred(
    lambda: st.lists(
        st.one_of(
            st.builds(lambda k: ld(1, k.encode()), texts),
            st.builds(lambda v: ld(2, v), values),
            st.builds(lambda n: vi(3, n), st.integers(0, 3)),
            noise,
        ),
        max_size=3,
    ).map(b"".join)
)
values: st.SearchStrategy[bytes] = st.deferred(lambda: any_value(keyvalues))
# mostly well-formed attributes: a key and one value
attrs = st.lists(
    st.one_of(
        st.builds(lambda k, v: ld(1, k.encode()) + ld(2, v), texts, values),
        keyvalues,
    ),
    max_size=4,
)
ids16 = st.one_of(
    st.just(IDS[0]),
    st.sampled_from([b"", bytes(16), b"\x01" * 6, b"\x01" * 17]),
    st.binary(min_size=16, max_size=16),
)
ids8 = st.one_of(
    st.just(IDS[1]),
    st.sampled_from([b"", bytes(8), b"\x01" * 4, b"\x01" * 9]),
    st.binary(min_size=8, max_size=8),
)
events = st.builds(
    lambda name, t, kvs, more: (
        ld(2, name.encode()) + f64(1, t) + b"".join(ld(3, a) for a in kvs) + more
    ),
    texts,
    u64s,
    attrs,
    st.lists(noise, max_size=1).map(b"".join),
)
statuses = st.lists(
    st.one_of(
        st.builds(lambda m: ld(2, m.encode()), texts), st.builds(lambda c: vi(3, c), ints), noise
    ),
    max_size=3,
).map(b"".join)
links = st.builds(
    lambda t, s, kvs: (
        ld(1, t) + ld(2, s) + ld(3, b"ts") + b"".join(ld(4, a) for a in kvs) + vi(5, 1) + f32(6, 1)
    ),
    ids16,
    ids8,
    attrs,
)
span_fields = st.one_of(
    st.builds(lambda b: ld(1, b), ids16),
    st.builds(lambda b: ld(2, b), ids8),
    st.builds(lambda b: ld(4, b), st.one_of(ids8, st.just(b""))),
    st.builds(lambda s: ld(5, s.encode()), texts),
    st.builds(lambda s: ld(3, s.encode()), texts),
    st.builds(lambda n: vi(6, n), ints),
    st.builds(lambda n: f64(7, n), u64s),
    st.builds(lambda n: f64(8, n), u64s),
    st.builds(lambda a: ld(9, a), attrs.map(lambda xs: xs[0] if xs else b"")),
    st.builds(lambda e: ld(11, e), events),
    st.builds(lambda link: ld(13, link), links),
    st.builds(lambda s: ld(15, s), statuses),
    st.builds(lambda n: vi(10, n), st.integers(0, 9)),
    st.builds(lambda n: f32(16, n), st.integers(0, 0xFFFFFFFF)),
    noise,
)
spans = st.builds(
    lambda tid, sid, rest: ld(1, tid) + ld(2, sid) + b"".join(rest),
    ids16,
    ids8,
    st.lists(span_fields, max_size=8),
)
scopes = st.builds(
    lambda name, ver, kvs: (
        ld(1, name.encode()) + ld(2, ver.encode()) + b"".join(ld(3, a) for a in kvs)
    ),
    texts,
    texts,
    attrs,
)
scope_spans = st.builds(
    lambda sc, sps, more: b"".join(ld(1, s) for s in sc) + b"".join(ld(2, s) for s in sps) + more,
    st.lists(scopes, max_size=2),
    st.lists(spans, max_size=3),
    st.lists(noise, max_size=1).map(b"".join),
)
resources = st.builds(
    lambda kvs, more: b"".join(ld(1, a) for a in kvs) + more,
    attrs,
    st.lists(
        st.one_of(noise, st.just(vi(2, 3)), st.just(ld(3, ld(1, b"s") + ld(3, b"k")))), max_size=1
    ).map(b"".join),
)
resource_spans = st.builds(
    lambda res, sss, url: b"".join(ld(1, r) for r in res) + b"".join(ld(2, s) for s in sss) + url,
    st.lists(resources, max_size=2),
    st.lists(scope_spans, max_size=3),
    st.sampled_from([b"", ld(3, b"https://x")]),
)
requests = st.lists(resource_spans, max_size=3).map(lambda rss: b"".join(ld(1, r) for r in rss))


@DIFF
@given(requests)
def test_generated_requests(data: bytes) -> None:
    same(data)


@DIFF
@given(requests, st.data())
def test_generated_requests_damaged(data: bytes, draw: st.DataObject) -> None:
    if not data:
        return
    buf = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 3))):
        if not buf:
            break
        i = draw.draw(st.integers(0, len(buf) - 1))
        op = draw.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        if op == "flip":
            buf[i] = draw.draw(st.integers(0, 255))
        elif op == "cut":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = draw.draw(st.binary(min_size=1, max_size=4))
        else:
            del buf[i : i + draw.draw(st.integers(1, 8))]
    same(bytes(buf))


@DIFF
@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    same(data)


# --------------------------------------------------------------------------- corpus files


def corpus_messages() -> Iterator[tuple[str, bytes]]:
    files = sorted((ROOT / "examples").glob("*.pb")) + sorted(
        (ROOT / "tests/fixtures/frameworks").glob("*.pb")
    )
    for path in files:
        buf = path.read_bytes()
        i = n = 0
        while i < len(buf):
            (size,) = struct.unpack(">I", buf[i : i + 4])
            n += 1
            yield f"{path.name}#{n}", buf[i + 4 : i + 4 + size]
            i += 4 + size


CORPUS = list(corpus_messages())


def test_corpus_is_there() -> None:
    assert len(CORPUS) >= 20


@pytest.mark.parametrize(("name", "data"), CORPUS, ids=[n for n, _ in CORPUS])
def test_corpus_message(name: str, data: bytes) -> None:
    kind, records, _ = same(data)
    assert kind == "ok" and records
    # every truncation point of the first 64 bytes and a spread over the rest, and byte flips
    cuts = sorted({*range(min(64, len(data))), *range(64, len(data), max(1, len(data) // 64))})
    for cut in cuts:
        same(data[:cut])
    for i in range(0, len(data), max(1, len(data) // 48)):
        for b in (0x00, 0xFF, data[i] ^ 0x80):
            same(data[:i] + bytes([b]) + data[i + 1 :])


# --------------------------------------------------------------------------- explicit cases


def nested_array(levels: int) -> bytes:
    """An attribute value nested `levels` ArrayValues deep."""
    v = ld(1, b"x")
    for _ in range(levels):
        v = ld(5, ld(1, v))
    return v


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\x00",  # field number 0
        b"\x0b\x0c",  # a group where a message is declared: unknown, skipped
        b"\x0b\x14",  # group closed by another field's end tag
        b"\x0c",  # end group at the top
        b"\x0a\x01\x0c",  # end group inside a submessage
        b"\x0e",  # wire type 6
        b"\xf8\xff\xff\xff\x0f\x00",  # the largest field number
        b"\xf8\xff\xff\xff\x1f\x00",  # a tag beyond 32 bits
        b"\x88\x80\x80\x80\x00\x01",  # 5-byte tag
        b"\x88\x80\x80\x80\x80\x00\x01",  # 6-byte tag
        b"\x12\x80\x80\x80\x80\x00",  # 5-byte length
        b"\x12\x80\x80\x80\x80\x80\x00",  # 6-byte length
        b"\x10" + b"\xff" * 9 + b"\x7f",  # 10-byte varint, high bits dropped
        b"\x10" + b"\xff" * 10 + b"\x01",  # 11-byte varint
        b"\x0a\x80\x80\x80\x80\x10",  # length beyond 32 bits
        group(5) * 3,
        *(group(5, inner) for inner in (b"\x00\x05", b"\x03\x04", b"\x04", b"\x03\x0c", b"\x0e")),
        tag(5, 3) * 100 + tag(5, 4) * 100,  # nesting budget: 100 groups fit at the top
        tag(5, 3) * 101 + tag(5, 4) * 101,
        wrap_span(ok_span(tag(15, 3) * 97 + tag(15, 4) * 97)),  # 3 levels down: 97 fit
        wrap_span(ok_span(tag(15, 3) * 98 + tag(15, 4) * 98)),
        *(wrap_span(ok_span(ld(9, ld(1, b"k") + ld(2, nested_array(n))))) for n in (46, 47, 48)),
        wrap_span(ok_span(ld(5, b"a\xffc"))),  # bad UTF-8 in a parsed string
        wrap_span(ok_span(ld(3, b"\xc0\x80"))),  # ... in trace_state, which nobody reads
        wrap_span(ok_span(ld(13, ld(3, b"\xed\xa0\x80")))),  # a surrogate in a link
        ld(1, ld(1, ld(3, ld(2, b"\xff")))),  # ... in a resource entity ref
        ld(1, ld(2, ld(1, ld(2, b"\xff")))),  # ... in a scope version
        ld(1, ld(2, ld(3, b"\xff"))),  # ... in a schema url
        wrap_span(ok_span(ld(5, b"a\xffc")))[:-1],  # bad UTF-8 vs truncation: upb's order
        # a field running past its message's end: upb reads it against the whole input and
        # checks a string's UTF-8 before the overrun (bad UTF-8 wins, else corrupt)
        *(
            wrap_span(ok_span(tag(9, 2) + varint(5) + tag(1, 2) + varint(8) + b"abc" + tail))
            for tail in (ld(5, b"okokok"), ld(5, b"ok\xffok"), ld(7, b"\x80"))
        ),
        ld(1, ld(2, ld(2, b"") + tag(3, 2))[:-1] + b"\x01" + b"\x12\x01\xff"),  # len past end
        ld(1, ld(2, ld(2, b"") + tag(3, 2))[:-1] + b"\x01" + b"\x12\x01a"),
        ld(1, ld(2, ld(2, b"\x39") + bytes(8))),  # a fixed64 past its message's end
        ld(1, ld(2, ld(2, b"\x3a\x05") + b"ab\xffcd")),  # bytes past the end
        wrap_span(ok_span(vi(1, 7))),  # trace_id as a varint: unknown, the id stays
        wrap_span(ld(2, IDS[1]) + ld(1, IDS[0]) + ld(1, b"")),  # last value wins: missing
        wrap_span(ok_span(vi(6, (1 << 64) - 1), vi(6, 1 << 40))),  # enum: low 32 bits
        wrap_span(ok_span(ld(15, vi(3, 2)), ld(15, ld(2, b"boom")))),  # status merged
        ld(1, ld(1, ld(1, ld(1, b"a") + ld(2, ld(1, b"1")))) + ld(1, ld(1, ld(1, b"b")))),
        wrap_span(
            ok_span(
                ld(
                    9,
                    ld(1, b"k") + ld(2, ld(5, ld(1, ld(1, b"a")))) + ld(2, ld(5, ld(1, vi(2, 1)))),
                )
            )
        ),
        wrap_span(
            ok_span(
                ld(
                    9,
                    ld(1, b"k")
                    + ld(2, ld(5, ld(1, ld(1, b"a"))))
                    + ld(2, ld(1, b"s"))
                    + ld(2, ld(5, b"")),
                )
            )
        ),
        wrap_span(
            ok_span(ld(9, ld(1, b"k") + ld(2, ld(6, ld(1, ld(1, b"in") + ld(2, vi(8, 1)))))))
        ),
        wrap_span(ok_span(ld(9, ld(1, "k\u00e9'\n".encode()) + ld(2, vi(8, 1))))),
        wrap_span(ok_span(ld(11, ld(3, ld(1, b"e") + ld(2, ld(5, ld(1, vi(8, 1)))))))),
        wrap_span(
            ok_span(
                ld(9, ld(1, b"dup") + ld(2, vi(3, 1))), ld(9, ld(1, b"dup") + ld(2, ld(1, b"")))
            )
        )
        + ld(1, ld(1, ld(1, ld(1, b"r") + ld(2, vi(8, 2))))),
        wrap_span(ok_span(ld(4, bytes(8)))),  # all-zero parent: a root span
        wrap_span(ok_span(ld(9, ld(1, b"k") + ld(2, b"")))),  # a value with no kind: None
        wrap_span(ok_span(ld(9, ld(1, b"k")))),  # no value at all: None
        wrap_span(ok_span(ld(9, ld(1, b"n") + ld(2, f64(4, 0x7FF8000000000001))))),  # NaN bits
    ],
)
def test_explicit(data: bytes) -> None:
    same(data)


def test_depth_errors_are_upb_names() -> None:
    deep = wrap_span(ok_span(ld(9, ld(1, b"k") + ld(2, nested_array(48)))))
    assert same(deep)[2].endswith("Exceeded upb_DecodeOptions_MaxDepth")
    assert same(tag(5, 3) * 101 + tag(5, 4) * 101)[2].endswith("Wire format was corrupt")


def test_schema_matches_the_installed_descriptors() -> None:
    """The native parser knows the same fields, with the same string/bytes/message kinds, as
    the opentelemetry-proto the Python path uses: a newer proto with another string field
    would change which inputs are rejected for bad UTF-8."""
    from google.protobuf.descriptor import FieldDescriptor as F
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    kinds = {F.TYPE_STRING: "string", F.TYPE_BYTES: "bytes", F.TYPE_MESSAGE: "message"}
    want: set[tuple[str, int, str]] = set()
    todo, seen = [ExportTraceServiceRequest.DESCRIPTOR], set()
    while todo:
        d = todo.pop()
        if d.full_name in seen:
            continue
        seen.add(d.full_name)
        for f in d.fields:
            want.add((d.full_name, f.number, kinds.get(f.type, "scalar")))
            if f.message_type is not None:
                todo.append(f.message_type)
    assert loopwatch_native is not None
    assert set(loopwatch_native.schema()) == want


def test_decode_proto_uses_the_active_path() -> None:
    # built here (this module's tests need the extension); LOOPWATCH_NATIVE=0 turns it off
    if native.ACTIVE == "native":
        assert proto.decode_proto is proto._decode_native
        assert native.describe().startswith("native (loopwatch_native ")
    else:
        assert proto.decode_proto is proto.decode_proto_py
        assert native.describe().startswith("python (")


def test_other_buffers_take_the_python_path() -> None:
    data = CORPUS[0][1]
    assert proto.decode_proto(bytearray(data)) == proto.decode_proto(data)
    assert proto.decode_proto(memoryview(data)) == proto.decode_proto_py(data)


def test_no_crash_on_huge_and_deep_inputs() -> None:
    same(tag(5, 3) * 10_000)
    same(wrap_span(ok_span(ld(9, ld(1, b"k") + ld(2, nested_array(5000))))))
    same(wrap_span(ok_span(ld(5, b"x" * 1_000_000))))
