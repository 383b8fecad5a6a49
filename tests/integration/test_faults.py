"""Faults a platform sees (issue 16), against the real broker:

* **outage under load** (`test_broker_outage_under_load`): the broker is stopped for
  ``OUTAGE`` seconds while the corpus streams in. Nothing is lost (outputs equal the
  replay's), the worker's log grows by at most ``MAX_OUTAGE_LINES`` lines during the
  outage, and /healthz turns not ready (HTTP 503) and back to ready. The long variant
  (``LOOPWATCH_CHAOS_LONG=1``, `make chaos`) is the issue's: a 60 s outage with the
  product's defaults (``LOOPWATCH_READY_BROKER_SECONDS`` 30, reminders every 60 s). The
  suite's is 15 s with 5 and 5: the same states, changes and summary lines, in less time
  (the line bound holds either way: 3 reminders here, 1 with the defaults).
* **SIGTERM during an outage** (`test_sigterm_during_outage`): exits within
  ``LOOPWATCH_STOP_TIMEOUT_SECONDS`` (10 here, 30 by default) plus the process's own exit;
  after a restart with the broker back, the outputs equal the replay's.
* **data dir deleted, then damaged, between runs** (`test_state_dir_deleted_or_damaged`):
  rocksdb tables, the corpus in three parts; the second and third wait in the input topic
  (a backlog) while the worker is stopped, its data dir deleted, then every table
  partition's CURRENT file overwritten. The tables are rebuilt from the changelogs, the
  outputs equal the replay's and every input record is committed. The restarts run with
  the ``seek_race`` failpoint (tests/integration/failpoints/): without the fix of
  streams/worker/faust_internals.py the records fetched during faust's end-of-recovery seek
  are cleared from the stream queue, never processed, and their partition stalls.
* **data dir unwritable** (`test_state_dir_unwritable`): at start (a file where the dir
  should be): one line, exit 2; while running (the dir made read-only, or as root a full
  tmpfs): /healthz not ready with the reason, and back once fixed.
* **disk full while processing** (`test_disk_full_while_processing`, root: a 64 MiB
  tmpfs): a table write fails, one error line, /readyz 503 with the reason, exit status
  3 with the failed batch uncommitted; a restart on the full disk exits 2; with space
  back the outputs equal the replay's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from streams.worker.settings import WorkerSettings
from tests.integration.test_chaos import (
    PacedProducer,
    chaos_policy,
    check_against_replay,
    collect,
    kafka_sh,
)
from tests.integration.worker_support import LONG, Oracle, rooted_corpus
from tests.support.kafka import create_topics, require_broker
from tests.support.worker_proc import REPO, WorkerProc, reader

pytestmark = pytest.mark.kafka

SPANS = 12_000
PARTITIONS = 4
OUTAGE = 60.0 if LONG else 15.0
# (not ready after, reminder every): the suite's variant makes the outage's states come
# sooner; `make chaos` runs the product's defaults
DEFAULTS = WorkerSettings()
OUTAGE_TIMINGS = (
    (DEFAULTS.ready_broker_seconds, DEFAULTS.broker_reminder_seconds) if LONG else (5.0, 5.0)
)
MAX_OUTAGE_LINES = 20  # whole worker log, outage start to broker back
STOP_TIMEOUT = 10.0
RESULT_TIMEOUT = 120.0
FAILPOINTS = Path(__file__).resolve().parent / "failpoints"


@pytest.fixture(scope="module")
def expected() -> Oracle:
    require_broker()
    oracle = Oracle.of([rooted_corpus(SPANS, seed=2029)])
    assert len(oracle.event_ids) >= 3, "the corpus must loop a little"
    return oracle


@pytest.fixture(autouse=True)
def broker_left_running() -> Iterator[None]:
    yield
    kafka_sh("start")


def fault_worker(workdir: Path, **env: str) -> WorkerProc:
    workdir.mkdir(parents=True, exist_ok=True)
    settings = {
        "LOOPWATCH_READY_BROKER_SECONDS": "5",
        "LOOPWATCH_BROKER_REMINDER_SECONDS": "10",
        "LOOPWATCH_STOP_TIMEOUT_SECONDS": str(STOP_TIMEOUT),
    }
    return WorkerProc(workdir, chaos_policy(workdir), **(settings | env))


def split(messages: list[bytes], n: int) -> list[list[bytes]]:
    size = -(-len(messages) // n)
    return [messages[i : i + size] for i in range(0, len(messages), size)]


class HealthPoller(threading.Thread):
    """GET /healthz every 0.5 s: (monotonic time, HTTP status, status field) of each."""

    def __init__(self, worker: WorkerProc) -> None:
        super().__init__(daemon=True, name="healthz-poller")
        self.worker = worker
        self.answers: list[tuple[float, int, str]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                code, doc = self.worker.api("/healthz", timeout=3)
                self.answers.append((time.monotonic(), code, str(doc.get("status"))))
            except OSError:
                self.answers.append((time.monotonic(), 0, "no answer"))
            self.halt.wait(0.5)

    def first(self, after: float, code: int) -> float | None:
        return next((t for t, c, _ in self.answers if t >= after and c == code), None)


def lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


# ---------------------------------------------------------------------------- outage


def test_broker_outage_under_load(expected: Oracle, tmp_path: Path) -> None:
    ready_after, remind_every = OUTAGE_TIMINGS
    worker = fault_worker(
        tmp_path / "outage",
        LOOPWATCH_READY_BROKER_SECONDS=str(ready_after),
        LOOPWATCH_BROKER_REMINDER_SECONDS=str(remind_every),
    )
    poller = HealthPoller(worker)
    producer: PacedProducer | None = None
    try:
        create_topics([worker.topics["input"]], PARTITIONS)
        worker.start()
        worker.wait_ready(120)
        poller.start()
        producer = PacedProducer(worker.topics["input"], expected.messages, 20.0)
        producer.start()
        time.sleep(6.0)  # under load
        before = lines(worker.log_path)
        down_at = time.monotonic()
        kafka_sh("stop")
        time.sleep(OUTAGE)
        outage_lines = lines(worker.log_path) - before
        back_at = time.monotonic()
        kafka_sh("start")
        ready_again = None
        deadline = time.monotonic() + 120
        while ready_again is None and time.monotonic() < deadline:
            ready_again = poller.first(back_at, 200)
            time.sleep(0.5)
        producer.wait(240)
        got = collect(worker, expected, RESULT_TIMEOUT)
        not_ready = poller.first(down_at, 503)
        print(
            f"\noutage {OUTAGE:.0f} s: {outage_lines} log lines "
            f"({outage_lines * 60 / OUTAGE:.0f} per minute); /healthz 503 after "
            f"{(not_ready - down_at) if not_ready else float('nan'):.1f} s; ready again "
            f"{(ready_again - back_at) if ready_again else float('nan'):.1f} s after the "
            "broker was back"
        )
        check_against_replay(got, expected, "outage", worker)
        assert not_ready is not None and not_ready < back_at, (
            f"/healthz never answered 503 during the outage: {poller.answers[-10:]}"
        )
        assert ready_again is not None, f"/healthz not ready again: {poller.answers[-5:]}"
        assert outage_lines <= MAX_OUTAGE_LINES, (
            f"{outage_lines} log lines during a {OUTAGE:.0f} s outage "
            f"(bound {MAX_OUTAGE_LINES}):\n{worker.log_tail(60)}"
        )
        # connected again once 30 s passed without a failure (the client's reconnect errors)
        deadline = time.monotonic() + 90
        while "broker: connected again" not in worker.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, worker.log_tail(20)
            time.sleep(1.0)
        assert "broker: disconnected since" in worker.log_path.read_text(errors="replace")
        assert worker.metric("loopwatch_broker_connected") == 1.0
        assert worker.metric("loopwatch_broker_failed_requests_total") > 0
        assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()
    finally:
        poller.halt.set()
        kafka_sh("start")
        if producer is not None:
            producer.join(5)
        worker.cleanup()


# ---------------------------------------------------------------------------- bounded stop


def test_sigterm_during_outage(expected: Oracle, tmp_path: Path) -> None:
    worker = fault_worker(tmp_path / "stop", LOOPWATCH_STORE="rocksdb://")
    first, rest = split(expected.messages, 2)
    try:
        create_topics([worker.topics["input"]], PARTITIONS)
        worker.start()
        worker.wait_ready(120)
        producer = PacedProducer(worker.topics["input"], first, 3.0)
        producer.start()
        producer.wait(120)
        kafka_sh("stop")
        time.sleep(5.0)
        assert worker.proc is not None
        signalled = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        try:
            code = worker.proc.wait(STOP_TIMEOUT + 20)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running {STOP_TIMEOUT + 20:.0f} s after SIGTERM with the broker "
                f"down:\n{worker.log_tail()}"
            ) from None
        took = time.monotonic() - signalled
        print(f"\nSIGTERM with the broker down: exited {code} after {took:.1f} s")
        assert took <= STOP_TIMEOUT + 5, f"exit took {took:.1f} s:\n{worker.log_tail()}"
        assert "stop did not finish within" in worker.log_path.read_text(errors="replace")
        kafka_sh("start")
        worker.start()
        worker.wait_ready(120)
        producer = PacedProducer(worker.topics["input"], rest, 3.0)
        producer.start()
        producer.wait(120)
        got = collect(worker, expected, RESULT_TIMEOUT)
        check_against_replay(got, expected, "sigterm-outage", worker)
        assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()
    finally:
        kafka_sh("start")
        worker.cleanup()


# ---------------------------------------------------------------------------- lost state


def damage(data_dir: Path) -> int:
    n = 0
    for current in data_dir.glob("*/v*/tables/*.db/CURRENT"):
        current.write_bytes(b"garbage, not a manifest name\n")
        n += 1
    return n


def committed_and_end(
    worker: WorkerProc, topic: str = "input"
) -> tuple[dict[int, int], dict[int, int]]:
    """The worker group's committed offsets and the end offsets of one of its topics."""
    consumer = reader(worker.app_id)
    try:
        parts = [TopicPartition(worker.topics[topic], p) for p in range(PARTITIONS)]
        committed = {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=10)}
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in parts}
    finally:
        consumer.close()
    return committed, ends


def test_state_dir_deleted_or_damaged(expected: Oracle, tmp_path: Path) -> None:
    worker = fault_worker(
        tmp_path / "state",
        LOOPWATCH_STORE="rocksdb://",
        LOOPWATCH_FAILPOINT_SEEK_RACE="1",
        PYTHONPATH=f"{FAILPOINTS}{os.pathsep}{REPO}",
    )
    data_dir = Path(worker.env["LOOPWATCH_DATA_DIR"])
    parts = split(expected.messages, 3)
    try:
        create_topics([worker.topics["input"]], PARTITIONS)
        for i, part in enumerate(parts):
            if i == 1:
                shutil.rmtree(data_dir)
            elif i == 2:
                assert damage(data_dir) > 0, f"no table state under {data_dir}"
            if i > 0:
                worker.produce((None, m) for m in part)  # a backlog waits at the restart
            worker.start()
            worker.wait_ready(120)
            if i == 0:
                worker.produce((None, m) for m in part)
            worker.wait_taken(len(part), 60)
            time.sleep(3.0)  # detect's batch and the commits
            if i < len(parts) - 1:
                assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()
        got = collect(worker, expected, RESULT_TIMEOUT)
        check_against_replay(got, expected, "state-dir", worker)
        committed, ends = committed_and_end(worker)
        assert committed == ends, f"committed {committed}, end offsets {ends}"
        text = worker.log_path.read_text(errors="replace")
        assert "is damaged" in text and "moved aside" in text, worker.log_tail()
        # the failpoint ran at both restarts (each rebuilt its tables)
        assert text.count("failpoint seek_race:") >= 2, worker.log_tail()
        assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()
    finally:
        worker.cleanup()


def test_state_dir_unwritable(tmp_path: Path) -> None:
    require_broker()
    # at start: a file where the data dir should be
    blocked = tmp_path / "blocked"
    blocked.write_text("not a directory")
    worker = fault_worker(tmp_path / "start", LOOPWATCH_DATA_DIR=str(blocked / "data"))
    try:
        worker.start()
        assert worker.proc is not None
        code = worker.proc.wait(60)
        out = worker.log_tail(5)
        assert code == 2, out
        assert "data dir" in out and "cannot be created" in out, out
        assert "Traceback" not in worker.log_path.read_text(errors="replace")
    finally:
        worker.cleanup()

    # while running: made read-only (not for root: root writes anyway) or, as root, full
    worker = fault_worker(tmp_path / "run", LOOPWATCH_STORE="rocksdb://")
    data_dir = Path(worker.env["LOOPWATCH_DATA_DIR"])
    data_dir.mkdir(parents=True)
    mounted = False
    if os.geteuid() == 0:
        mounted = _mount_tmpfs(data_dir)
        if not mounted:
            worker.cleanup()
            pytest.skip("root without mount: cannot make the data dir unwritable")
    try:
        worker.start()
        worker.wait_ready(120)
        ballast = data_dir / "ballast"
        if mounted:
            _fill(ballast)
        else:
            data_dir.chmod(0o500)
        deadline = time.monotonic() + 30
        while True:
            code, doc = worker.api("/healthz")
            if code == 503 and any("data dir not writable" in r for r in doc["reasons"]):
                break
            assert time.monotonic() < deadline, f"/healthz did not turn not ready: {doc}"
            time.sleep(0.5)
        assert "is not writable" in worker.log_path.read_text(errors="replace")
        if mounted:
            ballast.unlink()
        else:
            data_dir.chmod(0o700)
        deadline = time.monotonic() + 30
        while worker.api("/healthz")[0] != 200:
            assert time.monotonic() < deadline, worker.api("/healthz")
            time.sleep(0.5)
        assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()
    finally:
        if not mounted and data_dir.exists():
            data_dir.chmod(0o700)
        worker.cleanup()
        if mounted:
            subprocess.run(["umount", "-l", str(data_dir)], check=False)


def _mount_tmpfs(path: Path) -> bool:
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return proc.returncode == 0


def _fill(path: Path) -> Any:
    """Fill the file system of `path` (a full disk)."""
    with path.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


def test_disk_full_while_processing(expected: Oracle, tmp_path: Path) -> None:
    """The disk fills while the worker writes table state (rocksdb: "IO error: No space
    left on device"): one clear line, /readyz 503 with the reason, exit status 3, nothing
    committed past the batch whose state was not written; a restart with the disk still
    full is one line and exit 2; with space back, a restart loses nothing."""
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs: root only")
    worker = fault_worker(tmp_path / "full", LOOPWATCH_STORE="rocksdb://")
    data_dir = Path(worker.env["LOOPWATCH_DATA_DIR"])
    data_dir.mkdir(parents=True)
    if not _mount_tmpfs(data_dir):
        worker.cleanup()
        pytest.skip("mount failed: cannot make a small file system for the data dir")
    ballast = data_dir / "ballast"
    first, rest = split(expected.messages, 2)
    try:
        create_topics([worker.topics["input"]], PARTITIONS)
        worker.start()
        worker.wait_ready(120)
        worker.produce((None, m) for m in first)
        worker.wait_taken(len(first), 60)
        time.sleep(3.0)  # detect's batch and the commits
        _fill(ballast)
        worker.produce((None, m) for m in rest)
        assert worker.proc is not None
        reasons: list[str] = []
        deadline = time.monotonic() + STOP_TIMEOUT + 60
        while worker.proc.poll() is None:
            assert time.monotonic() < deadline, f"still running:\n{worker.log_tail()}"
            try:
                code, doc = worker.api("/readyz", timeout=2)
                if code == 503:
                    reasons += doc.get("reasons", [])
            except OSError:
                pass
            # the 503 lasts from the failed write until faust closes its web server during
            # the stop, which the worker holds back FATAL_HOLD_SECONDS (2 s) for this
            time.sleep(0.02)
        text = worker.log_path.read_text(errors="replace")
        assert worker.proc.returncode == 3, worker.log_tail()
        assert text.count("table state write failed") == 1, worker.log_tail()
        assert "No space left on device" in text
        assert any(r.startswith("table state write failed") for r in reasons), reasons
        steps_committed, steps_end = committed_and_end(worker, "steps")
        assert steps_committed != steps_end, "the batch whose state failed was committed"

        # the disk still full: one line, exit 2
        worker.start()
        assert worker.proc.wait(60) == 2, worker.log_tail()
        assert "not writable" in worker.log_tail(3), worker.log_tail()

        ballast.unlink()
        worker.start()
        worker.wait_ready(120)
        got = collect(worker, expected, RESULT_TIMEOUT)
        check_against_replay(got, expected, "disk-full", worker)
        deadline = time.monotonic() + 30
        while committed_and_end(worker, "steps")[0] != committed_and_end(worker, "steps")[1]:
            assert time.monotonic() < deadline, committed_and_end(worker, "steps")
            time.sleep(1.0)
        assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()
    finally:
        worker.cleanup()
        subprocess.run(["umount", "-l", str(data_dir)], check=False)
