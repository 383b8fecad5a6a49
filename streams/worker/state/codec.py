"""Compact binary encoding of a RunState: the value of the worker's `runs` table (inside the
envelope of streams/worker/state/store.py), decoded and re-encoded for every batch a run receives
(docs/PERFORMANCE.md: ≤ 2 KiB per active run).

Format 2 (first byte 0x02):

    0x02 | crc32 of the rest (u32 LE) | len(J) (u32 LE) | J | B

J is a compact JSON array ``[kinds, strings, n_refs, *items]``; B holds the references into the
string pool `strings` (u8, or u16 past 256 entries), then the binary columns. How columns
are written: streams/worker/state/packing.py; read: streams/worker/state/unpacking.py.

A value starting with '{' is format 1, the JSON of RunState.to_dict() that earlier versions
wrote: still read, and the run's next update writes it back in format 2. Anything else, or a
value whose checksum, lengths or structure do not add up, raises DecodeError.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from detectors.model import Step
from detectors.state import (
    WIN_ACTION,
    WIN_ASKETCH,
    WIN_CALL,
    WIN_CODE,
    WIN_EMPTY,
    WIN_END,
    WIN_IDENTITY,
    WIN_OUTCOME,
    WIN_POS,
    WIN_RSKETCH,
    WIN_SPAN,
    WIN_STALE,
    WIN_START,
    WIN_TOKENS,
    WIN_TOOL,
    WIN_TURN,
    WIN_WIDTH,
    RunState,
    pad_window_entry,
)
from streams.errors import DecodeError
from streams.worker.state.packing import FORMAT_PACKED, ColumnWriter, Layout, new_writer
from streams.worker.state.unpacking import ColumnReader

FORMAT_JSON = ord("{")  # format 1: RunState.to_dict() as JSON


# -- the state's fields, by how they are written (every field exactly once, see below)
_PLAIN = (  # small ints and short strings: JSON is already compact for them
    "v",
    "spans",
    "duplicate_spans",
    "late_spans",
    "conflicts",
    "forced_releases",
    "released_seq",
    "position",
    "action_steps",
    "tool_calls",
    "tokens",
    "prompt_version",
    "agent_name",
    "service_name",
    "session_id",
    "task_type",
    "distinct_actions",
    "reduction_epoch",
    "last_llm_input",
    "parallel_duplicate_calls",
    "termination",
    "current_agent",
    "budgets_fired",
    "fired",
    "shapes",
    "trigger_ns",
    # added later (states written before lack them; decoded with these defaults):
    "last_turn_wants_tools",
    "deferred",
    "wasted_steps",
    "wasted_tokens",
    "cost",
    "priced_tokens",
    "limit",
    "llm_turns",
    "guard_denied",
    "holds",
)
# defaults of the fields added last, in order
_PLAIN_ADDED: tuple[Any, ...] = (None, [], 0, 0, 0.0, 0, None, 0, [], [])
_PLAIN_FIRST = len(_PLAIN) - len(_PLAIN_ADDED)  # width of _PLAIN in the first states
_TIMES = ("max_end_ns", "start_ns", "last_end_ns", "root_end_ns", "guard_ns")
_FLAGS = (
    "unresolved_overflow",
    "progress_observed",
    "side_effect_committed",
    "root_seen",
    "root_error",
    "tool_after_guard",
    "finalized",
)
_BLOOMS = ("seen_bloom", "distinct_bloom", "item_bloom")
_MAPS = ("terminal", "plans", "edges", "docs", "ledger")  # fingerprint/edge -> record


_WINDOW = Layout(
    WIN_WIDTH,
    (
        (WIN_START, WIN_END),  # int64
        (WIN_POS, WIN_TOKENS, WIN_TURN),  # small ints
        (WIN_ACTION, WIN_OUTCOME),  # hex digests: raw bytes
        (WIN_ASKETCH, WIN_RSKETCH),  # hex sketches (or None): raw bytes when equally long
        (WIN_SPAN,),  # in the dedup map
        (WIN_TOOL, WIN_CALL),  # names and call ids: pooled strings
        (WIN_CODE,),  # mostly None
        (WIN_EMPTY, WIN_STALE),
        (WIN_IDENTITY,),  # mostly None, else a hex digest
    ),
)
# The window as states written before the identity column have it (15 columns).
_WINDOW_15 = Layout(
    WIN_IDENTITY,
    (
        (WIN_START, WIN_END),
        (WIN_POS, WIN_TOKENS, WIN_TURN),
        (WIN_ACTION, WIN_OUTCOME),
        (WIN_ASKETCH, WIN_RSKETCH),
        (WIN_SPAN,),
        (WIN_TOOL, WIN_CALL),
        (WIN_CODE,),
        (WIN_EMPTY, WIN_STALE),
    ),
)
# The window as states written before the sketches have it (11 columns).
_WINDOW_11 = Layout(
    WIN_ASKETCH,
    (
        (WIN_START, WIN_END),
        (WIN_POS, WIN_TOKENS),
        (WIN_ACTION, WIN_OUTCOME),
        (WIN_SPAN,),
        (WIN_TOOL, WIN_CALL),
        (WIN_CODE,),
        (WIN_EMPTY,),
    ),
)

_WINDOW_BY_WIDTH = {layout.width: layout for layout in (_WINDOW, _WINDOW_15, _WINDOW_11)}

_DOCS = Layout(6, ((0, 1, 3, 4), (2,), (5,)))  # context_collapse: counts; span ids; call ids
_LAYOUTS = {"docs": _DOCS}

_get_plain, _get_times, _get_flags = (attrgetter(*names) for names in (_PLAIN, _TIMES, _FLAGS))
_SPECIAL = ("run_id", "trace_id", "dedup", "pending", "last_key", "unresolved", "window", "streak")
# Written after everything else, and only when there is something (each section when it or
# a later one has something): states written before they existed end there. The tool
# versions' names are pooled strings (the window's tool names).
_TAIL = ("tool_versions", "seen_items", "turns")


def encode_state(state: RunState, make_writer: Callable[[], ColumnWriter] = new_writer) -> bytes:
    """The state in format 2 (exact: decode_state gives an equal RunState back).
    `make_writer`: packing.ColumnWriter to use the reference writer whatever path is active."""
    w = make_writer()
    w.column([state.run_id])
    w.item(None if state.trace_id == state.run_id else state.trace_id)  # usually equal
    w.item(_get_plain(state))
    w.column(list(_get_times(state)))
    w.column(list(_get_flags(state)))
    for name in _BLOOMS:
        w.bigint(getattr(state, name))
    w.item(len(state.dedup))
    w.column(list(state.dedup.values()))
    keys = list(state.dedup)
    w.column(keys)
    w.set_ids(keys)  # later span ids refer to these
    window = state.window
    w.rows(window, _WINDOW_BY_WIDTH.get(len(window[0]), _WINDOW) if window else _WINDOW)
    w.record(state.last_key)
    w.record(state.streak)
    for name in _MAPS:
        w.mapping(getattr(state, name), _LAYOUTS.get(name))
    w.item(len(state.unresolved))
    w.column(state.unresolved)
    w.rows([step.to_list() for step in state.pending])
    if state.tool_versions or state.seen_items or state.turns:
        w.item(len(state.tool_versions))
        w.column([part for pair in state.tool_versions for part in pair])
    if state.seen_items or state.turns:
        w.item(len(state.seen_items))
        for bloom in state.seen_items:
            w.bigint(bloom)
        w.rows(state.turns)
    return w.finish()


def decode_state(data: bytes) -> RunState:
    """A state from either format. Raises DecodeError for anything else."""
    data = bytes(data)
    if not data:
        raise DecodeError("run state: empty value")
    fmt = data[0]
    if fmt not in (FORMAT_JSON, FORMAT_PACKED):
        raise DecodeError(f"run state: unknown format byte 0x{fmt:02x} ({len(data)} bytes)")
    try:
        if fmt == FORMAT_JSON:
            return _decode_json(data)
        return _decode_packed(data)
    except DecodeError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, StopIteration) as exc:
        # (struct.error, JSONDecodeError and UnicodeDecodeError are ValueErrors)
        kind = "JSON" if fmt == FORMAT_JSON else "packed"
        raise DecodeError(
            f"run state: corrupt {kind} value ({len(data)} bytes): {type(exc).__name__}: {exc}"
        ) from None


def _decode_json(data: bytes) -> RunState:
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise DecodeError("run state: JSON value is not an object")
    return RunState.from_dict(doc)


def _decode_packed(data: bytes) -> RunState:
    r = ColumnReader(data)
    fields: dict[str, Any] = {"run_id": r.column(1)[0]}
    trace_id = r.item()
    fields["trace_id"] = fields["run_id"] if trace_id is None else trace_id
    plain = r.item()
    if isinstance(plain, list) and _PLAIN_FIRST <= len(plain) < len(_PLAIN):
        plain = [*plain, *json.loads(json.dumps(_PLAIN_ADDED[len(plain) - _PLAIN_FIRST :]))]
    if not isinstance(plain, list) or len(plain) != len(_PLAIN):
        raise DecodeError(f"run state: expected a list of {len(_PLAIN)} values")
    fields.update(zip(_PLAIN, plain, strict=True))
    fields.update(zip(_TIMES, r.column(len(_TIMES)), strict=True))
    fields.update(zip(_FLAGS, r.column(len(_FLAGS)), strict=True))
    for name in _BLOOMS:
        fields[name] = r.bigint()
    n = r.count()
    digests = r.column(n)
    r.ids = r.column(n)
    fields["dedup"] = dict(zip(r.ids, digests, strict=True))
    window = r.rows(tuple(_WINDOW_BY_WIDTH.values()))
    fields["window"] = [pad_window_entry(row) for row in window]
    fields["last_key"] = r.record()
    fields["streak"] = r.record()
    for name in _MAPS:
        fields[name] = r.mapping(_LAYOUTS.get(name))
    fields["unresolved"] = r.column(r.count())
    fields["pending"] = [Step.from_list(values) for values in r.rows()]
    fields["tool_versions"], fields["seen_items"], fields["turns"] = [], [], []
    if r.i < len(r.items):  # the tail (see _TAIL)
        flat = r.column(2 * r.count())
        fields["tool_versions"] = [list(pair) for pair in zip(flat[::2], flat[1::2], strict=True)]
    if r.i < len(r.items):
        fields["seen_items"] = [r.bigint() for _ in range(r.count())]
        fields["turns"] = r.rows()
    r.done()
    return RunState(**fields)


# RunState without a place here would silently not survive a restart.
_WRITTEN = (*_PLAIN, *_TIMES, *_FLAGS, *_BLOOMS, *_MAPS, *_SPECIAL, *_TAIL)
if sorted(_WRITTEN) != sorted(RunState.__dataclass_fields__):
    raise AssertionError(
        "streams.worker.state.codec: RunState fields and the codec's groups differ"
    )
