"""End to end through the real broker: worker throughput and latency, the bare
consume+decode ceiling of the same topic, worker memory, and 1 vs 2 workers.

Each measurement gets its own topics and app id (tests/integration/worker_support.py);
the worker runs as `loopwatch worker` in a subprocess with the production store
(rocksdb) unless said otherwise.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from confluent_kafka import Consumer, Producer, TopicPartition
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.corpus import export_messages
from bench.replay_bench import policy_without_sketches, replay_engine
from detectors.fingerprint import Fingerprinter
from detectors.policy import load_policy
from streams.cli.produce import split_by_trace
from streams.replay.runs import Replay
from streams.spanpath.otlp import decode_proto
from tests.support.kafka import admin_client, bootstrap, create_topics, delete_topics
from tests.support.worker_proc import EXAMPLE_POLICY, FINGERPRINT_KEY, WorkerProc

PARTITIONS = 4


def _worker(workdir: Path, **env: str) -> WorkerProc:
    return _worker_under(EXAMPLE_POLICY, workdir, env)


def _worker_under(policy: Path, workdir: Path, env: dict[str, str]) -> WorkerProc:
    # BENCH_WORKER_ENV="LOOPWATCH_X=1,LOOPWATCH_Y=2": settings to try (the worker is given
    # no LOOPWATCH_ variable of this process)
    tried = dict(
        pair.split("=", 1) for pair in os.environ.get("BENCH_WORKER_ENV", "").split(",") if pair
    )
    # (a setting tried may replace these defaults: LOOPWATCH_LOG_LEVEL=info for a probe)
    defaults = {"LOOPWATCH_STORE": "rocksdb://", "LOOPWATCH_LOG_LEVEL": "warning"}
    return WorkerProc(workdir, policy, **{**defaults, **tried, **env})


def _produce(
    topic: str,
    messages: list[bytes],
    rate_spans: float | None = None,
    spans_per_msg: list[int] | None = None,
    keys: list[bytes] | None = None,
) -> list[float]:
    """Produce messages (unkeyed, as the collector's default, unless `keys`); returns each
    send's wall time. With `rate_spans`, pace sends to that many spans per second."""
    producer = Producer(
        {"bootstrap.servers": bootstrap(), "linger.ms": 5, "log_level": 0, "acks": "all"}
    )
    sent: list[float] = []
    started = time.perf_counter()
    spans_so_far = 0
    for i, message in enumerate(messages):
        if rate_spans and spans_per_msg:
            due = started + spans_so_far / rate_spans
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            spans_so_far += spans_per_msg[i]
        sent.append(time.time())
        producer.produce(topic, value=message, key=keys[i] if keys else None)
        producer.poll(0)
    producer.flush(60)
    return sent


def _produce_elsewhere(
    topic: str,
    messages: list[bytes],
    rate_spans: float,
    spans_per_msg: list[int],
    keys: list[bytes] | None,
) -> list[float]:
    """`_produce` in a process of its own (spawned: librdkafka is not fork-safe); the send
    times come back through a pipe."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=_produce_to,
        args=(send, topic, messages, rate_spans, spans_per_msg, keys),
        name="bench-producer",
    )
    process.start()
    send.close()
    sent = cast(list[float], receive.recv())
    process.join(60)
    return sent


def _produce_to(
    conn: Any,
    topic: str,
    messages: list[bytes],
    rate_spans: float,
    spans_per_msg: list[int],
    keys: list[bytes] | None,
) -> None:
    conn.send(_produce(topic, messages, rate_spans, spans_per_msg, keys))
    conn.close()


class MachineLoad:
    """What else the machine did meanwhile: the load average at the end, and the share of
    CPU time stolen by the hypervisor and spent idle (from /proc/stat)."""

    def __init__(self) -> None:
        self.start = self._cpu()

    @staticmethod
    def _cpu() -> list[int]:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
            return [int(x) for x in fields]
        except (OSError, ValueError, IndexError):
            return []

    def since(self) -> dict[str, float]:
        end = self._cpu()
        if not self.start or len(end) < 8:
            return {}
        delta = [b - a for a, b in zip(self.start, end, strict=False)]
        total = sum(delta[:8]) or 1
        try:
            load1 = float(Path("/proc/loadavg").read_text().split()[0])
        except (OSError, ValueError):
            load1 = float("nan")
        return {
            "load1": load1,
            "steal_pct": round(100 * delta[7] / total, 2),
            "idle_pct": round(100 * (delta[3] + delta[4]) / total, 2),
        }


def stage_quantiles(
    text: str, before: dict[str, dict[float, float]] | None = None
) -> dict[str, dict[str, float]]:
    """The worker's stage histograms since `before` -> count, p50 and p99 (the upper bound
    of the bucket each falls in)."""
    buckets = stage_buckets(text)
    out: dict[str, dict[str, float]] = {}
    for stage, counts in buckets.items():
        earlier = (before or {}).get(stage, {})
        rows = sorted((le, n - earlier.get(le, 0.0)) for le, n in counts.items())
        total = rows[-1][1]
        if not total:
            continue

        def q(p: float, rows: list[tuple[float, float]] = rows, total: float = total) -> float:
            return next(bound for bound, n in rows if n >= p * total)

        out[stage] = {"count": total, "p50_le": q(0.5), "p99_le": q(0.99)}
    return out


def stage_buckets(text: str) -> dict[str, dict[float, float]]:
    """loopwatch_stage_seconds by stage, and loopwatch_processing_latency_seconds as
    `to_detect` (an input record's timestamp to detect handling its steps): stage ->
    bucket bound -> cumulative count."""
    buckets: dict[str, dict[float, float]] = {}
    for line in text.splitlines():
        if line.startswith("loopwatch_stage_seconds_bucket{"):
            labels, value = line[len("loopwatch_stage_seconds_bucket{") :].split("} ")
            fields = dict(kv.split("=", 1) for kv in labels.split(","))
            stage = fields["stage"].strip('"')
        elif line.startswith("loopwatch_processing_latency_seconds_bucket{"):
            labels, value = line[len("loopwatch_processing_latency_seconds_bucket{") :].split("} ")
            fields = dict(kv.split("=", 1) for kv in labels.split(","))
            stage = "to_detect"
        else:
            continue
        bound = fields["le"].strip('"')
        buckets.setdefault(stage, {})[float(bound)] = float(value)
    return buckets


def latency_rounds(rate_spans: float, seconds: float, rounds: int) -> dict[str, Any]:
    """`latency` unkeyed and keyed, alternating, `rounds` times each: min / median / max of
    each round's p50 and p99 (one run moves with whatever else the 2 cores do)."""
    runs: dict[str, list[dict[str, Any]]] = {"unkeyed": [], "keyed": []}
    for _ in range(rounds):
        runs["unkeyed"].append(latency(rate_spans, seconds))
        runs["keyed"].append(latency(rate_spans, seconds, keyed=True))
    out: dict[str, Any] = {"rounds": rounds, "offered_spans_per_s": rate_spans}
    for name, done in runs.items():
        summary: dict[str, Any] = {"runs": done}
        for stat in ("p50_s", "p99_s"):
            values = sorted(r[stat] for r in done)
            summary[stat] = {
                "min": values[0],
                "median": statistics.median(values),
                "max": values[-1],
            }
        summary["replay_events_missing"] = max(r["replay_events_missing"] for r in done)
        summary["expected_events"] = done[0]["expected_events"]
        summary["steal_pct_max"] = max(r["machine"].get("steal_pct", 0.0) for r in done)
        summary["load1_max"] = max(r["machine"].get("load1", 0.0) for r in done)
        out[name] = summary
    return out


def _replay_expectation(messages: list[bytes]) -> tuple[set[str], dict[str, int], list[int]]:
    """Event ids the replay finds on these messages, span id -> message index, spans/message."""
    events: list[dict[str, Any]] = []
    replay = Replay(
        load_policy(EXAMPLE_POLICY), Fingerprinter(FINGERPRINT_KEY.encode()), events.append
    )
    where: dict[str, int] = {}
    counts: list[int] = []
    for i, message in enumerate(messages):
        spans = decode_proto(message)
        counts.append(len(spans))
        for span in spans:
            where[span.span_id] = i
        replay.feed(spans)
    replay.close()
    return {e["event_id"] for e in events}, where, counts


def replay_rate(messages: list[bytes], rounds: int = 3) -> float:
    """spans/s of `loopwatch replay`'s engine over exactly these messages (best of
    `rounds`, as bench/replay_bench.py measures its corpus): the worker's same-corpus
    reference. Corpora differ in what a span costs to detect (runs interleaved per request,
    runs per message), so the worker/replay ratio is taken over the worker's own input."""
    replay_engine(messages[:20], str(EXAMPLE_POLICY))
    best = float("inf")
    spans = 0
    for _ in range(rounds):
        spans, seconds, _replay = replay_engine(messages, str(EXAMPLE_POLICY))
        best = min(best, seconds)
    return spans / best


def _wait_health(worker: WorkerProc, key: str, value: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, doc = worker.api("/healthz")
        if status == 200 and doc.get(key, 0) >= value:
            return time.time()
        time.sleep(0.05)
    raise RuntimeError(
        f"worker did not reach {key} >= {value} within {timeout} s: {worker.log_tail(10)}"
    )


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu_s(pid: int) -> float:
    """utime + stime of a process in seconds: the worker's own CPU, which moves less than
    wall-clock rates when other processes share the cores."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bare_consume_decode(topic: str, n_messages: int) -> float:
    """spans/s of a plain confluent-kafka consumer + decode_proto over the same topic."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap(),
            "group.id": f"bench-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "log_level": 0,
        }
    )
    md = consumer.list_topics(topic, timeout=10)
    consumer.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])
    spans = got = 0
    started = 0.0  # from the first record: connection and group setup are not throughput
    while got < n_messages:
        for msg in consumer.consume(500, 1.0):
            value = msg.value()
            if msg.error() or value is None:
                continue
            if not got:
                started = time.perf_counter()
            got += 1
            for span in decode_proto(value):
                spans += 1
                for _v in span.attributes.values():
                    pass
    elapsed = time.perf_counter() - started
    consumer.close()
    return spans / elapsed


def faust_floor(proc: WorkerProc, topic: str, n_records: int, timeout: float = 180.0) -> float:
    """Records/s of bench/faust_floor.py's counting agent over `topic`, with `proc`'s
    settings: faust's own cost, under any worker built on its stream."""
    floor = subprocess.Popen(
        [sys.executable, "-m", "bench.faust_floor", topic, str(n_records)],
        cwd=proc.env["PYTHONPATH"],
        env=proc.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert floor.stdout is not None
        line = _read_line(floor.stdout, timeout)
        if line is None:
            raise RuntimeError(f"faust floor: no result within {timeout} s")
        doc = json.loads(line)
        return float(doc["records"]) / float(doc["seconds"])
    finally:
        floor.kill()
        floor.wait(10)
        leader = f"{proc.app_id}-floor-__assignor-__leader"
        if leader in admin_client().list_topics(timeout=10).topics:
            delete_topics([leader])


def _read_line(stream: Any, timeout: float) -> bytes | None:
    """The JSON object on the first line of `stream` that holds one (faust's terminal
    handling may print before it, on the same line)."""
    got: list[bytes] = []

    def read() -> None:
        for line in iter(stream.readline, b""):
            at = line.find(b'{"')
            if at >= 0:
                got.append(line[at:])
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else None


def keyed_by_trace(messages: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """The messages as the Collector's kafkaexporter sends them with partition_traces_by_id:
    one record per (resource, scope, trace), keyed by the hex trace id."""
    keys: list[bytes] = []
    values: list[bytes] = []
    for message in messages:
        for key, piece in split_by_trace(ExportTraceServiceRequest.FromString(message)):
            keys.append(key)
            values.append(piece.SerializeToString())
    return keys, values


def throughput(
    total_spans: int, workers: int = 1, keyed: bool = False, sketches: bool = True
) -> dict[str, Any]:
    """Pre-produce the corpus, start the worker(s), time until every record is processed.
    `keyed`: records split and keyed by trace id, worker in keyed mode (no hop).
    `sketches=False`: the example policy with `similarity: false`."""
    past = time.time_ns() - 3_600_000_000_000  # an hour ago: no waiting on allowed lateness
    messages = list(export_messages(total_spans, seed=21, base_ns=past, run_spacing_ns=50_000_000))
    expected_ids, _, counts = _replay_expectation(messages)
    replay = replay_rate(messages)  # the export requests, as a replay reads them from files
    expected_events = len(expected_ids)
    keys: list[bytes] | None = None
    if keyed:
        keys, messages = keyed_by_trace(messages)
    mode = {"LOOPWATCH_INPUT_KEYED_BY_RUN": "true"} if keyed else {}
    with tempfile.TemporaryDirectory() as tmp:
        policy = EXAMPLE_POLICY
        if not sketches:
            policy = policy_without_sketches(EXAMPLE_POLICY, Path(tmp) / "no-sketches.yaml")
        first = _worker_under(policy, Path(tmp) / "w0", mode)
        # the others: same app, topics and group as the first
        procs = [first] + [first.sibling(Path(tmp) / f"w{i}") for i in range(1, workers)]
        for proc in procs:
            proc.workdir.mkdir(parents=True, exist_ok=True)
        create_topics([procs[0].topics["input"]], PARTITIONS)
        _produce(procs[0].topics["input"], messages, keys=keys)
        try:
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.wait_ready(120)
            # the first record any worker takes: a worker that joins late may find the
            # backlog of its partitions already taken (fast workers, small corpora)
            started = _wait_all(procs, "spans", 1, 120)
            cpu_started = sum(_cpu_s(p.proc.pid) for p in procs if p.proc)
            done = _wait_all(procs, "records", len(messages), 600)
            events_done = _replay_events_out(procs[0], expected_ids, 120)
            cpu = sum(_cpu_s(p.proc.pid) for p in procs if p.proc) - cpu_started
            rss = [round(_rss_mib(p.proc.pid), 1) for p in procs if p.proc]
            ceiling = bare_consume_decode(procs[0].topics["input"], len(messages))
            floor_records = (
                faust_floor(procs[0], procs[0].topics["input"], len(messages)) if keyed else None
            )
        finally:
            for proc in procs:
                proc.cleanup()
    spans = sum(counts)
    return {
        "workers": workers,
        "keyed": keyed,
        "sketches": sketches,
        "spans": spans,
        "records": len(messages),
        "worker_spans_per_s": spans / (max(done, events_done) - started),
        "worker_cpu_us_per_span": cpu * 1e6 / spans,
        "bare_consume_decode_spans_per_s": ceiling,
        "replay_same_corpus_spans_per_s": replay,
        # records/s -> spans/s at this corpus' spans per record
        "faust_floor_spans_per_s": (
            floor_records * spans / len(messages) if floor_records is not None else None
        ),
        "expected_events": expected_events,
        "rss_mib": rss,
    }


def best_of_rounds(
    rounds: int, kinds: dict[str, dict[str, Any]], total_spans: int
) -> dict[str, dict[str, Any]]:
    """`throughput` for each kind (its keyword arguments), in `rounds` alternating rounds:
    per kind the round with the most worker spans/s, its bare consume+decode rate the best
    of the rounds (a ceiling, as the replay's), and every round's rate."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in kinds}
    for _ in range(max(1, rounds)):
        for name, kwargs in kinds.items():
            runs[name].append(throughput(total_spans, **kwargs))
    out = {}
    for name, got in runs.items():
        best = dict(max(got, key=lambda r: r["worker_spans_per_s"]))
        best["bare_consume_decode_spans_per_s"] = max(
            r["bare_consume_decode_spans_per_s"] for r in got
        )
        best["replay_same_corpus_spans_per_s"] = max(
            r["replay_same_corpus_spans_per_s"] for r in got
        )
        floors = [r["faust_floor_spans_per_s"] for r in got if r["faust_floor_spans_per_s"]]
        best["faust_floor_spans_per_s"] = max(floors) if floors else None
        best["rounds_spans_per_s"] = [r["worker_spans_per_s"] for r in got]
        best["rounds_cpu_us_per_span"] = [r["worker_cpu_us_per_span"] for r in got]
        out[name] = best
    return out


def _all_out(expected_ids: set[str]) -> Callable[[list[Any]], bool]:
    """For WorkerProc.read: whether these event records hold every one of `expected_ids`."""

    def check(records: list[Any]) -> bool:
        return expected_ids <= {json.loads(r.value())["event_id"] for r in records}

    return check


def _replay_events_out(proc: WorkerProc, expected_ids: set[str], timeout: float) -> float:
    """When the last of the replay's events was first published (its record's timestamp),
    read from the events topic. Counting the workers' `events` instead overstated two
    workers' rate: after a rebalance both publish copies of some events (at least once),
    and the sum reached the replay's count before the last distinct one was out."""
    first: dict[str, float] = {}
    for record in proc.read("events", until=_all_out(expected_ids), timeout=timeout):
        event_id = json.loads(record.value())["event_id"]
        if event_id in expected_ids and event_id not in first:
            first[event_id] = record.timestamp()[1] / 1000
    missing = len(expected_ids) - len(first)
    if missing:
        raise RuntimeError(f"{missing} of the replay's {len(expected_ids)} events not published")
    return max(first.values())


def _wait_all(procs: list[WorkerProc], key: str, value: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        total = 0
        for proc in procs:
            status, doc = proc.api("/healthz")
            total += doc.get(key, 0) if status == 200 else 0
        if total >= value:
            return time.time()
        time.sleep(0.05)
    seen = []
    for proc in procs:
        status, doc = proc.api("/healthz")
        counts = {k: doc.get(k) for k in ("records", "spans", "events", "runs_finished")}
        seen.append(f"{proc.app_id} {status} {counts}\n{proc.log_tail(15)}")
    raise RuntimeError(
        f"workers did not reach {key} >= {value} within {timeout} s:\n" + "\n".join(seen)
    )


def latency(
    rate_spans: float, seconds: float, keyed: bool = False, workers: int = 1
) -> dict[str, Any]:
    """Offer `rate_spans` spans/s of live traffic; detection latency = loop_detected record
    timestamp minus the send time of the record holding the trigger span. `keyed`: records
    split and keyed by trace id, worker in keyed mode (no hop). `workers` > 1: more
    workers of the same group, started and sharing the partitions before the load (the
    stages are the first worker's)."""
    total = int(rate_spans * seconds)
    now = time.time_ns()
    messages = list(
        export_messages(total, seed=33, base_ns=now, run_spacing_ns=int(1e9 * 20 / rate_spans * 10))
    )
    keys: list[bytes] | None = None
    if keyed:
        keys, messages = keyed_by_trace(messages)
    expected_ids, where, counts = _replay_expectation(messages)
    latencies: list[float] = []  # events the replay finds too
    all_latencies: list[float] = []  # every distinct event
    published: set[str] = set()
    by_shape: dict[str, list[float]] = {}
    copies = 0
    with tempfile.TemporaryDirectory() as tmp:
        mode = {"LOOPWATCH_INPUT_KEYED_BY_RUN": "true"} if keyed else {}
        worker = _worker(Path(tmp), **mode)
        siblings = [worker.sibling(Path(tmp) / f"w{i}") for i in range(1, workers)]
        try:
            for proc in [worker, *siblings]:
                proc.workdir.mkdir(parents=True, exist_ok=True)
                proc.start()
            for proc in [worker, *siblings]:
                proc.wait_ready(120)
            deadline = time.monotonic() + 120  # every worker a member with partitions
            while not all(
                p.wait_ready(120).get("assigned_partitions") for p in [worker, *siblings]
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the workers never shared the partitions")
                time.sleep(0.5)
            # the load comes from a process of its own: as a thread of this one it competed
            # with the bench's reader for the GIL and its pacing slipped (issue 39)
            before = stage_buckets(worker.metrics_text())
            machine = MachineLoad()
            sent = _produce_elsewhere(worker.topics["input"], messages, rate_spans, counts, keys)
            machine_during = machine.since()

            records = worker.read("events", until=_all_out(expected_ids), timeout=120)
            for record in records:
                event = json.loads(record.value())
                if event["event_id"] in published:
                    copies += 1  # an at-least-once copy, not a new detection
                    continue
                published.add(event["event_id"])
                index = where.get(event["trigger_span_id"])
                if index is None:
                    continue
                _kind, ts_ms = record.timestamp()
                all_latencies.append(ts_ms / 1000 - sent[index])
                # Events the replay of the same corpus does not find come from spans that
                # arrived after the allowed lateness (the producer fell behind its pacing);
                # reported apart (p99_all_events_s), measured fast so far.
                if event["event_id"] in expected_ids:
                    latencies.append(all_latencies[-1])
                    by_shape.setdefault(event["shape"], []).append(all_latencies[-1])
            stages = stage_quantiles(worker.metrics_text(), before)
        finally:
            for proc in [*siblings, worker]:
                proc.cleanup()
    latencies.sort()
    all_latencies.sort()

    def pct(p: float, values: list[float] = latencies) -> float:
        return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")

    return {
        "offered_spans_per_s": rate_spans,
        "keyed": keyed,
        "machine": machine_during,
        "events": len(latencies),
        "expected_events": len(expected_ids),
        "events_not_in_replay": len(published - expected_ids),
        "replay_events_missing": len(expected_ids - published),
        "copies_skipped": copies,
        "p99_all_events_s": pct(0.99, all_latencies),
        "p50_s": pct(0.50),
        "p99_s": pct(0.99),
        "mean_s": statistics.fmean(latencies) if latencies else float("nan"),
        "stages": stages,
        "by_shape": {  # events, median and max latency (s)
            shape: [len(xs), statistics.median(xs), max(xs)] for shape, xs in by_shape.items()
        },
    }


# Half the first checkpoint: with at most two chunks in flight, the first checkpoint has
# seen the stream's steady concurrency. With chunks of 10k the 10k figure came from one chunk
# alone, half the runs in flight of every later one (10,000 run deadlines live at its peak
# against 20,000 after), so it measured a lighter load, not less history (issue 39).
_MEMORY_CHUNK = 5_000


def memory(runs_checkpoints: tuple[int, ...], **env: str) -> dict[str, Any]:
    """Worker RSS after N tiny finished runs (root + one tool span each) passed through.

    Runs arrive in chunks of 5k, a chunk produced once the one before the previous is
    processed (a steady stream at the worker's capacity, not one burst whose output backlog
    would be measured instead); RSS is read after the outputs are flushed (5 s settle)."""
    out: dict[str, float] = {}
    store: dict[str, dict[str, float]] = {}  # rocksdb memory by holder (MiB), per checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        worker = _worker(Path(tmp), LOOPWATCH_FINISHED_TTL_SECONDS="60", **env)
        worker.workdir.mkdir(parents=True, exist_ok=True)
        try:
            worker.start()
            worker.wait_ready(120)
            sent = 0
            for target in runs_checkpoints:
                while sent < target:
                    # at most two chunks in flight: the worker never idles on a grace period
                    _wait_health(worker, "runs_finished", max(0, sent - _MEMORY_CHUNK), 1800)
                    step = min(_MEMORY_CHUNK, target - sent)
                    _produce(worker.topics["input"], _tiny_runs(sent, step))
                    sent += step
                _wait_health(worker, "runs_finished", target, 1800)
                time.sleep(5)
                out[str(target)] = round(_rss_mib(worker.proc.pid), 1) if worker.proc else 0.0
                held = worker.api("/healthz")[1].get("store_memory_bytes") or {}
                store[str(target)] = {k: round(v / 2**20, 1) for k, v in held.items()}
        finally:
            worker.cleanup()
    return {"rss_mib_after_runs": out, "store_memory_mib": store, "env": env}


def memory_rounds(runs_checkpoints: tuple[int, ...], rounds: int, **env: str) -> dict[str, Any]:
    """`memory` `rounds` times, a worker each: min / median / max RSS per checkpoint, and
    each checkpoint's median against the first's."""
    done = [memory(runs_checkpoints, **env) for _ in range(rounds)]
    rss: dict[str, dict[str, float]] = {}
    for checkpoint in done[0]["rss_mib_after_runs"]:
        values = sorted(r["rss_mib_after_runs"][checkpoint] for r in done)
        rss[checkpoint] = {
            "min": values[0],
            "median": statistics.median(values),
            "max": values[-1],
        }
    first = next(iter(rss.values()))["median"]
    return {
        "rounds": rounds,
        "rss_mib": rss,
        "against_first": {k: round(v["median"] / first, 3) for k, v in rss.items()},
        "runs": done,
    }


_RUNS_PER_RECORD = 200


def _tiny_runs(first: int, count: int) -> list[bytes]:
    from bench.corpus import _kv

    past = time.time_ns() - 3_600_000_000_000
    out: list[bytes] = []
    for start in range(first, first + count, _RUNS_PER_RECORD):
        request = ExportTraceServiceRequest()
        scope = request.resource_spans.add().scope_spans.add()
        for n in range(start, min(start + _RUNS_PER_RECORD, first + count)):
            trace = (n + 1).to_bytes(16, "big")  # an all-zero trace id is invalid OTLP
            root = (n * 2 + 1).to_bytes(8, "big")
            t = past + n * 1_000_000
            scope.spans.add(
                trace_id=trace,
                span_id=(n * 2 + 2).to_bytes(8, "big"),
                parent_span_id=root,
                name="execute_tool lookup_order",
                start_time_unix_nano=t,
                end_time_unix_nano=t + 1000,
                attributes=[
                    _kv("gen_ai.operation.name", "execute_tool"),
                    _kv("gen_ai.tool.name", "lookup_order"),
                ],
            )
            scope.spans.add(
                trace_id=trace,
                span_id=root,
                name="invoke_agent support",
                start_time_unix_nano=t,
                end_time_unix_nano=t + 2000,
                attributes=[_kv("gen_ai.operation.name", "invoke_agent")],
            )
        out.append(request.SerializeToString())
    return out


def holds_api(n_holds: int = 1000, requests: int = 200) -> dict[str, Any]:
    """GET /holds answer time on a worker holding `n_holds` active holds (placed through
    POST /holds): a full answer (200) and an unchanged set (If-None-Match: 304, what the
    guards mostly get), median and p99 over `requests` each, from this process."""
    import json as _json
    import statistics
    import tempfile
    import time as _time
    import urllib.error
    import urllib.request

    token = "bench-holds-token"
    with tempfile.TemporaryDirectory(prefix="lw-holds-") as tmp:
        proc = _worker(Path(tmp), LOOPWATCH_API_TOKEN=token)
        try:
            proc.start()
            proc.wait_ready()
            base = f"http://127.0.0.1:{proc.web_port}/holds"
            auth = {"Authorization": f"Bearer {token}"}
            for i in range(n_holds):
                body = {"scope": {"tool": f"tool-{i % 50}", "prompt_version": f"v{i}"},
                        "reason": "bench", "by": "bench"}  # fmt: skip
                req = urllib.request.Request(
                    base, data=_json.dumps(body).encode(), method="POST",
                    headers={**auth, "Content-Type": "application/json"},
                )  # fmt: skip
                urllib.request.urlopen(req, timeout=30).read()

            def timed(headers: dict[str, str]) -> tuple[float, int, str | None]:
                req = urllib.request.Request(base, headers={**auth, **headers})
                t0 = _time.perf_counter()
                try:
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        resp.read()
                        status, etag = resp.status, resp.headers.get("ETag")
                except urllib.error.HTTPError as exc:
                    status, etag = exc.code, exc.headers.get("ETag")
                return (_time.perf_counter() - t0) * 1000, status, etag

            _ms, status, etag = timed({})
            assert status == 200 and etag, status
            full = [timed({})[0] for _ in range(requests)]
            same = [timed({"If-None-Match": etag})[0] for _ in range(requests)]
            assert timed({"If-None-Match": etag})[1] == 304

            def pct(xs: list[float], q: float) -> float:
                return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

            return {
                "holds": n_holds,
                "full_ms_median": statistics.median(full),
                "full_ms_p99": pct(full, 0.99),
                "not_modified_ms_median": statistics.median(same),
                "not_modified_ms_p99": pct(same, 0.99),
            }
        finally:
            proc.cleanup()


def _latency_main() -> None:
    """`python -m bench.e2e_bench [rounds] [seconds] [rate]`: the latency rounds alone, as
    `make bench` runs them (a worker per run, the load from a process of its own)."""
    rounds, seconds, rate = (sys.argv[1:] + ["3", "20", "10000"][len(sys.argv) - 1 :])[:3]
    done = latency_rounds(float(rate), float(seconds), int(rounds))
    for name in ("unkeyed", "keyed"):
        lat = done[name]
        print(
            f"{name:8} p50 {lat['p50_s']['median'] * 1000:6.0f} ms "
            f"({lat['p50_s']['min'] * 1000:.0f}-{lat['p50_s']['max'] * 1000:.0f})  "
            f"p99 {lat['p99_s']['median'] * 1000:6.0f} ms "
            f"({lat['p99_s']['min'] * 1000:.0f}-{lat['p99_s']['max'] * 1000:.0f})  "
            f"missing {lat['replay_events_missing']}/{lat['expected_events']}  "
            f"steal <= {lat['steal_pct_max']:.1f}%  load1 <= {lat['load1_max']:.1f}"
        )


if __name__ == "__main__":
    _latency_main()
