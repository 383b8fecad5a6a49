"""Per-run state: a plain, versioned, serializable record with a hard size bound.

Everything here is bounded by the policy's window and a few fixed caps, whatever the run's
length: the dedup map, the reorder buffer, the detectors' recent history and the fired
episode markers. The record round-trips through `to_dict`/`from_dict` (JSON-able) so it
can live in a faust Table and be shown to on-call.
"""

from __future__ import annotations

import marshal
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from .model import Step

STATE_VERSION = 1
DEDUP_CAP = 128  # recent span ids remembered for duplicate/conflict checks
UNRESOLVED_CAP = 64  # parent ids referenced but not yet seen (tree completeness)
FIRED_CAP = 64  # fired episode markers
DEFERRED_CAP = 64  # events whose metrics wait for the run's labels (see RunState.deferred)
MAP_CAP = 16  # per-detector keyed maps (plans, edges, documents, ledger)
BLOOM_BITS = 512  # seen span ids (tree completeness), 128 hex chars serialized
ITEM_BLOOM_BITS = 512  # seen pagination item ids
SEEN_ITEMS_BITS = 256  # each generation of RunState.seen_items
SEEN_ITEMS_GENERATION = 32  # items a generation takes before the older one is dropped
_BLOOMS = ("seen_bloom", "distinct_bloom", "item_bloom")


@dataclass(slots=True)
class RunState:
    run_id: str
    trace_id: str = ""
    v: int = STATE_VERSION
    # -- delivery bookkeeping
    spans: int = 0
    duplicate_spans: int = 0
    late_spans: int = 0
    conflicts: int = 0
    forced_releases: int = 0
    dedup: dict[str, str] = field(default_factory=dict)  # span_id -> content digest
    pending: list[Step] = field(default_factory=list)  # buffered steps (lists when serialized)
    released_seq: int | None = None  # highest explicit sequence released
    last_key: list[Any] | None = None  # ordering key of the last released step
    max_end_ns: int = 0  # per-run event-time watermark
    seen_bloom: int = 0
    unresolved: list[str] = field(default_factory=list)
    unresolved_overflow: bool = False
    # -- run facts (learned in release order, so deterministic)
    position: int = 0  # released, counted steps (1-based positions)
    action_steps: int = 0  # tool calls + handoffs (the `steps` budget)
    tool_calls: int = 0
    tokens: int = 0
    start_ns: int | None = None
    last_end_ns: int = 0
    prompt_version: str | None = None
    agent_name: str | None = None
    service_name: str | None = None
    session_id: str | None = None
    task_type: str | None = None
    distinct_bloom: int = 0
    distinct_actions: int = 0
    reduction_epoch: int = 0
    last_llm_input: int = 0
    progress_observed: bool = False
    side_effect_committed: bool = False
    parallel_duplicate_calls: int = 0
    last_turn_wants_tools: bool | None = None  # the latest released model turn's; None: none
    # -- container spans (root / agents): arrive last, only used at finalization
    root_seen: bool = False
    root_end_ns: int | None = None
    root_error: bool = False
    termination: str | None = None
    guard_ns: int | None = None
    tool_after_guard: bool = False
    # -- detectors
    window: list[list[Any]] = field(default_factory=list)  # recent tool steps, see WIN_*
    streak: list[Any] | None = None  # identical_repetition: current run of one action
    terminal: dict[str, list[Any]] = field(default_factory=dict)  # action_fp -> [span, pos]
    item_bloom: int = 0
    plans: dict[str, list[Any]] = field(default_factory=dict)
    edges: dict[str, list[Any]] = field(default_factory=dict)
    current_agent: str | None = None
    docs: dict[str, list[Any]] = field(default_factory=dict)
    ledger: dict[str, list[Any]] = field(default_factory=dict)
    budgets_fired: list[str] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)  # "shape|key" of fired episodes
    shapes: list[str] = field(default_factory=list)
    trigger_ns: dict[str, int] = field(default_factory=dict)  # shape -> first trigger start
    # Events that fired before the run's prompt_version was known: their loop metrics are
    # counted at finalization, in the run's final slice (streams/runloop/loop.py; at most
    # MAX_DEFERRED: [event_id, shape, severity, tool_name, tool_version, wasted_steps,
    # wasted_tokens]).
    deferred: list[list[Any]] = field(default_factory=list)
    # The tool versions the run called ([tool, version], first seen first, at most
    # MAP_CAP): a version comparison counts the run on each (detectors/versions.py).
    tool_versions: list[list[str]] = field(default_factory=list)
    # What its loops cost: the sum of its events' wasted_steps and wasted_tokens.
    wasted_steps: int = 0
    wasted_tokens: int = 0
    # What its priced model turns cost (policy `prices:`; detectors/prices.py) and their tokens.
    cost: float = 0.0
    priced_tokens: int = 0
    # The declared step limit [n, what counts] of its root or agent span, and its model
    # turns (streams/spanpath/limits.py): a run that reached it ended at its limit.
    limit: list[Any] | None = None
    llm_turns: int = 0
    # Near-duplicate loops (detectors/similarity.py): the items its results listed
    # [newer bloom, older bloom, items in the newer], and its recent model turns (T_*).
    seen_items: list[int] = field(default_factory=list)
    turns: list[list[Any]] = field(default_factory=list)
    # The guard checked (detectors/guard_check.py): the calls an enforced guard decision
    # denied, [call id, denial ns], at most MAP_CAP.
    guard_denied: list[list[Any]] = field(default_factory=list)
    # The on-call holds its calls were counted under (detectors/holds.py `account`: a run
    # is affected once per hold), at most MAX_RUN_HOLDS.
    holds: list[str] = field(default_factory=list)
    finalized: bool = False

    def clone(self) -> RunState:
        """An independent copy to try a step on (the guard's prediction). The state is plain
        data (lists, dicts, strings, numbers), so marshal copies it all the way down in C;
        buffered steps are shared (detectors never change a step). A twentieth of
        copy.deepcopy's cost."""
        twin = RunState.__new__(RunState)
        values = marshal.loads(marshal.dumps(_state_values(self)))
        for name, value in zip(_COPIED_FIELDS, values, strict=True):
            setattr(twin, name, value)
        twin.pending = list(self.pending)
        return twin

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in _FIELD_NAMES}
        data["pending"] = [step.to_list() for step in self.pending]
        for name in _BLOOMS:  # hex is a third shorter than a decimal bignum
            data[name] = format(data[name], "x")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        if data.get("v") != STATE_VERSION:
            raise ValueError(f"run state version {data.get('v')!r} is not {STATE_VERSION}")
        state = cls(**{k: v for k, v in data.items() if k in _FIELD_NAMES})
        for name in _BLOOMS:
            value = getattr(state, name)
            setattr(state, name, int(value, 16) if isinstance(value, str) else value)
        state.pending = [Step.from_list(values) for values in data.get("pending", ())]
        state.window = [pad_window_entry(e) for e in state.window]
        return state


_FIELD_NAMES = tuple(f.name for f in fields(RunState))


_COPIED_FIELDS = tuple(name for name in _FIELD_NAMES if name != "pending")
_state_values = attrgetter(*_COPIED_FIELDS)


# Layout of one entry of RunState.window (a recent tool step).
WIN_TOOL = 0
WIN_ACTION = 1
WIN_OUTCOME = 2  # result digest, or error code when no result was recorded
WIN_CODE = 3  # error code or None
WIN_EMPTY = 4
WIN_START = 5
WIN_END = 6
WIN_SPAN = 7
WIN_CALL = 8
WIN_POS = 9
WIN_TOKENS = 10  # run's cumulative tokens when this step was released
# added for near-duplicate loops (windows written before have 11 columns; codec.py pads them)
WIN_ASKETCH = 11  # similarity sketch of the arguments (detectors/sketch.py)
WIN_RSKETCH = 12  # ... of the result
WIN_STALE = 13  # its result brought nothing new (detectors/similarity.py)
WIN_TURN = 14  # the run's model turns when it was released: calls of one turn share it
WIN_IDENTITY = 15  # what names the record it acted on (Step.identity_fp), or None
WIN_WIDTH = 16
_WIN_ADDED: tuple[Any, ...] = (None, None, False, 0, None)  # what those hold in older entries


def pad_window_entry(entry: list[Any]) -> list[Any]:
    """A window entry written before the near-duplicate columns, with them. Sketches of
    entries written before the identity column are of the earlier estimator (16 one-byte
    bins), which the current one cannot compare: they are dropped."""
    if len(entry) >= WIN_WIDTH:
        return entry
    if len(entry) > WIN_RSKETCH:
        entry = [*entry[:WIN_ASKETCH], None, None, *entry[WIN_RSKETCH + 1 :]]
    return [*entry, *_WIN_ADDED[len(entry) - WIN_ASKETCH :]]


def _fnv1a(key: str) -> int:
    h = 0xCBF29CE484222325
    for byte in key.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def bloom_mask(key: str, size: int) -> int:
    """The key's two bits. Span ids and fingerprints are hex: their low 64 bits are the
    hash; anything else gets FNV-1a (stable across processes, unlike hash()). A caller that
    both tests and sets a key computes this once (the hot path: every span, every tool)."""
    try:
        h = int(key[-16:], 16)
    except ValueError:
        h = _fnv1a(key)
    return bloom_bits(h, size)


def bloom_bits(h: int, size: int) -> int:
    """The two bits of a hash in a bloom filter of `size` bits."""
    return (1 << (h % size)) | (1 << ((h >> 20) % size))


def bounded_put(mapping: dict[str, Any], key: str, value: Any, cap: int = MAP_CAP) -> None:
    """Insert keeping at most `cap` entries; the least recently inserted goes first."""
    if key in mapping:
        del mapping[key]
    elif len(mapping) >= cap:
        del mapping[next(iter(mapping))]
    mapping[key] = value
