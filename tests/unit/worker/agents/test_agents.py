"""The agents of streams/worker/ without a broker or faust: a `Worker` wired to recording
fake topics, tables and consumer (passed to its constructor), its agents' per-message
methods called with fake events."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, MessageSizeTooLargeError
from prometheus_client import CollectorRegistry

from alerts.metrics import Metrics
from detectors import pipeline
from detectors.fingerprint import Fingerprinter
from detectors.policy import policy_from_mapping
from streams.runloop.deadlines import Deadline
from streams.spanpath.normalize import Normalizer
from streams.worker.agents.messages import (
    decode_run_groups,
    encode_mark,
    encode_run_groups,
    encode_tick,
    mark_offsets,
    sent_clock,
    split_to_fit,
    tick_clock,
)
from streams.worker.kafka.delivery import Abandoned
from streams.worker.kafka.input_clock import InputClock
from streams.worker.service import Worker
from streams.worker.settings import WorkerSettings
from streams.worker.state.store import COUNT_TABLES, Tables, Writes, decode_envelope
from streams.worker.state.versions import history_of
from streams.worker.state.window_keys import decode_count
from tests.otlp_build import encode_request
from tests.paths import REPO
from tests.spankit import Run

ROOT = REPO


@dataclass
class Msg:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: float = 0.0
    headers: list[tuple[str, bytes]] | None = None
    generation_id: int = 0  # the consumer group generation it was read in (faust's)

    @property
    def tp(self) -> tuple[str, int]:
        return (self.topic, self.partition)


@dataclass
class Ev:
    message: Msg


class FakeFuture(asyncio.Future):  # type: ignore[type-arg]
    """faust's FutureMessage, as far as the worker uses it."""

    kw: dict[str, Any]


class FakeTopic:
    def __init__(self, name: str, log: list[tuple[str, Any]]) -> None:
        self.name = name
        self.log = log
        self.sent: list[dict[str, Any]] = []
        self.failures: list[BaseException] = []  # the next sends' delivery errors
        self.refusals: list[BaseException] = []  # the next sends' errors raised at once

    def as_future_message(self, **kw: Any) -> FakeFuture:
        fut = FakeFuture()
        fut.kw = kw
        return fut

    async def publish_message(self, fut: FakeFuture) -> None:
        if self.refusals:
            raise self.refusals.pop(0)
        self.sent.append(fut.kw)
        self.log.append(("send", self.name))
        if self.failures:
            fut.set_exception(self.failures.pop(0))
        else:
            fut.set_result(None)


class FakeStream:
    """The manual-ack stream of the ingest agent."""

    def __init__(self) -> None:
        self.acked: list[int] = []

    async def ack(self, event: Any) -> bool:
        self.acked.append(event.message.offset)
        return True


async def acked(service: Any, stream: FakeStream, event: Any, records: Any) -> None:
    """Run the ingest agent's acknowledgement of `event` to its end."""
    service.ingest.ack_when_delivered(stream, event, records)
    await service.ingest.last_ack[event.message.tp]


class FakeConsumer:
    """faust's consumer, as far as acknowledging read-back records goes."""

    def __init__(self) -> None:
        self.acked: list[tuple[str, int, int]] = []
        self._committed_offset: dict[tuple[str, int], int | None] = {}  # as faust's

    def ack(self, message: Any) -> bool:
        self.acked.append((message.topic, message.partition, message.offset))
        return True


class FakeTable(dict):  # type: ignore[type-arg]
    def __init__(self, name: str, log: list[tuple[str, Any]]) -> None:
        super().__init__()
        self.name = name
        self.log = log

    def __setitem__(self, key: Any, value: Any) -> None:
        self.log.append(("write", self.name))
        super().__setitem__(key, value)


@dataclass
class Fakes:
    """What a test worker reads and writes instead of faust's objects and the broker."""

    log: list[tuple[str, Any]] = field(default_factory=list)
    consumer: FakeConsumer = field(default_factory=FakeConsumer)
    refetchers: dict[str, Any] = field(default_factory=dict)  # by topic
    stopping: bool = False
    # faust's app.rebalancing and app.consumer_generation_id (faust_internals.read_in_assignment)
    rebalancing: bool = False
    group_generation: int = 0

    def read_in_assignment(self, message: Any) -> bool:
        return not self.rebalancing and message.generation_id == self.group_generation


@pytest.fixture
def fakes() -> Fakes:
    return Fakes()


@pytest.fixture
def make(tmp_path: Path, fakes: Fakes) -> Any:
    """A Worker over `fakes`; keyword arguments are LOOPWATCH_* settings."""

    def build(tables: Tables | None = None, **env: str) -> Worker:
        settings = WorkerSettings.from_env(
            {"LOOPWATCH_STORE": "memory://", "LOOPWATCH_DATA_DIR": str(tmp_path), **env}
        )
        raw = yaml.safe_load((ROOT / "examples" / "loopwatch.yaml").read_text())
        raw["allowed_lateness_seconds"] = 0  # steps are released as they arrive
        policy = policy_from_mapping(raw, "<test>")
        log = fakes.log
        return Worker(
            settings,
            policy,
            Normalizer(policy, Fingerprinter(b"k")),
            Metrics(CollectorRegistry()),
            4,
            tables=tables
            or Tables(
                FakeTable("runs", log),
                FakeTable("finished", log),
                FakeTable("loop_counts", log),
                FakeTable("run_counts", log),
                version_counts=FakeTable("version_counts", log),
                hold_counts=FakeTable("hold_counts", log),
            ),
            topics={name: FakeTopic(name, log) for name in ("steps", "events", "runs", "dead")},
            consumer=lambda: fakes.consumer,
            stopping=lambda: fakes.stopping,
            assigned=lambda: {0, 1, 2, 3},
            read_in_assignment=fakes.read_in_assignment,
            refetcher=lambda topic: fakes.refetchers[topic],
        )

    return build


@pytest.fixture
def service(make: Any) -> Worker:
    return make()


async def detect_batch(service: Any, events: list[Any]) -> list[Any]:
    """One detect batch and the flush of its staged state (as the agent does once per
    flush interval); returns the events the flush acknowledges."""
    await service.detect.batch(events)
    acked: list[Any] = await service.detect.checkpoint.flush()
    return acked


def total(table: Any) -> int:
    """The sum of a windowed count table (the test tables keep one window)."""
    return sum(decode_count(v)[0] for v in table.values())


def looping_run(trace: int) -> Run:
    run = Run(trace=trace)
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    run.root()
    return run


async def test_ingest_then_detect_publishes_before_writing_state(
    service: Any, fakes: Fakes
) -> None:
    runs = [looping_run(t) for t in (1, 2, 3)]
    record = encode_request([s for r in runs for s in r.spans])
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 7, None, record, 123.0)))
    sent = service.topics["steps"].sent
    assert 1 <= len(sent) <= 3 and all(m["key"] is None for m in sent)
    assert sum(len(decode_run_groups(m["value"])) for m in sent) == 3  # three runs, grouped
    assert all(m["timestamp"] == 123.0 for m in sent)
    fakes.log.clear()
    events = [
        Ev(Msg("loopwatch-steps", m["partition"], i, None, m["value"], 123.0))
        for i, m in enumerate(sent)
    ]
    await detect_batch(service, events)
    shapes = [json.loads(m["value"])["shape"] for m in service.topics["events"].sent]
    assert shapes == ["identical_repetition"] * 3
    consumed = service.metrics.registry.get_sample_value(
        "loopwatch_records_consumed_total", {"topic": "loopwatch-steps"}
    )
    assert consumed == len(sent)  # the stall alert needs the steps topic's progress too
    first_write = fakes.log.index(("write", "loop_counts"))
    assert all(entry == ("send", "events") for entry in fakes.log[:first_write])
    assert first_write < fakes.log.index(("write", "runs"))  # counts before state
    assert len(service.tables.runs) == 3
    assert total(service.tables.loop_counts) == 3


class Windows:
    """A windowed count table as faust_app.CurrentWindow shows it: reads and writes in the
    current window, `items` of every window as ((key, (start, end)), value)."""

    def __init__(self) -> None:
        self.windows: dict[float, dict[str, Any]] = {60.0: {}}
        self.now = 60.0

    def get(self, key: str, default: Any = None) -> Any:
        return self.windows.setdefault(self.now, {}).get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        self.windows.setdefault(self.now, {})[key] = value

    def items(self) -> list[tuple[Any, Any]]:
        return [((k, (end - 60, end)), v) for end, w in self.windows.items() for k, v in w.items()]

    def total(self) -> int:
        return sum(decode_count(v)[0] for _k, v in self.items())


@pytest.mark.parametrize("same_window", [True, False])
async def test_a_batch_redone_after_its_counts_were_written_is_not_counted_twice(
    make: Any, monkeypatch: pytest.MonkeyPatch, same_window: bool
) -> None:
    """A crash after the checkpoint wrote a batch's counts and before it wrote the run
    states: the next owner redoes the batch, the same events and summaries come again (no
    fired marker was written), and the counts refuse their ids, in the window they were
    written in or in a later one (the redo lands in the window of now). SIGKILL in the real
    worker: tests/integration/test_crash_counts.py."""
    counts = {name: Windows() for name in COUNT_TABLES}
    tables = Tables({}, {}, counts["loop_counts"], counts["run_counts"])
    tables.version_counts, tables.hold_counts = counts["version_counts"], counts["hold_counts"]
    first = make(tables=tables)
    runs = [looping_run(t) for t in (61, 62, 63)]
    await first.ingest.record(
        Ev(Msg("otlp_spans", 0, 1, None, encode_request([s for r in runs for s in r.spans])))
    )
    offsets = Counter[int]()  # per partition, from 0: no records skipped
    steps = []
    for m in first.topics["steps"].sent:
        p = m["partition"]
        steps.append(Ev(Msg("loopwatch-steps", p, offsets[p], None, m["value"])))
        offsets[p] += 1

    async def once(worker: Any, lose_states: bool) -> None:
        worker.recovered({0, 1, 2, 3})
        await worker.detect.batch(steps)
        for run in runs:  # finalized now: summaries, run and version counts
            deadline = worker.driver.index.get(run.trace_id)
            worker.driver.index.set(run.trace_id, Deadline(deadline.partition, 0, None, 0))
        ticks = [Ev(Msg("loopwatch-steps", p, offsets[p], None, b'{"tick":1}')) for p in range(4)]
        await worker.detect.batch(ticks)
        with monkeypatch.context() as m:
            if lose_states:  # the process dies after the counts
                m.setattr(Writes, "by_partition", lambda self: [])
            await worker.detect.checkpoint.flush()

    await once(first, lose_states=True)
    assert tables.runs == {} and tables.finished == {}
    expected = {name: table.total() for name, table in counts.items()}
    assert expected["loop_counts"] == 3 and expected["run_counts"] == 3
    if not same_window:
        for table in counts.values():
            table.now = 180.0
    second = make(tables=tables)
    await once(second, lose_states=False)
    assert len(second.topics["events"].sent) == 3  # the same events again (at least once)
    assert {name: table.total() for name, table in counts.items()} == expected
    assert len(tables.finished) == 3
    history = history_of(tables.versions.items())
    assert {r["runs"] for r in history.rows()} == {3}


async def test_undecodable_record_goes_to_the_dead_letters(service: Any) -> None:
    await service.ingest.record(Ev(Msg("otlp_spans", 2, 41, b"k", b"\x0a\xff\xff garbage")))
    (dead,) = service.topics["dead"].sent
    headers = dict(dead["headers"])
    assert headers["reason"] == b"decode_error" and headers["source_offset"] == b"41"
    assert headers["source_partition"] == b"2" and headers["source_topic"] == b"otlp_spans"
    assert b"garbage" not in dead["value"]
    assert service.topics["steps"].sent == []


async def test_an_unexpected_error_is_an_internal_error_dead_letter(
    service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(span: Any) -> Any:
        raise RuntimeError("customer text must not leak: SECRET")

    monkeypatch.setattr(service.normalizer, "step", boom)
    monkeypatch.setattr(service.reader.span_path, "native", None)  # the Python normalizer
    record = encode_request(looping_run(5).spans)
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 9, None, record)))
    (dead,) = service.topics["dead"].sent
    headers = dict(dead["headers"])
    assert headers["reason"] == b"internal_error" and headers["error"] == b"RuntimeError"
    assert all(b"SECRET" not in v for v in headers.values())


async def test_a_bad_steps_message_does_not_stop_the_batch(service: Any) -> None:
    good = encode_request(looping_run(6).spans)
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 1, None, good)))
    (msg,) = service.topics["steps"].sent
    events = [
        Ev(Msg("loopwatch-steps", 1, 0, None, b"[not json")),
        Ev(Msg("loopwatch-steps", msg["partition"], 1, None, msg["value"])),
    ]
    await detect_batch(service, events)
    assert [dict(d["headers"])["reason"] for d in service.topics["dead"].sent] == [
        b"internal_error"
    ]
    assert len(service.topics["events"].sent) == 1 and len(service.tables.runs) == 1


async def test_ticks_finalize_due_runs(service: Any) -> None:
    run = looping_run(7)
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 1, None, encode_request(run.spans))))
    (msg,) = service.topics["steps"].sent
    p = msg["partition"]
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 0, None, msg["value"]))])
    assert service.topics["runs"].sent == []
    deadline = service.driver.index.get(run.trace_id)
    service.driver.index.set(run.trace_id, deadline.__class__(p, 0, None, 0))  # due now
    assert p in service.driver.due_partitions(10**19)
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 1, None, b'{"tick":1}'))])
    (summary,) = [json.loads(m["value"]) for m in service.topics["runs"].sent]
    assert summary["run_id"] == run.trace_id and summary["outcome"] == "complete"
    assert run.trace_id.encode() not in service.tables.runs
    assert run.trace_id.encode() in service.tables.finished
    assert total(service.tables.run_counts) == 1


async def test_a_run_failing_at_its_deadline_leaves_the_ticks_other_runs_finalized(
    service: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tick's run whose finalization raises (a detector's bug) is counted and logged by
    id; the other runs of the tick still go out (they were lost with it: their state was
    saved, their summaries and events never sent), and the runs after it stay due."""
    runs = [looping_run(60 + i) for i in range(3)]
    p = 0
    for i, run in enumerate(runs):
        await service.ingest.record(Ev(Msg("otlp_spans", 0, i, None, encode_request(run.spans))))
        value = service.topics["steps"].sent[-1]["value"]
        await detect_batch(service, [Ev(Msg("loopwatch-steps", p, i, None, value))])
    for i, run in enumerate(runs):  # due now, in this order
        service.driver.index.set(run.trace_id, Deadline(p, 0, None, i))
    real = pipeline.finalize

    def finalize(policy: Any, state: Any) -> Any:
        if state.run_id == runs[1].trace_id:
            raise RuntimeError("customer text must not leak: SECRET")
        return real(policy, state)

    monkeypatch.setattr(pipeline, "finalize", finalize)
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 3, None, b'{"tick":1}'))])
    summaries = [json.loads(m["value"]) for m in service.topics["runs"].sent]
    assert [s["run_id"] for s in summaries] == [runs[0].trace_id, runs[2].trace_id]
    assert service.metrics.registry.get_sample_value("loopwatch_run_errors_total") == 1
    assert runs[1].trace_id.encode() in service.tables.runs  # its last saved state
    (failed,) = [r for r in caplog.records if "failed at its deadline" in r.getMessage()]
    assert runs[1].trace_id in failed.getMessage() and "SECRET" not in failed.getMessage()
    later = service.driver.index.get(runs[1].trace_id)
    assert later is not None and later.finalize_at > time.time_ns()  # not at every tick


async def test_a_finished_run_counts_on_its_versions_and_exports_their_history(
    service: Any,
) -> None:
    """The versions table (which version replaced which), the windowed measures of each
    version and the version metrics: written when the run's summary goes out."""
    for trace, version in ((7, "support-v12"), (8, "support-v13")):
        run = Run(trace=trace, prompt_version=version)
        for _ in range(3):
            run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
        run.root()
        await service.ingest.record(
            Ev(Msg("otlp_spans", 0, trace, None, encode_request(run.spans)))
        )
        msg = service.topics["steps"].sent[-1]
        p = msg["partition"]
        await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 2 * trace, None, msg["value"]))])
        deadline = service.driver.index.get(run.trace_id)
        service.driver.index.set(run.trace_id, deadline.__class__(p, 0, None, 0))  # due now
        await detect_batch(
            service, [Ev(Msg("loopwatch-steps", p, 2 * trace + 1, None, b'{"tick":1}'))]
        )
    history = history_of(service.tables.versions.items())
    rows = {(r["kind"], r["tool_name"], r["version"]): r for r in history.rows()}
    assert set(rows) == {
        ("prompt", None, "support-v12"),
        ("prompt", None, "support-v13"),
        ("tool", "lookup_order", "3"),
    }
    assert rows[("prompt", None, "support-v13")]["previous"] == "support-v12"
    assert rows[("tool", "lookup_order", "3")]["runs"] == 2
    measures = Counter()
    for key, value in service.tables.version_counts.items():
        labels = json.loads(key)[:-1]
        measures[(labels[0], labels[4], labels[5])] += decode_count(value)[0]
    assert measures[("prompt", "support-v13", "runs")] == 1
    assert measures[("prompt", "support-v13", "looping")] == 1
    assert measures[("prompt", "support-v13", "shape:identical_repetition")] == 1
    assert measures[("tool", "3", "runs")] == 2
    registry = service.metrics.registry
    labels = {"service_name": "support-bot", "agent_name": "support", "tool_name": "unknown"}
    for version in ("support-v12", "support-v13"):
        named = {"kind": "prompt", "version": version, **labels}
        assert registry.get_sample_value("loopwatch_version_runs_total", named) == 1
        assert registry.get_sample_value("loopwatch_version_looping_runs_total", named) == 1
    info = {"kind": "prompt", "version": "support-v13", **labels}
    first_v12 = rows[("prompt", None, "support-v12")]["first_ns"] / 1e9
    previous = {**info, "previous_version": "support-v12"}
    assert registry.get_sample_value("loopwatch_version_info", previous) == first_v12 > 0


async def test_unkeyed_finalization_waits_for_the_input_backlog(service: Any) -> None:
    """The root arrived, its grace passed on the wall clock, but the group has not yet
    processed every input record that existed meanwhile: the run is not finalized."""
    run = looping_run(8)
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 1, None, encode_request(run.spans))))
    (msg,) = service.topics["steps"].sent
    p = msg["partition"]
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 0, None, msg["value"]))])
    now = time.time_ns()
    due_at = now - 5 * 10**9  # due by the wall clock
    service.driver.index.set(run.trace_id, Deadline(p, due_at - 1, None, due_at))
    clock = service.clock.input = InputClock(start_ns=now - 10 * 10**9)
    clock.observe(due_at + 1, {0: 500, 1: 20}, {0: 120, 1: 20})  # partition 0 behind
    assert service.clock.now_ns() < due_at and clock.behind == 1
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 1, None, b'{"tick":1}'))])
    assert service.topics["runs"].sent == []  # held: spans may wait in partition 0's backlog
    clock.observe(due_at + 2, {0: 510, 1: 20}, {0: 500, 1: 20})  # first snapshot reached
    assert clock.now_ns == due_at + 1 and clock.behind == 1
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 2, None, b'{"tick":2}'))])
    (summary,) = [json.loads(m["value"]) for m in service.topics["runs"].sent]
    assert summary["run_id"] == run.trace_id


async def test_a_tick_judges_deadlines_by_the_clock_it_was_sent_with(service: Any) -> None:
    """A tick sent before the clock reached a run's deadline does not finalize it, however
    late it is handled: steps delivered after the send may be queued behind the tick."""
    run = looping_run(9)
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 1, None, encode_request(run.spans))))
    (msg,) = service.topics["steps"].sent
    p = msg["partition"]
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 0, None, msg["value"]))])
    due_at = time.time_ns() - 5 * 10**9  # due by the wall clock now
    service.driver.index.set(run.trace_id, Deadline(p, due_at - 1, None, due_at))
    assert tick_clock(encode_tick(time.time_ns(), due_at - 1)) == due_at - 1
    early = encode_tick(time.time_ns(), due_at - 1)  # sent when the clock was short of it
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 1, None, early))])
    assert service.topics["runs"].sent == [] and run.trace_id.encode() in service.tables.runs
    await detect_batch(
        service, [Ev(Msg("loopwatch-steps", p, 2, None, encode_tick(time.time_ns(), due_at)))]
    )
    (summary,) = [json.loads(m["value"]) for m in service.topics["runs"].sent]
    assert summary["run_id"] == run.trace_id


async def test_steps_carry_the_input_clock_they_were_sent_at(service: Any) -> None:
    """Ingest stamps each steps message with its input clock; detect reads it back and
    holds the arrival, unacknowledged, until a message or tick of its partition brings a
    clock past it: a clock short of it vouches for nothing; one past it applies the
    arrival and releases its steps as they are applied (one state write, not two)."""
    now = time.time_ns()
    service.clock.input = InputClock(start_ns=now - 7 * 10**9)
    run = Run(trace=11)
    for i in range(4):
        run.tool("lookup_order", {"order_id": f"A{i}"}, {"status": "pending"})
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 1, None, encode_request(run.spans))))
    (msg,) = service.topics["steps"].sent
    headers = list(msg["headers"].items())
    p = msg["partition"]
    stamped = Ev(Msg("loopwatch-steps", p, 0, None, msg["value"], headers=headers))
    assert sent_clock(stamped.message) == now - 7 * 10**9
    first_max_end = max(s.end_ns for s in run.spans)
    assert sent_clock(Msg("loopwatch-steps", 0, 0, None, b"[]")) is None  # older workers
    assert await detect_batch(service, [stamped]) == []  # held: not acknowledged
    assert run.trace_id not in service.driver.cache and len(service.tables.runs) == 0
    assert len(service.driver.arrivals) == 1
    early = encode_tick(time.time_ns(), now - 6 * 10**9)  # a clock short of the arrival
    tick = Ev(Msg("loopwatch-steps", p, 1, None, early))
    # acknowledged in read order only: faust would commit past the held record
    assert await detect_batch(service, [tick]) == []
    assert len(service.driver.arrivals) == 1 and len(service.tables.runs) == 0
    service.clock.input.now_ns = time.time_ns()  # the group got past that arrival
    more = Run(trace=11)
    more.tool("lookup_order", {"order_id": "B"}, {"status": "pending"})
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 2, None, encode_request(more.spans))))
    msg = service.topics["steps"].sent[-1]
    headers = list(msg["headers"].items())
    later = Ev(Msg("loopwatch-steps", msg["partition"], 2, None, msg["value"], headers=headers))
    # its clock vouches for the first arrival: the run's held arrivals are applied, the
    # later one too (it may carry a span that ended first), and released by that clock
    assert await detect_batch(service, [later]) == [stamped, tick, later]
    env, state = decode_envelope(service.tables.runs[run.trace_id.encode()])
    assert state.spans == len(run.spans) + 1 and not service.driver.arrivals
    assert env.confirmed_end_ns == first_max_end
    assert [at for at, _ in env.candidates] == [env.seen_ns]  # the later one's, not vouched
    # (its step ended before the first arrival's last: released with them, in order)
    assert state.pending == []


async def held_arrival(service: Any, run: Run) -> tuple[int, Ev]:
    """The run's spans through ingest, then its steps message (stamped with the input
    clock) through a detect batch: held, not acknowledged. Returns (partition, event)."""
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 1, None, encode_request(run.spans))))
    msg = service.topics["steps"].sent[-1]
    p, headers = msg["partition"], list(msg["headers"].items())
    held = Ev(Msg("loopwatch-steps", p, 0, None, msg["value"], headers=headers))
    assert await detect_batch(service, [held]) == []
    return p, held


async def test_an_arrival_held_too_long_waits_for_the_clock_in_the_runs_state(
    service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock that does not pass an arrival within the hold (a backlog, a stalled input
    partition): the arrival is applied as it was before holds, at its arrival time, its
    steps waiting in the run's state with a candidate for the clock."""
    now = time.time_ns()
    service.clock.input = InputClock(start_ns=now - 60 * 10**9)
    run = looping_run(12)
    p, held = await held_arrival(service, run)
    ((arrival,),) = service.driver.arrivals.queues[p].values()
    monkeypatch.setattr(service.driver.arrivals, "hold_ns", 0)  # held long enough
    assert p in service.driver.due_partitions(now - 60 * 10**9, time.time_ns())
    tick = Ev(Msg("loopwatch-steps", p, 1, None, encode_tick(now, now - 60 * 10**9)))
    assert await detect_batch(service, [tick]) == [held, tick]
    env, state = decode_envelope(service.tables.runs[run.trace_id.encode()])
    assert state.spans == len(run.spans) and state.pending and state.position == 0
    assert env.seen_ns == arrival.at_ns and env.candidates == [(arrival.at_ns, state.max_end_ns)]
    assert service.topics["events"].sent == []


async def test_a_rebalance_drops_held_arrivals_unacknowledged(make: Any, fakes: Fakes) -> None:
    """Held arrivals of the old assignment are never applied nor acknowledged: the
    partitions' next owner processes their records again."""
    service = make()
    service.clock.input = InputClock(start_ns=time.time_ns() - 7 * 10**9)
    run = looping_run(13)
    p, held = await held_arrival(service, run)
    service.revoked([])
    service.recovered({0, 1, 2, 3})
    assert not service.driver.arrivals
    now = time.time_ns()
    tick = Ev(Msg("loopwatch-steps", p, 1, None, encode_tick(now, now), generation_id=1))
    fakes.group_generation = 1
    assert await detect_batch(service, [tick]) == [tick]
    assert len(service.tables.runs) == 0 and not service.detect.holding


async def test_a_delivered_input_record_advances_the_clock_and_sends_the_ticks_it_makes_due(
    service: Any,
) -> None:
    """Ingest's own delivery vouches for its partition at once: the run due by then gets a
    tick carrying the new clock without waiting for the group's commit, the next probe or
    the tick timer (each cost up to a period of a release's latency)."""
    run = looping_run(12)
    event = Ev(Msg("otlp_spans", 0, 7, None, encode_request(run.spans)))
    records = await service.ingest.event(event)
    (msg,) = service.topics["steps"].sent
    p = msg["partition"]
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 0, None, msg["value"]))])
    now = time.time_ns()
    clock = service.clock.input = InputClock(start_ns=now - 10 * 10**9)
    clock.observe(now - 10**9, {0: 8, 1: 3}, {0: 7, 1: 3})  # record 7 not yet committed
    service.driver.index.set(run.trace_id, Deadline(p, now - 2 * 10**9, None, now - 2 * 10**9))
    service.ready = True
    await acked(service, FakeStream(), event, records)
    assert clock.now_ns == now - 10**9  # this worker delivered record 7's steps
    await asyncio.sleep(0)  # the tick sender the advance woke
    await asyncio.sleep(0)
    ticks = [m for m in service.topics["steps"].sent if m["value"].startswith(b'{"tick"')]
    assert [(m["partition"], tick_clock(m["value"])) for m in ticks] == [(p, now - 10**9)]


async def test_marks_tell_the_steps_partitions_of_other_workers_what_this_one_delivered(
    service: Any,
) -> None:
    """With two workers, a partition the other ingests was vouched for only through the
    group's commits and the next probe (about a second). The ingesting worker sends its
    delivered offsets as a mark to the steps partitions it does not own; a detect that
    reads one advances its clock, and a run due by then gets its tick at once."""
    now = time.time_ns()
    clock = service.clock.input = InputClock(start_ns=now - 10 * 10**9)
    service.ready = True
    service.timers.assigned = lambda: {0, 1}  # partitions 2 and 3 are the other worker's
    clock.observe(now - 10**9, {0: 3}, {0: 0})
    clock.delivered(0, 0, 3)
    await service.timers.send_marks()
    marks = [m for m in service.topics["steps"].sent if m["value"].startswith(b'{"mark"')]
    assert [m["partition"] for m in marks] == [2, 3]
    assert mark_offsets(marks[0]["value"]) == {0: 3}
    await service.timers.send_marks()  # nothing new delivered: no new marks
    assert len([m for m in service.topics["steps"].sent if b'"mark"' in m["value"]]) == 2
    service.timers.assigned = lambda: {0, 1, 2, 3}  # one worker owns them all: none
    clock.delivered(0, 3, 4)
    await service.timers.send_marks()
    assert len([m for m in service.topics["steps"].sent if b'"mark"' in m["value"]]) == 2

    # the other worker's detect: its clock waits on partition 1, which the mark covers
    other = InputClock(start_ns=now - 10 * 10**9)
    service.clock.input = other
    other.observe(now - 10**9, {0: 9, 1: 5}, {0: 9, 1: 2})
    run = looping_run(13)
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 1, None, encode_request(run.spans))))
    p = service.topics["steps"].sent[-1]["partition"]
    service.driver.index.set(run.trace_id, Deadline(p, now - 2 * 10**9, None, now - 2 * 10**9))
    before = len(service.topics["steps"].sent)
    mark = encode_mark(now, {1: 5})
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 0, None, mark))])
    assert other.now_ns == now - 10**9
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    ticks = [m for m in service.topics["steps"].sent[before:] if m["value"].startswith(b'{"tick"')]
    assert [(m["partition"], tick_clock(m["value"])) for m in ticks] == [(p, now - 10**9)]


async def test_a_malformed_mark_is_a_dead_letter_and_the_batch_goes_on(service: Any) -> None:
    run = looping_run(14)
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 1, None, encode_request(run.spans))))
    (msg,) = service.topics["steps"].sent
    p = msg["partition"]
    bad = b'{"mark": 1, "delivered": {"0": -4}}'
    await detect_batch(
        service,
        [
            Ev(Msg("loopwatch-steps", p, 0, None, bad)),
            Ev(Msg("loopwatch-steps", p, 1, None, msg["value"])),
        ],
    )
    (dead,) = service.topics["dead"].sent
    assert ("error", b"ValueError") in dead["headers"]
    assert run.trace_id.encode() in service.tables.runs  # the next message's run went on


def test_the_input_clock_holds_deadlines_at_most_the_maximum_lag(service: Any) -> None:
    """A partition whose commits stopped (a bug, a lost ack) must not freeze every run:
    deadlines trail the wall clock by at most input_clock_max_lag_seconds."""
    now = time.time_ns()
    service.clock.input = InputClock(start_ns=now - 5 * 10**9)
    assert now - 6 * 10**9 < service.clock.now_ns() <= now - 5 * 10**9  # held: within the cap
    service.clock.input = InputClock(start_ns=now - 3600 * 10**9)  # stuck for an hour
    max_lag = int(service.settings.input_clock_max_lag_seconds * 10**9)
    assert max_lag == 900 * 10**9
    assert now - max_lag <= service.clock.now_ns() <= time.time_ns() - max_lag + 10**9


class FakeRefetcher:
    """Stands in for streams.worker.kafka.refetch.Refetcher: the broker's copy of skipped records."""

    def __init__(self, records: dict[int, bytes], topic: str = "otlp_spans") -> None:
        self.records = records
        self.topic = topic
        self.reads: list[tuple[int, int, int]] = []

    def read(self, partition: int, first: int, end: int) -> list[Ev]:
        self.reads.append((partition, first, end))
        return [
            Ev(Msg(self.topic, partition, o, None, self.records[o]))
            for o in range(first, end)
            if o in self.records
        ]


async def test_keyed_detect_reads_back_a_record_the_stream_skipped(
    service: Any, fakes: Fakes, make: Any
) -> None:
    """Offsets 5 and 7 reach the agent, 6 never does: 6 is read from the broker and its
    run processed in the same batch (it would be committed with the others)."""
    service = make(LOOPWATCH_INPUT_KEYED_BY_RUN="true")
    runs = {o: looping_run(100 + o) for o in (5, 6, 7)}
    records = {o: encode_request(r.spans) for o, r in runs.items()}
    refetcher = fakes.refetchers["otlp_spans"] = FakeRefetcher(records)
    await detect_batch(service, [Ev(Msg("otlp_spans", 1, o, None, records[o])) for o in (5, 7)])
    assert refetcher.reads == [(1, 6, 7)]
    assert service.counters["refetched_records"] == 1
    assert len(service.tables.runs) == 3  # the skipped record's run too
    assert fakes.consumer.acked == [("otlp_spans", 1, 6)]  # or commits stop at 6
    shapes = [json.loads(m["value"])["shape"] for m in service.topics["events"].sent]
    assert shapes == ["identical_repetition"] * 3


async def test_detect_reads_back_the_first_record_after_an_assignment(
    service: Any, fakes: Fakes, make: Any
) -> None:
    """The partition was sought to committed offset 6, but the first record the stream
    hands over is 7: 6 is read back, processed and acknowledged (faust's own head check
    would commit past it)."""
    service = make(LOOPWATCH_INPUT_KEYED_BY_RUN="true")
    runs = {o: looping_run(400 + o) for o in (6, 7)}
    records = {o: encode_request(r.spans) for o, r in runs.items()}
    refetcher = fakes.refetchers["otlp_spans"] = FakeRefetcher(records)
    fakes.consumer._committed_offset[("otlp_spans", 2)] = 6
    await detect_batch(service, [Ev(Msg("otlp_spans", 2, 7, None, records[7]))])
    assert refetcher.reads == [(2, 6, 7)]
    assert len(service.tables.runs) == 2
    assert fakes.consumer.acked == [("otlp_spans", 2, 6)]


async def test_ingest_reads_back_skipped_records_before_the_one_that_revealed_them(
    service: Any, fakes: Fakes
) -> None:
    records = {o: encode_request(looping_run(200 + o).spans) for o in (2, 3, 4, 5)}
    refetcher = fakes.refetchers["otlp_spans"] = FakeRefetcher(records)
    await service.ingest.event(Ev(Msg("otlp_spans", 0, 2, None, records[2])))
    service.topics["steps"].sent.clear()
    event = Ev(Msg("otlp_spans", 0, 5, None, records[5]))
    ingested = await service.ingest.event(event)
    assert refetcher.reads == [(0, 3, 5)]
    assert [record.message.offset for record, _ in ingested] == [3, 4, 5]
    assert all(len(sent) == 1 for _, sent in ingested)
    forwarded = [decode_run_groups(m["value"]) for m in service.topics["steps"].sent]
    assert sum(len(groups) for groups in forwarded) == 3  # both skipped runs, then 5's
    stream = FakeStream()
    await acked(service, stream, event, ingested)
    assert fakes.consumer.acked == [("otlp_spans", 0, 3), ("otlp_spans", 0, 4)]
    assert stream.acked == [5]


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("streams.worker.kafka.delivery.PUBLISH_RETRY_FIRST_SECONDS", 0.01)


def retries(service: Any, stage: str) -> float | None:
    return service.metrics.registry.get_sample_value(
        "loopwatch_publish_retries_total", {"stage": stage}
    )


async def test_ingest_sends_steps_again_until_delivered_then_acks(
    service: Any, fast_retries: None
) -> None:
    """A delivery failing after the producer's own retries (a broker outage) used to leave
    the record unacked: its partition's commits stopped until a restart."""
    service.topics["steps"].failures = [KafkaTimeoutError(), KafkaConnectionError()]
    event = Ev(Msg("otlp_spans", 1, 8, None, encode_request(looping_run(7).spans)))
    stream = FakeStream()
    await acked(service, stream, event, await service.ingest.event(event))
    first, *again = service.topics["steps"].sent
    assert len(again) == 2 and all(m["value"] == first["value"] for m in again)
    assert stream.acked == [8]
    assert retries(service, "ingest") == 2
    consumed = service.metrics.registry.get_sample_value(
        "loopwatch_records_consumed_total", {"topic": "otlp_spans"}
    )
    assert consumed == 1
    assert service.topics["dead"].sent == []


async def test_ingest_sends_steps_refused_as_too_large_again_until_accepted(
    service: Any, fast_retries: None
) -> None:
    """The broker refuses a whole producer batch when a topic's max.message.bytes is below
    it, small messages included: a refusal says nothing about this record alone. It is sent
    again until an operator raises the limit; nothing goes to the dead letters."""
    service.topics["steps"].failures = [MessageSizeTooLargeError(), MessageSizeTooLargeError()]
    event = Ev(Msg("otlp_spans", 1, 9, None, encode_request(looping_run(8).spans)))
    stream = FakeStream()
    await acked(service, stream, event, await service.ingest.event(event))
    assert len(service.topics["steps"].sent) == 3 and stream.acked == [9]
    assert service.topics["dead"].sent == []


async def test_a_send_that_raises_at_once_is_sent_again_not_dead_lettered(
    service: Any, fast_retries: None
) -> None:
    """faust raises ProducerSendError at once when the producer's buffer stays full or its
    metadata is unavailable: before, ingest dead-lettered the record as internal_error."""
    service.topics["steps"].refusals = [RuntimeError("buffer full")]
    event = Ev(Msg("otlp_spans", 1, 11, None, encode_request(looping_run(10).spans)))
    stream = FakeStream()
    await acked(service, stream, event, await service.ingest.event(event))
    assert len(service.topics["steps"].sent) == 1 and stream.acked == [11]
    assert service.topics["dead"].sent == []
    assert retries(service, "ingest") == 1


async def test_ingest_leaves_the_record_unacked_when_the_worker_stops(
    service: Any, fast_retries: None, fakes: Fakes
) -> None:
    service.topics["steps"].failures = [KafkaTimeoutError()]
    fakes.stopping = True
    event = Ev(Msg("otlp_spans", 1, 10, None, encode_request(looping_run(9).spans)))
    stream = FakeStream()
    await acked(service, stream, event, await service.ingest.event(event))
    assert stream.acked == [] and len(service.topics["steps"].sent) == 1


async def test_detect_abandons_a_batch_whose_partitions_were_revoked_meanwhile(
    service: Any, fast_retries: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its outputs undelivered across a rebalance, a detect batch must not write the state
    of partitions whose new owner has restored them: it stays unacked, to be redone."""
    await service.ingest.record(
        Ev(Msg("otlp_spans", 0, 1, None, encode_request(looping_run(34).spans)))
    )
    (msg,) = service.topics["steps"].sent
    service.topics["events"].failures = [KafkaConnectionError()]
    sleep = asyncio.sleep

    async def rebalance_while_waiting(delay: float) -> None:
        service.revoked([])
        await sleep(0)

    monkeypatch.setattr(asyncio, "sleep", rebalance_while_waiting)
    with pytest.raises(Abandoned):
        await detect_batch(
            service, [Ev(Msg("loopwatch-steps", msg["partition"], 0, None, msg["value"]))]
        )
    assert len(service.tables.runs) == 0  # no state written for a batch that was not delivered
    assert total(service.tables.loop_counts) == 0


async def test_a_failed_acknowledgement_does_not_stop_the_next_ones(service: Any) -> None:
    class FlakyStream(FakeStream):
        async def ack(self, event: Any) -> bool:
            if event.message.offset == 20:
                raise RuntimeError("ack failed")
            return await super().ack(event)

    stream = FlakyStream()
    for offset in (20, 21):
        event = Ev(Msg("otlp_spans", 3, offset, None, encode_request(looping_run(offset).spans)))
        service.ingest.ack_when_delivered(stream, event, await service.ingest.event(event))
    await service.ingest.last_ack[("otlp_spans", 3)]
    assert stream.acked == [21]


async def test_a_resent_dead_letter_is_counted_once(service: Any, fast_retries: None) -> None:
    service.topics["dead"].failures = [KafkaTimeoutError()]
    event = Ev(Msg("otlp_spans", 2, 12, None, b"\x0a\xff\xff garbage"))
    stream = FakeStream()
    await acked(service, stream, event, await service.ingest.event(event))
    assert len(service.topics["dead"].sent) == 2 and stream.acked == [12]
    registry = service.metrics.registry
    assert (
        registry.get_sample_value("loopwatch_dead_letters_total", {"reason": "decode_error"}) == 1
    )
    assert (
        registry.get_sample_value("loopwatch_decode_errors_total", {"reason": "decode_error"}) == 1
    )


async def test_a_captured_dead_letter_refused_as_too_large_goes_without_its_payload(
    service: Any, fast_retries: None, make: Any
) -> None:
    service = make(LOOPWATCH_DLQ_CAPTURE_PAYLOAD="true")
    service.topics["dead"].failures = [MessageSizeTooLargeError()]
    event = Ev(Msg("otlp_spans", 2, 13, b"k", b"\x0a\xff\xff garbage"))
    stream = FakeStream()
    await acked(service, stream, event, await service.ingest.event(event))
    first, second = service.topics["dead"].sent
    assert b"garbage" in first["value"] and b"garbage" not in second["value"]
    assert stream.acked == [13]


def test_split_to_fit_keeps_every_step_in_order(service: Any) -> None:
    runs = [looping_run(t) for t in (30, 31, 32)]
    groups = [(run.trace_id, [service.normalizer.step(span) for span in run.spans]) for run in runs]
    whole = encode_run_groups(groups)
    pieces = split_to_fit(groups, encode_run_groups, len(whole) // 3)
    assert len(pieces) > 3 and all(len(p) <= len(whole) // 3 for p in pieces)
    back = [
        (run_id, step.span_id)
        for p in pieces
        for run_id, steps in decode_run_groups(p)
        for step in steps
    ]
    assert back == [(run_id, step.span_id) for run_id, steps in groups for step in steps]
    assert split_to_fit(groups, encode_run_groups, len(whole)) == [whole]


async def test_ingest_splits_steps_over_the_message_limit(
    service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("streams.worker.agents.ingest.MAX_STEPS_MESSAGE_BYTES", 2000)
    run = Run(trace=33)
    calls = 60  # over 3 messages of 2,000 bytes (marshal writes a str shared by steps once)
    for i in range(calls):
        run.tool("lookup_order", {"order_id": f"A{i}"}, {"status": "pending"})
    run.root()
    await service.ingest.record(Ev(Msg("otlp_spans", 0, 1, None, encode_request(run.spans))))
    sent = service.topics["steps"].sent
    assert len(sent) > 3 and all(len(m["value"]) <= 2000 for m in sent)
    assert len({m["partition"] for m in sent}) == 1
    steps = [s for m in sent for _, group in decode_run_groups(m["value"]) for s in group]
    assert len(steps) == calls + 1


async def test_detect_publishes_again_what_was_not_delivered(
    service: Any, fast_retries: None
) -> None:
    runs = [looping_run(t) for t in (11, 12, 13)]
    await service.ingest.record(
        Ev(Msg("otlp_spans", 0, 1, None, encode_request([s for r in runs for s in r.spans])))
    )
    steps = [
        Ev(Msg("loopwatch-steps", m["partition"], i, None, m["value"]))
        for i, m in enumerate(service.topics["steps"].sent)
    ]
    service.topics["events"].failures = [KafkaConnectionError()]
    await detect_batch(service, steps)
    sent = [json.loads(m["value"])["run_id"] for m in service.topics["events"].sent]
    assert len(sent) == 4 and sent[0] in sent[1:]  # the failed one, sent again
    assert retries(service, "detect") == 1
    assert total(service.tables.loop_counts) == 3  # counted once each, after delivery
    counted = [
        sample.value
        for metric in service.metrics.registry.collect()
        if metric.name == "loopwatch_loop_events"
        for sample in metric.samples
        if sample.name == "loopwatch_loop_events_total"
    ]
    assert sum(counted) == 3
    assert len(service.tables.runs) == 3


async def test_detect_reads_back_a_steps_message_the_stream_skipped(
    service: Any, fakes: Fakes
) -> None:
    """Unkeyed: the steps topic is tracked too. Steps messages 10 and 12 of a partition
    reach the agent, 11 (another run's steps) never does: it is read back and processed; a
    skipped tick is not replayed."""
    steps: dict[int, bytes] = {}
    for offset, trace in ((10, 301), (11, 302), (12, 303)):
        await service.ingest.record(
            Ev(Msg("otlp_spans", 0, offset, None, encode_request(looping_run(trace).spans)))
        )
        (msg,) = service.topics["steps"].sent
        service.topics["steps"].sent.clear()
        steps[offset] = encode_run_groups(decode_run_groups(msg["value"]))
    steps[13] = b'{"tick":1}'
    refetcher = fakes.refetchers["loopwatch-steps"] = FakeRefetcher(steps, "loopwatch-steps")
    await detect_batch(
        service, [Ev(Msg("loopwatch-steps", 2, o, None, steps[o])) for o in (10, 12)]
    )
    assert refetcher.reads == [(2, 11, 12)]
    assert service.counters["refetched_records"] == 1
    assert len(service.tables.runs) == 3  # the skipped message's run too
    assert fakes.consumer.acked == [("loopwatch-steps", 2, 11)]
    await detect_batch(service, [Ev(Msg("loopwatch-steps", 2, 14, None, steps[13]))])
    assert refetcher.reads[-1] == (2, 13, 14)  # the skipped tick, read and dropped
    assert service.counters["refetched_records"] == 2
    assert service.topics["dead"].sent == []


async def test_a_missing_faust_internal_for_the_head_check_is_said_once(
    service: Any, caplog: pytest.LogCaptureFixture, fakes: Fakes
) -> None:
    del fakes.consumer._committed_offset  # as a faust upgrade might
    for offset in (1, 2):
        record = encode_request(looping_run(400 + offset).spans)
        await service.ingest.event(Ev(Msg("otlp_spans", 0, offset, None, record)))
    warnings = [r for r in caplog.records if "_committed_offset" in r.getMessage()]
    assert len(warnings) == 1
    assert len(service.topics["steps"].sent) == 2  # ingest goes on


def test_the_faust_service_wires_a_worker_to_its_topics_and_tables(tmp_path: Path) -> None:
    """build_app (never started: no broker) hands faust's topics and tables to a Worker."""
    from streams.worker.faust_app import build_app

    def built(**env: str) -> Any:
        settings = WorkerSettings.from_env(
            {"LOOPWATCH_STORE": "memory://", "LOOPWATCH_DATA_DIR": str(tmp_path), **env}
        )
        policy = policy_from_mapping(
            yaml.safe_load((ROOT / "examples" / "loopwatch.yaml").read_text()), "<test>"
        )
        return build_app(settings, policy, Fingerprinter(b"k"), Metrics(CollectorRegistry()), 4)

    svc = built()
    assert list(svc.app.agents) == ["ingest", "detect"]
    assert {name: t.get_topic_name() for name, t in svc.worker.topics.items()} == {
        "steps": "loopwatch-steps",
        "events": "loop_detected",
        "runs": "loop_runs",
        "dead": "loopwatch-dead-letters",
    }
    assert svc.worker.tables.runs is svc.runs and svc.worker.tables.finished is svc.finished
    assert svc.worker.clock.input is not None  # unkeyed: the input clock is on
    # fetches of 16 MiB a partition by default (faust's 1 MiB starved the agents)
    assert svc.app.conf.consumer_max_fetch_size == 16 * 1024 * 1024
    assert built(LOOPWATCH_FETCH_PARTITION_MB="2").app.conf.consumer_max_fetch_size == 2 << 20
    # producer batches of 256 KiB (faust's 16 KiB holds 9 run states of the changelog)
    assert svc.app.conf.producer_max_batch_size == 256 * 1024
    assert built(LOOPWATCH_PRODUCER_BATCH_KB="64").app.conf.producer_max_batch_size == 64 << 10
    keyed = built(LOOPWATCH_INPUT_KEYED_BY_RUN="true")
    assert list(keyed.app.agents) == ["detect"]  # no hop
    assert keyed.worker.clock.input is None and keyed.detect_topic_names == {
        "otlp_spans",
        "loopwatch-steps",
    }


async def test_a_loop_before_the_runs_labels_is_counted_in_its_final_slice(service: Any) -> None:
    """The prompt version is only on the root, which ends (and is exported) after the loop
    fired: the event goes out at once, with labels_pending; the loop metrics wait for the
    run's summary and count under the root's version, never under "unknown"."""
    run = Run(trace=61, prompt_version="support-v77").version_only_on_root()
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    run.llm()
    run.clock += 10 * 10**9  # the agent goes on past the allowed lateness
    run.llm()
    run.root()
    children, root = run.spans[:-1], run.spans[-1:]

    async def deliver(offset: int, spans: list[Any]) -> int:
        before = len(service.topics["steps"].sent)
        await service.ingest.record(Ev(Msg("otlp_spans", 0, offset, None, encode_request(spans))))
        (msg,) = service.topics["steps"].sent[before:]
        await detect_batch(
            service, [Ev(Msg("loopwatch-steps", msg["partition"], offset, None, msg["value"]))]
        )
        return int(msg["partition"])

    def loop_events(**labels: str) -> float | None:
        return service.metrics.registry.get_sample_value("loopwatch_loop_events_total", labels)

    p = await deliver(1, children)
    (event,) = [json.loads(m["value"]) for m in service.topics["events"].sent]
    assert event["prompt_version"] is None and event["labels_pending"] is True
    assert total(service.tables.loop_counts) == 0  # not counted yet, in any slice
    await deliver(2, root)
    deadline = service.driver.index.get(run.trace_id)
    service.driver.index.set(run.trace_id, deadline.__class__(p, 0, None, 0))  # due now
    await detect_batch(service, [Ev(Msg("loopwatch-steps", p, 3, None, b'{"tick":1}'))])
    (summary,) = [json.loads(m["value"]) for m in service.topics["runs"].sent]
    assert summary["prompt_version"] == "support-v77"
    assert [d["event_id"] for d in summary["deferred_events"]] == [event["event_id"]]
    labels = {"shape": "identical_repetition", "severity": "warning", "tool_name": "lookup_order"}
    assert loop_events(**labels, prompt_version="support-v77", tool_version="3") == 1
    assert loop_events(**labels, prompt_version="unknown", tool_version="3") is None
    (key,) = [k for k, v in service.tables.loop_counts.items() if decode_count(v)[0]]
    assert json.loads(key)[:4] == ["identical_repetition", "support-v77", "lookup_order", "3"]
    assert len(json.loads(key)) == 7  # ..., service, agent (from the summary), partition


# ------------------------------------------------------------------ staged state writes


@dataclass
class RefMsg(Msg):
    """A message as the detect agent's `run` holds it (faust's reference count)."""

    refs: int = 0

    def incref(self) -> None:
        self.refs += 1


class BatchStream(FakeStream):
    """take_events as faust's stream gives it: these batches, then the end (a stop)."""

    def __init__(self, batches: list[list[Any]]) -> None:
        super().__init__()
        self.batches = batches

    async def take_events(self, n: int, within: float) -> Any:
        for batch in self.batches:
            yield batch
            await asyncio.sleep(0)


async def two_parts_of_one_run(service: Any, trace: int) -> list[Any]:
    """Two steps messages of one run (two input records), as detect events."""
    run = looping_run(trace)
    for offset, spans in enumerate((run.spans[:2], run.spans[2:])):
        await service.ingest.record(Ev(Msg("otlp_spans", 0, offset, None, encode_request(spans))))
    return [
        Ev(RefMsg("loopwatch-steps", m["partition"], i, None, m["value"]))
        for i, m in enumerate(service.topics["steps"].sent)
    ]


async def test_a_run_touched_by_two_batches_of_a_flush_interval_is_written_once(
    make: Any, fakes: Fakes
) -> None:
    service = make(LOOPWATCH_STATE_FLUSH_MS="60000")
    first, second = await two_parts_of_one_run(service, 41)
    fakes.log.clear()
    await service.detect.batch([first])
    await service.detect.batch([second])
    assert ("write", "runs") not in fakes.log and not service.detect.checkpoint.due()
    assert len(service.topics["events"].sent) == 1  # outputs are not held back
    assert await service.detect.checkpoint.flush() == [first, second]  # acked after the write
    assert fakes.log.count(("write", "runs")) == 1
    assert fakes.log.index(("send", "events")) < fakes.log.index(("write", "runs"))

    per_batch = make(LOOPWATCH_STATE_FLUSH_MS="0")  # the same run, written after each batch
    for event in await two_parts_of_one_run(per_batch, 41):
        await per_batch.detect.batch([event])
        assert per_batch.detect.checkpoint.due()
        await per_batch.detect.checkpoint.flush()
    assert fakes.log.count(("write", "runs")) == 1 + 2
    states = [
        {k: decode_envelope(v)[1] for k, v in s.tables.runs.items()} for s in (service, per_batch)
    ]
    assert states[0] == states[1]  # (the envelopes differ in arrival times only)


async def test_a_rebalance_drops_staged_state_and_never_acknowledges_its_records(
    make: Any, fakes: Fakes
) -> None:
    """Acknowledged after the rebalance, the records would let faust commit the new
    assignment past them while their state was never written: they must be redone."""
    service = make(LOOPWATCH_STATE_FLUSH_MS="60000")
    first, second = await two_parts_of_one_run(service, 42)
    await service.detect.batch([first])
    service.revoked([])
    service.recovered({0, 1, 2, 3})
    assert await service.detect.checkpoint.flush() == []
    assert len(service.tables.runs) == 0
    await service.detect.batch([first])  # redone from the committed offset
    await service.detect.batch([second])
    assert await service.detect.checkpoint.flush() == [first, second]
    assert len(service.tables.runs) == 1


async def test_a_rebalance_while_a_batch_publishes_abandons_it_even_when_delivered(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make(LOOPWATCH_STATE_FLUSH_MS="60000")
    first, _ = await two_parts_of_one_run(service, 43)
    deliver = service.publisher.deliver

    async def rebalance_then_deliver(stage: str, sent: Any) -> None:
        service.revoked([])
        await deliver(stage, sent)

    monkeypatch.setattr(service.publisher, "deliver", rebalance_then_deliver)
    with pytest.raises(Abandoned):
        await service.detect.batch([first])
    assert service.detect.checkpoint.staged == [] and not service.driver.store.writes


async def test_the_agent_acknowledges_after_the_flush_and_a_stop_drops_what_is_staged(
    make: Any, fakes: Fakes
) -> None:
    """Records are acknowledged only by the flush that wrote their state; at a stop what is
    staged is neither written nor acknowledged (redone after the restart): written during
    faust's stop, its changelog sends could meet a closed producer."""
    service = make(LOOPWATCH_STATE_FLUSH_MS="60000")
    first, second = await two_parts_of_one_run(service, 44)
    stream = BatchStream([[first], [second]])
    await service.detect.run(stream, 10, 0.01)  # the stream ends: a stop
    assert first.message.refs == second.message.refs == 1  # held, never released
    assert stream.acked == [] and len(service.tables.runs) == 0
    service = make(LOOPWATCH_STATE_FLUSH_MS="0")
    first, second = await two_parts_of_one_run(service, 44)
    stream = BatchStream([[first], [second]])
    await service.detect.run(stream, 10, 0.01)
    assert stream.acked == [0, 1] and len(service.tables.runs) == 1


async def test_a_quiet_stream_is_flushed_by_the_timer_until_a_stop(make: Any, fakes: Fakes) -> None:
    service = make(LOOPWATCH_STATE_FLUSH_MS="20")
    first, _ = await two_parts_of_one_run(service, 45)
    service.detect.stream = stream = FakeStream()
    await service.detect.batch([first])
    await service.detect.flush_if_due()
    assert stream.acked == [] or len(service.tables.runs) == 1  # (a slow machine: due)
    await asyncio.sleep(0.03)
    await service.detect.flush_if_due()
    assert stream.acked == [0] and len(service.tables.runs) == 1
    later = (await two_parts_of_one_run(service, 47))[-1]
    await service.detect.batch([later])
    await asyncio.sleep(0.03)
    fakes.stopping = True
    await service.detect.flush_if_due()
    assert stream.acked == [0]  # not during a stop


async def test_a_failed_state_write_stops_the_worker_unacked(
    make: Any, fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (rocksdb: "IO error: No space left on device") under a table write: the
    batch is not acknowledged, no later batch is processed (its acks would let faust commit
    past it), the worker asks to stop once and is not ready, with the reason."""
    stops: list[int] = []
    service = make(LOOPWATCH_STATE_FLUSH_MS="0")  # each batch written at once
    service.request_stop = lambda: stops.append(1)
    service.fatal_hold_seconds = 0.2
    runs = [looping_run(t) for t in (1, 2)]
    await service.ingest.record(
        Ev(Msg("otlp_spans", 0, 7, None, encode_request([s for r in runs for s in r.spans]), 123.0))
    )
    sent = service.topics["steps"].sent

    def full(key: Any, value: Any) -> None:
        raise Exception("IO error: No space left on device: While appending to file")

    monkeypatch.setattr(FakeTable, "__setitem__", lambda self, k, v: full(k, v))
    batch = [
        Ev(RefMsg("loopwatch-steps", m["partition"], i, None, m["value"], 123.0))
        for i, m in enumerate(sent)
    ]
    later = [Ev(RefMsg("loopwatch-steps", 0, 99, None, sent[0]["value"], 124.0))]
    stream = BatchStream([batch, later])
    agent = asyncio.ensure_future(service.detect.run(stream, 100, 0.1))
    for _ in range(50):
        await asyncio.sleep(0.01)
    assert not agent.done()  # held until the stop cancels it
    assert stops == [1]  # after the hold (0.2 s), not ready meanwhile
    agent.cancel()
    assert stream.acked == []
    assert service.counters["detect_batches"] == 1  # the first; the later one never
    assert len(service.topics["events"].sent) == 2  # (its loops only: none of `later`'s)
    status, reasons = service.readiness()
    assert status == "not_ready"
    assert any(
        r.startswith("table state write failed (Exception: IO error: No space") for r in reasons
    )


async def test_after_a_failed_state_write_readiness_says_why_until_the_stop(
    service: Any,
) -> None:
    """The stop is asked for FATAL_HOLD_SECONDS after the failure, once however often
    writes fail meanwhile, and /readyz answers not ready with the reason all along: the
    stop closes the web server, and a probe that came in the first milliseconds saw only
    a closed port."""
    stops: list[float] = []
    service.request_stop = lambda: stops.append(time.monotonic())
    service.fatal_hold_seconds = 0.3
    failed_at = time.monotonic()
    service.state_write_failed("OSError: No space left on device")
    service.state_write_failed("OSError: No space left on device")
    while not stops:
        assert time.monotonic() - failed_at < 5
        status, reasons = service.readiness()
        assert status == "not_ready"
        assert any(r.startswith("table state write failed (OSError: No space") for r in reasons)
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.4)
    assert len(stops) == 1 and stops[0] - failed_at >= 0.3


async def test_a_failed_flush_of_staged_state_stops_the_worker_unacked(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same when the failing write is a flush of several batches' staged state (the
    timer's, for a quiet stream): none of the batches is acknowledged, the next one halts."""
    stops: list[int] = []
    service = make(LOOPWATCH_STATE_FLUSH_MS="60000")
    service.request_stop = lambda: stops.append(1)
    service.fatal_hold_seconds = 0.0  # the stop at once
    first, second = await two_parts_of_one_run(service, 46)
    service.detect.stream = stream = FakeStream()
    await service.detect.batch([first])
    await service.detect.batch([second])
    monkeypatch.setattr(FakeTable, "__setitem__", lambda self, k, v: 1 / 0)
    service.detect.checkpoint.last_flush = 0.0  # due
    await service.detect.flush_if_due()
    assert stops == [1] and stream.acked == [] and service.detect.checkpoint.failed
    sent = len(service.topics["events"].sent)
    agent = asyncio.ensure_future(service.detect.run(BatchStream([[first]]), 10, 0.01))
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert not agent.done() and service.counters["detect_batches"] == 0  # held, not run
    assert len(service.topics["events"].sent) == sent
    agent.cancel()
    assert stream.acked == [] and service.readiness()[0] == "not_ready"


async def test_records_read_before_a_rebalance_are_never_acknowledged_after_it(
    make: Any, fakes: Fakes
) -> None:
    """Lost events in two-worker bench rounds: a rebalance dropped the staged batch of
    records 217-325 of a partition the worker kept, then the agent went on with records it
    had read before the rebalance (326-450), wrote and acknowledged them; faust, which
    forgets its committed offsets at a revocation until its seek, committed 451, past the
    dropped records, whose runs no worker ever saw."""
    service = make(LOOPWATCH_STATE_FLUSH_MS="60000")
    first, second = await two_parts_of_one_run(service, 46)
    await service.detect.batch([first])
    fakes.rebalancing = True  # faust: a revocation begins
    service.revoked([])
    await service.detect.batch([second])  # read before the rebalance: stale
    assert await service.detect.checkpoint.flush() == []
    fakes.rebalancing, fakes.group_generation = False, 1  # the same partitions, assigned again
    service.recovered({0, 1, 2, 3})
    await service.detect.batch([second])  # taken from a batch buffered across the rebalance
    assert await service.detect.checkpoint.flush() == []
    assert len(service.tables.runs) == 0
    assert service.counters["records_read_before_rebalance"] == 2
    redone = [Ev(replace(e.message, generation_id=1)) for e in (first, second)]
    for event in redone:  # from the committed offset
        await service.detect.batch([event])
    assert await service.detect.checkpoint.flush() == redone
    assert len(service.tables.runs) == 1


async def test_ingest_acknowledges_no_record_read_before_a_rebalance(
    service: Any, fakes: Fakes
) -> None:
    """A record whose steps are delivered once a rebalance has begun stays unacknowledged,
    and one taken from the stream after it began is not ingested: both are redone."""
    event = Ev(Msg("otlp_spans", 1, 10, None, encode_request(looping_run(47).spans)))
    records = await service.ingest.event(event)
    fakes.rebalancing = True
    stream = FakeStream()
    await acked(service, stream, event, records)
    assert stream.acked == []

    class Events(FakeStream):
        def noack(self) -> Any:
            return self

        async def events(self) -> Any:
            yield Ev(Msg("otlp_spans", 1, 11, None, encode_request(looping_run(48).spans)))

    sent = len(service.topics["steps"].sent)
    await service.ingest.run(Events())
    assert len(service.topics["steps"].sent) == sent
    assert service.counters["records_read_before_rebalance"] == 1
    fakes.rebalancing = False
    await acked(service, stream, event, records)
    assert stream.acked == [10]
