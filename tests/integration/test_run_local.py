"""`make run` (scripts/run-local.sh) against the real broker, under the signals a terminal
sends it: its window closed (the terminal goes away, SIGHUP to the process group), Ctrl-C
(SIGINT to the process group), and a crash that leaves no one to clean up (SIGKILL).

Each run has a pseudo-terminal for its output, like a shell's, and its own process group
(`start_new_session`), app id, topics, data dir, log and ports, so it shares the broker with
the other tests without touching what they use. The broker the other tests use was running
before these runs: they must leave it running. One test lets the run start a broker of its
own (other ports, data under tmp_path), which the run must then stop.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException

from streams.worker.kafka.topics import topic_specs
from streams.worker.settings import WorkerSettings
from tests.support.kafka import admin_client, bootstrap, delete_topics, require_broker
from tests.support.worker_proc import REPO, free_port

pytestmark = pytest.mark.kafka

EVENT = re.compile(r"\d\d:\d\d:\d\d  \S")  # a loop_detected line of the follow step
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIRST_EVENT_TIMEOUT = 200.0  # broker (if started) + topics + worker start on a busy 2-core box
STOP_TIMEOUT = 90.0  # the trap gives the worker up to 40 s, then stops a broker it started


def run_env(tmp: Path, **extra: str) -> dict[str, str]:
    """A run of its own on the shared broker: nothing named like the demo's defaults."""
    tag = uuid.uuid4().hex[:10]
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWATCH_")}
    tmp.mkdir(parents=True, exist_ok=True)
    return {
        **inherited,
        "LOOPWATCH_BOOTSTRAP": bootstrap(),
        "LOOPWATCH_APP_ID": f"lwrun-{tag}",
        "LOOPWATCH_INPUT_TOPIC": f"lwrun-{tag}-otlp",
        "LOOPWATCH_STEPS_TOPIC": f"lwrun-{tag}-steps",
        "LOOPWATCH_EVENTS_TOPIC": f"lwrun-{tag}-loop-detected",
        "LOOPWATCH_RUNS_TOPIC": f"lwrun-{tag}-loop-runs",
        "LOOPWATCH_DEAD_LETTER_TOPIC": f"lwrun-{tag}-dead-letters",
        "LOOPWATCH_HOLDS_TOPIC": f"lwrun-{tag}-holds",
        "LOOPWATCH_DATA_DIR": str(tmp / "data"),
        "LOOPWATCH_LOCAL_LOG": str(tmp / "worker.log"),
        "LOOPWATCH_WEB_PORT": str(free_port()),
        "LOOPWATCH_METRICS_PORT": str(free_port()),
        **extra,
    }


def worker_topics(env: dict[str, str]) -> set[str]:
    """Every topic the worker creates, from the project's own layout."""
    return {spec.name for spec in topic_specs(WorkerSettings.from_env(env), None)}


def group_members(pgid: int) -> dict[int, str]:
    """Live (not zombie) processes of process group `pgid`: pid -> command line."""
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError):
            continue
        out[int(entry)] = cmd.decode(errors="replace").strip()
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class DeathWatch:
    """When a process ended (polled every 20 ms from a thread)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.at: float | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while alive(self.pid):
            time.sleep(0.02)
        self.at = time.monotonic()

    def wait(self, timeout: float) -> float:
        self._thread.join(timeout)
        assert self.at is not None, f"pid {self.pid} still alive after {timeout:.0f} s"
        return self.at


class LocalRun:
    """`make run` (or the script itself) in a new session, its output on a pseudo-terminal."""

    def __init__(self, env: dict[str, str], *, via_make: bool = True) -> None:
        # -o: never (re)install the venv from a test; `run` itself only runs the script
        make = ["make", "-s", "-o", ".venv/.installed", "run"]
        cmd = make if via_make else ["scripts/run-local.sh"]
        master, slave = pty.openpty()
        self.master: int | None = master
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        self.pgid = self.proc.pid
        self.lines: list[tuple[float, str]] = []
        self._partial = b""
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.master is not None
        while not self._stop.is_set():
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if not ready:
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every writer is gone
                break
            if not chunk:
                break
            now = time.monotonic()
            *complete, self._partial = (self._partial + chunk).split(b"\n")
            for raw in complete:
                text = ANSI.sub("", raw.decode(errors="replace")).rstrip("\r")
                self.lines.append((now, text))

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str | re.Pattern[str], timeout: float) -> tuple[float, str]:
        """The first output line matching `pattern` (search): (when it came, the line)."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            for when, line in list(self.lines):
                if rx.search(line):
                    return when, line
            if time.monotonic() > deadline:
                raise AssertionError(f"no line matching {rx.pattern!r} in {timeout:.0f} s:\n{self}")
            if self.proc.poll() is not None:
                time.sleep(0.3)  # the last output may still be on its way
                if not any(rx.search(line) for _, line in self.lines):
                    raise AssertionError(
                        f"exited ({self.proc.returncode}) with no line matching "
                        f"{rx.pattern!r}:\n{self}"
                    )
            time.sleep(0.05)

    def worker_pid(self) -> int:
        pids = [p for p, cmd in group_members(self.pgid).items() if "streams.cli worker" in cmd]
        assert len(pids) == 1, f"worker processes of the run: {group_members(self.pgid)}"
        return pids[0]

    def close_terminal(self) -> None:
        """The window closes: the terminal goes away (writes to it fail from now on) and the
        shell sends SIGHUP to the job's process group."""
        self._stop.set()
        self._reader.join(5)
        if self.master is not None:
            os.close(self.master)
            self.master = None
        os.killpg(self.pgid, signal.SIGHUP)

    def signal(self, sig: int) -> None:
        os.killpg(self.pgid, sig)

    def wait_gone(self, timeout: float) -> None:
        """The run's first process exited and no process of its group is left."""
        deadline = time.monotonic() + timeout
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running {timeout:.0f} s later: {group_members(self.pgid)}\n{self}"
            ) from None
        while group_members(self.pgid):
            assert time.monotonic() < deadline, (
                f"left running after the run ended: {group_members(self.pgid)}\n{self}"
            )
            time.sleep(0.1)
        self._stop.set()
        self._reader.join(5)

    def kill(self) -> None:
        """Test teardown: nothing of the run survives a failed test."""
        for pid in group_members(self.pgid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._stop.set()
        self._reader.join(5)
        if self.master is not None:
            os.close(self.master)
            self.master = None

    def between(self, start: str, end: str | None) -> list[str]:
        """The output lines after the first line containing `start`, before `end`."""
        lines = [line for _, line in self.lines]
        i = next(n for n, line in enumerate(lines) if start in line)
        rest = lines[i + 1 :]
        if end is not None:
            rest = rest[: next((n for n, line in enumerate(rest) if end in line), len(rest))]
        return rest

    def __str__(self) -> str:
        return "\n".join(f"{when - self.started:7.2f}  {line}" for when, line in self.lines)


@pytest.fixture
def runs() -> Iterator[list[LocalRun]]:
    started: list[LocalRun] = []
    yield started
    for run in started:
        run.kill()


@pytest.fixture
def cleanup_kafka() -> Iterator[list[dict[str, str]]]:
    """The topics and consumer group of each env passed in are deleted after the test."""
    envs: list[dict[str, str]] = []
    yield envs
    for env in envs:
        try:
            delete_topics(worker_topics(env) | {f"{env['LOOPWATCH_APP_ID']}-__assignor-__leader"})
            app, admin = env["LOOPWATCH_APP_ID"], admin_client()
            admin.delete_consumer_groups([app], request_timeout=10)[app].result(15)
        except (KafkaException, TimeoutError):
            pass


def group_member_count(app: str) -> int:
    admin = admin_client()  # kept referenced until the answer came: its futures die with it
    try:
        desc = admin.describe_consumer_groups([app], request_timeout=10)[app].result(15)
    except KafkaException as exc:
        if exc.args and exc.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
            return 0
        raise
    return len(desc.members)


def test_closed_terminal_stops_the_run_and_the_next_run_prints_events_within_30s(
    tmp_path: Path, runs: list[LocalRun], cleanup_kafka: list[dict[str, str]]
) -> None:
    require_broker()
    env = run_env(tmp_path)
    cleanup_kafka.append(env)

    first = LocalRun(env)
    runs.append(first)
    first.wait_for(EVENT, FIRST_EVENT_TIMEOUT)
    worker = first.worker_pid()
    death = DeathWatch(worker)
    hung_up = time.monotonic()
    first.close_terminal()

    first.wait_gone(STOP_TIMEOUT)
    died = death.wait(5)
    print(
        f"hang-up -> worker exited {died - hung_up:.2f} s, run gone {time.monotonic() - hung_up:.2f} s"
    )
    require_broker()  # it was running before the run: the run left it running
    # the worker was stopped, not killed with the terminal: it left its consumer group, so
    # the next run need not wait for its session to expire
    assert group_member_count(env["LOOPWATCH_APP_ID"]) == 0, (
        f"the worker died {died - hung_up:.1f} s after the hang-up without leaving its "
        f"consumer group\n{first}"
    )
    log = Path(env["LOOPWATCH_LOCAL_LOG"]).read_text(errors="replace")
    # stopped, not killed: on the hang-up itself (the worker handles SIGHUP) or the trap's
    # SIGTERM, whichever came first
    assert re.search(r"stopping \(SIG(HUP|TERM)\)", log), log[-3000:]
    # the terminal is gone: the trap's line went to the log (among the worker's own lines)
    said = (
        r"(stopping the worker \(pid \d+\)\.\.\. .*stopped \(\d+ s\)"
        r"|the worker \(pid \d+\) had stopped on the same signal); .*left running"
    )
    assert re.search(said, log, re.S), log[-3000:]

    second = LocalRun(env)
    runs.append(second)
    first_event, _ = second.wait_for(EVENT, FIRST_EVENT_TIMEOUT)
    print(f"previous worker's death -> next run's first event {first_event - died:.2f} s")
    assert first_event - died <= 30.0, (
        f"first event {first_event - died:.1f} s after the previous worker's death\n{second}"
    )
    waiting = second.between("deleting the demo topics", "creating topics")
    assert len(waiting) <= 1, f"more than one line while waiting:\n{second}"
    if waiting:
        assert "waiting up to" in waiting[0] and "session" in waiting[0], second
    # every topic of the worker's layout was deleted and so created afresh
    _, created = second.wait_for("created:", 5)
    names = {n.strip() for n in created.split("created:", 1)[1].split(",")}
    assert names == worker_topics(env), second

    second.signal(signal.SIGINT)  # Ctrl-C
    second.wait_gone(STOP_TIMEOUT)
    assert "Traceback" not in second.text, second
    after = second.between("loop_detected events", None)
    # one line from the script (make adds its own "make: *** [...] Interrupt")
    stop = [line for line in after if not EVENT.match(line) and not line.startswith("make")]
    # the worker stops on the Ctrl-C too: the trap stops it, or finds it already stopped
    assert len(stop) == 1, second
    assert re.search(r"stopping the worker|the worker \(pid \d+\) had stopped", stop[0]), second
    assert "stopped" in stop[0] and "left running" in stop[0], second
    require_broker()


def test_crashed_run_next_run_waits_on_one_line_and_ctrl_c_is_quiet(
    tmp_path: Path, runs: list[LocalRun], cleanup_kafka: list[dict[str, str]]
) -> None:
    """SIGKILL to the whole run: the worker's group member stays registered until its
    session expires (10 s here: the same wait as the default 60 s, shorter)."""
    require_broker()
    session = 10.0
    env = run_env(tmp_path, LOOPWATCH_SESSION_TIMEOUT_SECONDS=f"{session:g}")
    cleanup_kafka.append(env)

    crashed = LocalRun(env, via_make=False)
    runs.append(crashed)
    crashed.wait_for(EVENT, FIRST_EVENT_TIMEOUT)
    crashed.worker_pid()
    crashed.signal(signal.SIGKILL)
    died = time.monotonic()
    crashed.wait_gone(10)
    assert group_member_count(env["LOOPWATCH_APP_ID"]) == 1

    # Ctrl-C while it waits: one line, no traceback
    interrupted = LocalRun(env, via_make=False)
    runs.append(interrupted)
    _, line = interrupted.wait_for("waiting up to", 30)
    assert "still registered" in line and f"up to {session:g} s" in line, interrupted
    time.sleep(1.0)
    assert interrupted.between("deleting the demo topics", None) == [line], interrupted
    sent = time.monotonic()
    interrupted.signal(signal.SIGINT)
    interrupted.wait_gone(10)
    assert time.monotonic() - sent < 5, interrupted
    assert "Traceback" not in interrupted.text, interrupted
    assert len(interrupted.between("waiting up to", None)) == 1, interrupted
    assert interrupted.proc.returncode == 130, interrupted

    # the next run takes the group over as soon as the broker lets it go
    resumed = LocalRun(env, via_make=False)
    runs.append(resumed)
    created_at, _ = resumed.wait_for("creating topics", session + 30)
    waited = resumed.between("deleting the demo topics", "creating topics")
    assert len(waited) <= 1, resumed
    assert created_at - died <= session + 5, (
        f"the group was taken over {created_at - died:.1f} s after the worker's death "
        f"(session {session:g} s)\n{resumed}"
    )
    first_event, _ = resumed.wait_for(EVENT, FIRST_EVENT_TIMEOUT)
    print(
        f"crashed worker's death -> group taken over {created_at - died:.2f} s, "
        f"first event {first_event - died:.2f} s (session {session:g} s)"
    )
    assert first_event - died <= session + 45, resumed
    resumed.signal(signal.SIGINT)
    resumed.wait_gone(STOP_TIMEOUT)
    assert "Traceback" not in resumed.text, resumed
    require_broker()


def test_closed_terminal_stops_the_broker_the_run_started(
    tmp_path: Path, runs: list[LocalRun]
) -> None:
    """A broker of the run's own (other ports, data in tmp_path): the run started it, so
    the run stops it, even though the terminal it would report to is gone."""
    port, controller = free_port(), free_port()
    kafka_env = {
        "KAFKA_PORT": str(port),
        "KAFKA_CONTROLLER_PORT": str(controller),
        "LOOPWATCH_KAFKA_DATA": str(tmp_path / "kafka"),
    }
    env = run_env(tmp_path / "run", LOOPWATCH_BOOTSTRAP=f"127.0.0.1:{port}", **kafka_env)
    pid_file = tmp_path / "kafka" / "kafka.pid"
    run = LocalRun(env, via_make=False)
    runs.append(run)
    try:
        run.wait_for("starting the Kafka broker", 30)
        run.wait_for(EVENT, FIRST_EVENT_TIMEOUT)
        broker = int(pid_file.read_text().strip())
        assert alive(broker)
        run.close_terminal()
        run.wait_gone(STOP_TIMEOUT)
        assert not alive(broker), "the broker the run started is still running"
    finally:
        subprocess.run(
            ["scripts/kafka.sh", "stop"],
            cwd=REPO,
            env={**os.environ, **kafka_env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=90,
        )
