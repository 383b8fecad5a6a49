"""The checkpoint (streams/worker/agents/checkpoint.py), the one writer of the worker's tables:
counts, then states, the producer flushed between, the states' changelog delivered before
the acks, and nothing written for partitions revoked meanwhile."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from alerts.metrics import Metrics
from detectors.policy import policy_from_mapping
from detectors.versions import PROMPT, Seen, Slice
from streams.worker.agents.checkpoint import Checkpoint, StateWriteError
from streams.worker.agents.counting import Counting
from streams.worker.agents.driver import RunDriver
from streams.worker.state.store import Tables
from streams.worker.state.window_keys import contribution_id, decode_count


class Logged(dict):  # type: ignore[type-arg]
    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        super().__init__()
        self.name, self.log, self.fail = name, log, fail

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.fail:
            raise OSError("IO error: No space left on device")
        self.log.append(f"write {self.name}")
        super().__setitem__(key, value)


def checkpoint(log: list[str], on_flush: Any = None, fail: str | None = None) -> Checkpoint:
    def table(name: str) -> Logged:
        return Logged(name, log, fail == name)

    tables = Tables(
        table("runs"),
        table("finished"),
        table("loop_counts"),
        table("run_counts"),
        retained=table("retained"),
        episodes=table("episodes"),
        versions=table("versions"),
        version_counts=table("version_counts"),
        hold_counts=table("hold_counts"),
    )
    # faust's view, as Publisher.may_acknowledge reads it: a rebalance begun or not
    publisher = SimpleNamespace(generation=0, stopping=lambda: False, rebalancing=False)
    publisher.may_acknowledge = lambda message: not publisher.rebalancing
    skips = SimpleNamespace(ack_refetched=lambda records: log.append("ack refetched"))
    driver = RunDriver(policy_from_mapping({}, "<test>"))
    parts = SimpleNamespace(driver=driver, tables=tables, skips=skips, publisher=publisher)
    counters = {"events": 0, "runs_finished": 0}
    counting = Counting(Metrics(CollectorRegistry()), counters, tables)

    async def flush_producer() -> None:
        log.append("producer flushed")
        if on_flush is not None:
            on_flush(publisher)

    return Checkpoint(parts, counting, flush_producer=flush_producer)  # type: ignore[arg-type]


EVENT = SimpleNamespace(message="steps/0@7")


def stage(cp: Checkpoint) -> None:
    """One batch's writes: a run state, a finished marker and a loop count, on partition 0."""
    writes = cp.driver.store.writes
    writes.put("runs", 0, b"run-1", b"state")
    writes.put("finished", 0, b"run-0", b"[1,0]")
    writes.count("loop_counts", 0, '["identical_repetition",0]', contribution_id("event", "e1"))
    cp.stage([EVENT], [], {0: "routing"}, cp.publisher.generation)


async def test_counts_are_written_before_the_states_with_the_producer_flushed_between() -> None:
    log: list[str] = []
    cp = checkpoint(log)
    stage(cp)
    assert await cp.flush() == [EVENT]
    assert log == [
        "write loop_counts",
        "producer flushed",  # the counts are in the log before these states
        "write runs",
        "write finished",
        "ack refetched",
    ]
    (value,) = cp.tables.loop_counts.values()
    assert decode_count(value) == (1, [contribution_id("event", "e1")])
    assert not cp.driver.store.writes


async def test_a_revocation_while_the_producer_flushes_the_counts_writes_no_state() -> None:
    log: list[str] = []

    def revoke(publisher: Any) -> None:
        publisher.generation += 1

    cp = checkpoint(log, revoke)
    stage(cp)
    assert await cp.flush() == []  # not acknowledged: the new owner redoes the records
    written = [entry for entry in log if entry.startswith("write")]
    assert written == ["write loop_counts"]  # written while owned: a redo's ids are refused
    assert not cp.driver.store.writes and not cp.driver.cache


class Writer:
    """A Tables.writer: logs the partitions it writes, then does `then` (the changelog's
    delivery: a revocation meanwhile, a failure)."""

    def __init__(self, log: list[str], then: Any) -> None:
        self.log, self.then = log, then
        self.calls = 0

    async def write(self, parts: list[tuple[Any, int, Any]]) -> None:
        self.calls += 1
        for table, partition, rows in parts:
            self.log.append(f"write {table.name} {partition}: {len(rows)}")
        self.then()


async def test_the_states_go_through_the_writer_and_a_revocation_meanwhile_acks_nothing() -> None:
    log: list[str] = []
    cp = checkpoint(log)
    cp.tables.writer = Writer(log, lambda: None)
    stage(cp)
    assert await cp.flush() == [EVENT]
    assert log[-3:] == ["write runs 0: 1", "write finished 0: 1", "ack refetched"]

    log.clear()

    def revoke() -> None:
        cp.publisher.generation += 1

    cp.tables.writer = Writer(log, revoke)
    stage(cp)
    assert await cp.flush() == []  # the state is written: the new owner's redo finds it
    assert "ack refetched" not in log and cp.failed is None


class Window:
    """A `Windowed` count table (faust_app.CurrentWindow): one window, read by partition,
    written only as rows through the writer."""

    def __init__(self, name: str) -> None:
        self.raw = SimpleNamespace(name=name)
        self.stored: dict[tuple[int, str], Any] = {}

    def read(self, partition: int, key: str) -> Any:
        return self.stored.get((partition, key), 0)

    def rows(self, partition: int, items: list[tuple[str, Any]]) -> list[tuple[bytes, bytes]]:
        self.stored.update({(partition, key): value for key, value in items})
        return [(key.encode(), json.dumps(value).encode()) for key, value in items]


async def test_windowed_counts_and_sightings_go_in_one_write_before_the_states() -> None:
    """The service's count tables (`Windowed`): the counts of the flush and the versions'
    sightings in one bulk write (one wait for the broker), before the states; each count
    added to what the partition's current window holds."""
    log: list[str] = []
    cp = checkpoint(log)
    cp.tables.writer = writer = Writer(log, lambda: None)
    cp.tables.loop_counts = window = Window("loop_counts")
    key = '["identical_repetition",0]'
    window.stored[(0, key)] = [4, [1]]
    stage(cp)
    cp.driver.store.writes.sight(0, Slice(PROMPT, "svc", "agent", "", "v1"), 9, Seen(1, 2, 1))
    assert await cp.flush() == [EVENT]
    assert log == [
        "write loop_counts 0: 1",
        "write versions 0: 1",
        "producer flushed",
        "write runs 0: 1",
        "write finished 0: 1",
        "ack refetched",
    ]
    assert writer.calls == 2  # the counts with the sightings, then the states
    assert window.stored[(0, key)] == [5, [contribution_id("event", "e1")]]


async def test_a_rebalance_begun_while_the_states_are_written_acks_nothing() -> None:
    """faust starts a revocation by forgetting the partitions' acks and committed offsets;
    the generation changes only at its end. An ack in between would let faust commit the
    next assignment past records dropped at the rebalance."""
    log: list[str] = []
    cp = checkpoint(log)

    def rebalance_begins() -> None:
        cp.publisher.rebalancing = True

    cp.tables.writer = Writer(log, rebalance_begins)
    stage(cp)
    assert await cp.flush() == []
    assert "ack refetched" not in log and cp.failed is None


async def test_a_changelog_that_fails_at_a_stop_is_redone_and_elsewhere_halts() -> None:
    log: list[str] = []

    def fail() -> None:
        raise RuntimeError("ProducerClosed")

    cp = checkpoint(log)
    cp.tables.writer = Writer(log, fail)
    cp.publisher.stopping = lambda: True
    stage(cp)
    assert await cp.flush() == [] and cp.failed is None
    assert not cp.driver.store.writes

    cp.publisher.stopping = lambda: False
    stage(cp)
    with pytest.raises(StateWriteError, match="ProducerClosed"):
        await cp.flush()
    assert "ack refetched" not in log


async def test_a_failed_write_raises_and_drops_the_staged_writes() -> None:
    log: list[str] = []
    cp = checkpoint(log, fail="runs")
    stage(cp)
    with pytest.raises(StateWriteError, match="No space left"):
        await cp.flush()
    assert "ack refetched" not in log
    assert not cp.driver.store.writes


async def test_a_producer_that_cannot_flush_drops_the_batch_without_halting_the_worker() -> None:
    """At a stop faust's producer refuses to flush ("Cannot flush: Producer not Running"):
    the batches are redone after the restart, and it is not a table write failure (which
    would stop the worker with exit status 3)."""
    log: list[str] = []

    def stopping(publisher: Any) -> None:
        raise RuntimeError("Cannot flush: Producer not Running")

    cp = checkpoint(log, stopping)
    stage(cp)
    assert await cp.flush() == []
    assert [entry for entry in log if entry.startswith("write")] == ["write loop_counts"]
    assert cp.failed is None and not cp.driver.store.writes
