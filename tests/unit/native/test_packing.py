"""The native state writer (loopwatch_native.StateWriter) against the reference `ColumnWriter` of
streams/worker/state/packing.py: the same method calls give the same bytes, for generated columns,
rows, records and mappings (every kind the format has, and the values that fall back to
JSON), and for every state the example corpus and the bench corpus pass through.

Runs whenever the extension is built (CI: LOOPWATCH_REQUIRE_NATIVE=1 builds it and fails
without it); skipped only on a fallback-only installation.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.corpus import export_messages
from detectors.fingerprint import Fingerprinter
from detectors.policy import load_policy
from detectors.state import RunState
from streams.replay.engine import Engine
from streams.replay.files import iter_batches
from streams.spanpath.otlp import decode_proto
from streams.worker.state import packing
from streams.worker.state.codec import _DOCS, _WINDOW, decode_state, encode_state
from streams.worker.state.packing import ColumnWriter, Layout
from tests.native_ext import EXT, requires_native
from tests.paths import REPO

pytestmark = requires_native

ROOT = REPO
EXAMPLES = ROOT / "examples"
POLICY = load_policy(EXAMPLES / "loopwatch.yaml")
DIFF = settings(
    max_examples=int(os.environ.get("LOOPWATCH_DIFF_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def native_writer() -> Any:
    return EXT.StateWriter(packing._JSON.encode)


# values as a state holds them, and the ones that must fall back to JSON
HEX = st.sampled_from([8, 16, 32]).flatmap(
    lambda w: st.text("0123456789abcdef", min_size=w, max_size=w)
)
TEXT = st.one_of(
    HEX,
    st.text(max_size=6),
    st.text("0123456789abcdefABCDEF ", max_size=8),  # hex-looking, not quite
    st.sampled_from(["\ud800", "a\udfffb", "é", "ab cd"]),  # lone surrogates, non-ASCII
)
BOUNDS = [s * (1 << n) for n in (7, 15, 31, 63) for s in (1, -1)]  # each width's edges
INT = st.one_of(
    st.integers(-130, 130),
    st.integers(-(1 << 16), 1 << 16),
    st.integers(-(1 << 33), 1 << 33),
    st.sampled_from([b + d for b in BOUNDS for d in (-1, 0)] + [1 << 63, 1 << 70]),
)
SCALAR = st.one_of(TEXT, INT, st.booleans(), st.none(), st.floats(allow_nan=False))
VALUE = st.recursive(
    SCALAR,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


def column_values() -> st.SearchStrategy[list[Any]]:
    """Columns of one kind (so the compact kinds are taken) or of mixed kinds."""
    one_kind = st.one_of(
        st.lists(HEX, max_size=12),
        st.lists(TEXT, max_size=12),
        st.lists(INT, max_size=12),
        st.lists(st.booleans(), max_size=12),
        st.lists(st.none(), max_size=3),
        st.lists(st.lists(INT, max_size=3), max_size=6),
        st.lists(st.lists(HEX, min_size=2, max_size=2), max_size=6),
        st.lists(st.one_of(st.none(), HEX), max_size=70),  # masks past 64 bits
        st.lists(st.one_of(st.none(), st.floats(allow_nan=False)), max_size=6),
    )
    return one_kind | st.lists(VALUE, max_size=8)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("column"), column_values()),
        st.tuples(st.just("item"), VALUE),
        st.tuples(
            st.just("bigint"), st.one_of(st.integers(0, 1 << 300), st.integers(-5, -1), st.none())
        ),
        st.tuples(
            st.just("rows"),
            st.one_of(
                st.integers(0, 4).flatmap(
                    lambda m: st.lists(st.lists(SCALAR, min_size=m, max_size=m), max_size=5)
                ),
                st.lists(VALUE, max_size=3),
            ),
            st.sampled_from([None, Layout(3, ((0, 2), (1,))), Layout(2, ((1,), (0,)))]),
        ),
        st.tuples(
            st.just("record"),
            st.one_of(
                st.none(), st.lists(st.one_of(SCALAR, st.lists(TEXT, max_size=3)), max_size=5)
            ),
        ),
        st.tuples(
            st.just("mapping"),
            st.dictionaries(HEX | TEXT, st.lists(SCALAR, min_size=2, max_size=2), max_size=5),
            st.sampled_from([None, Layout(2, ((1,), (0,)))]),
        ),
        st.tuples(st.just("set_ids"), st.lists(HEX, max_size=6, unique=True)),
    ),
    max_size=12,
)


def play(writer: Any, ops: list[tuple[Any, ...]]) -> bytes:
    for name, *args in ops:
        getattr(writer, name)(*args)
    return bytes(writer.finish())


@DIFF
@given(OPS)
def test_generated_writes_give_the_same_bytes(ops: list[tuple[Any, ...]]) -> None:
    assert play(native_writer(), ops) == play(ColumnWriter(), ops)


@pytest.mark.parametrize(
    "ops",
    [
        [("column", ["ab", "AB"])],  # upper case: pooled, not hex
        [("column", ["abcd", "ab"])],  # unequal widths
        [("column", [1 << 63])],  # past int64: JSON
        *([("column", [0, b + d])] for b in BOUNDS for d in (-1, 0)),  # each width's edges
        [("column", [True, 1])],  # bool and int are two types
        [("column", [None, None, 1.5])],
        [("column", [[1, 2], [3]])],
        [("set_ids", ["aa", "bb"]), ("column", ["bb", "aa"]), ("column", ["bb", "cc"])],
        [("column", [f"s{i}" for i in range(300)]), ("column", ["s299", "s1"])],  # u16 refs
        [("rows", [[1, "a"], [2]])],  # ragged: JSON
        [("rows", [[1, 2, 3]] * 3, _WINDOW)],  # a layout of another width: plain columns
        [("mapping", {"aa": [1, 2, 3, 4, 5, 6]}, _DOCS)],
        [("bigint", 0), ("bigint", 1 << 64), ("bigint", -1)],
        [("record", ["a", ["x", "y"], None, []])],
    ],
)
def test_edge_cases_give_the_same_bytes(ops: list[tuple[Any, ...]]) -> None:
    assert play(native_writer(), ops) == play(ColumnWriter(), ops)


def _states_of(batches: list[list[Any]]) -> list[RunState]:
    """Every live state after every batch of a replay."""
    engine = Engine(POLICY, Fingerprinter(b"packing-key"), lambda e: None, lambda s: None)
    seen: list[RunState] = []
    for batch in batches:
        engine.feed(batch)
        seen += [decode_state(encode_state(s, ColumnWriter)) for s in engine.runs.values()]
    engine.close()
    return seen


def test_every_state_of_the_corpora_encodes_to_the_same_bytes() -> None:
    batches: list[list[Any]] = []
    for path in sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".pb", ".jsonl")):
        for _source, spans in iter_batches([path], lambda e: None):
            batches += [spans[i : i + 3] for i in range(0, len(spans), 3)]
    batches += [decode_proto(m) for m in export_messages(20_000, seed=5)]
    states = _states_of(batches)
    assert len(states) > 1000
    kinds = set()
    for state in states:
        raw = encode_state(state, native_writer)
        assert raw == encode_state(state, ColumnWriter), state.run_id
        j_len = int.from_bytes(raw[5:9], "little")  # after the format byte and the crc32
        kinds.update(json.loads(raw[9 : 9 + j_len])[0])
    assert kinds >= set("bqrxsSnfzlot")  # the corpora take the format's kinds


def test_the_active_path_uses_the_native_writer() -> None:
    from streams.spanpath import native

    writer = packing.new_writer()
    assert isinstance(writer, ColumnWriter) == (native.ACTIVE == "python")


def test_the_writer_looks_methods_up_by_interned_names() -> None:
    """The writer's method lookups (`bit_length`, `to_bytes`, `from_bytes`, `values`) use
    interned names. A name built per call stays in CPython 3.11's type attribute cache, a
    fresh copy in a random slot each time, and a few thousand of them, each living past the
    burst that allocated it, kept pymalloc pools in use (worker RSS grew with history:
    docs/PERFORMANCE.md, "What pinned the pools")."""
    writer = native_writer()
    sys._clear_type_cache()
    before = sys.getallocatedblocks()
    for n in range(3000):
        noise = [str(i) * 3 for i in range(n % 7)]  # other allocations move the next name
        writer.bigint((1 << 70) + n)  # bit_length, to_bytes
        writer.column([n, None, n + 1])  # int.from_bytes (the None mask)
        writer.mapping({"a": n}, None)  # values
        del noise
    held = sys.getallocatedblocks() - before
    sys._clear_type_cache()
    dropped = held - (sys.getallocatedblocks() - before)
    assert dropped < 20, f"the type cache held {dropped} names the writer built"
