"""Hostile load on the embedded engine (the same pure pipeline the stream worker runs):
what stays bounded whatever the input does.

Stated bounds (the numbers the assertions use):
- open runs: at most what one idle timeout of event time holds (here ~1 000 of 100 000);
- finished-run memory: at most streams.replay.engine.FINISHED_MEMORY ids;
- memory: RSS grows < 96 MB over 100 000 one-span runs; after warm-up, 9 000 more runs
  (finished-id memory capped at 500) grow traced memory by < 512 kB;
- one run: json(RunState.to_dict()) < 48 kB, the same (±10 %) at 1k and 10k steps, and
  every per-run collection within its cap (pending, dedup, unresolved, fired, maps, window);
- 1 MB argument/result values: Step on the wire < 2 kB, normalization < 1 s per span.
"""

from __future__ import annotations

import gc
import json
import os
import time
import tracemalloc
from typing import Any

import pytest

import streams.replay.engine as engine_module
from detectors.fingerprint import Fingerprinter
from detectors.policy import Policy, policy_from_mapping
from detectors.state import DEDUP_CAP, FIRED_CAP, MAP_CAP, UNRESOLVED_CAP, RunState
from streams.replay.engine import FINISHED_MEMORY, Engine
from streams.spanpath.normalize import Normalizer
from streams.spanpath.spans import SpanRecord
from tests.spankit import BASE_NS, EXAMPLE_POLICY, MS

PAGE = os.sysconf("SC_PAGE_SIZE")
NO_BUDGETS = {"budgets": {"steps": 10**9, "tokens": 10**15, "seconds": 10**8}}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def policy(**overrides: Any) -> Policy:
    raw = json.loads(json.dumps(EXAMPLE_POLICY))
    raw["defaults"].update(NO_BUDGETS)
    raw["task_types"]["support"] = dict(NO_BUDGETS)
    raw.update(overrides)
    return policy_from_mapping(raw, "<bounds policy>")


def tool_span(
    trace_id: str,
    n: int,
    start: int,
    *,
    tool: str = "lookup_order",
    args: Any = None,
    result: Any = None,
    parent: str | None = "f" * 16,
    resource: dict[str, Any] | None = None,
    dur: int = 5 * MS,
    **extra: Any,
) -> SpanRecord:
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": tool,
        "gen_ai.tool.call.id": f"call_{n}",
    }
    if args is not None:
        attrs["gen_ai.tool.call.arguments"] = args if isinstance(args, str) else json.dumps(args)
    if result is not None:
        attrs["gen_ai.tool.call.result"] = result if isinstance(result, str) else json.dumps(result)
    attrs.update(extra)
    return SpanRecord(
        trace_id,
        f"{n + 1:016x}",
        parent,
        f"execute_tool {tool}",
        1,
        start,
        start + dur,
        0,
        "",
        attrs,
        resource if resource is not None else {"service.name": "bounds"},
    )


class Sink:
    def __init__(self) -> None:
        self.events = 0
        self.summaries = 0
        self.outcomes: dict[str, int] = {}
        self.shapes: dict[str, int] = {}
        self.last_summary: dict[str, Any] | None = None

    def event(self, e: dict[str, Any]) -> None:
        self.events += 1
        self.shapes[e["shape"]] = self.shapes.get(e["shape"], 0) + 1

    def summary(self, s: dict[str, Any]) -> None:
        self.summaries += 1
        self.outcomes[s["outcome"]] = self.outcomes.get(s["outcome"], 0) + 1
        self.last_summary = s


def engine_for(pol: Policy, sink: Sink) -> Engine:
    return Engine(pol, Fingerprinter(b"bounds-key"), sink.event, sink.summary)


# ---------------------------------------------------------------- many runs


def tiny_runs_batches(
    count: int, *, distinct_labels: bool = False, batch: int = 100, first: int = 0
) -> Any:
    """One tool span per run, no root, a new run every 1 ms of event time."""
    shared = {"service.name": "bounds", "prompt.version": "p1"}
    for b in range(first, first + count, batch):
        spans = []
        for i in range(b, min(b + batch, first + count)):
            start = BASE_NS + i * MS
            resource = (
                {"service.name": "bounds", "prompt.version": f"prompt-{i}"}
                if distinct_labels
                else shared
            )
            spans.append(
                tool_span(
                    f"{i + 1:032x}",
                    i,
                    start,
                    tool=f"tool_{i}" if distinct_labels else "search",
                    args={"q": i},
                    result={"n": i},
                    resource=resource,
                    dur=MS // 2,
                )
            )
        yield spans


def test_100k_distinct_runs_stay_bounded() -> None:
    pol = policy(idle_timeout_seconds=1, finalize_grace_seconds=1)
    sink = Sink()
    engine = engine_for(pol, sink)
    gc.collect()
    before = rss()
    peak_runs = peak_schedule = 0
    started = time.perf_counter()
    for spans in tiny_runs_batches(100_000):
        engine.feed(spans)
        peak_runs = max(peak_runs, len(engine.runs))
        peak_schedule = max(peak_schedule, engine.loop.index.scheduled())
        assert len(engine.finished) <= FINISHED_MEMORY
    elapsed = time.perf_counter() - started
    grown = rss() - before
    engine.close()
    # 1 s of idle timeout at one run per ms: ~1 000 open runs, never the whole input
    assert peak_runs <= 1_200, peak_runs
    assert peak_schedule <= 2_400, peak_schedule
    assert len(engine.loop.index) == 0 and not engine.runs
    assert len(engine.finished) <= FINISHED_MEMORY
    assert len(engine.span_path.normalizer._resources) <= 4097
    assert sink.summaries == 100_000
    assert sink.outcomes == {"incomplete_trace": 100_000}
    assert grown < 96 * 2**20, f"RSS grew {grown / 2**20:.1f} MB over 100k runs"
    assert elapsed < 60, elapsed


def _traced_growth(distinct_labels: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, Engine]:
    monkeypatch.setattr(engine_module, "FINISHED_MEMORY", 500)
    pol = policy(idle_timeout_seconds=1, finalize_grace_seconds=1)
    sink = Sink()
    engine = engine_for(pol, sink)
    tracemalloc.start()
    try:
        for spans in tiny_runs_batches(3_000, distinct_labels=distinct_labels):
            engine.feed(spans)
        gc.collect()
        warm = tracemalloc.get_traced_memory()[0]
        for spans in tiny_runs_batches(9_000, distinct_labels=distinct_labels, first=3_000):
            engine.feed(spans)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(engine.finished) <= 500
    return after - warm, engine


def test_no_memory_growth_per_finished_run(monkeypatch: pytest.MonkeyPatch) -> None:
    growth, engine = _traced_growth(False, monkeypatch)
    assert growth < 512 * 1024, f"{growth / 1024:.0f} kB retained by 9 000 finished runs"


def test_label_cardinality_does_not_grow_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run with its own prompt.version (a resource attribute any producer sets): the
    engine's Stats counters (runs_by_prompt, loops_by_prompt, loops_by_tool) are keyed by
    these free-form labels and never forget one."""
    growth, engine = _traced_growth(True, monkeypatch)
    labels = len(engine.stats.runs_by_prompt) + len(engine.stats.loops_by_tool)
    assert growth < 512 * 1024, (
        f"{growth / 1024:.0f} kB retained by 9 000 finished runs; "
        f"{labels} distinct label keys in Engine.stats"
    )


# ---------------------------------------------------------------- one long run


def assert_run_caps(state: RunState, pol: Policy) -> None:
    limits = pol.limits_for(state.task_type)
    assert len(state.pending) <= pol.max_pending_steps
    assert len(state.dedup) <= DEDUP_CAP
    assert len(state.unresolved) <= UNRESOLVED_CAP
    assert len(state.fired) <= FIRED_CAP
    assert len(state.window) <= limits.window
    for name in ("terminal", "plans", "edges", "ledger"):
        assert len(getattr(state, name)) <= MAP_CAP, name
    assert len(state.docs) <= max(MAP_CAP, limits.window)
    assert len(state.shapes) <= 11 and len(state.trigger_ns) <= 11
    assert len(state.budgets_fired) <= 3
    if state.streak is not None:
        assert len(state.streak[3]) <= 8 and len(state.streak[4]) <= 8


def state_size(state: RunState) -> int:
    return len(json.dumps(state.to_dict()))


def long_run(
    steps: int,
    pol: Policy,
    *,
    repeat: int = 1,
    distinct_parents: bool = False,
    checkpoints: tuple[int, ...] = (),
) -> tuple[Engine, Sink, RunState, dict[int, int]]:
    sink = Sink()
    engine = engine_for(pol, sink)
    trace = "ab" * 16
    sizes: dict[int, int] = {}
    state: RunState | None = None
    batch: list[SpanRecord] = []
    for i in range(steps):
        action = i // repeat
        batch.append(
            tool_span(
                trace,
                i,
                BASE_NS + i * 10 * MS,
                tool=f"tool_{action % 7}",
                args={"q": action},
                result={"r": action},
                parent=f"{i + 1:08x}{'e' * 8}" if distinct_parents else "f" * 16,
            )
        )
        if len(batch) == 25 or i + 1 in checkpoints or i + 1 == steps:
            engine.feed(batch)
            batch = []
            state = engine.runs[trace]
            assert_run_caps(state, pol)
            if i + 1 in checkpoints:
                sizes[i + 1] = state_size(state)
    assert state is not None
    engine.close()
    return engine, sink, state, sizes


def test_long_run_state_size_is_independent_of_length() -> None:
    pol = policy()
    engine, sink, state, sizes = long_run(10_000, pol, checkpoints=(100, 1_000, 10_000))
    assert sink.events == 0, sink.shapes
    assert sink.last_summary is not None and sink.last_summary["steps"] == 10_000
    assert state.position == 10_000
    assert state.forced_releases > 0  # 5 s lateness at 10 ms/step: the cap did the releasing
    assert sizes[10_000] < 48 * 1024, sizes
    assert abs(sizes[10_000] - sizes[1_000]) <= 0.10 * sizes[1_000], sizes
    assert abs(sizes[1_000] - sizes[100]) <= 0.10 * sizes[100], sizes


def test_long_run_with_many_findings_and_missing_parents_stays_capped() -> None:
    """10k steps, each action three times in a row (≈3.3k identical_repetition findings),
    every span under a parent that never arrives."""
    pol = policy()
    engine, sink, state, sizes = long_run(
        10_000, pol, repeat=3, distinct_parents=True, checkpoints=(1_000, 10_000)
    )
    assert sink.shapes.get("identical_repetition") == 3_333, sink.shapes
    assert len(state.fired) == FIRED_CAP
    assert len(state.unresolved) == UNRESOLVED_CAP and state.unresolved_overflow
    assert sink.last_summary is not None
    assert sink.last_summary["outcome"] == "incomplete_trace"
    assert sink.last_summary["steps"] == 10_000
    # (JSON form: 64 buffered steps of which each carries two 32-digit similarity sketches)
    assert sizes[10_000] < 56 * 1024, sizes
    assert abs(sizes[10_000] - sizes[1_000]) <= 0.10 * sizes[1_000], sizes


# ---------------------------------------------------------------- big values


MB = 1 << 20


@pytest.mark.parametrize(
    ("args", "result"),
    [
        ({"order_id": "A12", "blob": "a" * MB}, {"version": 1, "blob": "r" * MB}),
        ("a" * MB, "r" * MB),  # bare values
        ({"order_id": "A12", "items": list(range(100_000))}, [{"k": "v" * 10}] * 50_000),
        ({"order_id": "A12", "nested": {"x": ["y" * 1000] * 1000}}, {"ok": False, "code": "404"}),
    ],
    ids=["json-object", "bare-string", "long-arrays", "nested"],
)
def test_megabyte_arguments_and_results_reduce_to_digests(args: Any, result: Any) -> None:
    pol = policy()
    normalizer = Normalizer(pol, Fingerprinter(b"k"))
    trace = "cd" * 16
    spans = [
        tool_span(trace, i, BASE_NS + i * 200 * MS, args=args, result=result) for i in range(3)
    ]
    started = time.perf_counter()
    for span in spans:
        step = normalizer.step(span)
        wire = json.dumps(step.to_list())
        assert len(wire) < 2048, len(wire)
    assert time.perf_counter() - started < 3.0

    sink = Sink()
    engine = engine_for(pol, sink)
    started = time.perf_counter()
    engine.feed(spans)
    state = engine.runs[trace]
    assert state_size(state) < 16 * 1024, state_size(state)
    engine.close()
    assert time.perf_counter() - started < 3.0
    assert sink.last_summary is not None and sink.last_summary["steps"] == 3
    # three identical 1 MB calls are still one action repeated: the digests work
    assert sink.shapes.get("identical_repetition") == 1, sink.shapes


@pytest.mark.parametrize(
    "field",
    [
        "gen_ai.tool.name",
        "gen_ai.tool.call.id",
        "gen_ai.agent.name",
        "gen_ai.prompt.version",
        "gen_ai.tool.version",
        "gen_ai.conversation.id",
    ],
)
def test_megabyte_identifiers_do_not_inflate_state(field: str) -> None:
    """Names and ids are copied into Step, RunState (window, streak, prompt/agent fields)
    and events as they arrive, with no length limit: one 1 MB tool name makes every
    window entry 1 MB, i.e. a run state of ~8 MB (a Kafka changelog record is 1 MB max)."""
    pol = policy()
    trace = "ef" * 16
    spans = []
    for i in range(10):
        value = f"{i % 2}" + "n" * MB if field != "gen_ai.tool.name" else "t" * MB
        huge: dict[str, Any] = {field: value}
        spans.append(tool_span(trace, i, BASE_NS + i * 200 * MS, args={"q": 1}, **huge))
    sink = Sink()
    events: list[dict[str, Any]] = []
    engine = Engine(pol, Fingerprinter(b"k"), events.append, sink.summary)
    engine.feed(spans)
    size = state_size(engine.runs[trace])
    engine.close()
    assert size < 64 * 1024, f"RunState is {size / MB:.1f} MB"
    assert all(len(json.dumps(e)) < 64 * 1024 for e in events)


def test_span_with_10k_attributes_normalizes_quickly() -> None:
    pol = policy()
    normalizer = Normalizer(pol, Fingerprinter(b"k"))
    attrs: dict[str, Any] = {f"custom.attribute.{i}": f"value {i}" for i in range(10_000)}
    attrs.update({f"gen_ai.tool.call.arguments.{i}": i for i in range(100)})
    span = tool_span("12" * 16, 0, BASE_NS, args={"order_id": "A12"}, **attrs)
    started = time.perf_counter()
    step = normalizer.step(span)
    assert time.perf_counter() - started < 1.0
    assert step.kind == "tool" and step.name == "lookup_order"

    # an LLM span announcing 10k tool calls (OpenInference flattened attributes)
    prefix = "llm.output_messages.0.message.tool_calls."
    llm_attrs: dict[str, Any] = {"gen_ai.operation.name": "chat"}
    for i in range(10_000):
        llm_attrs[f"{prefix}{i}.tool_call.function.name"] = f"tool_{i}"
        llm_attrs[f"{prefix}{i}.tool_call.function.arguments"] = json.dumps({"i": i})
    llm = SpanRecord(
        "12" * 16, "2" * 16, None, "chat", 3, BASE_NS, BASE_NS + MS, 0, "", llm_attrs, {}
    )
    started = time.perf_counter()
    step = normalizer.step(llm)
    assert time.perf_counter() - started < 2.0
    assert step.plan_fp is not None and len(json.dumps(step.to_list())) < 2048

    sink = Sink()
    engine = engine_for(pol, sink)
    engine.feed([span, llm])
    engine.close()
    assert sink.summaries == 1


# ---------------------------------------------------------------- reorder buffer overflow


@pytest.mark.parametrize("max_pending", [1, 8, 64])
@pytest.mark.parametrize("mode", ["same-time", "sequence-gap", "reverse"])
def test_pending_overflow_forces_releases_and_loses_nothing(max_pending: int, mode: str) -> None:
    """Event time never advances past the lateness bound (all spans end at the same ns;
    sequence 1 never arrives; sequences arrive newest first): the buffer is capped, the
    overflow is counted, every step is processed exactly once.

    Only with same-time unsequenced spans is every release a forced one; after a forced
    release of a sequenced step the rest flows by sequence (gap) or arrives behind the
    released key and is fed at once as late (reverse)."""
    pol = policy(max_pending_steps=max_pending)
    trace = "34" * 16
    steps = 1_000
    spans = []
    for i in range(steps):
        extra: dict[str, Any] = {}
        if mode == "sequence-gap":
            extra["agent.step.sequence"] = i + 2  # sequence 1 never arrives
        if mode == "reverse":
            extra["agent.step.sequence"] = steps - i  # children first, newest first
        spans.append(tool_span(trace, i, BASE_NS, args={"q": i}, result={"r": i}, dur=MS, **extra))
    sink = Sink()
    engine = engine_for(pol, sink)
    for start in range(0, steps, 40):
        engine.feed(spans[start : start + 40])
        state = engine.runs[trace]
        assert len(state.pending) <= max_pending
        assert state.position + len(state.pending) == min(start + 40, steps)
    if mode == "same-time":
        assert state.forced_releases == steps - max_pending
    else:
        assert 1 <= state.forced_releases <= steps - max_pending
    if mode == "reverse":
        assert state.late_spans > 0
    engine.close()
    assert state.position == steps
    assert not state.pending
    assert sink.last_summary is not None
    assert sink.last_summary["steps"] == steps and sink.last_summary["tool_calls"] == steps


# ---------------------------------------------------------------- absurd clocks


@pytest.mark.parametrize("end_ns", [2**64 - 1, time.time_ns() + 2 * 24 * 3600 * 10**9])
def test_far_future_span_is_invalid_and_other_runs_keep_their_summaries(end_ns: int) -> None:
    """A span ending more than a day after the wall clock would drag replay's watermark:
    every other run would be finalized, late or idle by it. It is counted invalid instead."""

    def summaries(with_bad_span: bool) -> tuple[list[dict[str, Any]], Engine]:
        sink = Sink()
        seen: list[dict[str, Any]] = []
        eng = Engine(pol, Fingerprinter(b"bounds-key"), sink.event, seen.append)
        for i, spans in enumerate(tiny_runs_batches(300, batch=30)):
            if with_bad_span and i == 3:
                bad = tool_span("ab" * 16, 999_999, BASE_NS, args={"q": "x"}, dur=MS)
                bad.end_ns = end_ns
                spans = [*spans[:10], bad, *spans[10:]]
            eng.feed(spans)
        eng.close()
        return seen, eng

    pol = policy()
    clean, _ = summaries(False)
    dirty, eng = summaries(True)
    assert eng.stats.invalid_spans == 1
    assert len(clean) == 300
    assert dirty == clean  # same runs, same outcomes, same order
