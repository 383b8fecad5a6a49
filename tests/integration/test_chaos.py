"""Chaos against the real broker: `loopwatch worker` killed, restarted and rebalanced while a
realistic corpus streams in, and the final outputs compared with the replay.

* **crash chaos** (`test_sigkill_and_broker_restart_keep_findings`): the bench corpus
  (`bench.corpus.export_messages`, a few % looping runs, timestamps an hour in the past) is
  produced in parts at a steady pace while the worker runs; during the parts the worker is
  killed with SIGKILL at random moments and restarted (CI: 3 kills, two of them a crash
  loop: killed again within 0.5 s of being ready, its part sent as a burst so that every
  restart finds a backlog), and the broker itself is restarted once (`scripts/kafka.sh
  stop; start`). rocksdb tables with one persistent data dir, a 6 s consumer session.
* **rebalance** (`test_rebalance_join_and_leave_keep_findings`): two workers on one app id;
  the second joins mid-stream, then the first leaves (SIGTERM) mid-stream.

The oracle is `streams.replay.engine.Engine` (what `loopwatch replay` computes) over the same
messages with the example policy and the workers' fingerprint key. The workers' policy
adds only stream timing (finalization 3 s after a run's root arrived; a lateness buffer long
enough that the order in which the input partitions are consumed does not matter). The
corpus keeps only runs that end with their root span (the generator cuts the last live
runs short), so no run waits for an idle timeout.

Checks at the end: every expected `event_id` is on `loop_detected` and no other; for every
(run, shape) the stream's ids are exactly the replay's (no episode fired twice under two
ids); the set of (run_id, outcome) on `loop_runs` equals the replay's. Redelivered copies
of the same event or the same summary are allowed (at-least-once): they are counted and
printed (`pytest -s` shows them). On a mismatch the failure message says which input
records never reached the internal steps topic (against the group's committed offsets) and
what the worker's API and the steps topic know about each differing run.

Sizes: the CI variant streams ~36k spans (the file takes about 85 s). The long variant,
``LOOPWATCH_CHAOS_LONG=1`` (`make chaos`, `scripts/chaos.sh`), streams ~220k spans over
~90 s with 7 kills (two crash loops) and 2 broker restarts. ``LOOPWATCH_CHAOS_SEED=<int>``
replays a given chaos schedule (the seed in use is printed; the moments are wall-clock
races all the same, so a replayed schedule is not a replayed run).

The broker is always left running (a `finally` and an autouse fixture start it again).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Producer, TopicPartition
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from streams.worker.agents.messages import decode_run_groups
from tests.integration.worker_support import LONG, Oracle, read_to_end, rooted_corpus
from tests.support.kafka import bootstrap, create_topics, require_broker
from tests.support.worker_proc import REPO, WorkerProc, reader, write_policy

pytestmark = pytest.mark.kafka

SPANS = 220_000 if LONG else 36_000
PRODUCE_SECONDS = 90.0 if LONG else 12.0  # the corpus trickles in over this long (+ chaos)
# SIGKILL bursts: 1 = one kill at a random moment; 2 = a crash loop (kill, restart, kill
# again within 0.5 s of being ready)
KILL_BURSTS = (1, 1, 1, 2, 2) if LONG else (1, 2)
BROKER_RESTARTS = 2 if LONG else 1
RESULT_TIMEOUT = 300.0 if LONG else 120.0
PARTITIONS = 4
KAFKA_SH = REPO / "scripts" / "kafka.sh"


def seeded_rng(label: str) -> random.Random:
    """The chaos schedule's randomness: LOOPWATCH_CHAOS_SEED, else a fresh seed (printed)."""
    raw = os.environ.get("LOOPWATCH_CHAOS_SEED")
    seed = int(raw) if raw else random.SystemRandom().randrange(1 << 30)
    print(f"\n{label} seed {seed} (LOOPWATCH_CHAOS_SEED={seed} replays this schedule)")
    return random.Random(seed)


# ---------------------------------------------------------------------------- corpus + oracle


@pytest.fixture(scope="module")
def expected() -> Oracle:
    require_broker()
    oracle = Oracle.of([rooted_corpus(SPANS, seed=2027)])
    assert len(oracle.event_ids) >= 10, "the corpus must loop a little"
    assert len(oracle.runs) >= 500
    print(
        f"\ncorpus: {len(oracle.messages)} records, {len(oracle.runs)} runs, "
        f"{len(oracle.event_ids)} expected events "
        f"{dict(Counter(e['shape'] for e in oracle.events))}"
    )
    return oracle


def chaos_policy(workdir: Path) -> Path:
    return write_policy(
        workdir / "policy.yaml",
        allowed_lateness_seconds=60,  # any consumption order of the input partitions
        finalize_grace_seconds=3,
        idle_timeout_seconds=120,  # every run ends with its root: never reached
    )


# ---------------------------------------------------------------------------- input + broker


class PacedProducer(threading.Thread):
    """Produces `messages` (unkeyed, as the collector's default) spread over `seconds`,
    through broker restarts (librdkafka buffers and retries); failed deliveries are
    produced again at the end (at-least-once input, as a real collector)."""

    def __init__(self, topic: str, messages: list[bytes], seconds: float) -> None:
        super().__init__(daemon=True, name="paced-producer")
        self.topic = topic
        self.messages = messages
        self.seconds = seconds
        self.failed: list[bytes] = []
        self.redelivered = 0
        self.error: BaseException | None = None
        self.done = threading.Event()

    def _producer(self) -> Producer:
        return Producer(
            {
                "bootstrap.servers": bootstrap(),
                "log_level": 0,
                "linger.ms": 5,
                "acks": "all",
                "message.timeout.ms": 180_000,
                "reconnect.backoff.max.ms": 1000,
            }
        )

    def run(self) -> None:
        try:
            producer = self._producer()
            lock = threading.Lock()

            def delivered(err: Any, msg: Any) -> None:
                if err is not None:
                    with lock:
                        self.failed.append(msg.value())

            started = time.monotonic()
            n = len(self.messages)
            for i, message in enumerate(self.messages):
                due = started + self.seconds * i / n
                while (left := due - time.monotonic()) > 0:
                    producer.poll(min(left, 0.05))
                while True:
                    try:
                        producer.produce(self.topic, value=message, on_delivery=delivered)
                        break
                    except BufferError:
                        producer.poll(0.1)
                producer.poll(0)
            assert producer.flush(200) == 0, "input not delivered within 200 s"
            for _attempt in range(3):
                with lock:
                    retry, self.failed = self.failed, []
                if not retry:
                    break
                self.redelivered += len(retry)
                for message in retry:
                    producer.produce(self.topic, value=message, on_delivery=delivered)
                assert producer.flush(120) == 0
            assert not self.failed, f"{len(self.failed)} input records never delivered"
        except BaseException as exc:  # reported by wait()
            self.error = exc
        finally:
            self.done.set()

    def wait(self, timeout: float) -> None:
        self.join(timeout)
        assert not self.is_alive(), f"producer still running after {timeout} s"
        if self.error is not None:
            raise self.error


def kafka_sh(command: str, timeout: float = 120.0) -> float:
    """`scripts/kafka.sh <command>` for the broker the tests use. Its port is taken from
    LOOPWATCH_BOOTSTRAP (a KAFKA_PORT that disagrees is an error), LOOPWATCH_KAFKA_DATA
    passes through: a broker of its own is `KAFKA_PORT=29092 LOOPWATCH_KAFKA_DATA=/tmp/x
    LOOPWATCH_BOOTSTRAP=127.0.0.1:29092`. Before a stop, `status` must find that broker
    serving there, so a mismatched data dir never stops someone else's broker."""
    host, _, port = bootstrap().rpartition(":")
    assert host in ("127.0.0.1", "localhost"), f"cannot restart a remote broker ({bootstrap()})"
    assert os.environ.get("KAFKA_PORT", port) == port, (
        f"KAFKA_PORT={os.environ['KAFKA_PORT']} but LOOPWATCH_BOOTSTRAP={bootstrap()}"
    )
    env = {**os.environ, "KAFKA_PORT": port}

    def run(cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(KAFKA_SH), cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
        )

    started = time.monotonic()
    if command == "stop":
        status = run("status")
        assert status.returncode == 0, (
            f"kafka.sh status (data dir {os.environ.get('LOOPWATCH_KAFKA_DATA', 'default')}) "
            f"does not find the broker serving {bootstrap()}: set LOOPWATCH_KAFKA_DATA to its "
            f"data dir\n{status.stdout}{status.stderr}"
        )
    proc = run(command)
    assert proc.returncode == 0, f"kafka.sh {command}: {proc.stdout}{proc.stderr}"
    return time.monotonic() - started


def restart_broker(pause: float) -> float:
    """stop, `pause` seconds down, start; returns the downtime."""
    started = time.monotonic()
    try:
        kafka_sh("stop")
        time.sleep(pause)
    finally:
        kafka_sh("start")
    return time.monotonic() - started


@pytest.fixture(autouse=True)
def broker_left_running() -> Iterator[None]:
    yield
    kafka_sh("start")  # whatever happened: leave the broker running


# ---------------------------------------------------------------------------- result checks


@dataclass
class Outcome:
    event_copies: Counter[str] = field(default_factory=Counter)
    summary_copies: Counter[tuple[str, str]] = field(default_factory=Counter)
    events: list[dict[str, Any]] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)


def collect(worker: WorkerProc, want: Oracle, timeout: float, quiet: float = 20.0) -> Outcome:
    """Everything on loop_detected and loop_runs, read until every expected event id and
    run is there plus a 2 s settle (so a late extra or duplicate shows up too), or until
    nothing new arrived for `quiet` seconds (something is lost: fail fast), or `timeout`."""
    want_runs = {r for r, _ in want.runs}
    names = {worker.topics["events"]: "events", worker.topics["runs"]: "runs"}
    consumer = reader()
    out = Outcome()
    try:
        parts = []
        for name in names:
            md = consumer.list_topics(name, timeout=10)
            parts += [TopicPartition(name, p, OFFSET_BEGINNING) for p in md.topics[name].partitions]
        consumer.assign(parts)
        seen_ids: set[str] = set()
        seen_runs: set[str] = set()
        started = last_new = time.monotonic()
        settle_until: float | None = None
        while True:
            now = time.monotonic()
            if settle_until is not None and now >= settle_until:
                break
            if now - started > timeout or now - last_new > quiet:
                break
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            last_new = time.monotonic()
            doc = json.loads(msg.value() or b"null")
            if names[str(msg.topic())] == "events":
                out.events.append(doc)
                seen_ids.add(doc["event_id"])
            else:
                out.summaries.append(doc)
                seen_runs.add(doc["run_id"])
            if settle_until is None and seen_ids >= want.event_ids and seen_runs >= want_runs:
                settle_until = time.monotonic() + 2.0
    finally:
        consumer.close()
    out.event_copies = Counter(e["event_id"] for e in out.events)
    out.summary_copies = Counter((s["run_id"], s["outcome"]) for s in out.summaries)
    return out


def check_against_replay(
    got: Outcome, want: Oracle, label: str, worker: WorkerProc | None = None
) -> None:
    dup_events = {i: n for i, n in got.event_copies.items() if n > 1}
    dup_runs = {r: n for r, n in got.summary_copies.items() if n > 1}
    print(
        f"\n[{label}] events: {sum(got.event_copies.values())} records, "
        f"{len(got.event_copies)} distinct ids ({len(want.event_ids)} expected); "
        f"duplicate event ids: {len(dup_events)} "
        f"(extra copies {sum(n - 1 for n in dup_events.values())})"
    )
    for event_id, n in sorted(dup_events.items()):
        print(f"[{label}]   event {event_id} x{n}")
    print(
        f"[{label}] run summaries: {sum(got.summary_copies.values())} records, "
        f"{len(got.summary_copies)} distinct (run, outcome) ({len(want.runs)} expected); "
        f"duplicated summaries: {len(dup_runs)} "
        f"(extra copies {sum(n - 1 for n in dup_runs.values())})"
    )
    for (run_id, outcome), n in sorted(dup_runs.items())[:50]:
        print(f"[{label}]   summary {run_id} {outcome} x{n}")
    problems, differ = want.differences(got.events, got.summaries)
    if problems:
        problems.append(explain(differ[:6], got, want, worker))
    assert not problems, f"[{label}] stream != replay:\n  " + "\n  ".join(problems)


def spans_of(message: bytes) -> list[Any]:
    return [
        sp
        for rs in ExportTraceServiceRequest.FromString(message).resource_spans
        for ss in rs.scope_spans
        for sp in ss.spans
    ]


def steps_on_internal_topic(worker: WorkerProc, run_ids: list[str]) -> dict[str, Counter[str]]:
    """span id -> copies, per run, of the steps the ingest agent forwarded (partition-grouped
    messages on the internal steps topic; ticks skipped)."""
    out: dict[str, Counter[str]] = {r: Counter() for r in run_ids}
    for record in read_to_end(worker.topics["steps"]):
        value = record.value()
        if not value or value[:1] == b"{":
            continue
        for run_id, steps in decode_run_groups(value):
            if run_id in out:
                out[run_id].update(step.span_id for step in steps)
    return out


def unforwarded_input(worker: WorkerProc) -> str:
    """Which input records (partition@offset) have spans that never reached the internal
    steps topic, against the worker group's committed input offsets."""
    forwarded: set[str] = set()
    for record in read_to_end(worker.topics["steps"]):
        value = record.value()
        if value and value[:1] != b"{":
            for _run_id, steps in decode_run_groups(value):
                forwarded.update(step.span_id for step in steps)
    lost: dict[int, list[str]] = defaultdict(list)
    n_input = 0
    for record in read_to_end(worker.topics["input"]):
        n_input += 1
        try:
            ids = [
                sp.span_id.hex()
                for rs in ExportTraceServiceRequest.FromString(record.value()).resource_spans
                for ss in rs.scope_spans
                for sp in ss.spans
            ]
        except Exception:
            continue
        missing = sum(1 for i in ids if i not in forwarded)
        if missing:
            created = time.strftime("%H:%M:%S", time.localtime(record.timestamp()[1] / 1000))
            lost[record.partition()].append(
                f"{record.offset()}({missing}/{len(ids)} spans, produced {created})"
            )
    consumer = reader(worker.app_id)
    try:
        parts = [TopicPartition(worker.topics["input"], p) for p in range(PARTITIONS)]
        committed = {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=10)}
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(worker.topics["input"], p))[1]
            for p in range(PARTITIONS)
        }
    finally:
        consumer.close()
    lines = [f"input: {n_input} records; committed offsets {committed}, end offsets {ends}"]
    for partition, offsets in sorted(lost.items()):
        lines.append(f"  partition {partition}: records not (fully) forwarded: {offsets}")
    return "\n  ".join(lines)


def explain(run_ids: list[str], got: Outcome, want: Oracle, worker: WorkerProc | None) -> str:
    """The replay's and the stream's events and summaries of the runs that differ, what the
    worker's API says about them, and how many of their spans reached the steps topic."""
    lines = []
    forwarded: dict[str, Counter[str]] = {}
    if worker is not None and worker.alive():
        try:
            lines.append(unforwarded_input(worker))
            forwarded = steps_on_internal_topic(worker, run_ids)
        except Exception as exc:  # diagnostics only
            lines.append(f"(steps topic not read: {exc!r})")
    spans_by_run = Counter(sp.trace_id.hex() for m in want.messages for sp in spans_of(m))
    for run_id in run_ids:
        lines.append(f"run {run_id}: {spans_by_run.get(run_id)} spans in the input")
        if run_id in forwarded:
            copies = forwarded[run_id]
            lines.append(
                f"    steps topic: {len(copies)} distinct spans forwarded, "
                f"{sum(copies.values())} copies"
            )
        if worker is not None and worker.alive():
            try:
                status, doc = worker.api(f"/runs/{run_id}")
                state = doc.get("state") or {}
                lines.append(
                    f"    API: found={doc.get('found')} finished={doc.get('finished')} "
                    f"spans={state.get('spans')} pending={state.get('pending')} "
                    f"root_seen={state.get('root_seen')} steps={state.get('steps')}"
                )
            except OSError as exc:
                lines.append(f"    API: {exc!r}")
        lines += want.describe(run_id, got.events, got.summaries)
    return "\n  ".join(lines)


# ---------------------------------------------------------------------------- crash chaos


def test_sigkill_and_broker_restart_keep_findings(
    expected: Oracle, tmp_path_factory: pytest.TempPathFactory
) -> None:
    rng = seeded_rng("chaos")
    workdir = tmp_path_factory.mktemp("chaos-worker")
    worker = WorkerProc(
        workdir,
        chaos_policy(workdir),
        LOOPWATCH_STORE="rocksdb://",
        LOOPWATCH_SESSION_TIMEOUT_SECONDS="6",
        LOOPWATCH_LOG_LEVEL="info",
    )
    # the chaos schedule, in a random order, one action at a random moment while each part
    # of the input (but the last) streams in: single SIGKILLs, SIGKILL crash loops (killed
    # again within half a second of being ready, with the input piling up) and broker
    # restarts
    actions: list[tuple[str, int]] = [("kill", n) for n in KILL_BURSTS]
    actions += [("broker", 1)] * BROKER_RESTARTS
    rng.shuffle(actions)
    if actions[0][1] > 1:  # a crash loop comes once the tables hold state worth recovering
        actions.append(actions.pop(0))
    n_parts = len(actions) + 1
    size = -(-len(expected.messages) // n_parts)
    parts = [expected.messages[i : i + size] for i in range(0, len(expected.messages), size)]
    part_seconds = PRODUCE_SECONDS / n_parts
    journal: list[str] = []
    worker_died_with_broker: list[str] = []
    producers: list[PacedProducer] = []
    redelivered = 0
    t0 = time.monotonic()

    def note(text: str) -> None:
        journal.append(f"{time.monotonic() - t0:6.1f}s {text}")
        print(journal[-1])

    def crash(times: int) -> None:
        for burst in range(times):
            if burst:  # crash loop: killed again right after it came back
                time.sleep(rng.uniform(0.0, 0.5))
            assert worker.alive(), f"worker died on its own:\n{worker.log_tail()}"
            try:
                spans = worker.api("/healthz")[1].get("spans")
            except OSError as exc:
                spans = f"? ({exc})"
            worker.stop(signal.SIGKILL)
            note(f"SIGKILL (spans processed by this process so far: {spans})")
            time.sleep(rng.uniform(0.2, 2.0))
            worker.start()
            worker.wait_ready(120)
            note("worker restarted and ready")

    try:
        create_topics([worker.topics["input"]], PARTITIONS)
        worker.start()
        worker.wait_ready(120)
        note("worker ready")
        for i, part in enumerate(parts):
            action = actions[i] if i < len(actions) else None
            # a crash loop gets its part as a burst: every restart finds a backlog
            seconds = 0.3 if action is not None and action[1] > 1 else part_seconds
            producer = PacedProducer(worker.topics["input"], part, seconds)
            producers.append(producer)
            producer.start()
            note(f"part {i + 1}/{len(parts)}: {len(part)} records over {seconds:.1f} s")
            time.sleep(rng.uniform(0.15, 0.9) * seconds)
            if action is not None and action[0] == "kill":
                crash(action[1])
            elif action is not None and action[0] == "broker":
                down = restart_broker(pause=rng.uniform(0.5, 2.0))
                note(f"broker restarted ({down:.1f} s down)")
                time.sleep(1.0)
                if not worker.alive():
                    worker_died_with_broker.append(worker.log_tail(30))
                    assert worker.proc is not None
                    note(f"worker exited during the broker restart: {worker.proc.returncode}")
                    worker.start()
                worker.wait_ready(120)
                note("worker ready after the broker restart")
            producer.wait(seconds + 240)
            redelivered += producer.redelivered
        note(f"input produced ({redelivered} records produced twice)")
        got = collect(worker, expected, RESULT_TIMEOUT)
        note("outputs collected")
        status, health = worker.api("/healthz")
        print(f"final /healthz: {health}")
        print("crash-like log lines:", *worker.crash_lines()[:20], sep="\n  ")
        check_against_replay(got, expected, "chaos", worker)
        assert not worker_died_with_broker, (
            "the worker exited when the broker restarted (a supervisor restarted it):\n"
            + "\n---\n".join(worker_died_with_broker)
        )
        assert worker.alive()
        assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()
    finally:
        print("schedule:", *journal, sep="\n  ")
        print(f"worker log: {worker.log_path}")
        for producer in producers:
            producer.join(5)
        kafka_sh("start")
        worker.cleanup()


# ---------------------------------------------------------------------------- rebalance


def test_rebalance_join_and_leave_keep_findings(
    expected: Oracle, tmp_path_factory: pytest.TempPathFactory
) -> None:
    rng = seeded_rng("rebalance")
    workdir = tmp_path_factory.mktemp("rebalance-workers")
    policy = chaos_policy(workdir)
    env = {"LOOPWATCH_STORE": "rocksdb://", "LOOPWATCH_SESSION_TIMEOUT_SECONDS": "6"}
    a = WorkerProc(workdir / "a", policy, **env)
    b = WorkerProc(workdir / "b", policy, **env)
    for proc in (a, b):
        proc.workdir.mkdir(parents=True, exist_ok=True)
    # b: the same app (consumer group, tables) and topics as a; its own ports and data dir
    b.env.update({k: v for k, v in a.env.items() if k.startswith("LOOPWATCH_") and "PORT" not in k})
    b.env["LOOPWATCH_DATA_DIR"] = str(b.workdir / "data")
    b.topics, b.app_id = a.topics, a.app_id
    seconds = PRODUCE_SECONDS
    producer: PacedProducer | None = None
    t0 = time.monotonic()
    journal: list[str] = []

    def note(text: str) -> None:
        journal.append(f"{time.monotonic() - t0:6.1f}s {text}")
        print(journal[-1])

    def assigned(worker: WorkerProc) -> list[int]:
        try:
            status, doc = worker.api("/healthz")
        except OSError:  # not listening yet
            return []
        return doc.get("assigned_partitions", []) if status == 200 else []

    try:
        create_topics([a.topics["input"]], PARTITIONS)
        a.start()
        a.wait_ready(120)
        note("a ready")
        producer = PacedProducer(a.topics["input"], expected.messages, seconds)
        producer.start()
        time.sleep(rng.uniform(0.15, 0.3) * seconds)
        b.start()
        note("b joins")
        deadline = time.monotonic() + 90
        while True:  # the rebalance splits the partitions between a and b
            if b.alive() and a.alive():
                pa, pb = assigned(a), assigned(b)
                if pa and pb and sorted(pa + pb) == list(range(PARTITIONS)):
                    break
            assert b.alive(), f"b exited:\n{b.log_tail()}"
            assert time.monotonic() < deadline, f"no split after 90 s: {pa} {pb}"
            time.sleep(0.3)
        note(f"split: a {pa}, b {pb}")
        time.sleep(rng.uniform(0.1, 0.25) * seconds)
        assert a.stop(signal.SIGTERM) == 0, a.log_tail()
        note("a left (SIGTERM)")
        deadline = time.monotonic() + 90
        while sorted(assigned(b)) != list(range(PARTITIONS)):
            assert time.monotonic() < deadline, f"b did not take over: {assigned(b)}"
            time.sleep(0.3)
        note("b owns every partition")
        producer.wait(seconds + 240)
        note("input produced")
        got = collect(b, expected, RESULT_TIMEOUT)
        note("outputs collected")
        check_against_replay(got, expected, "rebalance", b)
        assert b.stop(signal.SIGTERM) == 0, b.log_tail()
    finally:
        print("schedule:", *journal, sep="\n  ")
        if producer is not None and producer.is_alive():
            producer.join(5)
        if b.alive():
            b.stop(signal.SIGKILL)
        a.cleanup()
