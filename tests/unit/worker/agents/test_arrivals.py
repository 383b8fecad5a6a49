"""Unkeyed arrivals held until the input clock passes them (streams/worker/agents/arrivals.py)
and applied by the driver (`RunDriver.apply_arrivals`): in arrival order, each run's at
once and released as applied when vouched for; as before holds (waiting in the run's state)
when held too long or beyond the bound."""

from __future__ import annotations

from typing import Any

from detectors.fingerprint import Fingerprinter
from detectors.model import NS
from streams.spanpath import group_steps
from streams.spanpath.normalize import Normalizer
from streams.worker.agents.arrivals import Arrival, Arrivals
from streams.worker.agents.driver import RunDriver
from streams.worker.agents.messages import PackedSteps
from streams.worker.state.store import decode_envelope
from tests.spankit import Run, example_policy

T0 = 1_800_000_000 * NS


def arrival(at: int, run: str = "r", steps: int = 1, clock: int = 0) -> Arrival:
    # counted, never unpacked here: steps with no fields
    return Arrival(at, run, PackedSteps([()] * steps), clock, f"{run}@{at}")


def test_a_runs_arrivals_leave_together_once_the_clock_passes_its_first() -> None:
    held = Arrivals(hold_ns=10, max_steps=100)
    for at, run in ((100, "a"), (105, "b"), (110, "a"), (120, "c")):
        held.hold(0, arrival(at, run))
    held.hold(1, arrival(100, "d"))
    assert held.take(0, wall_ns=105) == []  # no clock read yet, none held 10
    held.saw(0, 101)
    held.saw(0, 90)  # an older clock does not move it back
    # a's later arrival goes with it: it may carry a span that ended before the first's
    assert [[x.token for x in run] for run in held.take(0, wall_ns=105)] == [["a@100", "a@110"]]
    assert held.due(clock_ns=0, wall_ns=116) == {0, 1}  # b held 11 by then; d on 1
    assert held.due(clock_ns=0, wall_ns=114) == {1}
    assert held.due(clock_ns=105, wall_ns=0) == {0, 1}
    assert [[x.token for x in run] for run in held.take(0, wall_ns=116)] == [["b@105"]]
    held.hold(0, arrival(117, "b"))  # held again: behind c
    assert list(held.queues[0]) == ["c", "b"]
    assert len(held) == 3 and held.steps == 3
    held.clear()
    assert not held and held.steps == 0 and held.take(1, wall_ns=10**9) == []


def test_more_steps_than_the_bound_are_let_go_oldest_run_first() -> None:
    held = Arrivals(hold_ns=10**12, max_steps=5)
    held.hold(0, arrival(1, "a", steps=4))
    held.hold(0, arrival(2, "b", steps=1))
    assert held.due(0, 0) == set() and held.take(0, wall_ns=3) == []
    held.hold(0, arrival(3, "c", steps=2))  # 7 held
    assert held.due(0, 0) == {0}
    assert [[x.token for x in run] for run in held.take(0, wall_ns=3)] == [["a@1"]]
    assert held.steps == 3


def steps_of(policy: Any, run: Run) -> list[Any]:
    by_run, _, _ = group_steps(Normalizer(policy, Fingerprinter(b"k")), run.spans)
    return by_run[run.trace_id]


def test_a_vouched_run_is_applied_once_and_released_as_it_is_applied() -> None:
    """Two arrivals of a run, both passed by the clock: one apply, one state write, its
    steps released (the sequenced run's event fires); the same steps applied on arrival
    wait in the state for a tick, as a candidate."""
    policy = example_policy(allowed_lateness_seconds=5, idle_timeout_seconds=600)
    run = Run(trace=7, sequenced=True)
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    steps = steps_of(policy, run)
    driver = RunDriver(policy)
    runs: dict[bytes, bytes] = {}
    driver.bind(runs, {})
    saves: list[str] = []
    save = driver.store.save
    driver.store.save = lambda run_id, env, state: (saves.append(run_id), save(run_id, env, state))[
        1
    ]  # type: ignore[method-assign]
    driver.arrivals.hold(2, Arrival(T0, run.trace_id, PackedSteps.of(steps[:2]), T0 - NS, "m1"))
    driver.arrivals.hold(
        2, Arrival(T0 + NS // 10, run.trace_id, PackedSteps.of(steps[2:]), T0 - NS, "m2")
    )
    assert driver.apply_arrivals(2, T0 + NS // 5) == []  # no clock past them yet
    driver.arrivals.saw(2, T0 + NS // 5)
    ((applied, out),) = driver.apply_arrivals(2, T0 + NS // 5)
    assert [a.token for a in applied] == ["m1", "m2"]
    assert not isinstance(out, Exception)
    assert [e["shape"] for e in out.events] == ["identical_repetition"]
    assert out.vouched_arrivals == [T0]  # the oldest the clock vouched for
    assert saves == [run.trace_id]
    driver.apply_writes()
    env, state = decode_envelope(runs[run.trace_id.encode()])
    assert state.pending == [] and env.candidates == [] and env.seen_ns == T0 + NS // 10
    # on arrival instead: the steps wait in the state for the clock
    other = RunDriver(policy)
    other.bind({}, {})
    out = other.process_run(2, run.trace_id, [(steps, T0 - NS)], T0)
    assert out.events == []
    env, state = other.cache[run.trace_id]
    assert len(state.pending) == len(steps) and env.candidates == [(T0, state.max_end_ns)]


def test_a_run_that_fails_leaves_nothing_and_the_others_go_on(monkeypatch: Any) -> None:
    from detectors import pipeline

    policy = example_policy(allowed_lateness_seconds=0)
    a, b = Run(trace=8), Run(trace=9)
    for run in (a, b):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "ok"})
    driver = RunDriver(policy)
    runs: dict[bytes, bytes] = {}
    driver.bind(runs, {})
    driver.arrivals.hold(
        0, Arrival(T0, a.trace_id, PackedSteps.of(steps_of(policy, a)), T0 - NS, "a")
    )
    driver.arrivals.hold(
        0, Arrival(T0, b.trace_id, PackedSteps.of(steps_of(policy, b)), T0 - NS, "b")
    )
    driver.arrivals.saw(0, T0)
    ingest = pipeline.ingest

    def failing(policy: Any, state: Any, step: Any) -> Any:
        if state.run_id == a.trace_id:
            raise RuntimeError("detector bug")
        return ingest(policy, state, step)

    monkeypatch.setattr(pipeline, "ingest", failing)
    (failed, error), (done, out) = driver.apply_arrivals(0, T0)
    assert [x.token for x in failed] == ["a"] and isinstance(error, RuntimeError)
    assert [x.token for x in done] == ["b"] and not isinstance(out, Exception)
    driver.apply_writes()
    assert list(runs) == [b.trace_id.encode()]


def test_a_tick_takes_a_runs_held_arrivals_before_it_finalizes_the_run() -> None:
    """A run due for finalization by a tick's clock, with a later arrival still held (the
    clock has not passed it): the arrival goes into the run first, as it would have on
    arrival, and moves the run's deadline; the tick does not finalize the run without it."""
    policy = example_policy(finalize_grace_seconds=2, idle_timeout_seconds=600)
    run = Run(trace=10)
    run.tool("lookup_order", {"order_id": "A1"}, {"status": "ok"})
    run.root()
    first = steps_of(policy, run)
    run.tool("lookup_order", {"order_id": "A2"}, {"status": "ok"})
    late = steps_of(policy, run)[len(first) :]
    driver = RunDriver(policy)
    driver.bind({}, {})
    driver.process_run(0, run.trace_id, [(first, T0 - NS)], T0)
    held_at = T0 + 3 * NS  # after the grace by the wall clock
    driver.arrivals.hold(0, Arrival(held_at, run.trace_id, PackedSteps.of(late), T0, "late"))
    tick = T0 + 2 * NS  # the input clock: the run is due, the arrival not vouched for
    assert driver.loop.index.get(run.trace_id).due <= tick  # type: ignore[union-attr]
    assert driver.arrivals.take(0, held_at) == []  # not for the clock alone
    ((applied, out),) = driver.apply_arrivals(0, held_at, tick)
    assert [a.token for a in applied] == ["late"] and not isinstance(out, Exception)
    assert driver.tick(0, tick).summaries == []  # its deadline counts from the arrival
    (summary,) = driver.tick(0, held_at + 2 * NS).summaries
    assert summary["tool_calls"] == 2
