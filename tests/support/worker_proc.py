"""Run `loopwatch worker` as a subprocess against the real broker (the bench and the
integration tests).

Every worker gets its own topics, app id (consumer group, changelog prefix), data dir and
ports; `WorkerProc.cleanup()` deletes its topics. Outputs are read back with a group-less
confluent-kafka consumer from the beginning of each topic.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import Consumer, Producer, TopicPartition

from streams.worker.kafka.topics import TABLES  # every changelog goes with the topics
from tests.support.kafka import admin_client, bootstrap, delete_topics

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_POLICY = REPO / "examples" / "loopwatch.yaml"
FINGERPRINT_KEY = "integration-test-key"


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port this process has not handed out before: the kernel may give the
    port it has just freed again, and a worker's web and metrics ports once came out equal
    (it then exits 2: "the same port as LOOPWATCH_WEB_PORT")."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def write_policy(path: Path, **overrides: Any) -> Path:
    raw = yaml.safe_load(EXAMPLE_POLICY.read_text())
    raw.update(overrides)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


class WorkerProc:
    def __init__(self, workdir: Path, policy: Path, **env: str) -> None:
        tag = uuid.uuid4().hex[:10]
        self.tag = tag
        self.workdir = workdir
        self.policy = policy
        self.app_id = f"lwtest-{tag}"
        self.topics = {
            "input": f"lwtest-{tag}-otlp",
            "steps": f"lwtest-{tag}-steps",
            "events": f"lwtest-{tag}-loop-detected",
            "runs": f"lwtest-{tag}-loop-runs",
            "dead": f"lwtest-{tag}-dead-letters",
            "holds": f"lwtest-{tag}-holds",
        }
        self.web_port = free_port()
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWATCH_")}
        self.env = {
            **inherited,
            "PYTHONPATH": str(REPO),
            "LOOPWATCH_BOOTSTRAP": bootstrap(),
            "LOOPWATCH_APP_ID": self.app_id,
            "LOOPWATCH_INPUT_TOPIC": self.topics["input"],
            "LOOPWATCH_STEPS_TOPIC": self.topics["steps"],
            "LOOPWATCH_EVENTS_TOPIC": self.topics["events"],
            "LOOPWATCH_RUNS_TOPIC": self.topics["runs"],
            "LOOPWATCH_DEAD_LETTER_TOPIC": self.topics["dead"],
            "LOOPWATCH_HOLDS_TOPIC": self.topics["holds"],
            "LOOPWATCH_STORE": "memory://",
            "LOOPWATCH_DATA_DIR": str(workdir / "data"),
            "LOOPWATCH_WEB_PORT": str(self.web_port),
            "LOOPWATCH_METRICS_PORT": str(free_port()),
            "LOOPWATCH_PARTITIONS": "4",
            "LOOPWATCH_SESSION_TIMEOUT_SECONDS": "6",
            "LOOPWATCH_TICK_SECONDS": "0.5",
            "LOOPWATCH_LOG_LEVEL": "info",
            "LOOPWATCH_FINGERPRINT_KEY": FINGERPRINT_KEY,
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        # the workers sharing these topics (`sibling`): cleanup stops them all first
        self.group: list[WorkerProc] = [self]

    def sibling(self, workdir: Path) -> WorkerProc:
        """A second worker of the same app: its group, topics and settings, its own ports
        and data directory."""
        other = WorkerProc(workdir, self.policy)
        other.env.update(
            {k: v for k, v in self.env.items() if k.startswith("LOOPWATCH_") and "PORT" not in k}
        )
        other.env["LOOPWATCH_DATA_DIR"] = str(workdir / "data")
        other.app_id, other.topics = self.app_id, self.topics
        other.group = self.group
        self.group.append(other)
        return other

    # ------------------------------------------------------------------ lifecycle

    @property
    def log_path(self) -> Path:
        return self.workdir / f"worker-{self.tag}.log"

    def start(self) -> None:
        self.starts += 1
        log = self.log_path.open("ab")
        log.write(f"\n===== start #{self.starts} =====\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streams.cli", "worker", "--config", str(self.policy)],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"worker exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                status, doc = self.api("/healthz")
                if status == 200 and doc.get("ready"):
                    return doc
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"worker not ready within {timeout} s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(
                    f"worker did not stop within {timeout} s:\n{self.log_tail()}"
                ) from None
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def cleanup(self) -> None:
        """Kill this worker and every sibling, then delete the topics they share. A sibling
        still running when they are deleted recreates them (its clients' metadata requests
        auto-create topics on a broker that allows it), and the deletion's wait then timed
        out (`make bench`, 2026-12-06: the two-worker round's first cleanup)."""
        for worker in self.group:
            worker.kill()
        names = list(self.topics.values()) + [f"{self.app_id}-{t}-changelog" for t in TABLES]
        names.append(f"{self.app_id}-__assignor-__leader")  # faust creates it
        existing = set(admin_client().list_topics(timeout=10).topics)
        delete_topics([n for n in names if n in existing])

    # ------------------------------------------------------------------ HTTP API

    def api(
        self, path: str, token: str | None = None, timeout: float = 10.0
    ) -> tuple[int, dict[str, Any]]:
        headers = {"Accept": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(f"http://127.0.0.1:{self.web_port}{path}", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = exc.read()
            try:
                return exc.code, json.loads(body)
            except ValueError:
                return exc.code, {"raw": body.decode("utf-8", "replace")}

    def metrics_text(self) -> str:
        port = self.env["LOOPWATCH_METRICS_PORT"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return str(resp.read().decode("utf-8", "replace"))

    def metric(self, name: str) -> float:
        """Sum of the samples whose line starts with `name` (a name or a name{labels})."""
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in self.metrics_text().splitlines()
            if line.startswith(name) and not line.startswith("#")
        )

    def crash_lines(self) -> list[str]:
        """Lines of the worker log that tell of a crash: tracebacks, crashed agents, errors
        (aiokafka's are left out: it logs disconnects as errors while the broker restarts)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [
            line
            for line in text.splitlines()
            if ("crash" in line.lower() or "Traceback" in line or " ERROR " in line)
            and "aiokafka" not in line
        ]

    def wait_taken(self, total: int, timeout: float) -> dict[str, Any]:
        """Until the worker took `total` input records (ingested or dead-lettered); its
        /healthz answer then."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, doc = self.api("/healthz")
            except OSError:
                status, doc = 0, {}
            done = doc.get("records", 0) + doc.get("dead_letters", 0)
            if status == 200 and done >= total:
                return doc
            assert time.monotonic() < deadline, f"{done} of {total} input records taken: {doc}"
            time.sleep(0.5)

    # ------------------------------------------------------------------ Kafka I/O

    def produce(
        self, records: Iterable[tuple[bytes | None, bytes | None]]
    ) -> list[tuple[int, int]]:
        """Produce in order; returns each record's (partition, offset)."""
        producer = Producer({"bootstrap.servers": bootstrap(), "log_level": 0, "linger.ms": 5})
        where: dict[int, tuple[int, int]] = {}

        def delivered(i: int) -> Callable[[Any, Any], None]:
            def done(err: Any, msg: Any) -> None:
                assert err is None, err
                where[i] = (msg.partition(), msg.offset())

            return done

        n = 0
        for n, (key, value) in enumerate(records):
            producer.produce(self.topics["input"], value=value, key=key, on_delivery=delivered(n))
            producer.poll(0)
        assert producer.flush(30) == 0, "records not delivered"
        return [where[i] for i in range(len(where))] if where else []

    def read(
        self,
        topic: str,
        until: Callable[[list[Any]], bool] | None = None,
        timeout: float = 60.0,
        settle: float = 0.0,
    ) -> list[Any]:
        """All records of a worker topic ('events', 'runs', 'dead'), from the beginning,
        until `until(records)` holds (then `settle` more seconds) or `timeout` passes."""
        name = self.topics[topic]
        consumer = reader()
        try:
            md = consumer.list_topics(name, timeout=10)
            parts = [TopicPartition(name, p, 0) for p in md.topics[name].partitions]
            consumer.assign(parts)
            out: list[Any] = []
            deadline = time.monotonic() + timeout
            settle_until: float | None = None
            while time.monotonic() < deadline:
                msg = consumer.poll(0.2)
                if msg is not None and not msg.error():
                    out.append(msg)
                    continue
                if settle_until is None and until is not None and until(out):
                    settle_until = time.monotonic() + settle
                if settle_until is not None and time.monotonic() >= settle_until:
                    break
            return out
        finally:
            consumer.close()


def reader(group: str | None = None) -> Consumer:
    """A consumer that commits nothing; without `group`, in a group of its own."""
    return Consumer(
        {
            "bootstrap.servers": bootstrap(),
            "group.id": group or f"reader-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "log_level": 0,
        }
    )
