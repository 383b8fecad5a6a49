"""The worker's thin driver of the run loop (streams/worker/agents/driver.py, no faust, no broker): RunDriver over
dict tables with an explicit clock behaves like the replay engine; deadlines, ticks,
finished markers, eviction and the write-through state cache."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.fingerprint import Fingerprinter
from detectors.model import NS
from detectors.policy import Policy, load_policy, policy_from_mapping
from detectors.recovery import event_id
from streams.runloop.deadlines import Deadline, DeadlineIndex
from streams.spanpath import group_steps
from streams.spanpath.normalize import Normalizer
from streams.spanpath.otlp import decode_record
from streams.worker.agents.driver import RunDriver
from streams.worker.agents.messages import (
    decode_run_groups,
    decode_steps,
    encode_run_groups,
    encode_steps,
    key_partition,
    packed_run_steps,
)
from streams.worker.api.answers import run_view
from streams.worker.state.retained import INDEX, index_key, indexed_key, is_record_key
from streams.worker.state.store import (
    Envelope,
    TableStore,
    decode_envelope,
    decode_header,
    encode_envelope,
    encode_finished,
)
from tests.otlp_build import encode_request, example_files, file_messages, replay_messages
from tests.paths import REPO
from tests.spankit import Run, example_policy
from tests.support.deliveries import exported_in_time_order

ROOT = REPO
POLICY = load_policy(ROOT / "examples" / "loopwatch.yaml")
KEY = b"unit-key"
T0 = 1_800_000_000 * NS  # wall clock of the fake worker


def stream_policy(**timing: Any) -> Policy:
    import yaml

    raw = yaml.safe_load((ROOT / "examples" / "loopwatch.yaml").read_text())
    raw.update(timing)
    return policy_from_mapping(raw, "<stream test policy>")


class FakeWorker:
    """Ingest + detect + ticks, as the faust agents call them, on dict tables."""

    def __init__(self, policy: Policy, partitions: int = 4, **kw: Any) -> None:
        self.normalizer = Normalizer(policy, Fingerprinter(KEY))
        self.driver = RunDriver(policy, **kw)
        self.runs: dict[bytes, bytes] = {}
        self.finished: dict[bytes, bytes] = {}
        self.retained: dict[bytes, bytes] = {}
        self.episodes: dict[bytes, bytes] = {}
        self.driver.bind(self.runs, self.finished, self.retained, self.episodes)
        self.partitions = partitions
        self.now = T0
        self.events: list[dict[str, Any]] = []
        self.summaries: list[dict[str, Any]] = []
        self.after_finalize = 0
        self.late = 0
        self.evicted = 0
        # The input clock steps messages carry (None: keyed input / wall-clock mode).
        self.clock: int | None = None

    def collect(self, out: Any) -> None:
        self.events += out.events
        self.summaries += out.summaries
        self.after_finalize += out.spans_after_finalize
        self.late += out.late_spans
        self.evicted += out.evicted

    def feed(self, message: bytes) -> None:
        by_run, _invalid, _ = group_steps(
            self.normalizer, decode_record(message, "otlp_proto", "t")
        )
        # over the wire and back, like the internal topic
        for run_id, steps in decode_run_groups(encode_run_groups(by_run.items())):
            p = key_partition(run_id.encode(), self.partitions)
            self.collect(self.driver.process_run(p, run_id, [(steps, self.clock)], self.now))
        self.driver.apply_writes()  # after the outputs

    def advance(self, seconds: float, clock_lag: float = 0.0) -> None:
        """Wall time moves on, then a tick, its clock `clock_lag` s behind (the input clock)."""
        self.now += int(seconds * NS)
        clock = self.now - int(clock_lag * NS)
        for p in sorted(self.driver.due_partitions(clock)):
            self.collect(self.driver.tick(p, clock))
        self.driver.apply_writes()


# Run facts an event takes from the run's spans as they were when it fired: the stream may
# fire before the span carrying them (often the root, which ends last) has come; the replay
# holds the run whole and always has them.
RUN_FACTS = ("session_id", "agent_name", "prompt_version")


def as_streamed(stream_event: dict[str, Any], replay_event: dict[str, Any]) -> dict[str, Any]:
    """The replay's event with the run facts the stream's event did not have yet."""
    out = dict(replay_event)
    for key in RUN_FACTS:
        if stream_event[key] is None:
            out[key] = None
    if stream_event["labels_pending"]:
        out["labels_pending"] = True
    return out


def test_every_read_asks_the_partition_its_run_is_processed_in() -> None:
    """The worker reads a key from one partition's database (faust_internals.partition_read;
    faust's Table, read outside an event, searched every partition for a key it had not
    seen): a run's state, finished marker and retained record must be asked for in the
    partition the run is processed in, the one its key maps to. Over the examples, with
    finalizations, finished runs' late spans and retained records."""
    from streams.worker.state.retained import Retention

    policy = stream_policy(finalize_grace_seconds=2, idle_timeout_seconds=5)
    worker = FakeWorker(policy, retention=Retention.hours(1, 1))
    reads: list[tuple[int, bytes]] = []

    def read(table: dict[bytes, bytes], partition: int, key: bytes) -> bytes | None:
        reads.append((partition, key))
        return table.get(key)

    worker.driver.store.read = read
    for path in example_files():
        for message in file_messages(path):
            worker.feed(message)
        worker.advance(10)
    for message in file_messages(example_files()[0]):  # again: their runs are finished
        worker.feed(message)
    assert worker.summaries and worker.after_finalize
    run_keys = [(p, key) for p, key in reads if is_record_key(key)]
    assert len({key for _, key in run_keys}) >= len(worker.summaries)
    assert [(p, key) for p, key in run_keys if p != key_partition(key, 4)] == []


def test_driver_equals_replay_on_the_examples() -> None:
    """Same events (same order, same fields, but for the run facts the stream had not
    received when an event fired) and the same run outcomes."""
    policy = stream_policy(finalize_grace_seconds=2, idle_timeout_seconds=5)
    for path in example_files():
        messages = list(file_messages(path))
        want_events, want_runs = replay_messages(messages, POLICY, KEY)
        worker = FakeWorker(policy)
        for m in messages:
            worker.feed(m)
            worker.advance(0.01)
        worker.advance(10)
        assert len(worker.events) == len(want_events), path.name
        for got, want in zip(worker.events, want_events, strict=True):
            assert got == as_streamed(got, want), path.name
        assert sorted((s["run_id"], s["outcome"]) for s in worker.summaries) == sorted(
            (s["run_id"], s["outcome"]) for s in want_runs
        ), path.name
        assert worker.runs == {} and len(worker.finished) == len(want_runs)
        assert len(worker.driver.index) == 0


def test_shuffled_and_duplicated_input_with_a_long_buffer_gives_the_same_ids() -> None:
    policy = stream_policy(
        allowed_lateness_seconds=60, finalize_grace_seconds=2, idle_timeout_seconds=5
    )
    want: set[str] = set()
    messages: list[bytes] = []
    for path in example_files():
        msgs = list(file_messages(path))
        want |= {e["event_id"] for e in replay_messages(msgs, POLICY, KEY)[0]}
        messages += msgs
    rng = random.Random(5)
    for _ in range(3):
        batch = messages + rng.sample(messages, 15)
        rng.shuffle(batch)
        worker = FakeWorker(policy)
        for m in batch:
            worker.feed(m)
        worker.advance(10)
        assert {e["event_id"] for e in worker.events} == want
        assert len(worker.events) == len(want)  # each episode fired once


def test_unkeyed_arrivals_out_of_order_are_held_until_the_input_clock_vouches() -> None:
    """Spans of one trace on different input partitions, one far behind: a run's later
    spans arrive first. Released by their end times (default lateness, 5 s) the earlier
    ones would come late and the episodes change; the steps carry an input clock behind
    every arrival, so nothing is released on end times until a tick vouches for them."""
    policy = stream_policy(finalize_grace_seconds=2, idle_timeout_seconds=5)
    want: set[str] = set()
    want_late: dict[str, int] = {}  # one example has a late span in file order
    messages: list[bytes] = []
    for path in example_files():
        msgs = list(file_messages(path))
        events, runs = replay_messages(msgs, POLICY, KEY)
        want |= {e["event_id"] for e in events}
        want_late |= {r["run_id"]: r["late_spans"] for r in runs}
        messages += msgs
    for seed in range(3):
        batch = list(messages)
        random.Random(seed).shuffle(batch)
        worker = FakeWorker(policy)
        worker.clock = T0 - NS  # the group has not got past any of it yet
        for m in batch:
            worker.feed(m)
        worker.advance(10)
        assert {e["event_id"] for e in worker.events} == want, seed
        # no late spans beyond the file order's own (held, that one may come in order)
        late = {r["run_id"]: r["late_spans"] for r in worker.summaries}
        assert late.keys() == want_late.keys()
        assert all(n <= want_late[run_id] for run_id, n in late.items()), (seed, late)


def test_a_busy_run_is_released_while_the_input_clock_trails_its_arrivals() -> None:
    """A run without sequence numbers whose messages come every 0.2 s, the input clock
    1.5 s behind: every message arrives before the clock reaches the previous one, yet
    release keeps up, about the clock's lag behind, not only when the run pauses."""
    policy = stream_policy(allowed_lateness_seconds=1, finalize_grace_seconds=2)
    worker = FakeWorker(policy)
    run = Run(trace=77)
    for _ in range(40):
        # 100 ms of event time per span, two spans per message: event time keeps pace
        run.tool("lookup_order", {"order_id": "Z"}, {"status": "pending"}, gap_ms=0)
        run.tool("lookup_order", {"order_id": "Z"}, {"status": "pending"}, gap_ms=0)
    released = []
    for i in range(0, len(run.spans), 2):
        worker.clock = worker.now - int(1.5 * NS)
        worker.feed(encode_request(run.spans[i : i + 2]))
        worker.advance(0.2)
        _, state = decode_envelope(worker.runs[run.trace_id.encode()])
        released.append(state.position)
    # Held back: the lateness (1 s) plus one to two clock lags (a candidate waits for the
    # clock, the next is taken at the arrival after that), 10 spans a second.
    for i in range(20, 40):
        assert released[i] >= 2 * (i + 1) - (10 + 2 * 15 + 2), (i, released)
    assert worker.events and worker.events[0]["shape"] == "identical_repetition"


def test_a_runs_last_message_is_released_once_the_input_clock_passes_its_arrival() -> None:
    """Unkeyed input: sequenced steps of a run's last message wait for the input clock to
    vouch for their arrival (everything in the input by then has been forwarded), as a later
    message of the run would confirm them; not for the lateness timer (5 s here), the
    fallback for a clock that does not move. The first tick whose clock is past the arrival
    releases them (the bench's unkeyed events came 5-10 s after its last record)."""
    policy = stream_policy(allowed_lateness_seconds=5, idle_timeout_seconds=600)
    run = Run(trace=19, sequenced=True)  # contiguous steps release once vouched for
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    worker = FakeWorker(policy)
    worker.clock = worker.now - NS  # sent while the input clock trails by a second
    worker.feed(encode_request(run.spans))
    assert worker.events == []  # not vouched for yet: held
    arrival = worker.now
    for _ in range(8):  # ticks every 0.25 s, their clock 1 s behind the wall clock
        worker.advance(0.25, clock_lag=1)
        if worker.events:
            break
    assert [e["shape"] for e in worker.events] == ["identical_repetition"]
    clock = worker.now - NS
    assert arrival <= clock < arrival + NS // 4  # the first tick past it
    assert decode_envelope(worker.runs[run.trace_id.encode()])[1].pending == []


def test_a_tick_handles_a_run_of_two_arrivals_once() -> None:
    """Unkeyed input: a run's second message keeps the first one's release time (its
    candidate is the older one). Each tick loads, releases and saves the run once, however
    often it was scheduled for that time (it was twice per tick: a load, a release of
    nothing and a save more for a third of the bench's runs)."""
    policy = stream_policy(allowed_lateness_seconds=5, idle_timeout_seconds=600)
    run = Run(trace=24, sequenced=True)
    for i in range(6):
        run.tool("lookup_order", {"order_id": f"A{i}"}, {"status": "ok", "version": i})
    worker = FakeWorker(policy)
    saves: list[int] = []  # the clock of each save made by a tick
    ticking: list[int] = []
    tick, save = worker.driver.tick, worker.driver.store.save

    def ticked(partition: int, now_ns: int) -> Any:
        ticking.append(now_ns)
        try:
            return tick(partition, now_ns)
        finally:
            ticking.pop()

    def saved(run_id: str, env: Envelope, state: Any) -> None:
        saves.extend(ticking)
        save(run_id, env, state)

    worker.driver.tick = ticked  # type: ignore[method-assign]
    worker.driver.store.save = saved  # type: ignore[method-assign]
    worker.clock = worker.now - NS
    worker.feed(encode_request(run.spans[:3]))
    worker.advance(0.1, clock_lag=1)
    worker.clock = worker.now - NS
    worker.feed(encode_request(run.spans[3:]))
    for _ in range(8):
        worker.advance(0.25, clock_lag=1)
    assert decode_envelope(worker.runs[run.trace_id.encode()])[1].position == len(run.spans)
    assert saves and len(saves) == len(set(saves)), saves


def test_each_arrival_of_a_busy_run_is_released_one_clock_lag_after_it() -> None:
    """Unkeyed input, a sequenced run whose messages come every 0.2 s while the input clock
    trails by 1 s and ticks come every 0.05 s: each message's steps are released by the
    first tick whose clock passes their arrival (one lag), not after the arrival before
    them was vouched for and then their own (up to two lags: one candidate at a time, 1.65 s
    here)."""
    policy = stream_policy(allowed_lateness_seconds=5, idle_timeout_seconds=600)
    run = Run(trace=23, sequenced=True)
    for i in range(24):
        run.tool("lookup_order", {"order_id": f"A{i}"}, {"status": "ok", "version": i})
    worker = FakeWorker(policy)
    arrivals: list[tuple[int, int]] = []  # (wall clock at arrival, steps up to then)
    released_at: dict[int, int] = {}
    for i in range(0, 24, 2):
        worker.clock = worker.now - NS  # sent at an input clock a second behind
        worker.feed(encode_request(run.spans[i : i + 2]))
        arrivals.append((worker.now, i + 2))
        for _ in range(4):  # 0.2 s between messages, in ticks of 0.05 s
            worker.advance(0.05, clock_lag=1)
            position = decode_envelope(worker.runs[run.trace_id.encode()])[1].position
            released_at.setdefault(position, worker.now)
    for _ in range(40):
        worker.advance(0.05, clock_lag=1)
        position = decode_envelope(worker.runs[run.trace_id.encode()])[1].position
        released_at.setdefault(position, worker.now)
    waits = []
    for arrived, steps in arrivals:
        done = min(t for position, t in released_at.items() if position >= steps)
        waits.append((done - arrived) / NS)
    assert max(waits) <= 1.0 + 0.05 + 1e-9, waits


def test_release_timer_feeds_buffered_steps_without_a_new_span() -> None:
    policy = stream_policy(allowed_lateness_seconds=1, idle_timeout_seconds=600)
    run = Run(trace=9)
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})

    worker = FakeWorker(policy)
    worker.feed(encode_request(run.spans))
    assert worker.events == []  # the last steps wait for the lateness
    state = decode_envelope(worker.runs[run.trace_id.encode()])[1]
    assert state.pending
    worker.advance(0.5)
    assert worker.events == []
    worker.advance(0.6)  # 1.1 s of wall time: the run clock passed the lateness
    assert [e["shape"] for e in worker.events] == ["identical_repetition"]
    assert worker.summaries == []  # released, not finalized
    state = decode_envelope(worker.runs[run.trace_id.encode()])[1]
    assert state.pending == []
    worker.advance(600)
    assert [s["outcome"] for s in worker.summaries] == ["incomplete_trace"]  # no root: idle


def test_finalization_deadlines_and_late_spans_after_finalize() -> None:
    policy = stream_policy(finalize_grace_seconds=2, idle_timeout_seconds=5)

    run = Run(trace=10)
    run.tool("lookup_order", {"order_id": "A1"}, {"status": "ok"})
    first = encode_request(run.spans)
    run.root()
    rest = encode_request(run.spans[1:])
    worker = FakeWorker(policy)
    worker.feed(first)
    worker.advance(4.9)
    assert worker.summaries == []  # idle timeout 5 s not reached
    worker.feed(rest)  # the root: grace 2 s from now
    worker.advance(1.9)
    assert worker.summaries == []
    worker.advance(0.2)
    assert [(s["run_id"], s["outcome"]) for s in worker.summaries] == [(run.trace_id, "complete")]
    worker.feed(first)  # redelivered after the end: counted, not a new run
    assert worker.after_finalize == 1 and worker.runs == {}
    worker.advance(100)
    assert len(worker.summaries) == 1


def test_late_spans_and_spans_after_finalize_are_counted_apart() -> None:
    """`late_spans`: behind steps of the run already released (fed, as in summaries);
    `spans_after_finalize`: of a run already finished (counted, not fed)."""
    policy = stream_policy(
        allowed_lateness_seconds=0, finalize_grace_seconds=2, idle_timeout_seconds=5
    )
    run = Run(trace=12)
    for i in range(3):
        run.tool("lookup_order", {"order_id": f"A{i}"}, {"status": "ok"})
    run.root()
    worker = FakeWorker(policy)
    worker.feed(encode_request(run.spans[1:]))  # released at once (lateness 0)
    worker.feed(encode_request(run.spans[:1]))  # the first tool call, behind them
    assert (worker.late, worker.after_finalize) == (1, 0)
    worker.advance(3)
    assert [s["late_spans"] for s in worker.summaries] == [1]
    worker.feed(encode_request(run.spans[:2]))
    assert (worker.late, worker.after_finalize) == (1, 2)


def test_finished_markers_expire() -> None:

    policy = stream_policy(finalize_grace_seconds=1, idle_timeout_seconds=5)
    run = Run(trace=11)
    run.tool("lookup_order", {"order_id": "A1"}, {"status": "ok"})
    run.root()
    worker = FakeWorker(policy, finished_ttl_seconds=60)
    worker.feed(encode_request(run.spans))
    worker.advance(2)
    assert run.trace_id.encode() in worker.finished
    worker.advance(59)
    assert run.trace_id.encode() in worker.finished
    worker.advance(2)
    assert worker.finished == {}  # the first sweep past the TTL


def test_the_markers_sweep_goes_through_a_partition_in_slices() -> None:
    """Markers live in the table only (no index in memory): a sweep reads the next `limit`
    of the partition from where the last one stopped, deletes those past the cutoff that
    are its partition's, and starts again past the end."""
    store = TableStore(0)
    finished: dict[bytes, bytes] = {
        b"a": encode_finished(10, 0),
        b"b": encode_finished(50, 0),
        b"c": encode_finished(10, 1),  # another partition's (a plain mapping holds all)
        b"d": encode_finished(20, 0),
        b"e": encode_finished(90, 0),
    }
    store.bind({}, finished)
    assert store.sweep_finished(0, 30, 2) == 1  # a and b read: a goes
    assert store.finished_after[0] == b"b"
    assert store.sweep_finished(0, 30, 2) == 1  # c (not its own) and d: d goes
    assert store.sweep_finished(0, 30, 2) == 0  # e, the end: next time from the start
    assert store.finished_after[0] is None
    writes = store.take_writes().rows()
    assert sorted(key for _t, _p, key, value in writes if value is None) == [b"a", b"d"]


def test_a_settled_runs_state_is_not_cached() -> None:
    """The state cache keeps runs that will be loaded again soon: one whose root has not
    ended is. One whose root ended with nothing waiting is loaded once more, to be
    finalized after the grace: its decoded state is not held until then, and the
    finalization reads it from the table."""
    policy = stream_policy(
        allowed_lateness_seconds=2, finalize_grace_seconds=10, idle_timeout_seconds=600
    )
    worker = FakeWorker(policy)
    open_run, done_run = Run(trace=60), Run(trace=61)
    for run in (open_run, done_run):
        for _ in range(3):
            run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    done_run.root()
    worker.feed(encode_request(open_run.spans + done_run.spans))
    assert done_run.trace_id in worker.driver.cache  # its last steps wait for the lateness
    worker.advance(3)  # released: the open run waits for more, the done one for the grace
    assert open_run.trace_id in worker.driver.cache
    assert done_run.trace_id not in worker.driver.cache
    assert done_run.trace_id.encode() in worker.runs and not worker.summaries
    worker.advance(10)
    assert [s["run_id"] for s in worker.summaries] == [done_run.trace_id]
    assert worker.summaries[0]["tool_calls"] == 3  # the state read back from the table
    assert not worker.runs.get(done_run.trace_id.encode())


def test_capacity_evicts_the_oldest_idle_runs() -> None:

    policy = stream_policy(idle_timeout_seconds=600)
    worker = FakeWorker(policy, max_active_runs=2)
    ids = []
    for trace in range(20, 24):
        run = Run(trace=trace)
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "ok"})
        worker.feed(encode_request(run.spans))
        ids.append(run.trace_id)
        worker.now += NS  # later runs are younger
    worker.advance(0.1)
    assert worker.evicted == 2
    assert sorted(s["run_id"] for s in worker.summaries) == sorted(ids[:2])  # the oldest
    assert {k.decode() for k in worker.runs} == set(ids[2:])
    assert len(worker.driver.index) == 2
    worker.advance(0.1)
    assert worker.evicted == 2  # stable at the bound


def test_rebuild_after_rebalance_restarts_the_clocks() -> None:

    policy = stream_policy(finalize_grace_seconds=2, idle_timeout_seconds=5)
    run = Run(trace=30)
    run.tool("lookup_order", {"order_id": "A1"}, {"status": "ok"})
    worker = FakeWorker(policy)
    worker.feed(encode_request(run.spans))
    # a new worker (restart) finds the tables 100 s later
    fresh = FakeWorker(policy)
    fresh.runs, fresh.finished, fresh.now = worker.runs, worker.finished, worker.now + 100 * NS
    fresh.driver.bind(fresh.runs, fresh.finished)  # the restarted worker's restored tables
    fresh.driver.rebuild(fresh.runs.items(), None, fresh.now)
    assert len(fresh.driver.index) == 1
    fresh.advance(4.9)  # downtime did not count
    assert fresh.summaries == []
    fresh.advance(0.2)
    assert [s["outcome"] for s in fresh.summaries] == ["incomplete_trace"]
    # partitions not assigned to this worker are left out
    other = FakeWorker(policy)
    other.driver.rebuild(worker.runs.items(), {99}, worker.now)
    assert len(other.driver.index) == 0


def test_a_failure_never_leaves_a_half_updated_state_in_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from detectors import pipeline

    policy = stream_policy(idle_timeout_seconds=600)
    run = Run(trace=31)
    run.tool("lookup_order", {"order_id": "A1"}, {"status": "ok"})
    worker = FakeWorker(policy)
    worker.feed(encode_request(run.spans))
    before = worker.runs[run.trace_id.encode()]
    run.tool("lookup_order", {"order_id": "A2"}, {"status": "ok"})

    def boom(*args: Any) -> Any:
        raise RuntimeError("detector bug")

    monkeypatch.setattr(pipeline, "release", boom)
    with pytest.raises(RuntimeError):
        worker.feed(encode_request(run.spans[1:]))
    assert worker.runs[run.trace_id.encode()] == before
    assert run.trace_id not in worker.driver.cache
    assert not worker.driver.take_writes()
    monkeypatch.undo()
    worker.feed(encode_request(run.spans[1:]))
    state = decode_envelope(worker.runs[run.trace_id.encode()])[1]
    assert state.spans == 2 and state.duplicate_spans == 0


def test_table_writes_wait_for_the_outputs_and_reads_see_them() -> None:

    policy = stream_policy(allowed_lateness_seconds=0, finalize_grace_seconds=1)
    run = Run(trace=32)
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    run.root()
    worker = FakeWorker(policy, cache_size=0)  # no cache: reads go to the overlay or table
    key = run.trace_id.encode()
    out = worker.driver.process_run(
        0,
        run.trace_id,
        [([worker.normalizer.step(s) for s in run.spans], None)],
        worker.now,
    )
    assert [e["shape"] for e in out.events] == ["identical_repetition"]
    assert worker.runs == {}  # nothing written before the caller published the event
    worker.now += 2 * NS
    out = worker.driver.tick(0, worker.now)  # same batch
    assert [s["outcome"] for s in out.summaries] == ["complete"]  # read the pending state
    writes = worker.driver.take_writes().rows()
    assert sorted((t, k, v is None) for t, _p, k, v in writes) == [
        ("finished", key, False),
        ("runs", key, True),
    ]
    worker.driver.discard_writes()
    assert not worker.driver.take_writes()


def test_deadline_index() -> None:
    index = DeadlineIndex()
    index.set("a", Deadline(0, 10, None, 100))
    index.set("b", Deadline(0, 20, 50, 200))
    index.set("c", Deadline(1, 30, None, 60))
    assert index.next_due(0) == 50 and index.next_due(1) == 60
    index.set("b", Deadline(0, 25, None, 300))  # rescheduled: the old heap entry is stale
    assert index.pop_due(0, 99) == []
    assert index.pop_due(0, 100) == ["a"]
    index.remove("a")
    assert index.mark_evictions(1, 0) == 1  # b (seen 25) and c (30): the oldest goes
    assert index.get("b").evict and index.pop_due(0, 0) == ["b"]
    assert index.mark_evictions(1, 0) == 0  # already marked
    index.remove("b")
    assert len(index) == 1 and index.evicting == 0


def test_a_run_scheduled_twice_at_the_same_time_is_due_once() -> None:
    """A second arrival keeps the first one's release time (its candidate is the oldest):
    the run is in the heap twice at that time, and the tick handled it twice (a load, a
    release that released nothing, a save), then scheduled it twice again."""
    index = DeadlineIndex()
    index.set("a", Deadline(0, 10, 40, 100))
    index.set("a", Deadline(0, 20, 40, 100))  # same due
    index.set("b", Deadline(0, 30, 50, 100))
    assert index.pop_due(0, 60) == ["a", "b"]
    index.set("a", Deadline(0, 20, None, 100))
    assert index.pop_due(0, 60) == []
    assert index.pop_due(0, 100) == ["a"]


def test_wire_formats_round_trip() -> None:
    policy = example_policy()
    normalizer = Normalizer(policy, Fingerprinter(KEY))
    run = Run(trace=40)
    run.tool("lookup_order", {"order_id": "A1"}, {"status": "ok"})
    run.llm()
    steps = [normalizer.step(s) for s in run.spans]

    def wire(items: list[Any]) -> str:  # () and [] are the same on the wire
        return json.dumps([s.to_list() for s in items])

    assert wire(decode_steps(encode_steps(steps))) == wire(steps)
    groups = decode_run_groups(encode_run_groups([("r1", steps), ("r2", steps[:1])]))
    assert [(r, wire(g)) for r, g in groups] == [("r1", wire(steps)), ("r2", wire(steps[:1]))]
    assert b"A1" not in encode_steps(steps)  # arguments are digests on the wire

    from detectors import pipeline

    state = pipeline.new_state("r1")
    for step in steps:
        pipeline.ingest(policy, state, step)
    raw = encode_envelope(state, Envelope(3, 111, 100, 0, None, 0, 42))
    head = decode_header(raw)
    assert head == Envelope(3, 111, 100, state.max_end_ns, None, len(state.pending), 42)
    env, back = decode_envelope(raw)
    assert json.dumps(back.to_dict()) == json.dumps(state.to_dict()) and env == head
    # arrivals waiting for the input clock, and the one pair written before there were more
    waiting = Envelope(3, 111, 100, 0, None, 0, 42, [(111, 7), (112, 9)])
    assert decode_header(encode_envelope(state, waiting)).candidates == [(111, 7), (112, 9)]
    old = raw.replace(b'"cand":[]', b'"cand":[111,7]', 1)
    assert old != raw and decode_header(old).candidates == [(111, 7)]
    # a settled run's summary rides in the header; a header without one (and one from
    # before it) reads as None
    summary = {**pipeline.summarize(policy, state), "deferred_events": []}
    kept = decode_header(encode_envelope(state, Envelope(3, 111, 100, 0, 5, 0, summary=summary)))
    assert kept.summary == summary and json.dumps(kept.summary) == json.dumps(summary)
    assert head.summary is None and b'"sum"' not in raw


def test_steps_messages_are_binary_exact_and_checked() -> None:
    policy = example_policy()
    normalizer = Normalizer(policy, Fingerprinter(KEY))
    run = Run(trace=41)
    run.tool("lookup_order", {"order_id": "A1"}, {"status": "ok"})
    run.llm()
    steps = [normalizer.step(s) for s in run.spans]
    value = encode_run_groups([("r1", steps)])
    assert value[:1] == b"\x01"
    ((run_id, back),) = decode_run_groups(value)
    assert run_id == "r1" and back == steps  # exact: tuples stay tuples, floats stay floats
    assert decode_steps(encode_steps(steps)) == steps
    # JSON of earlier versions (in flight across an upgrade) is still read
    legacy = json.dumps([["r1", [s.to_list() for s in steps]]]).encode()
    assert decode_run_groups(legacy) == [("r1", steps)]
    assert decode_steps(json.dumps([s.to_list() for s in steps]).encode()) == steps
    import marshal

    bad = [
        b"\x01" + marshal.dumps({"not": "a list"}),
        b"\x01" + marshal.dumps([("r1", [("too", "short")])]),
        b"\x01" + marshal.dumps([("r1", [(*steps[0].to_list()[:-1], [1])])]),
        b"\x01garbage",
        b"\x02" + marshal.dumps([]),
    ]
    for value in bad:
        with pytest.raises(ValueError):
            decode_run_groups(value)


def test_held_steps_are_packed_checked_alike_and_give_the_same_steps_back() -> None:
    """What detect holds for the input clock (messages.packed_run_steps): each run's steps
    as decoding gives them, from a grouped, a run-keyed or an earlier JSON message; what
    decoding refuses, packing refuses too; and packed, a step takes a third of the memory
    of its Step objects or less (the held bursts' pages stayed behind, stop 62)."""
    import marshal
    import tracemalloc

    policy = example_policy()
    normalizer = Normalizer(policy, Fingerprinter(KEY))
    run = Run(trace=42)
    for _ in range(20):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "ok"})
    run.llm()
    steps = [normalizer.step(s) for s in run.spans]
    grouped = encode_run_groups([("r1", steps), ("r2", steps[:3])])
    packed = packed_run_steps(None, grouped)
    assert [(r, len(p), p.unpack()) for r, p in packed] == [
        ("r1", len(steps), steps),
        ("r2", 3, steps[:3]),
    ]
    ((run_id, one),) = packed_run_steps(b"r9", encode_steps(steps))
    assert run_id == "r9" and one.unpack() == steps
    legacy = json.dumps([["r1", [s.to_list() for s in steps]]]).encode()
    assert [(r, p.unpack()) for r, p in packed_run_steps(None, legacy)] == [("r1", steps)]
    legacy_keyed = json.dumps([s.to_list() for s in steps]).encode()
    assert packed_run_steps(b"r9", legacy_keyed)[0][1].unpack() == steps
    bad = [
        b"\x01" + marshal.dumps({"not": "a list"}),
        b"\x01" + marshal.dumps([("r1", [("too", "short")])]),
        b"\x01" + marshal.dumps([("r1", [(*steps[0].to_list()[:-1], [1])])]),
        b"\x01garbage",
    ]
    for value in bad:
        with pytest.raises(ValueError):
            decode_run_groups(value)
        with pytest.raises(ValueError):
            packed_run_steps(None, value)
    with pytest.raises(ValueError):
        packed_run_steps(b"r9", b"\x01" + marshal.dumps([("too", "short")]))
    many = [encode_run_groups([(f"r{i}", steps)]) for i in range(50)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held_packed = [packed_run_steps(None, m) for m in many]
        as_packed = tracemalloc.get_traced_memory()[0] - before
        held_steps = [decode_run_groups(m) for m in many]
        as_steps = tracemalloc.get_traced_memory()[0] - before - as_packed
    finally:
        tracemalloc.stop()
    assert len(held_packed) == len(held_steps) == 50
    assert as_packed * 3 < as_steps, (as_packed, as_steps)


def test_key_partition_matches_the_java_client() -> None:
    # murmur2 of the Java client (org.apache.kafka.common.utils.Utils.murmur2)
    assert key_partition(b"21", 8) == (-973932308 & 0x7FFFFFFF) % 8
    assert {key_partition(f"run-{i}".encode(), 4) for i in range(50)} == {0, 1, 2, 3}


def test_run_view_shows_digests_only() -> None:
    policy = stream_policy(allowed_lateness_seconds=0)

    run = Run(trace=50, prompt_version="v7")
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "SECRET-ORDER"}, {"status": "SECRET-RESULT"})
    worker = FakeWorker(policy)
    worker.feed(encode_request(run.spans))
    worker.advance(0.1)
    raw = worker.runs[run.trace_id.encode()]
    doc = run_view(run.trace_id, raw, False)
    text = json.dumps(doc)
    assert "SECRET" not in text
    assert doc["found"] and not doc["finished"] and doc["state"]["prompt_version"] == "v7"
    assert [s["position"] for s in doc["steps"]] == [1, 2, 3]
    assert set(doc["steps"][0]) == {
        "position",
        "span_id",
        "tool_name",
        "action_fp",
        "outcome_digest",
        "error_code",
    }
    fired = doc["findings"][0]
    assert fired["shape"] == "identical_repetition"
    assert fired["event_id"] == worker.events[0]["event_id"]
    assert "trace_url" not in doc
    from alerts.trace_links import TraceLinks

    linked = run_view(run.trace_id, raw, False, TraceLinks("https://tempo.example/{trace_id}"))
    assert linked["trace_url"] == f"https://tempo.example/{run.trace_id}"
    missing = run_view("nope", None, True)
    assert missing["found"] is False and missing["finished"] is True and missing["steps"] == []
    assert event_id  # imported for the id function the view uses


# ---------------------------------------------------------------------------- split over partitions


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_any_split_over_input_partitions_gives_the_replays_events(n: int, seed: int) -> None:
    """Unkeyed input, the worker's driver: a time-ordered export stream's spans split at
    random over 1-5 input partitions, each exported in time order as its spans end (a
    batch spans at most 2 s, within the allowed lateness) and
    consumed as a live stream at uneven rates (each step, a random partition reads a random
    number of the records produced by then), the input clock being what every partition
    has read (the earliest record not yet read), ticks judging deadlines by it: the same
    events, ids and positions as the replay of the one stream."""
    messages = exported_in_time_order(2_000, seed=seed % 7)
    rng = random.Random(seed)
    spans = [s for m in messages for s in decode_record(m, "otlp_proto", "t")]
    base = spans[0].end_ns
    queues: list[list[tuple[int, bytes]]] = [[] for _ in range(n)]  # (produced at, record)
    pending: list[list[Any]] = [[] for _ in range(n)]

    def flush(p: int) -> None:  # a batch is produced when its last span has ended
        queues[p].append((T0 + pending[p][-1].end_ns - base, encode_request(pending[p])))
        pending[p] = []

    for span in spans:  # each partition exports its spans as they end: 20-60 at a time,
        p = rng.randrange(n)  # within 2 s (each source delivers within the allowed lateness)
        if pending[p] and span.end_ns - pending[p][0].end_ns > 2 * NS:
            flush(p)
        pending[p].append(span)
        if len(pending[p]) >= rng.randint(20, 60):
            flush(p)
    for p in range(n):
        if pending[p]:
            flush(p)
    # Held releases: with release_on_sequence (the default) a run's sequenced steps go as
    # soon as they are contiguous and the input clock vouches for their arrival, so an
    # unsequenced model span of the run that ended just before, still in another source's
    # export batch, can be late (test_a_lagging_partition_does_not_make_model_spans_late)
    policy = stream_policy(release_on_sequence=False)
    want, _ = replay_messages(messages, policy, KEY)
    worker = FakeWorker(policy)
    driver = worker.driver

    def tick(clock: int) -> None:
        for part in sorted(driver.due_partitions(clock)):
            worker.collect(driver.tick(part, clock))
        driver.apply_writes()

    while any(queues):
        worker.now += rng.randint(50, 400) * 1_000_000  # 50-400 ms of wall time
        heads = [q[0][0] for q in queues if q]
        worker.clock = min([*heads, worker.now]) - 1  # every record before it was read
        ready = [q for q in queues if q and q[0][0] <= worker.now]
        if ready:
            q = rng.choice(ready)
            for _ in range(rng.randint(1, 3)):
                if q and q[0][0] <= worker.now:
                    worker.feed(q.pop(0)[1])
        tick(worker.clock)
    worker.clock = worker.now + 3600 * NS  # caught up: every deadline passes
    tick(worker.clock)

    def same(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # agent_name is the run's agent as known when the event fired (an agent span ends,
        # and arrives, after its children): arrival-dependent by design, unlike everything
        # the episode itself decides (README "Reading an event")
        return sorted(({**e, "agent_name": None} for e in events), key=lambda e: e["event_id"])

    assert worker.late == 0
    assert same(worker.events) == same(want)


def test_a_lagging_partition_does_not_make_model_spans_late() -> None:
    """release_on_sequence: the run's sequenced tool calls are read from a partition that
    is ahead; its model spans (unsequenced, in between) from one that lags. The tool calls
    are not released past what the input clock vouches for, so the model spans are not
    counted late when their partition catches up."""
    run = Run(trace=91, sequenced=True)
    for _ in range(3):
        run.llm()
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    run.root()
    tools = [s for s in run.spans if s.name.startswith("execute_tool")]
    others = [s for s in run.spans if s not in tools]
    worker = FakeWorker(stream_policy())
    worker.clock = T0 - NS  # the lagging partition: nothing after T0 - 1 s is vouched for
    worker.feed(encode_request(tools))  # the partition that is ahead
    worker.now += NS
    worker.feed(encode_request(others))  # the lagging partition catches up
    worker.clock = worker.now  # every record produced before now has been read
    worker.feed(encode_request([]))
    worker.clock = None
    worker.advance(60)
    assert worker.late == 0
    assert [e["shape"] for e in worker.events] == ["identical_repetition"]


def test_the_worker_links_events_and_summaries_to_their_trace() -> None:
    """LOOPWATCH_TRACE_URL reaches the worker's run loop (WorkerSettings.trace_links)."""
    from alerts.trace_links import TraceLinks

    links = TraceLinks.parse("https://jaeger.example/trace/{trace_id}?uiFind={span_id}")
    worker = FakeWorker(
        stream_policy(finalize_grace_seconds=2, idle_timeout_seconds=5), links=links
    )
    for path in example_files():
        for m in file_messages(path):
            worker.feed(m)
            worker.advance(0.01)
    worker.advance(10)
    assert worker.events and worker.summaries
    for event in worker.events:
        assert event["trace_url"] == (
            f"https://jaeger.example/trace/{event['trace_id']}?uiFind={event['trigger_span_id']}"
        )
    for summary in worker.summaries:
        assert summary["trace_url"] == f"https://jaeger.example/trace/{summary['trace_id']}?uiFind="


# ---------------------------------------------------------------------------- retained runs


def retaining_worker(looping_h: float = 168, clean_h: float = 24) -> FakeWorker:
    from streams.worker.state.retained import Retention

    policy = stream_policy(
        allowed_lateness_seconds=0, finalize_grace_seconds=2, idle_timeout_seconds=5
    )
    return FakeWorker(policy, retention=Retention.hours(looping_h, clean_h))


def test_a_finished_run_that_looped_is_kept_with_its_summary_events_and_steps() -> None:
    from streams.worker.api.answers import retained_view
    from streams.worker.state.retained import Retention, header

    worker = retaining_worker()
    looping = Run(trace=61, prompt_version="v7")
    for _ in range(4):
        looping.tool("lookup_order", {"order_id": "SECRET-ORDER"}, {"status": "SECRET-RESULT"})
    looping.root()
    clean = Run(trace=62, prompt_version="v7")
    clean.tool("lookup_order", {"order_id": "B2"}, {"status": "ok"})
    clean.root()
    worker.feed(encode_request(looping.spans[:3]))  # the loop fires while the run is open
    worker.advance(0.1)
    assert looping.trace_id.encode() in worker.retained  # its events so far
    worker.feed(encode_request(looping.spans[3:] + clean.spans))
    worker.advance(10)
    assert worker.runs == {}  # both finished
    raw = worker.retained[looping.trace_id.encode()]
    expires, finished, _partition = header(raw)
    assert expires - finished == 168 * 3600 * NS and finished == worker.now
    doc = retained_view(looping.trace_id, raw, Retention.hours(168, 24))
    assert doc["found"] and doc["finished"]
    assert doc["summary"]["outcome"] == "complete" and doc["summary"]["shapes"] == [
        "identical_repetition"
    ]
    assert [e["shape"] for e in doc["events"]] == ["identical_repetition"]
    assert {e["event_id"] for e in doc["events"]} == {
        e["event_id"] for e in worker.events if e["run_id"] == looping.trace_id
    }
    assert [s["position"] for s in doc["timeline"]] == [1, 2, 3, 4]
    assert {s["tool_name"] for s in doc["timeline"]} == {"lookup_order"}
    assert "SECRET" not in json.dumps(doc)
    # a clean run: its summary only, for the shorter retention
    raw = worker.retained[clean.trace_id.encode()]
    expires, finished, _ = header(raw)
    assert expires - finished == 24 * 3600 * NS
    doc = retained_view(clean.trace_id, raw, Retention.hours(168, 24))
    assert doc["summary"]["shapes"] == [] and doc["events"] == [] and doc["timeline"] == []


def _kept_records(worker: FakeWorker) -> dict[bytes, bytes]:
    return {k: v for k, v in worker.retained.items() if is_record_key(k)}


def test_expired_runs_are_swept_and_the_rest_kept() -> None:
    from streams.worker.agents import driver as driver_module

    worker = retaining_worker(looping_h=2, clean_h=1)
    for trace in range(70, 90):
        run = Run(trace=trace)
        for _ in range(3 if trace % 2 else 1):
            run.tool("lookup_order", {"order_id": "C3"}, {"status": "ok"})
        run.root()
        worker.feed(encode_request(run.spans))
    worker.advance(10)
    assert len(_kept_records(worker)) == 20
    worker.advance(3600 + 60)  # clean runs expired, looping ones not yet
    assert len(_kept_records(worker)) == 10
    kept = {bytes.fromhex(k.decode())[-1] for k in _kept_records(worker)}
    assert all(n % 2 for n in kept)
    assert sum(k.startswith(INDEX) for k in worker.retained) == 10  # one entry a record
    for _ in range(2):  # swept in slices of SWEEP_BATCH, once a SWEEP_SECONDS
        worker.advance(3600)
    assert _kept_records(worker) == {}
    assert not any(k.startswith(INDEX) for k in worker.retained)
    assert driver_module.SWEEP_BATCH >= 1


def test_the_sweep_takes_a_partition_a_slice_at_a_time() -> None:
    from streams.worker.state.retained import encode
    from streams.worker.state.store import TableStore

    store = TableStore()
    table = {
        f"run-{i:03d}".encode(): encode({}, i % 2, 100 if i < 60 else 10**12, 1) for i in range(100)
    }
    store.bind({}, {}, table)
    # records written before the expiry index: one pass over partition 0's records, 20
    # keys read at a time from where the last slice stopped, indexes the live ones
    deleted = [store.sweep_retained(0, 1000, 20) for _ in range(6)]
    store.apply_writes()
    records = {k for k in table if is_record_key(k)}
    assert sum(deleted) == 30 and len(records) == 70  # the even keys below 60 are gone
    assert all(int(k[4:]) % 2 or int(k[4:]) >= 60 for k in records)
    assert store.sweep_after[0] is None  # past the end: the next slice starts again
    index = sorted(k for k in table if k.startswith(INDEX))
    assert index == sorted(index_key(10**12, f"run-{i:03d}".encode()) for i in range(60, 100, 2))
    assert indexed_key(0) in table and indexed_key(1) not in table
    # from then on the index: nothing more is due until the live records' time
    assert store.sweep_retained(0, 10**12 - 1, 20) == 0
    assert store.sweep_retained(0, 10**12, 20) == 20
    store.apply_writes()
    assert all(int(k[4:]) % 2 for k in table if is_record_key(k))


def _counting_store() -> tuple[TableStore, list[int]]:
    """A store whose scans count the records they hand out, per call."""
    from streams.worker.state.store import scan_mapping

    handed: list[int] = []

    def counting_scan(
        table: Any, partition: int, after: bytes | None, limit: int
    ) -> Iterator[tuple[bytes, bytes]]:
        handed.append(0)
        for item in scan_mapping(table, partition, after, limit):
            handed[-1] += 1
            yield item

    store = TableStore()
    store.scan = counting_scan
    return store, handed


def test_the_retained_sweep_reads_what_expired_not_every_record_kept() -> None:
    """A record is kept for a day or a week, so a sweep that read every record each minute
    read millions a minute at a steady finish rate. The expiry index is read in expiry
    order up to the first entry not yet due: a sweep reads the records due and one more,
    however many are kept, and a record whose expiry moved is deleted at its new time."""
    from streams.worker.state.retained import encode

    store, handed = _counting_store()
    table: dict[bytes, bytes] = {}
    store.bind({}, {}, table)
    store.sweep_retained(0, 0, 5_000)  # an empty partition: indexed at once, nothing written
    assert not store.writes and store.retained_indexed == {0}
    for i in range(2_000):
        expires = 100 + i if i < 10 else 10**12  # ten due soon, the rest kept long
        store.put_retained(0, f"run-{i:04d}".encode(), encode({}, 0, expires, 1), was=None)
    moved = b"run-0003"  # its expiry moved out: its old entry goes, its record stays
    was = store.load_retained(0, moved)
    store.put_retained(0, moved, encode({"again": 1}, 0, 10**12 + 5, 1), was=was)
    store.apply_writes()
    handed.clear()
    assert store.sweep_retained(0, 1_000, 5_000) == 9
    assert handed == [10]  # nine entries due, then the first one that is not: 10 read
    store.apply_writes()
    records = {k for k in table if is_record_key(k)}
    assert len(records) == 1_991 and moved in records
    assert store.sweep_after[0] is None


def test_a_sweep_reads_its_slice_one_record_at_a_time() -> None:
    """The sweeps read records as they go, not a slice held at once (5,000 retained records
    in a list were a burst that grew with the history kept), and the episodes' sweep
    stops reading at its first record inside the retention."""
    from streams.worker.state import episodes
    from streams.worker.state.retained import encode

    store, handed = _counting_store()
    retained = {f"run-{i:03d}".encode(): encode({}, 0, 100, 1) for i in range(50)}
    listed = {
        episodes.key({"run_id": f"r{i}", "event_id": f"e{i}"}, t): b"{}"
        for i, t in enumerate([10, 20, 30, 10**12, 2 * 10**12, 3 * 10**12])
    }
    store.bind({}, {}, retained, listed)
    assert store.sweep_retained(0, 1000, 20) == 20
    assert store.sweep_after[0] == b"run-019"  # the cursor: the last key read
    assert store.sweep_episodes(0, 10**9, 100) == 3
    assert handed == [20, 4]  # the episodes' sweep read one past the retention, not 100


def test_the_side_effect_ledger_says_whether_a_refund_went_out_before_the_loop() -> None:
    """A refund, then a loop, then the same refund with another key, then a reconcile call:
    the kept run lists both refunds, their keys, outcomes, the reconcile and which one
    committed before the first loop event."""
    from streams.worker.api.answers import retained_view
    from streams.worker.state.retained import Retention

    worker = retaining_worker()
    run = Run(trace=95, prompt_version="v7")
    run.tool(
        "issue_refund", {"order_id": "A1", "amount": 10, "idempotency_key": "k-1"}, {"ok": True}
    )
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "refunded"})
    run.tool(
        "issue_refund", {"order_id": "A1", "amount": 10, "idempotency_key": "k-2"}, {"ok": True}
    )
    run.tool("issue_refund", {"order_id": "A1", "amount": 10}, {"ok": False, "code": "timeout"})
    run.tool("get_refund_status", {"order_id": "A1"}, {"status": "done"})
    run.root()
    worker.feed(encode_request(run.spans[:4]))
    worker.advance(0.1)
    worker.feed(encode_request(run.spans[4:]))
    worker.advance(10)
    shapes = {e["shape"] for e in worker.events}
    assert {"identical_repetition", "duplicate_side_effect"} <= shapes
    doc = retained_view(
        run.trace_id, worker.retained[run.trace_id.encode()], Retention.hours(168, 24)
    )
    calls = doc["side_effects"]
    assert [c["tool"] for c in calls] == ["issue_refund"] * 3
    assert [c["idempotency_key"] for c in calls] == ["new", "new", "missing"]
    assert [c["outcome"] for c in calls] == ["ok", "ok", "ambiguous"]
    assert [c["committed_before_first_loop"] for c in calls] == [True, False, False]
    assert all(c["reconciled"] for c in calls)  # get_refund_status came after each
    assert len({c["business"] for c in calls}) == 1  # one order
    assert "A1" not in json.dumps(doc) and "k-1" not in json.dumps(doc)


def test_every_loop_episode_is_listed_by_time_and_swept_after_the_retention() -> None:
    from streams.worker.api.answers import recent_episodes
    from streams.worker.state import episodes

    def newest(table: dict[bytes, bytes], partition: int) -> list[tuple[bytes, bytes]]:
        return sorted(table.items(), reverse=True)

    worker = retaining_worker(looping_h=2, clean_h=1)
    driver = worker.driver
    runs = []
    for trace in (101, 102, 103):
        run = Run(trace=trace).version_only_on_root()  # the version comes last, with the root
        for _ in range(3):
            run.tool("lookup_order", {"order_id": "D4"}, {"status": "pending"})
        run.root()
        runs.append(run)
    for run in runs:
        worker.now += NS  # listed in this order
        for p_, steps in _groups(worker, encode_request(run.spans)):
            worker.collect(driver.process_run(p_, run.trace_id, [(steps, None)], worker.now))
        driver.apply_writes()
    for p_ in range(worker.partitions):
        worker.now += 10 * NS
        worker.collect(driver.tick(p_, worker.now))
    driver.apply_writes()
    assert len(worker.episodes) == len(worker.events) == 3
    rows = recent_episodes(
        range(4), worker.episodes, worker.retained, newest, 0, {"prompt_version": "support-v12"}
    )
    assert [r["run_id"] for r in rows] == sorted((r.trace_id for r in runs), reverse=True)
    assert all(r["run_status"] == "finished" and r["outcome"] == "complete" for r in rows)
    assert all(episodes.key_ns(k) > 0 for k in worker.episodes)
    assert (
        recent_episodes(
            range(4), worker.episodes, worker.retained, newest, 0, {"shape": "retry_storm"}
        )
        == []
    )
    # two hours on, a sweep deletes them (the oldest keys first)
    deleted = driver.store.sweep_episodes(0, worker.now + 3 * 3600 * NS, 100)
    driver.apply_writes()
    assert deleted == 3 and worker.episodes == {}


def _groups(worker: FakeWorker, message: bytes) -> list[tuple[int, list[Any]]]:
    by_run, _invalid, _ = group_steps(worker.normalizer, decode_record(message, "otlp_proto", "t"))
    return [(key_partition(r.encode(), worker.partitions), s) for r, s in by_run.items()]


def test_a_sweep_pass_goes_on_at_the_next_ticks_until_the_partition_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One slice a minute fell behind a finish rate above SWEEP_BATCH a minute a partition
    (the markers grew on disk). A pass starts every SWEEP_SECONDS and its partition stays
    due, a slice a tick, until the pass reaches its end."""
    from streams.worker.agents import driver as driver_module

    monkeypatch.setattr(driver_module, "SWEEP_BATCH", 3)
    driver = RunDriver(stream_policy(), finished_ttl_seconds=60)
    finished = {f"run-{i:02d}".encode(): encode_finished(1_000, 0) for i in range(10)}
    driver.bind({}, finished)
    now = 100 * NS
    assert 0 not in driver.due_partitions(now)  # nothing finished here yet, not assigned
    driver.rebuild([], {0}, now)
    passes = 0
    while 0 in driver.due_partitions(now):
        driver.tick(0, now)
        driver.store.apply_writes()
        passes += 1
        assert passes < 10
    assert finished == {} and passes == 4  # 3 + 3 + 3 + 1 (the end)
    assert 0 not in driver.due_partitions(now + driver_module.SWEEP_NS - 1)
    assert 0 in driver.due_partitions(now + driver_module.SWEEP_NS)
