"""The one run loop (streams/runloop/loop.py) that the replay (streams/replay/engine.py) and the worker
(streams/worker/agents/driver.py) both drive: per-run apply, release, deadline choice (grace vs
idle, release timer), finalization and event building over a store, with the clock and the
sink passed in. The drivers' own tests (test_examples, test_worker_driver) are thin: what
each adds is where state lives and what the clock is."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from detectors import pipeline
from detectors.fingerprint import Fingerprinter
from detectors.model import NS, Step
from detectors.policy import Policy
from streams.replay.engine import Engine
from streams.runloop.loop import MemoryStore, RunLoop
from streams.spanpath import group_steps
from streams.spanpath.normalize import Normalizer
from streams.worker.state.store import TableStore
from tests.spankit import Run, example_policy

T0 = 1_800_000_000 * NS


class Recorder:
    """A sink that keeps everything, in order."""

    def __init__(self) -> None:
        self.out: list[tuple[str, Any]] = []

    def event(self, event: dict[str, Any]) -> None:
        self.out.append(("event", event))

    def summary(self, summary: dict[str, Any]) -> None:
        self.out.append(("summary", summary))

    def started(self) -> None:
        self.out.append(("started", None))

    def counted(self, duplicate_spans: int, late_spans: int) -> None:
        if duplicate_spans or late_spans:
            self.out.append(("counted", (duplicate_spans, late_spans)))

    def after_finalize(self, spans: int) -> None:
        self.out.append(("after_finalize", spans))

    def evicted_run(self) -> None:
        self.out.append(("evicted", None))

    def vouched(self, arrival_ns: int) -> None:
        self.out.append(("vouched", arrival_ns))

    def held(self, call: Any) -> None:
        self.out.append(("held", call))

    def failed(self, run_id: str, exc: Exception) -> None:
        self.out.append(("failed", (run_id, exc)))

    def kinds(self, kind: str) -> list[Any]:
        return [value for k, value in self.out if k == kind]


def steps_of(policy: Policy, run: Run) -> list[Step]:
    by_run, invalid, _ = group_steps(Normalizer(policy, Fingerprinter(b"k")), run.spans)
    assert invalid == 0
    return by_run[run.trace_id]


def looping(trace: int, root: bool = True) -> Run:
    run = Run(trace=trace)
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    if root:
        run.root()
    return run


def test_group_steps_groups_by_run_in_first_seen_order_and_counts_invalid() -> None:
    normalizer = Normalizer(example_policy(), Fingerprinter(b"k"))
    a, b = looping(1), looping(2)
    spans = [b.spans[0], a.spans[0], *b.spans[1:], *a.spans[1:]]
    broken = a.spans[1]

    class Strict:
        def step(self, span: Any) -> Step:
            if span is broken:
                raise ValueError("unusable")
            return normalizer.step(span)

    seen: list[Any] = []
    by_run, invalid, max_end = group_steps(Strict(), spans, lambda s, e: seen.append(s))  # type: ignore[arg-type]
    assert list(by_run) == [b.trace_id, a.trace_id]
    assert len(by_run[a.trace_id]) == len(a.spans) - 1
    assert invalid == 1 and seen == [broken]
    assert max_end == max(s.end_ns for s in spans if s is not broken)


def test_apply_fires_at_the_threshold_and_schedules_grace_after_the_root() -> None:
    policy = example_policy(allowed_lateness_seconds=0)
    loop, sink = RunLoop(policy, MemoryStore(10), release_timer=True), Recorder()
    run = looping(3, root=False)
    loop.apply(0, run.trace_id, [(steps_of(policy, run), None)], T0, sink)
    assert [e["shape"] for e in sink.kinds("event")] == ["identical_repetition"]
    assert sink.kinds("started") == [None]
    deadline = loop.index.get(run.trace_id)
    assert deadline is not None and deadline.release_at is None  # nothing buffered
    assert deadline.finalize_at == T0 + int(policy.idle_timeout_seconds * NS)  # no root
    run.root()
    loop.apply(0, run.trace_id, [(steps_of(policy, run)[-1:], None)], T0 + NS, sink)
    deadline = loop.index.get(run.trace_id)
    assert deadline is not None
    assert deadline.finalize_at == T0 + NS + int(policy.finalize_grace_seconds * NS)


def test_due_finalizes_then_spans_after_finalize_are_counted_not_fed() -> None:
    policy = example_policy(finalize_grace_seconds=2)
    store = MemoryStore(10)
    loop, sink = RunLoop(policy, store, release_timer=False), Recorder()
    run = looping(4)
    steps = steps_of(policy, run)
    loop.apply(0, run.trace_id, [(steps, None)], T0, sink)
    loop.due(0, T0 + NS, sink)
    assert sink.kinds("summary") == []
    loop.due(0, T0 + 2 * NS, sink)
    (summary,) = sink.kinds("summary")
    assert summary["run_id"] == run.trace_id and summary["outcome"] == "complete"
    assert store.is_finished(run.trace_id, 0) and not store.states and len(loop.index) == 0
    loop.apply(0, run.trace_id, [(steps[:2], None)], T0 + 3 * NS, sink)
    assert sink.kinds("after_finalize") == [2] and not store.states


def test_the_release_timer_releases_buffered_steps_without_a_new_span() -> None:
    policy = example_policy(allowed_lateness_seconds=1, idle_timeout_seconds=600)
    run = looping(5, root=False)
    steps = steps_of(policy, run)
    for timer in (True, False):
        loop, sink = RunLoop(policy, MemoryStore(10), release_timer=timer), Recorder()
        loop.apply(0, run.trace_id, [(steps, None)], T0, sink)
        assert sink.kinds("event") == []  # the last steps wait for the lateness
        deadline = loop.index.get(run.trace_id)
        assert deadline is not None
        assert deadline.release_at == (T0 + NS if timer else None)
        loop.due(0, T0 + NS, sink)
        assert len(sink.kinds("event")) == (1 if timer else 0)
        assert sink.kinds("summary") == []  # released, not finalized


def test_evicted_runs_are_finalized_and_counted() -> None:
    policy = example_policy()
    loop, sink = RunLoop(policy, MemoryStore(10), release_timer=True), Recorder()
    runs = [looping(10 + i, root=False) for i in range(3)]
    for i, run in enumerate(runs):
        loop.apply(0, run.trace_id, [(steps_of(policy, run), None)], T0 + i, sink)
    assert loop.index.mark_evictions(1, T0) == 2
    loop.due(0, T0 + 3, sink)
    assert [s["run_id"] for s in sink.kinds("summary")] == [runs[0].trace_id, runs[1].trace_id]
    assert sink.kinds("evicted") == [None, None] and len(loop.index) == 1


def failing_for(monkeypatch: Any, name: str, run_id: str) -> None:
    """`pipeline.<name>` raises for one run (a detector's bug), works for the others."""
    real = getattr(pipeline, name)

    def maybe_raise(policy: Policy, state: Any, *args: Any) -> Any:
        if state.run_id == run_id:
            raise RuntimeError("a detector's bug")
        return real(policy, state, *args)

    monkeypatch.setattr(pipeline, name, maybe_raise)


def test_a_run_that_fails_at_its_deadline_leaves_the_others_due_with_it_alone(
    monkeypatch: Any,
) -> None:
    policy = example_policy(finalize_grace_seconds=2, idle_timeout_seconds=600)
    store = MemoryStore(10)
    loop, sink = RunLoop(policy, store, release_timer=True), Recorder()
    runs = [looping(20 + i) for i in range(3)]
    for i, run in enumerate(runs):
        loop.apply(0, run.trace_id, [(steps_of(policy, run), None)], T0 + i, sink)
    failing_for(monkeypatch, "finalize", runs[1].trace_id)
    loop.due(0, T0 + 5 * NS, sink)
    assert [s["run_id"] for s in sink.kinds("summary")] == [runs[0].trace_id, runs[2].trace_id]
    ((run_id, exc),) = sink.kinds("failed")
    assert run_id == runs[1].trace_id and isinstance(exc, RuntimeError)
    # kept, and tried again after the idle timeout, not at every tick
    assert runs[1].trace_id in store.states
    deadline = loop.index.get(runs[1].trace_id)
    assert deadline is not None and deadline.finalize_at == T0 + 605 * NS
    loop.due(0, T0 + 604 * NS, sink)
    assert len(sink.kinds("failed")) == 1
    monkeypatch.undo()
    loop.due(0, T0 + 605 * NS, sink)
    assert sink.kinds("summary")[-1]["run_id"] == runs[1].trace_id
    assert len(loop.index) == 0


def test_a_failed_release_is_retried_and_a_failed_eviction_is_not_due_at_once(
    monkeypatch: Any,
) -> None:
    policy = example_policy(allowed_lateness_seconds=1, idle_timeout_seconds=600)
    loop, sink = RunLoop(policy, MemoryStore(10), release_timer=True), Recorder()
    runs = [looping(30 + i, root=False) for i in range(3)]
    for i, run in enumerate(runs):
        loop.apply(0, run.trace_id, [(steps_of(policy, run), None)], T0 + i, sink)
    failing_for(monkeypatch, "release", runs[0].trace_id)
    loop.due(0, T0 + 2 * NS, sink)  # the releases
    assert [r for r, _ in sink.kinds("failed")] == [runs[0].trace_id]
    assert len(sink.kinds("event")) == 2  # the other two runs' loops
    assert loop.index.mark_evictions(0, T0) == 3
    failing_for(monkeypatch, "finalize", runs[1].trace_id)
    loop.due(0, T0 + 3 * NS, sink)
    assert [r for r, _ in sink.kinds("failed")][1:] == [runs[1].trace_id]
    assert [s["run_id"] for s in sink.kinds("summary")] == [runs[0].trace_id, runs[2].trace_id]
    assert loop.index.evicting == 0 and loop.index.next_due(0) == T0 + 603 * NS
    loop.due(0, T0 + 4 * NS, sink)
    assert len(sink.kinds("failed")) == 2


def test_close_finalizes_in_the_order_given() -> None:
    policy = example_policy()
    store = MemoryStore(10)
    loop, sink = RunLoop(policy, store, release_timer=False), Recorder()
    runs = [looping(30 - i, root=False) for i in range(3)]
    for run in runs:
        loop.apply(0, run.trace_id, [(steps_of(policy, run), None)], T0, sink)
    loop.close(sorted(store.states), T0, sink)
    assert [s["run_id"] for s in sink.kinds("summary")] == sorted(r.trace_id for r in runs)
    assert len(loop.index) == 0 and not store.states


def _drive(loop: RunLoop, store: Any, plan: list[tuple[str, list[Step], int]]) -> Recorder:
    sink = Recorder()
    for run_id, steps, now in plan:
        if run_id == "tick":
            loop.due(0, now, sink)
        else:
            loop.apply(0, run_id, [(steps, None)], now, sink)
        if isinstance(store, TableStore):
            store.apply_writes()  # to the tables and back through the codec
            store.cache.clear()
    return sink


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), timer=st.booleans())
def test_the_store_does_not_change_what_the_loop_finds(seed: int, timer: bool) -> None:
    """The replay's dicts and the worker's tables (every state encoded, stored and decoded
    between two calls; settled runs finalized from the summary their envelope keeps, as
    the worker does) give the same outputs in the same order for the same calls."""
    policy = example_policy(allowed_lateness_seconds=1, finalize_grace_seconds=2)
    rng = random.Random(seed)
    pieces: list[tuple[str, list[Step]]] = []
    for trace in range(3):
        run = Run(trace=100 + trace)
        ids = 2 if rng.random() < 0.5 else 99  # repeats (a loop) or distinct orders
        for i in range(rng.randint(2, 6)):
            run.tool("lookup_order", {"order_id": f"A{i % ids}"}, {"status": "pending"})
        if rng.random() < 0.7:
            run.root()
        steps = steps_of(policy, run)
        cut = rng.randint(1, len(steps))
        pieces += [(run.trace_id, steps[:cut]), (run.trace_id, steps[cut:])]
    rng.shuffle(pieces)
    plan, now = [], T0
    for run_id, steps in pieces:
        now += rng.randint(0, 2) * NS
        plan.append((run_id, steps, now))
        if rng.random() < 0.4:
            plan.append(("tick", [], now))
    plan.append(("tick", [], now + 3600 * NS))
    memory = MemoryStore(100)
    table, kept = TableStore(), TableStore()
    want = _drive(RunLoop(policy, memory, release_timer=timer), memory, plan).out
    got = _drive(RunLoop(policy, table, release_timer=timer), table, plan).out
    worker = RunLoop(policy, kept, release_timer=timer, summary_at_settle=True)
    assert got == want
    assert _drive(worker, kept, plan).out == want
    assert len(want) > 0 and table.runs == {} and kept.runs == {} and not memory.states


class CountingDecodes(TableStore):
    """The worker's store, counting the states it decodes."""

    def __init__(self) -> None:
        super().__init__()
        self.decoded = 0

    def load(self, run_id: str, partition: int) -> Any:
        loaded = super().load(run_id, partition)
        self.decoded += loaded is not None
        return loaded


def _settle_and_finalize(run: Run, more: Run | None = None) -> tuple[CountingDecodes, Recorder]:
    """`run` applied and its steps released (its root ended: settled), `more`'s last span
    and its release after that, then the run finalized: the worker's loop over its
    tables, every write applied and nothing cached."""
    policy = example_policy(allowed_lateness_seconds=1, finalize_grace_seconds=5)
    store = CountingDecodes()
    loop, sink = RunLoop(policy, store, release_timer=True, summary_at_settle=True), Recorder()
    arrivals = [(run, T0)] + ([] if more is None else [(more, T0 + 3 * NS)])
    for i, (part, at) in enumerate(arrivals):
        steps = steps_of(policy, part)
        loop.apply(0, run.trace_id, [(steps if i == 0 else steps[-1:], None)], at, sink)
        store.apply_writes()
        loop.due(0, at + 2 * NS, sink)  # the release
        store.apply_writes()
        store.cache.clear()
    store.decoded = 0
    loop.due(0, T0 + 20 * NS, sink)
    return store, sink


def _clean(trace: int) -> Run:
    run = Run(trace=trace)
    for i in range(3):
        run.tool("lookup_order", {"order_id": f"A{i}"}, {"status": "shipped"})
    run.root()
    return run


def test_a_settled_run_without_a_loop_is_finalized_from_its_envelope_without_its_state():
    run = _clean(60)
    store, sink = _settle_and_finalize(run)
    (summary,) = sink.kinds("summary")
    want = pipeline.finalize(example_policy(), _state_of(run))[1]
    assert summary == {**want, "deferred_events": []}
    assert store.decoded == 0  # only the envelope was read
    assert store.finishing == {}  # no state for the retained record
    store.apply_writes()
    assert run.trace_id.encode() not in store.runs and run.trace_id.encode() in store.finished


def test_a_settled_run_that_looped_is_finalized_from_its_state_for_its_timeline():
    run = looping(61)
    store, sink = _settle_and_finalize(run)
    (summary,) = sink.kinds("summary")
    assert summary["shapes"] == ["identical_repetition"]
    assert store.decoded == 1  # its retained record's timeline needs the state
    assert list(store.finishing) == [run.trace_id]


def test_a_span_after_the_settled_save_is_in_the_summary_kept_for_the_finalization():
    run = _clean(62)
    more = _clean(62)
    more.tool("lookup_order", {"order_id": "B9"}, {"status": "shipped"})
    store, sink = _settle_and_finalize(run, more)
    (summary,) = sink.kinds("summary")
    last = max(step.end_ns for step in steps_of(example_policy(), more))
    assert summary["tool_calls"] == 4 and summary["end_time_unix_nano"] == last
    assert store.decoded == 0


def test_an_unsettled_run_keeps_no_summary_and_is_finalized_from_its_state():
    policy = example_policy(idle_timeout_seconds=5)
    store = CountingDecodes()
    loop, sink = RunLoop(policy, store, release_timer=True, summary_at_settle=True), Recorder()
    run = Run(trace=63)
    run.tool("lookup_order", {"order_id": "A1"}, {"status": "shipped"})  # no root yet
    loop.apply(0, run.trace_id, [(steps_of(policy, run), None)], T0, sink)
    store.apply_writes()
    store.cache.clear()
    env = store.load_envelope(run.trace_id, 0)
    assert env is not None and env.summary is None and not env.settled()
    loop.due(0, T0 + 10 * NS, sink)
    (summary,) = sink.kinds("summary")
    assert summary["outcome"] == "incomplete_trace" and store.decoded == 1


def _state_of(run: Run) -> Any:
    policy = example_policy()
    state = pipeline.new_state(run.trace_id)
    for step in pipeline.runtime_order(steps_of(policy, run)):
        pipeline.ingest(policy, state, step)
    return state


# ---------------------------------------------------------------------------- late labels


def _late_labelled_run(trace: int) -> Run:
    """Three identical lookups, the agent going on for 10 s more (past the allowed
    lateness, so the lookups are released before the run ends), then the root, which alone
    carries the prompt version and ends last."""
    run = Run(trace=trace, prompt_version="support-v77").version_only_on_root()
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    run.llm()
    run.clock += 10 * NS
    run.llm()
    run.root()
    return run


def test_an_event_before_the_runs_labels_is_counted_in_the_runs_final_slice():
    run = _late_labelled_run(41)
    children, root = run.spans[:-1], run.spans[-1:]
    events: list[dict] = []
    summaries: list[dict] = []
    engine = Engine(example_policy(), Fingerprinter(b"k"), events.append, summaries.append)
    engine.feed(children)  # the root ends last and is exported in a later batch
    engine.feed(root)
    engine.close()
    (event,) = events
    assert event["prompt_version"] is None and event["labels_pending"] is True
    (summary,) = summaries
    assert summary["prompt_version"] == "support-v77"
    assert [d["event_id"] for d in summary["deferred_events"]] == [event["event_id"]]
    assert summary["deferred_events"][0]["shape"] == "identical_repetition"
    # the replay's table counts the loop in the run's slice, not under "unknown"
    assert engine.stats.loops_by_prompt == {"support-v77": 1}


def test_an_event_whose_labels_are_known_is_counted_at_once():
    run = _late_labelled_run(42)
    events: list[dict] = []
    summaries: list[dict] = []
    engine = Engine(example_policy(), Fingerprinter(b"k"), events.append, summaries.append)
    engine.feed(run.spans)  # the root in the same batch: known before release
    engine.close()
    (event,) = events
    assert event["prompt_version"] == "support-v77" and event["labels_pending"] is False
    assert summaries[0]["deferred_events"] == []
    assert engine.stats.loops_by_prompt == {"support-v77": 1}


def test_a_run_that_never_names_its_version_counts_its_loops_as_unknown_at_the_end():
    run = Run(trace=43, prompt_version="x").version_only_on_root()
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    run.version_on_root = None
    run.root()
    events: list[dict] = []
    summaries: list[dict] = []
    engine = Engine(example_policy(), Fingerprinter(b"k"), events.append, summaries.append)
    engine.feed(run.spans)
    engine.close()
    assert events[0]["labels_pending"] is True and len(summaries[0]["deferred_events"]) == 1
    assert engine.stats.loops_by_prompt == {"unknown": 1}


# ---------------------------------------------------------------------------- episode identity


def test_a_span_arriving_beyond_the_lateness_keeps_the_episodes_event_id():
    """A model span of the run arrives after the loop was released (beyond the allowed
    lateness): it shifts the run's positions, not what happened to the repeated lookup, so
    the identical_repetition event keeps its id."""
    run = Run(trace=71)
    first_llm = run.llm()
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    run.root()
    later = Run(trace=72)  # another run, 20 s later: moves the replay's event time on
    later.clock = run.clock + 20 * NS
    later.llm()

    def events_of(batches: list[list[Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        engine = Engine(example_policy(), Fingerprinter(b"k"), events.append)
        for batch in batches:
            engine.feed(batch)
        engine.close()
        return [e for e in events if e["run_id"] == run.trace_id]

    in_order = events_of([run.spans, later.spans])
    rest = [s for s in run.spans if s is not first_llm]
    late = events_of([rest, later.spans, [first_llm]])
    assert [e["shape"] for e in in_order] == [e["shape"] for e in late] == ["identical_repetition"]
    assert late[0]["first_sequence"] != in_order[0]["first_sequence"]  # positions did move
    assert late[0]["event_id"] == in_order[0]["event_id"]
    assert late[0]["span_ids"] == in_order[0]["span_ids"]


def test_calls_under_a_hold_are_counted_once_per_span_and_runs_once_per_hold() -> None:
    """What `loopwatch query holds` counts (detectors/holds.py `account`): a tool call that
    ran under a hold undecided (the hold book's `held_by` says which), a denial whose
    loop_guard event named a hold; a redelivered span is not counted again, and a run is
    affected once per hold. A denial written before hold ids (two fields) names none."""
    from detectors.holds import HeldCall

    policy = example_policy()
    loop, sink = RunLoop(policy, MemoryStore(10), release_timer=True), Recorder()
    loop.held_by = lambda step: "hold-a" if step.name == "lookup_order" else None
    run = Run(trace=0x38)
    run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    run.tool("search_cases", {"query": "late"}, {"case_ids": []})
    run.tool("lookup_order", {"order_id": "A2"}, {"status": "pending"})
    steps = steps_of(policy, run)
    loop.apply(0, run.trace_id, [(steps, None)], T0, sink)
    loop.apply(0, run.trace_id, [(steps[:1], None)], T0 + NS, sink)  # delivered again
    denial_run = Run(trace=0x38)
    denial_run.root()
    (root_step,) = steps_of(policy, denial_run)
    root_step.denied_calls = ("7 hold-b call-9", "8 hold-a call-10", "9 call-11", "x - c")
    loop.apply(0, run.trace_id, [([root_step], None)], T0 + 2 * NS, sink)
    v = steps[0].prompt_version
    assert v is not None
    held = sink.kinds("held")
    assert len({call.call_id for call in held}) == len(held)  # each counted once
    assert [call._replace(call_id="") for call in held] == [
        HeldCall("hold-a", "lookup_order", v, False, True),
        HeldCall("hold-a", "lookup_order", v, False, False),
        HeldCall("hold-b", None, root_step.prompt_version, True, True),
        HeldCall("hold-a", None, root_step.prompt_version, True, False),
    ]
    # no hold book (the replay): tool calls are not looked up, denials still counted
    plain, sink = RunLoop(policy, MemoryStore(10), release_timer=True), Recorder()
    plain.apply(0, "other", [(steps_of(policy, run), None)], T0, sink)
    assert sink.kinds("held") == []
