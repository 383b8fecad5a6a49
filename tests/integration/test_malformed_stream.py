"""Malformed input through `loopwatch worker` (real broker, protobuf input, the hop).

Bad records are interleaved with a good stream (the bench corpus, timestamps an hour in the
past, plus every example export). What a bad record must do depends on whether the OTLP
decoder accepts it, so every bad record is classified up front by `decode_record` (the
worker's own decoder, unit-tested separately) and each category is checked to land in the
class it was built for:

* **undecodable** (expected: one dead letter each, header ``reason=decode_error``, its
  ``source_partition``/``source_offset`` pointing at the record, nothing else happens):
  truncated protobuf, random bytes, OTLP JSON sent as otlp_proto, invalid UTF-8 in string
  fields, ~900 KB garbage, missing trace/span ids, ids of the wrong length, all-zero ids,
  AnyValue nesting beyond the decoder's depth limit, profiles-only ``string_value_strindex``
  values, null (tombstone) values; some of them with binary (non-UTF-8) keys.
* **decodable but absurd** (expected: no dead letter, no crash, and no effect on any other
  run; they form their own "decoy" runs, whose findings are not checked): start > end,
  zero timestamps, ``2**64-1`` ns timestamps (fixed64 cannot be negative, and year 9999 is
  beyond it), deeply nested JSON text (500 to 50 000 levels) as tool arguments, results,
  LLM output messages, plan steps or root output, ~900 KB valid records, AnyValue nesting
  just inside the depth limit, empty values and empty requests
  (a valid ExportTraceServiceRequest with no spans), attribute values of odd types
  (negative and 2**63-1 token counts, negative sequence numbers, bytes, NaN, kvlists).

Checks: every undecodable record is dead-lettered exactly once with a reason (counted by
reason and by category, printed) and no other record is; every good run's events and
summaries equal the replay of the good records only (`streams.replay.engine.Engine`, each
example file replayed on its own, as `loopwatch replay` of that file); no event or summary
names a run outside the good and decoy runs; `/healthz` answers ``status: ok`` (and
``ready``) on every poll (every 0.25 s) from start to end, its ``uptime_seconds`` never goes
back, and the worker process is the one that was started (no restart, no crashed agent in
its log); the dead-letter metric and the ``records``/``dead_letters`` counters match.

The workers' policy adds only stream timing, with a generous 15 s finalization grace: with
900 KB records and deep JSON on some input partitions, the records of one run on different
partitions are taken seconds apart, and the worker finalizes a run `finalize_grace_seconds`
of wall time after its root arrived even while its other spans still wait in another
input partition's backlog (a known limitation, not what this file tests).

Sizes: the CI variant sends 10 000 bad records (~8 000 undecodable) among ~100 good ones
(~12k spans, 13 example files); the long variant (``LOOPWATCH_CHAOS_LONG=1``, `make chaos`)
sends 30 000 among ~40k good spans.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from streams.errors import DecodeError
from streams.spanpath.otlp import decode_record
from streams.spanpath.spans import STATUS_ERROR, SpanEvent
from tests.integration.worker_support import LONG, Oracle, headers_of, rooted_corpus, values
from tests.otlp_build import encode_request, example_files, file_messages, to_json
from tests.spankit import Run
from tests.support.kafka import require_broker
from tests.support.worker_proc import WorkerProc, write_policy

pytestmark = pytest.mark.kafka

N_BAD = 30_000 if LONG else 10_000
GOOD_SPANS = 40_000 if LONG else 12_000
N_HUGE = 8 if LONG else 4  # of each huge kind (~900 KB records)
TIMEOUT = 240.0 if LONG else 120.0
U64 = (1 << 64) - 1


# ---------------------------------------------------------------------------- good input


def good_input() -> Oracle:
    """The bench corpus and every example file, each file replayed on its own (as
    `loopwatch replay` of that file)."""
    groups = [rooted_corpus(GOOD_SPANS, seed=4242)]
    groups += [list(file_messages(f)) for f in example_files()]
    good = Oracle.of(groups)
    assert len(good.event_ids) >= 30 and len(good.runs) >= 300
    return good


# ---------------------------------------------------------------------------- bad input


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if not n:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def _ld(field_no: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(field_no << 3 | 2) + _varint(len(payload)) + payload


@dataclass
class Bad:
    category: str
    key: bytes | None
    value: bytes | None
    dead: bool  # the decoder rejects it: a dead letter is expected
    runs: set[str] = field(default_factory=set)  # decoy run ids (decodable ones)


class BadFactory:
    """Builds bad records; decoy runs get trace ids no good run uses."""

    def __init__(self, rng: random.Random, taken: set[str]) -> None:
        self.rng = rng
        self.taken = taken
        self.next_trace = 5_000_000  # spankit clocks: trace * 1000 s, must fit fixed64

    def run(self, steps: int = 2, root: bool = True) -> Run:
        self.next_trace += 1
        run = Run(trace=self.next_trace)
        assert run.trace_id not in self.taken
        for i in range(steps):
            run.llm(100 + i, 10)
            run.tool("lookup_order", {"order_id": f"D{i % 2}"}, {"status": "pending"})
        if root:
            run.root()
        return run

    def small(self) -> bytes:
        return encode_request(self.run().spans)

    def span_bytes(self, run: Run) -> bytes:
        """The first span of `run`, serialized alone (to splice raw fields onto it)."""
        req = ExportTraceServiceRequest.FromString(encode_request(run.spans[:1]))
        return bytes(req.resource_spans[0].scope_spans[0].spans[0].SerializeToString())

    @staticmethod
    def wrap_span(span: bytes) -> bytes:
        # ExportTraceServiceRequest.resource_spans(1) > ScopeSpans(2) > spans(2)
        return _ld(1, _ld(2, _ld(2, span)))

    # -- undecodable

    def truncated(self) -> bytes:
        data = self.small()
        while True:
            cut = data[: self.rng.randrange(1, len(data))]
            if not _decodes(cut):
                return cut

    def random_bytes(self, lo: int = 1, hi: int = 3000) -> bytes:
        while True:
            data = self.rng.randbytes(self.rng.randint(lo, hi))
            if not _decodes(data):
                return data

    def json_as_proto(self) -> bytes:
        return to_json(self.small())

    def non_utf8(self) -> bytes:
        run = self.run(1)
        marker = "UTF8HOLE"
        where = self.rng.choice(("name", "attr", "status", "resource", "event"))
        span = run.spans[1]
        if where == "name":
            span.name = f"execute_tool {marker}"
        elif where == "attr":
            span.attributes["gen_ai.tool.call.arguments"] = f'{{"q": "{marker}"}}'
        elif where == "status":
            span.status_code, span.status_message = STATUS_ERROR, marker
        elif where == "resource":
            run.resource["customer.tier"] = marker
        else:
            span.events.append(SpanEvent("exception", span.end_ns, {"exception.message": marker}))
        data = encode_request(run.spans)
        assert marker.encode() in data
        return data.replace(marker.encode(), b"\xff\xfe\xc3\x28\xa0\xa1\xe2\x28")

    def huge_garbage(self) -> bytes:
        return self.random_bytes(880_000, 920_000)

    def bad_ids(self) -> bytes:
        run = self.run(1)
        req = ExportTraceServiceRequest.FromString(encode_request(run.spans))
        span = req.resource_spans[0].scope_spans[0].spans[-1]
        kind = self.rng.choice(
            (
                "no_trace",
                "no_span",
                "trace6",
                "trace17",
                "span4",
                "span9",
                "parent3",
                "zero_trace",
                "zero_span",
            )
        )
        if kind == "no_trace":
            span.trace_id = b""
        elif kind == "no_span":
            span.span_id = b""
        elif kind == "trace6":
            span.trace_id = span.trace_id[:6]
        elif kind == "trace17":
            span.trace_id += b"\x01"
        elif kind == "span4":
            span.span_id = span.span_id[:4]
        elif kind == "span9":
            span.span_id += b"\x02"
        elif kind == "parent3":
            span.parent_span_id = b"\x01\x02\x03"
        elif kind == "zero_trace":
            span.trace_id = bytes(16)
        else:
            span.span_id = bytes(8)
        return bytes(req.SerializeToString())

    def nested_anyvalue(self, depth: int, as_list: bool) -> bytes:
        value = _ld(1, b"x")  # AnyValue.string_value
        for _ in range(depth):
            if as_list:  # AnyValue.array_value(5) > ArrayValue.values(1)
                value = _ld(5, _ld(1, value))
            else:  # AnyValue.kvlist_value(6) > KeyValueList.values(1) > KeyValue
                value = _ld(6, _ld(1, _ld(1, b"k") + _ld(2, value)))
        attr = _ld(9, _ld(1, b"gen_ai.tool.call.arguments") + _ld(2, value))
        return self.wrap_span(self.span_bytes(self.run(1)) + attr)

    def strindex(self) -> bytes:
        # AnyValue.string_value_strindex is field 8 (varint)
        value = _varint(8 << 3) + _varint(3)
        attr = _ld(9, _ld(1, b"odd") + _ld(2, value))
        return self.wrap_span(self.span_bytes(self.run(1)) + attr)

    # -- decodable

    def absurd_times(self) -> tuple[bytes, Run]:
        run = self.run(2)
        kind = self.rng.choice(("start_after_end", "zero", "u64_end", "u64_start", "u64_both"))
        for span in run.spans:
            if kind == "start_after_end":
                span.start_ns, span.end_ns = span.end_ns + 10**12, span.start_ns
            elif kind == "zero":
                span.start_ns = span.end_ns = 0
            elif kind == "u64_end":
                span.end_ns = U64
            elif kind == "u64_start":
                span.start_ns = U64
            else:
                span.start_ns = span.end_ns = U64
        return encode_request(run.spans), run

    def deep_json(self) -> tuple[bytes, Run]:
        """Deeply nested JSON text where the normalizer parses JSON: arguments, results,
        LLM output messages, plan steps, the root's output (one of them per record)."""
        run = self.run(0, root=False)
        depth = self.rng.choice((500, 1_000, 5_000, 50_000))
        deep = "[" * depth + "]" * depth if self.rng.random() < 0.5 else '{"a":' * depth + "1"
        where = self.rng.choice(("arguments", "result", "output", "plan", "root"))
        span = run.tool("lookup_order", {"order_id": "A"}, {"status": "x"})
        if where == "arguments":
            span.attributes["gen_ai.tool.call.arguments"] = deep
        elif where == "result":
            span.attributes["gen_ai.tool.call.result"] = deep
        elif where == "output":
            run.llm(10, 10).attributes["gen_ai.output.messages"] = deep
        elif where == "plan":
            run.plan([]).attributes["gen_ai.plan.steps"] = deep
        run.root(attrs={"output.value": '{"messages": ' + deep} if where == "root" else None)
        return encode_request(run.spans), run

    def huge_valid(self) -> tuple[bytes, Run]:
        run = self.run(1)
        blob = json.dumps({"order_id": "H", "note": "x" * 880_000})
        run.spans[1].attributes["gen_ai.tool.call.arguments"] = blob
        return encode_request(run.spans), run

    def odd_attrs(self) -> tuple[bytes, Run]:
        run = self.run(0, root=False)
        run.llm(-5, (1 << 63) - 1)
        span = run.tool("lookup_order", True, float("nan"), seq=-3)
        span.attributes["gen_ai.tool.call.arguments"] = {"order_id": ["A", {"b": b"\x00\xff"}]}
        span.attributes["gen_ai.tool.call.result"] = b"\xff\x00 not utf-8 bytes"
        span.attributes["gen_ai.usage.input_tokens"] = -(1 << 62)
        span.attributes["agent.step.sequence"] = (1 << 63) - 1
        span.attributes["gen_ai.tool.name"] = ""
        span.attributes["gen_ai.prompt.version"] = "v" * 5000
        run.tool("get_export_status", {"export_id": 1}, {"status": None}, error="x" * 300)
        run.root(attrs={"gen_ai.agent.finish_reason": ["stop", 3, None]})
        return encode_request(run.spans), run


def _decodes(data: bytes | None) -> bool:
    try:
        decode_record(data, "otlp_proto", "probe")  # type: ignore[arg-type]
    except DecodeError:
        return False
    return True


def bad_records(n: int, seed: int, taken: set[str]) -> list[Bad]:
    rng = random.Random(seed)
    f = BadFactory(rng, taken)
    undecodable: list[tuple[str, float, Callable[[], bytes | None]]] = [
        ("truncated", 24, f.truncated),
        ("random_bytes", 20, f.random_bytes),
        ("json_as_proto", 8, f.json_as_proto),
        ("non_utf8", 8, f.non_utf8),
        ("bad_ids", 10, f.bad_ids),
        (
            "too_deep_anyvalue",
            3,
            lambda: f.nested_anyvalue(rng.randint(48, 400), rng.random() < 0.5),
        ),
        ("strindex_value", 2, f.strindex),
        ("null_value", 2, lambda: None),
    ]
    decodable: list[tuple[str, float, Callable[[], tuple[bytes, Run | None]]]] = [
        ("absurd_timestamps", 8, f.absurd_times),
        ("deep_json_strings", 2, f.deep_json),
        ("odd_attribute_values", 5, f.odd_attrs),
        ("nesting_inside_limit", 2, lambda: (f.nested_anyvalue(rng.randint(1, 40), True), None)),
        ("empty_value", 1, lambda: (b"", None)),
        ("empty_request", 1, lambda: (_ld(1, _ld(2, b"")), None)),
    ]
    out: list[Bad] = []
    for _ in range(N_HUGE):
        out.append(Bad("huge_garbage", None, f.huge_garbage(), True))
        data, run = f.huge_valid()
        out.append(Bad("huge_valid", None, data, False, {run.trace_id}))
    weights = [w for _, w, _ in undecodable] + [w for _, w, _ in decodable]
    kinds = rng.choices(range(len(weights)), weights, k=n - len(out))
    for k in kinds:
        key = rng.choice((None, None, None, b"", rng.randbytes(16), b"\xff\xfe key"))
        if k < len(undecodable):
            name, _, make = undecodable[k]
            out.append(Bad(name, key, make(), True))
        else:
            name, _, make_ok = decodable[k - len(undecodable)]
            data, decoy = make_ok()
            out.append(Bad(name, key, data, False, {decoy.trace_id} if decoy else set()))
    for bad in out:  # each category lands in the class it was built for
        assert _decodes(bad.value) != bad.dead, (bad.category, (bad.value or b"")[:60])
    for bad in out:
        if not bad.dead and bad.value:
            bad.runs = {s.trace_id for s in decode_record(bad.value, "otlp_proto", "x")}
    return out


# ---------------------------------------------------------------------------- health poller


class HealthPoller(threading.Thread):
    """GET /healthz every `every` seconds; remembers every answer that is not ok."""

    def __init__(self, worker: WorkerProc, every: float = 0.25) -> None:
        super().__init__(daemon=True, name="healthz-poller")
        self.worker = worker
        self.every = every
        self.stop = threading.Event()
        self.polls = 0
        self.failures: list[str] = []
        self.uptimes: list[float] = []

    def run(self) -> None:
        while not self.stop.is_set():
            self.polls += 1
            try:
                status, doc = self.worker.api("/healthz", timeout=5)
                if status != 200 or doc.get("status") != "ok" or not doc.get("ready"):
                    self.failures.append(f"{time.strftime('%X')} HTTP {status} {doc}")
                else:
                    self.uptimes.append(float(doc["uptime_seconds"]))
            except Exception as exc:  # connection refused/reset, timeout
                self.failures.append(f"{time.strftime('%X')} {exc!r}")
            self.stop.wait(self.every)


# ---------------------------------------------------------------------------- the stream


@dataclass
class Streamed:
    worker: WorkerProc
    good: Oracle
    bad: list[Bad]
    bad_where: list[tuple[int, int]]
    decoys: set[str]
    poller: HealthPoller
    pid: int


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Streamed]:
    require_broker()
    started = time.monotonic()
    good = good_input()
    bad = bad_records(N_BAD, seed=99, taken=good.run_ids)
    decoys = set().union(*(b.runs for b in bad))
    assert not decoys & good.run_ids
    print(
        f"\ngood: {len(good.messages)} records, {len(good.runs)} runs, "
        f"{len(good.event_ids)} events; bad: {len(bad)} records "
        f"({sum(b.dead for b in bad)} undecodable, {len(decoys)} decoy runs); "
        f"built in {time.monotonic() - started:.1f} s"
    )
    workdir = tmp_path_factory.mktemp("malformed-worker")
    policy = write_policy(
        workdir / "policy.yaml",
        allowed_lateness_seconds=60,  # any consumption order of the input partitions
        # generous: with 900 KB records and deep JSON on some input partitions, a run's
        # records on different partitions are taken seconds apart (finalizing a run while
        # its spans wait in another partition's backlog is test_chaos.py's backlog test)
        finalize_grace_seconds=15,
        idle_timeout_seconds=20,  # example runs without a root end by idle time
    )
    worker = WorkerProc(workdir, policy, LOOPWATCH_STORE="rocksdb://")
    poller = HealthPoller(worker)
    try:
        worker.start()
        worker.wait_ready(120)
        assert worker.proc is not None
        pid = worker.proc.pid
        poller.start()
        # the good records in order (runs arrive as they were exported), bad ones between
        rng = random.Random(7)
        records: list[tuple[int, bytes | None, bytes | None]] = [
            (-1, None, m) for m in good.messages
        ]
        for i, b in enumerate(bad):
            records.insert(rng.randrange(len(records) + 1), (i, b.key, b.value))
        t0 = time.monotonic()
        where = worker.produce((key, value) for _i, key, value in records)
        print(f"produced {len(records)} records in {time.monotonic() - t0:.1f} s")
        bad_where: list[tuple[int, int]] = [(-1, -1)] * len(bad)
        for (i, _k, _v), pos in zip(records, where, strict=True):
            if i >= 0:
                bad_where[i] = pos
        yield Streamed(worker, good, bad, bad_where, decoys, poller, pid)
    finally:
        poller.stop.set()
        worker.cleanup()


def test_every_undecodable_record_is_dead_lettered_with_a_reason(streamed: Streamed) -> None:
    worker, bad = streamed.worker, streamed.bad
    want = {streamed.bad_where[i]: b for i, b in enumerate(bad) if b.dead}
    t0 = time.monotonic()
    records = worker.read("dead", until=lambda rs: len(rs) >= len(want), timeout=TIMEOUT, settle=2)
    print(f"\n{len(records)} dead letters read in {time.monotonic() - t0:.1f} s")
    by_pos: dict[tuple[int, int], list[dict[str, str]]] = defaultdict(list)
    for r in records:
        h = headers_of(r)
        assert h["source_topic"] == worker.topics["input"], h
        by_pos[(int(h["source_partition"]), int(h["source_offset"]))].append(h)
    by_reason = Counter(h["reason"] for hs in by_pos.values() for h in hs)
    table: dict[str, Counter[str]] = defaultdict(Counter)
    for pos, b in want.items():
        for h in by_pos.get(pos, []):
            table[b.category][h["reason"]] += 1
        if pos not in by_pos:
            table[b.category]["(missing)"] += 1
    print("dead letters by reason:", dict(by_reason))
    for category, reasons in sorted(table.items()):
        print(f"  {category:22} {dict(reasons)}")
    missing = [(pos, b.category) for pos, b in want.items() if pos not in by_pos]
    extra = [
        (pos, hs[0]["reason"], hs[0]["error"]) for pos, hs in by_pos.items() if pos not in want
    ]
    twice = {pos: len(hs) for pos, hs in by_pos.items() if len(hs) > 1}
    assert not missing, f"{len(missing)} undecodable records not dead-lettered: {missing[:10]}"
    assert not extra, f"{len(extra)} records dead-lettered that decode: {extra[:10]}"
    assert not twice, f"dead-lettered more than once: {list(twice.items())[:10]}"
    assert set(by_reason) == {"decode_error"}, by_reason
    for r in records[:200]:
        h = headers_of(r)
        assert h["error"] and h["payload_sha256"] and h["payload_captured"] == "false", h
        body = json.loads(r.value())
        assert body["value"] is None and body["payload_length"] == int(h["payload_length"])
    assert worker.metric('loopwatch_dead_letters_total{reason="decode_error"}') == len(want)
    assert worker.metric('loopwatch_dead_letters_total{reason="internal_error"}') == 0


def test_good_runs_equal_the_replay_of_the_good_records(streamed: Streamed) -> None:
    worker, good = streamed.worker, streamed.good
    t0 = time.monotonic()
    worker.wait_taken(len(good.messages) + len(streamed.bad), TIMEOUT)
    consumed = time.monotonic() - t0

    # then every run ends within the idle timeout (20 s): 60 s is plenty
    def covering(topic: str, name: str, want: set[str]) -> list[dict[str, Any]]:
        def done(records: list[Any]) -> bool:
            return {json.loads(r.value())[name] for r in records} >= want

        return values(worker.read(topic, until=done, timeout=60, settle=2))

    events = covering("events", "event_id", good.event_ids)
    summaries = covering("runs", "run_id", good.run_ids)
    print(
        f"\ninput consumed after {consumed:.1f} s, outputs read after {time.monotonic() - t0:.1f} s"
    )
    decoy_summaries = Counter(s["outcome"] for s in summaries if s["run_id"] in streamed.decoys)
    decoy_events = Counter(e["shape"] for e in events if e["run_id"] in streamed.decoys)
    print(f"decoy runs: summaries {dict(decoy_summaries)}, events {dict(decoy_events)}")
    strangers = {e["run_id"] for e in events} | {s["run_id"] for s in summaries}
    strangers -= good.run_ids | streamed.decoys
    assert not strangers, f"outputs for runs nobody sent: {sorted(strangers)[:10]}"
    good_events = [e for e in events if e["run_id"] in good.run_ids]
    good_summaries = [s for s in summaries if s["run_id"] in good.run_ids]
    problems, differ = good.differences(good_events, good_summaries)
    for run_id in differ[:8]:
        problems += [f"run {run_id}:", *good.describe(run_id, good_events, good_summaries)]
    assert not problems, "good runs differ from the replay:\n  " + "\n  ".join(problems)
    dup = Counter(e["event_id"] for e in good_events)
    print(f"duplicate event ids: {sum(1 for n in dup.values() if n > 1)}")


def test_worker_stayed_healthy_and_never_restarted(streamed: Streamed) -> None:
    """Runs last in this module: by now every output above was read."""
    worker, poller = streamed.worker, streamed.poller
    # one more look at the counters once everything is through
    status, health = worker.api("/healthz")
    assert status == 200 and health["status"] == "ok", health
    n_dead = sum(b.dead for b in streamed.bad)
    n_ok = len(streamed.good.messages) + sum(not b.dead for b in streamed.bad)
    print(f"\n/healthz: {health}")
    print(f"health polls: {poller.polls}, failed: {len(poller.failures)}")
    assert worker.alive(), worker.log_tail()
    assert worker.proc is not None and worker.proc.pid == streamed.pid and worker.starts == 1
    assert not poller.failures, poller.failures[:10]
    assert poller.polls >= 20
    assert all(b >= a for a, b in zip(poller.uptimes, poller.uptimes[1:], strict=False)), (
        "uptime went back"
    )
    assert health["dead_letters"] == n_dead
    assert health["records"] == n_ok, (health["records"], n_ok)
    assert worker.log_path.read_text(errors="replace").count("===== start #") == 1
    crashes = worker.crash_lines()
    assert not crashes, crashes[:20]
