"""Run `loopwatch worker` as a subprocess against the real broker, for integration tests.

Every worker gets its own topics, app id (consumer group, changelog prefix), data dir and
ports; `WorkerProc.cleanup()` deletes its topics. Outputs are read back with a group-less
confluent-kafka consumer from the beginning of each topic.

Also shared by the reliability tests (chaos, malformed stream, canary): the bench corpus as
input (`rooted_corpus`), the replay oracle (`Oracle`), reading a whole topic
(`read_to_end`), the worker's metrics and crash lines in its log, and `LONG`
(``LOOPWATCH_CHAOS_LONG=1``, `make chaos`: the long variants).
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
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.corpus import export_messages
from detectors.policy import load_policy
from tests.kafka_support import admin_client, bootstrap, delete_topics
from tests.otlp_build import replay_messages

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_POLICY = REPO / "examples" / "loopwatch.yaml"
FINGERPRINT_KEY = "integration-test-key"
TABLES = ("runs", "finished", "loop_counts", "run_counts")
LONG = os.environ.get("LOOPWATCH_CHAOS_LONG", "").lower() in ("1", "true", "yes", "on")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
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


def values(records: list[Any]) -> list[dict[str, Any]]:
    return [json.loads(r.value()) for r in records]


def headers_of(record: Any) -> dict[str, str]:
    return {k: v.decode() for k, v in (record.headers() or [])}


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


def read_to_end(topic: str, timeout: float = 60.0) -> list[Any]:
    """Every record of `topic` up to its end offsets at the call (group-less consumer)."""
    consumer = reader()
    try:
        md = consumer.list_topics(topic, timeout=10)
        ends = {}
        for p in md.topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            out.append(msg)
            if (msg.offset() or 0) >= ends[msg.partition()] - 1:
                del ends[msg.partition()]
        assert not ends, f"{topic}: not read to the end within {timeout} s ({ends})"
        return out
    finally:
        consumer.close()


# ---------------------------------------------------------------------------- input + oracle


def rooted_corpus(total_spans: int, seed: int) -> list[bytes]:
    """The bench corpus (`bench.corpus.export_messages`: concurrent runs, a few % looping)
    an hour in the past, without the runs the generator cut off before their root span
    (they would end by idle timeout only)."""
    past = time.time_ns() - 3_600_000_000_000
    requests = [
        ExportTraceServiceRequest.FromString(m)
        for m in export_messages(total_spans, seed=seed, base_ns=past, run_spacing_ns=50_000_000)
    ]
    rooted = {
        sp.trace_id
        for req in requests
        for rs in req.resource_spans
        for ss in rs.scope_spans
        for sp in ss.spans
        if not sp.parent_span_id
    }
    out = []
    for req in requests:
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                keep = [sp for sp in ss.spans if sp.trace_id in rooted]
                del ss.spans[:]
                ss.spans.extend(keep)
        if any(ss.spans for rs in req.resource_spans for ss in rs.scope_spans):
            out.append(req.SerializeToString())
    return out


_EVENT_KEYS = ("shape", "event_id", "count", "first_sequence", "last_sequence", "trigger_span_id")
_SUMMARY_KEYS = (
    "outcome",
    "steps",
    "tool_calls",
    "spans",
    "distinct_actions",
    "duplicate_spans",
    "late_spans",
    "shapes",
)


@dataclass
class Oracle:
    """What `loopwatch replay` (`streams.engine.Engine`, the example policy, the workers'
    fingerprint key) computes from groups of export messages, each group replayed on its
    own (the replay's watermark is global: files of different days replayed as one stream
    would finalize each other's runs)."""

    messages: list[bytes] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)  # by run id
    event_ids: set[str] = field(default_factory=set)
    by_run_shape: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    runs: set[tuple[str, str]] = field(default_factory=set)  # (run_id, outcome)

    @classmethod
    def of(cls, groups: list[list[bytes]]) -> Oracle:
        policy = load_policy(EXAMPLE_POLICY)
        oracle = cls()
        for messages in groups:
            events, summaries = replay_messages(messages, policy, FINGERPRINT_KEY.encode())
            assert not {s["run_id"] for s in summaries} & set(oracle.summaries), (
                "one run, two groups"
            )
            oracle.messages.extend(messages)
            oracle.events.extend(events)
            oracle.summaries.update((s["run_id"], s) for s in summaries)
        oracle.event_ids = {e["event_id"] for e in oracle.events}
        oracle.by_run_shape = by_run_shape(oracle.events)
        oracle.runs = {(r, s["outcome"]) for r, s in oracle.summaries.items()}
        assert len(oracle.event_ids) == len(oracle.events), "replay ids are unique"
        return oracle

    @property
    def run_ids(self) -> set[str]:
        return set(self.summaries)

    def differences(
        self, events: list[dict[str, Any]], summaries: list[dict[str, Any]]
    ) -> tuple[list[str], list[str]]:
        """(problems, run ids that differ) of a stream's events and summaries against the
        replay: the same event ids, per (run, shape) the replay's ids and no other (no
        episode fired twice under two ids), one outcome per run, the replay's. Copies of
        one event or summary (at-least-once) are not a difference."""
        ids = {e["event_id"] for e in events}
        missing, invented = self.event_ids - ids, ids - self.event_ids
        got_by_run_shape = by_run_shape(events)
        refired = {
            k: sorted(v) for k, v in got_by_run_shape.items() if v != self.by_run_shape.get(k)
        }
        refired |= {k: [] for k in self.by_run_shape if k not in got_by_run_shape}
        runs = {(s["run_id"], s["outcome"]) for s in summaries}
        two_outcomes = sorted(r for r, n in Counter(r for r, _ in runs).items() if n > 1)
        problems = []
        if missing:
            problems.append(f"{len(missing)} expected event ids missing: {sorted(missing)[:10]}")
        if invented:
            shapes = Counter(e["shape"] for e in events if e["event_id"] in invented)
            problems.append(f"{len(invented)} unexpected event ids ({dict(shapes)})")
        if refired:
            sample = dict(list(refired.items())[:5])
            problems.append(
                f"{len(refired)} (run, shape) with ids other than the replay's: {sample}"
            )
        if two_outcomes:
            problems.append(f"runs with two different outcomes: {two_outcomes[:10]}")
        if runs != self.runs:
            lost, extra = self.runs - runs, runs - self.runs
            problems.append(
                f"run summaries differ: {len(lost)} expected (run, outcome) missing "
                f"{sorted(lost)[:5]}, {len(extra)} unexpected {sorted(extra)[:5]}"
            )
        differ = {r for r, _ in refired} | {r for r, _ in self.runs ^ runs}
        differ |= {e["run_id"] for e in self.events if e["event_id"] in missing}
        differ |= {e["run_id"] for e in events if e["event_id"] in invented}
        return problems, sorted(differ)

    def describe(
        self, run_id: str, events: list[dict[str, Any]], summaries: list[dict[str, Any]]
    ) -> list[str]:
        """The replay's and the stream's events and summaries of one run."""
        lines = []
        for name, evs in (("replay", self.events), ("stream", events)):
            lines += [
                f"    {name} event   {[e.get(k) for k in _EVENT_KEYS]}"
                for e in evs
                if e["run_id"] == run_id
            ]
        summary = self.summaries.get(run_id)
        if summary:
            lines.append(f"    replay summary {[summary.get(k) for k in _SUMMARY_KEYS]}")
        lines += [
            f"    stream summary {[s.get(k) for k in _SUMMARY_KEYS]}"
            for s in summaries
            if s["run_id"] == run_id
        ]
        return lines


def by_run_shape(events: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for e in events:
        out[(e["run_id"], e["shape"])].add(e["event_id"])
    return dict(out)
