"""The worker's fault handling without a broker: the broker state (`BrokerLink`), folding
the library loggers' repeats (`FoldRepeats`), the data dir checks (`statedir`), the
bounded stop (`BoundedStop`). The same against the real broker:
tests/integration/test_faults.py."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from alerts.metrics import Metrics
from detectors.errors import LoopwatchError
from streams.cli.worker import BoundedStop
from streams.worker.kafka.broker import BrokerLink, FoldRepeats
from streams.worker.settings import WorkerSettings
from streams.worker.state import statedir


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(CollectorRegistry())


def link_with(metrics: Metrics, clock: Clock, reminder: float = 60.0) -> BrokerLink:
    return BrokerLink(metrics, reminder_seconds=reminder, clock=clock, wall=lambda: 0.0)


def gauge(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def test_states_one_line_per_change_and_a_reminder_per_interval(
    metrics: Metrics, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    link = link_with(metrics, clock, reminder=60)
    caplog.set_level(logging.WARNING, logger="streams")
    assert link.state == "connected" and gauge(metrics, "loopwatch_broker_connected") == 1
    # an outage: the probe fails every 2 s for 5 minutes
    for _ in range(150):
        clock.now += 2
        link.probe_result(False, "KafkaError{code=_TRANSPORT}")
    assert link.state == "disconnected"
    assert gauge(metrics, "loopwatch_broker_connected") == 0
    assert link.disconnected_for() == pytest.approx(298)
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("broker: disconnected since") for m in messages) == 1
    reminders = [m for m in messages if "still disconnected" in m]
    assert len(reminders) == 4, messages  # one a minute
    assert "failed requests" in reminders[0]
    # back: the probe answers; library errors of the reconnect make it degraded a while
    clock.now += 2
    link.failure("library", "Unable connect to node with id 1")
    link.probe_result(True)
    assert link.state == "degraded" and gauge(metrics, "loopwatch_broker_connected") == 0.5
    clock.now += 31
    link.probe_result(True)
    assert link.state == "connected" and link.disconnected_for() == 0
    assert "connected again" in caplog.records[-1].getMessage()
    assert gauge(metrics, "loopwatch_broker_failed_requests_total", source="probe") == 150
    assert len(caplog.records) == 1 + 4 + 1 + 1


def test_library_repeats_are_folded_and_counted(metrics: Metrics) -> None:
    clock = Clock()
    link = link_with(metrics, clock)
    fold = FoldRepeats(link)
    aiokafka = logging.getLogger("aiokafka.client")
    written = 0
    for _ in range(1000):
        clock.now += 0.05
        record = aiokafka.makeRecord(
            "aiokafka.client",
            logging.ERROR,
            __file__,
            1,
            "Unable connect to node with id %s: %s",
            (1, "Connect call failed"),
            None,
        )
        written += fold.filter(record)
        timer = logging.getLogger("mode.timers").makeRecord(
            "mode.timers",
            logging.WARNING,
            __file__,
            1,
            "Timer %s is overlapping (interval=%r runtime=%r)",
            ("loopwatch-input-clock", 1.0, 6.0),
            None,
        )
        written += fold.filter(timer)
    assert written == 2  # the first of each kind of the outage
    assert link.folded_total == 2000
    assert link.failed_requests == 1000  # connection errors, not slow timers
    assert gauge(metrics, "loopwatch_broker_failed_requests_total", source="library") == 1000
    other = aiokafka.makeRecord("aiokafka", logging.INFO, __file__, 1, "something else", (), None)
    assert fold.filter(other)
    # the next outage writes the first of each kind again
    link.probe_result(True)
    clock.now += 31
    link.probe_result(True)
    assert link.state == "connected"
    assert fold.filter(record) and not fold.filter(record)


def test_readiness_reasons() -> None:
    from streams.worker.service import Worker

    worker: Any = Worker.__new__(Worker)
    worker.settings = WorkerSettings(ready_broker_seconds=30, ready_max_consumer_lag=100)
    clock = Clock()
    worker.broker = BrokerLink(None, clock=clock)
    worker.ready = True
    worker.assigned = lambda: {0}
    worker.clock = type("C", (), {"lag_seconds": lambda self: None})()
    worker.timers = type("T", (), {"max_lag": 0})()
    worker.state_dir_error = None
    worker.crashed = {}
    worker.fatal = None
    worker.counters = {"records": 0, "detect_batches": 0}
    worker._progress = (-1, 0.0)
    assert worker.readiness() == ("ok", [])
    worker.broker.probe_result(False, "timed out")
    status, reasons = worker.readiness()
    assert status == "degraded" and "broker disconnected" in reasons[0]
    clock.now += 31
    worker.broker.probe_result(False, "timed out")
    status, reasons = worker.readiness()
    assert status == "not_ready" and "bound 30 s" in reasons[0]
    worker.broker = BrokerLink(None, clock=clock)
    worker.timers.max_lag = 101
    worker.state_dir_error = "No space left on device"
    worker.crashed = {"detect": "OSError: disk"}
    worker.ready = False
    status, reasons = worker.readiness()
    assert status == "not_ready"
    assert [r.split(" ")[0] for r in reasons] == ["recovery", "consumer", "data", "agent"]


def test_readiness_sees_a_stalled_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    from streams.worker import service
    from streams.worker.service import Worker

    now = [100.0]
    monkeypatch.setattr(service.time, "monotonic", lambda: now[0])
    worker: Any = Worker.__new__(Worker)
    worker.settings = WorkerSettings()
    worker.broker = BrokerLink(None)
    worker.ready = True
    worker.assigned = lambda: {0}
    worker.clock = type("C", (), {"lag_seconds": lambda self: None})()
    worker.timers = type("T", (), {"max_lag": 7})()
    worker.state_dir_error = None
    worker.crashed = {}
    worker.fatal = None
    worker.counters = {"records": 8, "detect_batches": 3}
    worker._progress = (-1, 0.0)
    assert worker.readiness()[0] == "ok"
    now[0] += 59
    assert worker.readiness()[0] == "ok"
    now[0] += 2
    status, reasons = worker.readiness()
    assert status == "not_ready" and reasons[0].startswith("nothing processed for 61 s")
    worker.counters["records"] += 1  # progress
    assert worker.readiness()[0] == "ok"


def test_state_dir_prepare(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(LoopwatchError, match="cannot be created"):
        statedir.prepare(blocked / "data", "app", rocksdb=True)
    data = tmp_path / "data"
    assert statedir.prepare(data, "app", rocksdb=True) == []
    assert statedir.writable(data) is None
    # a damaged rocksdb partition is moved aside; a sound one is left
    from rocksdict import Options, Rdict

    tables = data / "app" / "v1" / "tables"
    tables.mkdir(parents=True)
    for name in ("runs-0.db", "runs-1.db"):
        db = Rdict(str(tables / name), Options(raw_mode=True))
        db[b"k"] = b"v"
        db.close()
    (tables / "runs-1.db" / "CURRENT").write_bytes(b"garbage\n")
    moved = statedir.prepare(data, "app", rocksdb=True)
    assert [p.name.split(".damaged-")[0] for p in moved] == ["runs-1.db"]
    assert (tables / "runs-0.db").is_dir() and not (tables / "runs-1.db").exists()


def test_a_closed_terminal_stops_the_worker_as_sigterm_does() -> None:
    """SIGHUP (the terminal of `loopwatch worker` or `make run` closed) schedules the same
    bounded shutdown as SIGTERM, on mode's real Worker: before, mode installed no handler
    and the worker died of it without leaving its consumer group."""
    import asyncio
    import signal

    from mode import Worker

    from streams.cli.worker import bounded_worker

    armed: list[int] = []
    stop = SimpleNamespace(arm=armed.append)
    loop = asyncio.new_event_loop()
    try:
        worker = bounded_worker(Worker, stop)(loop=loop)  # type: ignore[arg-type]
        scheduled: list[int] = []
        worker._stop_on_signal = lambda signum: scheduled.append(signum) or asyncio.sleep(0)
        worker.install_signal_handlers()
        handle = loop._signal_handlers[signal.SIGHUP]  # type: ignore[attr-defined]
        handle._run()
        loop.run_until_complete(asyncio.sleep(0))
        assert armed == [signal.SIGHUP] and scheduled == [signal.SIGHUP]
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        loop.close()


def test_bounded_stop_exits_after_the_bound(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import signal

    from streams.cli import worker as worker_cli

    exits: list[int] = []
    monkeypatch.setattr(worker_cli.os, "_exit", exits.append)
    stop = BoundedStop(0.05, lambda: "3 output(s) awaiting delivery")
    stop.arm(signal.SIGTERM)
    stop.arm(signal.SIGTERM)  # a second signal does not re-arm
    assert stop._timer is not None
    stop._timer.join(2)
    assert exits == [0]
    assert "abandoned: 3 output(s) awaiting delivery" in caplog.text


def test_store_memory_is_read_from_every_open_rocksdb_partition(tmp_path: Path) -> None:
    """/healthz store_memory_bytes: rocksdb's memory by holder, summed over partitions
    (what docs/PERFORMANCE.md's memory analysis reads); nothing for the in-memory store."""
    from types import SimpleNamespace

    import rocksdict

    from streams.worker.faust_app import rocksdb_memory

    dbs = {p: rocksdict.Rdict(str(tmp_path / f"t-{p}.db")) for p in (0, 1)}
    try:
        for p, db in dbs.items():
            for i in range(2000):
                db[f"run-{p}-{i}".encode()] = b"x" * 200
        table = SimpleNamespace(data=SimpleNamespace(_dbs=dbs))
        memory = rocksdb_memory([table, SimpleNamespace(data={})])
        assert set(memory) == {"memtables", "block_cache", "table_readers"}
        assert memory["memtables"] >= 2 * 2000 * 200  # both partitions' writes, in memtables
        dbs[1].close()  # a closed partition is skipped, not an error
        assert rocksdb_memory([table])["memtables"] < memory["memtables"]
    finally:
        for db in dbs.values():
            with contextlib.suppress(Exception):  # (one was closed above)
                db.close()
