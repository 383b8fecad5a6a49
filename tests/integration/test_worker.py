"""`loopwatch worker` against the real broker, started as a subprocess.

Three workers, each with its own topics and app id:

* **proto**: protobuf input with null keys (records spread over partitions: the repartition
  hop), every example export plus duplicated records, in shuffled order, with poison
  records interleaved. Proves stream == replay (event ids, run outcomes), dead letters and
  that the worker stays up.
* **keyed-json**: OTLP JSON input split and keyed by trace id as the kafkaexporter does with
  ``partition_traces_by_id``, ``LOOPWATCH_INPUT_KEYED_BY_RUN=true`` (no hop), JSON poison
  records, an API token. Proves stream == replay without the hop, and the on-call API.
* **restart**: rocksdb tables; the input arrives in three parts while the worker is stopped
  with SIGTERM and later killed with SIGKILL; tables come back from the changelogs and the
  distinct event ids end up exactly the replay's (nothing lost, nothing invented).

The expectation is `loopwatch replay` of each example file with the example policy (the
engine over the same exports). The workers' policy adds only stream timing: finalization a
few seconds after the last span instead of minutes, and (proto, restart) a lateness buffer
long enough that any arrival order gives the same result.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from detectors.policy import load_policy
from streams.cli.produce import split_by_trace
from streams.spanpath.otlp import decode_record
from tests.integration.worker_support import headers_of, values
from tests.otlp_build import (
    encode_request,
    example_files,
    file_messages,
    replay_messages,
    to_json,
)
from tests.spankit import Run
from tests.support.kafka import require_broker
from tests.support.worker_proc import EXAMPLE_POLICY, FINGERPRINT_KEY, WorkerProc, write_policy

pytestmark = pytest.mark.kafka

TIMEOUT = 60.0


# ---------------------------------------------------------------------------- expectations


class Corpus:
    """The example exports per file and what the replay makes of them."""

    def __init__(self) -> None:
        policy = load_policy(EXAMPLE_POLICY)
        self.files: dict[str, list[bytes]] = {
            f.name: list(file_messages(f)) for f in example_files()
        }
        self.event_ids: set[str] = set()
        self.events: list[dict[str, Any]] = []
        self.runs: set[tuple[str, str]] = set()
        self.summaries: list[dict[str, Any]] = []
        for messages in self.files.values():
            events, summaries = replay_messages(messages, policy, FINGERPRINT_KEY.encode())
            self.summaries.extend(summaries)
            self.events.extend(events)
            self.event_ids |= {e["event_id"] for e in events}
            self.runs |= {(s["run_id"], s["outcome"]) for s in summaries}
        assert len(self.event_ids) == len(self.events) >= 15
        assert len(self.runs) >= 24

    def messages(self) -> list[bytes]:
        return [m for msgs in self.files.values() for m in msgs]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    require_broker()
    return Corpus()


def event_ids(worker: WorkerProc, want: set[str], timeout: float = TIMEOUT) -> set[str]:
    """Distinct event ids on loop_detected once `want` is there (plus a short settle, so an
    extra id would show up too)."""
    records = worker.read(
        "events",
        until=lambda rs: {json.loads(r.value())["event_id"] for r in rs} >= want,
        timeout=timeout,
        settle=1.5,
    )
    return {e["event_id"] for e in values(records)}


def run_outcomes(worker: WorkerProc, want: set[tuple[str, str]]) -> set[tuple[str, str]]:
    records = worker.read(
        "runs",
        until=lambda rs: {json.loads(r.value())["run_id"] for r in rs} >= {r for r, _ in want},
        timeout=TIMEOUT,
        settle=1.0,
    )
    return {(s["run_id"], s["outcome"]) for s in values(records)}


def metric(worker: WorkerProc, name: str) -> float:
    port = worker.env["LOOPWATCH_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------------------- poison


def poison_proto(corpus: Corpus) -> list[tuple[str, bytes | None]]:
    good = corpus.messages()[0]
    rng = random.Random(3)
    run = Run(trace=77)
    run.tool("lookup_order", {"order_id": "X"}, {"status": "ok"})
    six_byte_trace = encode_request(run.spans, trace_id_bytes=6)
    return [
        ("truncated", good[: len(good) // 2]),
        ("random", bytes(rng.getrandbits(8) for _ in range(300))),
        ("six_byte_trace_id", six_byte_trace),
        ("null_value", None),
    ]


def poison_json() -> list[tuple[str, bytes | None]]:
    run = Run(trace=78)
    run.tool("lookup_order", {"order_id": "X"}, {"status": "ok"})
    doc = json.loads(to_json(encode_request(run.spans)))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = "0102030405ab"  # 6 bytes
    return [
        ("invalid_json", b'{"resourceSpans": [{"scopeSpans": [ {"spans": [}'),
        ("random", bytes(random.Random(4).getrandbits(8) for _ in range(200))),
        ("six_byte_trace_id", json.dumps(doc).encode()),
    ]


def check_dead_letters(
    worker: WorkerProc, poison: list[tuple[str, bytes | None]], where: list[tuple[int, int]]
) -> None:
    records = worker.read("dead", until=lambda rs: len(rs) >= len(poison), timeout=TIMEOUT)
    by_offset = {
        (int(headers_of(r)["source_partition"]), int(headers_of(r)["source_offset"])): r
        for r in records
    }
    assert len(records) == len(poison), [headers_of(r) for r in records]
    for (label, payload), pos in zip(poison, where, strict=True):
        assert pos in by_offset, f"{label} record at {pos} not dead-lettered"
        record = by_offset[pos]
        h = headers_of(record)
        assert h["reason"] == "decode_error", (label, h)
        assert h["source_topic"] == worker.topics["input"]
        assert h["error"], label
        body = json.loads(record.value())
        data = payload or b""
        assert body["payload_sha256"] == hashlib.sha256(data).hexdigest(), label
        assert body["payload_length"] == len(data)
        if data:  # privacy: the payload itself is not in the dead letter
            assert data[:16] not in record.value() or len(data) < 16


# ---------------------------------------------------------------------------- proto worker


@pytest.fixture(scope="module")
def proto_worker(
    corpus: Corpus, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("proto-worker")
    policy = write_policy(
        workdir / "policy.yaml",
        allowed_lateness_seconds=60,
        finalize_grace_seconds=2,
        idle_timeout_seconds=5,
    )
    worker = WorkerProc(workdir, policy)
    try:
        worker.start()
        worker.wait_ready()
        rng = random.Random(11)
        messages = corpus.messages()
        records: list[tuple[str, bytes | None]] = [("good", m) for m in messages]
        records += [("dup", m) for m in rng.sample(messages, len(messages) // 3)]
        rng.shuffle(records)
        poison = poison_proto(corpus)
        for i, item in enumerate(poison):  # interleaved with the good ones
            records.insert((i + 1) * len(records) // (len(poison) + 1), item)
        where = worker.produce((None, value) for _label, value in records)
        poison_where = [where[i] for i, r in enumerate(records) if r[0] not in ("good", "dup")]
        yield {"worker": worker, "poison": poison, "poison_where": poison_where}
    finally:
        worker.cleanup()


def test_unkeyed_stream_events_equal_replay(proto_worker: dict[str, Any], corpus: Corpus) -> None:
    got = event_ids(proto_worker["worker"], corpus.event_ids)
    assert got == corpus.event_ids


def test_unkeyed_stream_run_summaries_equal_replay(
    proto_worker: dict[str, Any], corpus: Corpus
) -> None:
    assert run_outcomes(proto_worker["worker"], corpus.runs) == corpus.runs


def test_poison_records_are_dead_lettered_and_worker_stays_up(
    proto_worker: dict[str, Any], corpus: Corpus
) -> None:
    worker: WorkerProc = proto_worker["worker"]
    check_dead_letters(worker, proto_worker["poison"], proto_worker["poison_where"])
    status, health = worker.api("/healthz")
    assert status == 200 and health["status"] == "ok" and health["ready"]
    assert worker.alive()
    assert metric(worker, 'loopwatch_dead_letters_total{reason="decode_error"}') == 4
    assert metric(worker, "loopwatch_duplicate_spans_total") > 0
    assert metric(worker, "loopwatch_loop_events_total") >= len(corpus.event_ids)


# ---------------------------------------------------------------------------- keyed JSON worker

TOKEN = "s3cret-token"


def keyed_json_records(messages: list[bytes]) -> list[tuple[bytes | None, bytes]]:
    """The kafkaexporter with partition_traces_by_id and encoding otlp_json: one record per
    (resource, scope, trace), keyed by the lowercase hex trace id."""
    out: list[tuple[bytes | None, bytes]] = []
    for message in messages:
        req = ExportTraceServiceRequest.FromString(message)
        for key, piece in split_by_trace(req):
            out.append((key, to_json(piece.SerializeToString())))
    return out


@pytest.fixture(scope="module")
def keyed_worker(
    corpus: Corpus, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("keyed-worker")
    policy = write_policy(
        workdir / "policy.yaml",
        allowed_lateness_seconds=1,  # the release timer runs (ordered per trace)
        finalize_grace_seconds=3,
        idle_timeout_seconds=600,  # the open run below stays open
    )
    worker = WorkerProc(
        workdir,
        policy,
        LOOPWATCH_INPUT_ENCODING="otlp_json",
        LOOPWATCH_INPUT_KEYED_BY_RUN="true",
        LOOPWATCH_API_TOKEN=TOKEN,
        LOOPWATCH_STORE="rocksdb://",
    )
    try:
        worker.start()
        health = worker.wait_ready()
        assert health["keyed_input"] is True
        records = keyed_json_records(corpus.messages())
        records += records[::4]  # redelivered
        poison = poison_json()
        for i, (_label, value) in enumerate(poison):
            records.insert((i + 1) * len(records) // (len(poison) + 1), (b"", value or b""))
        # an open run: no root span, idle timeout 10 minutes
        open_run = Run(trace=4242, prompt_version="support-v99")
        for _ in range(3):
            open_run.tool("lookup_order", {"order_id": "A7"}, {"status": "pending"})
        records.append((open_run.trace_id.encode(), to_json(encode_request(open_run.spans))))
        where = worker.produce(records)
        poison_values = {value for _label, value in poison}
        poison_where = [where[i] for i, (_k, v) in enumerate(records) if v in poison_values]
        open_events, _ = replay_messages(
            [encode_request(open_run.spans)], load_policy(EXAMPLE_POLICY), FINGERPRINT_KEY.encode()
        )
        assert [e["shape"] for e in open_events] == ["identical_repetition"]
        yield {
            "worker": worker,
            "poison": poison,
            "poison_where": poison_where,
            "open_run": open_run,
            "open_event_ids": {e["event_id"] for e in open_events},
        }
    finally:
        worker.cleanup()


def test_keyed_json_stream_equals_replay(keyed_worker: dict[str, Any], corpus: Corpus) -> None:
    worker: WorkerProc = keyed_worker["worker"]
    want = corpus.event_ids | keyed_worker["open_event_ids"]  # + the run left open
    assert event_ids(worker, want) == want
    assert run_outcomes(worker, corpus.runs) == corpus.runs


def test_keyed_json_poison_dead_lettered(keyed_worker: dict[str, Any]) -> None:
    worker: WorkerProc = keyed_worker["worker"]
    check_dead_letters(worker, keyed_worker["poison"], keyed_worker["poison_where"])
    assert worker.api("/healthz")[1]["ready"]


def test_api_run_views(keyed_worker: dict[str, Any], corpus: Corpus) -> None:
    worker: WorkerProc = keyed_worker["worker"]
    open_run: Run = keyed_worker["open_run"]
    run_id = open_run.trace_id
    deadline = time.monotonic() + TIMEOUT
    while True:  # the open run's steps are released by the timer (lateness 1 s)
        status, doc = worker.api(f"/runs/{run_id}", token=TOKEN)
        assert status == 200, doc
        if doc["found"] and doc["steps"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert doc["run_id"] == run_id and doc["found"] is True and doc["finished"] is False
    state = doc["state"]
    assert state["spans"] == 3 and state["tool_calls"] == 3 and state["pending"] == 0
    assert state["prompt_version"] == "support-v99"
    assert state["shapes"] == ["identical_repetition"]
    assert [s["position"] for s in doc["steps"]] == [1, 2, 3]
    assert {s["tool_name"] for s in doc["steps"]} == {"lookup_order"}
    assert len({s["action_fp"] for s in doc["steps"]}) == 1
    assert [f["shape"] for f in doc["findings"]] == ["identical_repetition"]
    assert {f["event_id"] for f in doc["findings"]} == keyed_worker["open_event_ids"]
    assert "A7" not in json.dumps(doc) and "pending" not in json.dumps(doc["steps"])

    # a finished run: gone from the state table, kept in the retained one
    event_ids(worker, corpus.event_ids)
    looped = corpus.events[0]
    outcomes = dict(corpus.runs)
    doc = finished_run(worker, looped["run_id"])
    assert doc["summary"]["outcome"] == outcomes[looped["run_id"]]
    assert looped["shape"] in doc["summary"]["shapes"]
    assert {e["event_id"] for e in doc["events"]} == {
        e["event_id"] for e in corpus.events if e["run_id"] == looped["run_id"]
    }
    assert doc["timeline"] and doc["retention"] == {"looping_hours": 168.0, "clean_hours": 24.0}
    clean = next(r for r, _o in sorted(corpus.runs) if all(e["run_id"] != r for e in corpus.events))
    doc = finished_run(worker, clean)
    assert doc["summary"]["shapes"] == [] and doc["events"] == [] and doc["timeline"] == []
    status, doc = worker.api("/runs/0123456789abcdef0123456789abcdef", token=TOKEN)
    assert status == 200 and doc["found"] is False and doc["finished"] is False
    assert doc["retention"]["looping_hours"] == 168.0
    # a run id as the tables print it: its first characters
    status, doc = worker.api(f"/find?run={looped['run_id'][:12]}", token=TOKEN)
    assert status == 200 and [m["run_id"] for m in doc["matches"]] == [looped["run_id"]]
    assert doc["matches"][0]["status"] == "finished"
    status, doc = worker.api("/find?run=0123", token=TOKEN)
    assert status == 400 and "8 to 64 hex characters" in doc["error"]


def finished_run(worker: WorkerProc, run_id: str, token: str | None = TOKEN) -> dict[str, Any]:
    """GET /runs/{run_id} once the run has finished (its grace may still be running)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        status, doc = worker.api(f"/runs/{run_id}", token=token)
        assert status == 200, doc
        if doc.get("finished") and doc.get("found"):
            return doc
        assert time.monotonic() < deadline, (doc, worker.log_tail())
        time.sleep(0.3)


def test_api_aggregates(keyed_worker: dict[str, Any], corpus: Corpus) -> None:
    worker: WorkerProc = keyed_worker["worker"]
    event_ids(worker, corpus.event_ids)
    run_outcomes(worker, corpus.runs)
    time.sleep(1.0)
    status, doc = worker.api("/loops?by=shape&since=1h", token=TOKEN)
    assert status == 200, doc
    assert doc["by"] == ["shape"] and doc["since"] == "1h"
    want = Counter(e["shape"] for e in corpus.events)
    want["identical_repetition"] += 1  # the open run's finding
    assert {r["shape"]: r["events"] for r in doc["rows"]} == dict(want)

    status, doc = worker.api("/loops", token=TOKEN)
    assert status == 200 and doc["by"] == ["shape", "prompt_version", "tool_version"]
    assert sum(r["events"] for r in doc["rows"]) == len(corpus.events) + 1
    spread = {"looping_runs", "first_ns", "last_ns"}  # from the slice's episodes
    assert all(
        set(r) == {"shape", "prompt_version", "tool_version", "events"} | spread
        for r in doc["rows"]
    )

    status, doc = worker.api("/loops?by=prompt_version,shape&since=30m", token=TOKEN)
    assert status == 200 and doc["since"] == "30m"
    assert all(set(r) == {"prompt_version", "shape", "events"} | spread for r in doc["rows"])

    status, doc = worker.api("/loops?by=shape", token=TOKEN)
    runs_by_shape = Counter(
        shape for shape, _run in {(e["shape"], e["run_id"]) for e in corpus.events}
    )
    runs_by_shape["identical_repetition"] += 1  # the run left open
    assert {r["shape"]: r["looping_runs"] for r in doc["rows"]} == dict(runs_by_shape)
    assert all(r["first_ns"] <= r["last_ns"] for r in doc["rows"])

    status, doc = worker.api("/loops?by=agent_name&service_name=support-bot", token=TOKEN)
    support = [e for e in corpus.events if e["service_name"] == "support-bot"]
    assert support and len(support) < len(corpus.events)  # a filter that filters
    # + the run left open (spankit's service is support-bot too)
    assert status == 200 and sum(r["events"] for r in doc["rows"]) == len(support) + 1

    status, doc = worker.api("/loops?by=tool_name&shape=identical_repetition", token=TOKEN)
    want = Counter(e["tool_name"] for e in corpus.events if e["shape"] == "identical_repetition")
    want["lookup_order"] += 1  # the run left open
    assert status == 200 and doc["where"] == {"shape": "identical_repetition"}
    assert {r["tool_name"]: r["events"] for r in doc["rows"]} == dict(want)

    # the runs behind a slice: its latest episodes, newest first, how each run ended
    status, doc = worker.api("/episodes?shape=identical_repetition&limit=50", token=TOKEN)
    assert status == 200, doc
    want_runs = {e["run_id"] for e in corpus.events if e["shape"] == "identical_repetition"}
    assert want_runs <= {r["run_id"] for r in doc["rows"]}
    assert all(r["shape"] == "identical_repetition" for r in doc["rows"])
    times = [r["detected_ns"] for r in doc["rows"]]
    assert times == sorted(times, reverse=True)
    finished = [r for r in doc["rows"] if r["run_id"] in want_runs]
    outcomes = dict(corpus.runs)
    assert all(
        r["run_status"] == "finished" and r["outcome"] == outcomes[r["run_id"]] for r in finished
    )
    status, doc = worker.api("/episodes?limit=2", token=TOKEN)
    assert status == 200 and len(doc["rows"]) == 2

    status, doc = worker.api("/loops?by=shape&since=7d", token=TOKEN)
    assert (status, doc["since"], doc["covers"], doc["kept"]) == (200, "7d", "24h", "24h")
    assert sum(r["events"] for r in doc["rows"]) == len(corpus.events) + 1

    status, doc = worker.api("/runs?since=2h", token=TOKEN)
    assert status == 200 and doc["since"] == "2h" and doc["covers"] == "2h"
    assert sum(r["runs"] for r in doc["rows"]) == len(corpus.runs)
    outcomes = Counter(o for _r, o in corpus.runs)
    got = Counter()
    for row in doc["rows"]:
        assert set(row) == {"prompt_version", "outcome", "termination_reason", "runs"}
        got[row["outcome"]] += row["runs"]
    assert got == outcomes


def expected_comparison(corpus: Corpus) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """From the replay's summaries, by hand: every version with the one first seen before it
    in its service and agent, and support-v13 against support-v12 where both ran (the
    example corpus has both in service support-bot, agent support)."""
    first: dict[tuple[Any, ...], int] = {}
    for s in corpus.summaries:
        keys = [("prompt", s["service_name"], s["agent_name"], None, s["prompt_version"])]
        keys += [("tool", s["service_name"], s["agent_name"], t, v) for t, v in s["tool_versions"]]
        for key in keys:
            if key[-1]:
                first[key] = min(
                    first.get(key, s["start_time_unix_nano"]), s["start_time_unix_nano"]
                )
    previous = {}
    for key in first:
        older = [k for k in first if k[:4] == key[:4] and first[k] < first[key]]
        previous[key] = max(older, key=lambda k: first[k])[-1] if older else None

    def side(version: str) -> dict[str, int]:
        runs = [
            s
            for s in corpus.summaries
            if (s["service_name"], s["agent_name"], s["prompt_version"])
            == ("support-bot", "support", version)
        ]
        return {"runs": len(runs), "looping": sum(1 for s in runs if s["shapes"])}

    return [{"key": k, "previous": p} for k, p in sorted(previous.items(), key=str)], {
        "support-v12": side("support-v12"),
        "support-v13": side("support-v13"),
    }


def test_api_versions_and_compare(keyed_worker: dict[str, Any], corpus: Corpus) -> None:
    worker: WorkerProc = keyed_worker["worker"]
    run_outcomes(worker, corpus.runs)
    versions, sides = expected_comparison(corpus)
    assert sides["support-v12"]["runs"] > 10 and sides["support-v13"]["runs"] > 0

    # this worker's records (scope=local: no window, every version it holds)
    status, doc = worker.api("/versions?scope=local", token=TOKEN)
    assert status == 200, doc
    got = [
        {
            "key": (
                r["kind"],
                r["service_name"],
                r["agent_name"],
                r["tool_name"],
                r["version"],
            ),
            "previous": r["previous"],
        }
        for r in doc["versions"]
    ]
    assert sorted(got, key=str) == versions
    assert sum(r["runs"] for r in doc["versions"] if r["kind"] == "prompt") == len(
        [s for s in corpus.summaries if s["prompt_version"]]
    )

    status, doc = worker.api("/compare?prompt_version=support-v13", token=TOKEN)
    assert status == 200, doc
    assert doc["baseline"]["version"] == "support-v12" and doc["baseline"]["chosen"] == "previous"
    for name, side in (("baseline", "support-v12"), ("candidate", "support-v13")):
        assert {k: doc[name][k] for k in ("runs", "looping")} == sides[side], doc
    assert doc["rows"][0]["verdict"] == "not enough runs" and doc["since"] == "24h"

    for path, status_want in (
        ("/compare?prompt_version=support-v99", 404),  # the open run has not finished
        ("/compare?prompt_version=research-v4", 404),  # the first of its service
        ("/compare?prompt_version=support-v13&baseline=support-v13", 400),
        ("/compare?tool_name=lookup_order", 400),
    ):
        status, doc = worker.api(path, token=TOKEN)
        assert status == status_want and doc["error"], (path, doc)


@pytest.mark.parametrize(
    "path",
    [
        "/loops?by=shape,colour",
        "/loops?by=",
        "/loops?by=shape,shape",
        "/loops?since=abc",
        "/loops?since=-1h",
        "/loops?since=0h",
        "/runs?since=abc",
        "/runs?since=-1h",
        "/loops?shape=spinning",
        "/loops?tool_name=",
        "/find?run=0123",
        "/episodes?limit=0",
        "/episodes?shape=spinning",
    ],
)
def test_api_bad_parameters_are_400(keyed_worker: dict[str, Any], path: str) -> None:
    status, doc = keyed_worker["worker"].api(path, token=TOKEN)
    assert status == 400, doc
    assert isinstance(doc.get("error"), str) and doc["error"]


def test_api_token(keyed_worker: dict[str, Any]) -> None:
    worker: WorkerProc = keyed_worker["worker"]
    for path in ("/loops", "/runs", "/runs/abc"):
        assert worker.api(path)[0] == 401
        assert worker.api(path, token="wrong")[0] == 401
        assert worker.api(path, token=TOKEN)[0] == 200
    status, doc = worker.api("/healthz")  # health needs no token
    assert status == 200 and doc["status"] == "ok" and doc["active_runs"] >= 1


# ---------------------------------------------------------------------------- restart


def wait_health(worker: WorkerProc, key: str, at_least: int, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, doc = worker.api("/healthz")
        if status == 200 and doc.get(key, 0) >= at_least:
            return
        time.sleep(0.2)
    raise AssertionError(f"healthz {key} < {at_least} after {timeout} s:\n{worker.log_tail()}")


def test_restart_sigterm_and_sigkill_keep_event_ids(
    corpus: Corpus, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir: Path = tmp_path_factory.mktemp("restart-worker")
    policy = write_policy(
        workdir / "policy.yaml",
        allowed_lateness_seconds=60,
        finalize_grace_seconds=2,
        idle_timeout_seconds=60,  # runs wait for their next part across the restarts
    )
    worker = WorkerProc(workdir, policy, LOOPWATCH_STORE="rocksdb://")
    # Every run is cut across three parts in its own order: its first export message, the
    # middle ones, the last (with the root span, which ends the run).
    parts: list[list[bytes]] = [[], [], []]
    for msgs in corpus.files.values():
        parts[0].append(msgs[0])
        parts[1].extend(msgs[1:-1])
        parts[2].append(msgs[-1])
    n_runs = len(corpus.runs)
    try:
        worker.start()
        worker.wait_ready()
        worker.produce((None, m) for m in parts[0])
        wait_health(worker, "active_runs", n_runs)  # every run is open, none finished
        assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()

        worker.produce((None, m) for m in parts[1])  # while the worker is down
        worker.start()
        worker.wait_ready()
        # a stop drops state staged since the last flush (its records were not acknowledged
        # and are processed again): every run is back, none finished
        wait_health(worker, "active_runs", n_runs)
        wait_health(worker, "records", len(parts[1]))
        assert worker.api("/healthz")[1]["runs_finished"] == 0
        worker.produce((None, m) for m in parts[2][: len(parts[2]) // 2])
        emitted = worker.read("events", until=lambda rs: len(rs) >= 1, timeout=TIMEOUT)
        worker.stop(signal.SIGKILL)  # mid-stream: outputs, state and offsets partly committed
        assert emitted, "no event before the kill"

        worker.produce((None, m) for m in parts[2][len(parts[2]) // 2 :])
        worker.start()
        worker.wait_ready()
        got = event_ids(worker, corpus.event_ids, timeout=90)
        assert got == corpus.event_ids, (
            f"missing {sorted(corpus.event_ids - got)}, invented {sorted(got - corpus.event_ids)}"
        )
        assert run_outcomes(worker, corpus.runs) == corpus.runs

        # spans of finished runs, redelivered late: counted, no new run, no new event
        late = parts[0][:5]
        worker.produce((None, m) for m in late)
        n_late = sum(len(decode_record(m, "otlp_proto", "late")) for m in late)
        deadline = time.monotonic() + TIMEOUT
        while metric(worker, "loopwatch_spans_after_finalize_total") < n_late:
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.3)
        assert event_ids(worker, corpus.event_ids) == corpus.event_ids
        assert worker.api("/healthz")[1]["active_runs"] == 0
        # finished runs stay open to `query run` across the restarts (rocksdb + changelog)
        looped = corpus.events[0]
        doc = finished_run(worker, looped["run_id"], None)
        assert looped["event_id"] in {e["event_id"] for e in doc["events"]}
        assert worker.stop(signal.SIGTERM) == 0
        worker.start()  # once more, from the local state only
        worker.wait_ready()
        assert finished_run(worker, looped["run_id"], None)["summary"] == doc["summary"]
        assert worker.stop(signal.SIGTERM) == 0
    finally:
        worker.cleanup()


# ---------------------------------------------------------------------------- two workers


def test_two_workers_split_partitions_and_answer_for_each_other(
    corpus: Corpus, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir: Path = tmp_path_factory.mktemp("two-workers")
    policy = write_policy(
        workdir / "policy.yaml", finalize_grace_seconds=2, idle_timeout_seconds=600
    )
    a = WorkerProc(workdir, policy, LOOPWATCH_STORE="rocksdb://")
    b = WorkerProc(workdir, policy, LOOPWATCH_STORE="rocksdb://")
    b.topics, b.app_id = a.topics, a.app_id  # the same app: one consumer group, one set of tables
    for name in ("APP_ID", "INPUT_TOPIC", "STEPS_TOPIC", "EVENTS_TOPIC", "RUNS_TOPIC"):
        b.env[f"LOOPWATCH_{name}"] = a.env[f"LOOPWATCH_{name}"]
    b.env["LOOPWATCH_DEAD_LETTER_TOPIC"] = a.env["LOOPWATCH_DEAD_LETTER_TOPIC"]
    b.env["LOOPWATCH_DATA_DIR"] = str(workdir / "data-b")
    try:
        a.start()
        a.wait_ready()
        b.start()
        b.wait_ready()
        deadline = time.monotonic() + TIMEOUT
        while True:  # the rebalance gives each worker two of the four partitions
            parts = [w.api("/healthz")[1]["assigned_partitions"] for w in (a, b)]
            if sorted(parts[0] + parts[1]) == [0, 1, 2, 3] and parts[0] and parts[1]:
                break
            assert time.monotonic() < deadline, parts
            time.sleep(0.3)
        open_runs = []
        records: list[tuple[bytes | None, bytes]] = []
        for trace in range(900, 908):  # runs left open (no root, idle timeout 10 min)
            run = Run(trace=trace)
            for _ in range(3):
                run.tool("lookup_order", {"order_id": "Z9"}, {"status": "pending"})
            open_runs.append(run.trace_id)
            records.append((None, encode_request(run.spans)))
        records += [(None, m) for m in corpus.messages()]
        a.produce(records)
        missing = corpus.event_ids - event_ids(a, corpus.event_ids)
        assert not missing, [  # which run and episode, to tell a loss from a changed episode
            {k: e[k] for k in ("run_id", "shape", "first_sequence", "last_sequence")}
            for e in corpus.events
            if e["event_id"] in missing
        ]
        assert run_outcomes(a, corpus.runs) == corpus.runs
        expected_loops = len(corpus.events) + len(open_runs)
        for worker in (a, b):
            health = worker.api("/healthz")[1]
            assert health["active_runs"] < len(open_runs)  # each holds only its share
            for run_id in open_runs:  # routed to the owner of the key
                status, doc = worker.api(f"/runs/{run_id}")
                assert status == 200 and doc["found"], (worker.web_port, run_id, doc)
            # a prefix is searched on every worker: the open runs share their first 28
            # characters, and half of them are the other worker's
            status, doc = worker.api(f"/find?run={open_runs[0][:28]}")
            assert status == 200, doc
            assert [m["run_id"] for m in doc["matches"]] == sorted(open_runs)
            local = worker.api(f"/find?run={open_runs[0][:28]}&scope=local")[1]["matches"]
            assert 0 < len(local) < len(open_runs)
            # Each worker sums its own windows and its peer's. The open runs' events are
            # released by ticks, possibly after the corpus's events: wait for exactly them.
            deadline = time.monotonic() + TIMEOUT
            while True:
                loops = worker.api("/loops?by=shape")[1]["rows"]
                total = sum(r["events"] for r in loops)
                if total == expected_loops or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert total == expected_loops, (worker.web_port, loops)
            runs = worker.api("/runs")[1]["rows"]
            assert sum(r["runs"] for r in runs) == len(corpus.runs)
        local = [
            sum(r["events"] for r in w.api("/loops?by=shape&scope=local")[1]["rows"])
            for w in (a, b)
        ]
        assert sum(local) == len(corpus.events) + len(open_runs) and all(local)
        # a version's predecessor and its comparison need every worker's share
        _versions, sides = expected_comparison(corpus)
        compared = [w.api("/compare?prompt_version=support-v13")[1] for w in (a, b)]
        assert compared[0] == compared[1], compared
        assert compared[0]["baseline"]["version"] == "support-v12"
        for name, side in (("baseline", "support-v12"), ("candidate", "support-v13")):
            assert {k: compared[0][name][k] for k in ("runs", "looping")} == sides[side]
        prompt_runs = [
            sum(
                r["runs"]
                for r in w.api("/versions?scope=local")[1]["versions"]
                if r["kind"] == "prompt"
            )
            for w in (a, b)
        ]
        assert sum(prompt_runs) == len(corpus.summaries) and all(prompt_runs), prompt_runs
        assert b.stop() == 0
    finally:
        if b.alive():
            b.stop()
        a.cleanup()
