"""Canaries through the real `loopwatch worker`: customer text never leaves the normalizer.

The canary runs of the embedded privacy test (`tests.spankit.canary_runs`: tool
arguments, results, status messages, exception messages and stacktraces, LLM messages,
plan arguments, OpenInference/OpenLLMetry envelopes, kvlist values, unrecognized span and
resource attributes carry unique ``CANARY-<kind>-<uuid4>`` strings; every detector fires on
them), plus poison records holding canaries (in their values, one in its key: a dead
letter keeps only a trace-id key), run through two workers at once:

* **hop**: otlp_proto, unkeyed records (ingest -> internal steps topic -> detect);
* **keyed**: otlp_json split and keyed by trace id (the kafkaexporter's
  ``partition_traces_by_id``), ``LOOPWATCH_INPUT_KEYED_BY_RUN=true``, an API token.

Both log at ``LOOPWATCH_LOG_LEVEL=debug`` into a file. The runs are first left open (their
roots are sent last) so that ``/runs/{id}`` shows live state, then finalized.

Then everything the workers wrote or serve is scanned, case-insensitively, for any canary
or the first 16 hex digits of its uuid (a lowercased or cut copy is still a leak): every
record (key, value, headers) of every topic the worker created or used except the input
(steps, loop_detected, loop_runs, dead letters, every ``<app_id>-*-changelog`` and faust's
assignor topic, listed with the admin client), every API answer (``/healthz``,
``/runs/{id}`` live and finished, ``/loops`` and ``/runs`` with their parameters, error
answers), ``/metrics``, the worker's debug log, and (a weaker check: rocksdb may compress)
the files of the table store. The input topic itself must contain the canaries (proof
that the scan would see them).

Also: the API is read-only but for the holds (POST/PUT/PATCH/DELETE answer 404 or 405, never
2xx; POST /holds and DELETE /holds/{id} need the token: 401 without it), listens on
127.0.0.1 only by default (the listening socket in /proc/net/tcp{,6}; a connection to the
machine's non-loopback addresses is refused), the bearer token is enforced when set (and
never echoed), malformed query parameters get 400 and odd run ids never a 5xx.
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from streams.cli.produce import split_by_trace
from streams.spanpath.spans import SpanRecord
from streams.worker.kafka.topics import TABLES
from streams.worker.state import retained
from tests.integration.worker_support import read_to_end
from tests.otlp_build import encode_request, to_json
from tests.spankit import CANARY_SHAPES, Canaries, Run, canary_runs
from tests.support.kafka import admin_client, require_broker
from tests.support.worker_proc import WorkerProc, write_policy

pytestmark = pytest.mark.kafka

TOKEN = "canary-test-token-0f3a"
TIMEOUT = 90.0


# ---------------------------------------------------------------------------- poison records


def poison_proto(c: Canaries, good: bytes) -> list[tuple[bytes | None, bytes | None]]:
    secret = c("poison-proto")
    at = good.find(b"CANARY-")
    assert at > 0
    return [
        (None, json.dumps({"resourceSpans": [{"note": c("poison-json-as-proto")}]}).encode()),
        (None, good[: at + 30]),  # truncated inside a canary
        (None, good[:at] + b"\xff\xfe" + good[at + 2 :]),  # invalid UTF-8 next to one
        (None, b"\x0a\xff\xff" + secret.encode() + good),
    ]


def poison_json(c: Canaries) -> list[tuple[bytes | None, bytes | None]]:
    run = Run(trace=9199)
    run.tool("lookup_order", {"order_id": "X"}, {"status": "ok"})
    doc = json.loads(to_json(encode_request(run.spans)))
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    bad_type = json.loads(json.dumps(doc))
    bad_type["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] = [
        {"key": "gen_ai.tool.call.arguments", "value": {"intValue": c("poison-int")}}
    ]
    bad_id = json.loads(json.dumps(doc))
    bad_id["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = c("poison-trace-id")
    bad_kind = json.loads(json.dumps(doc))
    bad_kind["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["kind"] = c("poison-kind")
    assert span
    return [
        (b"", b'{"resourceSpans": [' + c("poison-broken-json").encode() + b"]}"),
        (b"", json.dumps(bad_type).encode()),
        (b"", json.dumps(bad_id).encode()),
        (b"", json.dumps(bad_kind).encode()),
        (b"", c("poison-utf8").encode() + b"\xff"),
        (c("poison-key").encode(), b"{not json at all"),
    ]


# ---------------------------------------------------------------------------- workers


@dataclass
class Side:
    name: str
    worker: WorkerProc
    token: str | None
    run_ids: list[str]
    expected_dead: int
    scanned: dict[str, str] = field(default_factory=dict)  # where -> text
    statuses: Counter[str] = field(default_factory=Counter)


def call(
    side: Side, path: str, method: str = "GET", token: str | None = None, **headers: str
) -> tuple[int, str]:
    """(status, body text) of one API request; the body is kept for the scan."""
    url = f"http://127.0.0.1:{side.worker.web_port}{path}"
    req = urllib.request.Request(url, method=method, headers=headers)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if method in ("POST", "PUT", "PATCH"):
        req.data = json.dumps({"run_id": "x", "state": None}).encode()
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    text = body.decode("utf-8", "replace")
    side.scanned[f"API {method} {path} -> {status}"] = text
    return status, text


def _api_json(side: Side, path: str) -> dict[str, Any]:
    status, text = call(side, path, token=side.token)
    assert status == 200, (side.name, path, status, text)
    doc: dict[str, Any] = json.loads(text)
    return doc


def _wait(predicate: Any, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def record_text(msg: Any) -> str:
    value = msg.value() or b""
    record = retained.is_record_key(msg.key() or b"")  # not the expiry index, scanned raw
    if msg.topic().endswith("-retained-changelog") and value and record:
        # retained-run records are compressed: scan what they hold, decompressed
        value = json.dumps(retained.decode(value)).encode()
    parts = [msg.key() or b"", value]
    for k, v in msg.headers() or []:
        parts += [k.encode(), v or b""]
    return "\n".join(p.decode("latin-1") for p in parts)


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Canaries, list[Side]]]:
    require_broker()
    c = Canaries()
    runs = canary_runs(c)
    workdir = tmp_path_factory.mktemp("canary")
    policy = write_policy(
        workdir / "policy.yaml",
        defaults={
            "allowed_repeats": 2,
            "window": 8,
            "budgets": {"steps": 8, "tokens": 5000, "seconds": 300},
        },
        allowed_lateness_seconds=1,
        finalize_grace_seconds=1,
        idle_timeout_seconds=600,  # the runs stay open until their roots are sent
    )
    common = {"LOOPWATCH_STORE": "rocksdb://", "LOOPWATCH_LOG_LEVEL": "debug"}
    hop = WorkerProc(workdir / "hop", policy, **common)
    keyed = WorkerProc(
        workdir / "keyed",
        policy,
        LOOPWATCH_INPUT_ENCODING="otlp_json",
        LOOPWATCH_INPUT_KEYED_BY_RUN="true",
        LOOPWATCH_API_TOKEN=TOKEN,
        **common,
    )
    for w in (hop, keyed):
        w.workdir.mkdir(parents=True, exist_ok=True)
    bodies = [[s for s in run.spans if s.parent_span_id is not None] for run in runs]
    roots = [[s for s in run.spans if s.parent_span_id is None] for run in runs]

    def proto_records(span_lists: list[list[SpanRecord]]) -> list[tuple[None, bytes]]:
        return [(None, encode_request(spans)) for spans in span_lists]

    def json_records(span_lists: list[list[SpanRecord]]) -> list[tuple[bytes, bytes]]:
        out = []
        for spans in span_lists:
            req = ExportTraceServiceRequest.FromString(encode_request(spans))
            out += [(k, to_json(p.SerializeToString())) for k, p in split_by_trace(req)]
        return out

    hop_poison = poison_proto(c, encode_request(runs[0].spans))
    key_poison = poison_json(c)
    run_ids = [r.trace_id for r in runs]
    result = [
        Side("hop", hop, None, run_ids, len(hop_poison)),
        Side("keyed", keyed, TOKEN, run_ids, len(key_poison)),
    ]
    try:
        hop.start()
        keyed.start()
        hop.wait_ready(120)
        keyed.wait_ready(120)
        hop.produce(proto_records(bodies) + hop_poison)
        keyed.produce(json_records(bodies) + key_poison)
        for side in result:  # live state of every run (lateness 1 s: released by the timer)
            for run, body in zip(runs, bodies, strict=True):

                def live(side: Side = side, run: Run = run, n: int = len(body)) -> bool:
                    doc = _api_json(side, f"/runs/{run.trace_id}")
                    state = doc["state"] or {}
                    return bool(doc["found"] and state["spans"] >= n and state["pending"] == 0)

                _wait(live, f"{side.name}: live state of {run.trace_id}")
        hop.produce(proto_records(roots))
        keyed.produce(json_records(roots))
        for side in result:
            _wait(
                lambda side=side: all(
                    _api_json(side, f"/runs/{r}")["finished"] for r in side.run_ids
                ),
                f"{side.name}: runs finalized",
            )
        time.sleep(1.5)  # windowed counters and the last changelog writes
        yield c, result
    finally:
        for w in (hop, keyed):
            w.cleanup()


# ---------------------------------------------------------------------------- the scan


def test_no_canary_in_topics_api_metrics_logs_or_store(sides: tuple[Canaries, list[Side]]) -> None:
    c, both = sides
    leaks: list[str] = []
    for side in both:
        w = side.worker
        # every topic of this worker: its names all start with the app id
        topics = sorted(
            t for t in admin_client().list_topics(timeout=10).topics if t.startswith(w.app_id)
        )
        changelogs = [t for t in topics if t.endswith("-changelog")]
        assert set(w.topics.values()) <= set(topics), topics
        # one changelog per table, the versions and hold counts tables included (their keys
        # hold names and hold ids, never content: scanned like the others)
        assert len(TABLES) == 9
        assert sorted(changelogs) == sorted(f"{w.app_id}-{t}-changelog" for t in TABLES), topics
        counts: dict[str, int] = {}
        for topic in topics:
            records = read_to_end(topic)
            counts[topic[len(w.app_id) + 1 :]] = len(records)
            if topic == w.topics["input"]:
                found = set().union(*(c.find(record_text(r)) for r in records))
                assert len(found) >= 30, f"{side.name}: the scan does not see the input: {found}"
                continue
            for r in records:
                kinds = c.find(record_text(r))
                if kinds:
                    leaks.append(
                        f"{side.name} topic {topic} {r.partition()}@{r.offset()} "
                        f"key={r.key()!r:.80} headers={r.headers()!r:.300}: {kinds}"
                    )
        print(f"\n{side.name}: records per topic {counts}")
        assert counts["loop-detected"] >= 10 and counts["loop-runs"] == len(side.run_ids)
        assert counts["dead-letters"] == side.expected_dead, counts
        # the API: every run (finished now; live answers were kept above), aggregates, errors
        for run_id in side.run_ids:
            _api_json(side, f"/runs/{run_id}")
        for path in (
            "/healthz",
            "/loops",
            "/loops?by=shape",
            "/loops?by=shape,prompt_version,tool_version&since=1d",
            "/runs",
            "/runs?since=2h",
            "/episodes?limit=50",
            "/loops?by=tool_name,service_name,agent_name",
            f"/find?run={sorted(side.run_ids)[0][:8]}",
            "/loops?by=colour",
            "/runs?since=forever",
            "/hold-counts",
            "/runs/" + "r" * 600,
            "/nothing-here",
        ):
            call(side, path, token=side.token)
        loops = json.loads(side.scanned["API GET /loops?by=shape -> 200"])
        shapes = {row["shape"] for row in loops["rows"]}
        print(f"{side.name}: shapes {sorted(shapes)}")
        assert shapes >= CANARY_SHAPES, CANARY_SHAPES - shapes
        side.scanned["/metrics"] = w.metrics_text()
        for where, text in side.scanned.items():
            if kinds := c.find(text):
                leaks.append(f"{side.name} {where}: {kinds}")
        log = w.log_path.read_bytes()
        assert len(log) > 10_000 and b"DEBUG" in log, "the worker did not log at debug level"
        if kinds := c.find_bytes(log):
            lines = [line[:300] for line in log.decode("latin-1").splitlines() if c.find(line)]
            leaks.append(
                f"{side.name} worker log ({len(lines)} lines): {kinds}\n    "
                + "\n    ".join(lines[:5])
            )
        # the rocksdb store (weaker: blocks may be compressed)
        for file in sorted(Path(w.env["LOOPWATCH_DATA_DIR"]).rglob("*")):
            if file.is_file() and (kinds := c.find_bytes(file.read_bytes())):
                leaks.append(f"{side.name} store file {file.name}: {kinds}")
    assert not leaks, "canaries leaked:\n" + "\n".join(leaks)


# ---------------------------------------------------------------------------- API security


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_api_is_read_only(sides: tuple[Canaries, list[Side]], method: str) -> None:
    _c, both = sides
    seen: Counter[int] = Counter()
    for side in both:
        run_id = side.run_ids[0]
        for path in ("/healthz", "/runs", "/loops", f"/runs/{run_id}", "/", "/table/runs/"):
            for token in {None, side.token}:
                status, text = call(side, path, method=method, token=token)
                seen[status] += 1
                assert status in (404, 405), (side.name, method, path, status, text[:200])
        # and nothing changed: the run is still there, finished
        assert _api_json(side, f"/runs/{run_id}")["finished"] is True
    print(f"\n{method}: {dict(seen)}")


@pytest.mark.parametrize("method", ["POST", "DELETE"])
def test_the_only_writes_are_holds_and_they_need_the_token(
    sides: tuple[Canaries, list[Side]], method: str
) -> None:
    """Issue 38: /holds (POST) and /holds/{id} (DELETE) are the API's only writes. Without the
    token, or with a wrong one: 401. With it, the canary's body (no scope) and an unknown id
    are refused too (400 / 404): nothing is written either way."""
    _c, both = sides
    for side in both:
        path = "/holds" if method == "POST" else "/holds/hold-unknown"
        for token in (None, "wrong-token"):
            status, text = call(side, path, method=method, token=token)
            assert status == 401, (side.name, method, token, status, text[:200])
        status, text = call(side, path, method=method, token=side.token)
        # a worker without a token takes no writes at all
        expected = (400, 404) if side.token else (401,)
        assert status in expected, (side.name, method, status, text[:200])
        status, text = call(side, "/holds?all=1", token=side.token)
        assert status == 200 and json.loads(text)["holds"] == [], text[:300]


def _listeners(port: int) -> list[str]:
    """Local addresses of the LISTEN sockets on `port` (/proc/net/tcp and tcp6)."""
    out = []
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A = LISTEN
                continue
            if name == "tcp":
                out.append(socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(addr_hex, 16))))
            else:
                raw = bytes.fromhex(addr_hex)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                out.append(socket.inet_ntop(socket.AF_INET6, words))
    return out


def _non_loopback_ipv4() -> list[str]:
    """This machine's IPv4 addresses other than 127.x (SIOCGIFADDR per interface)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            addr = socket.inet_ntoa(packed[20:24])
            if not addr.startswith("127."):
                out.append(addr)
    return out


def test_api_listens_on_loopback_only(sides: tuple[Canaries, list[Side]]) -> None:
    _c, both = sides
    others = _non_loopback_ipv4()
    print(f"\nnon-loopback addresses: {others}")
    for side in both:
        port = side.worker.web_port
        assert "LOOPWATCH_WEB_HOST" not in side.worker.env  # the default
        listeners = _listeners(port)
        assert listeners == ["127.0.0.1"], (side.name, port, listeners)
        for addr in others:
            with socket.socket() as sock:
                sock.settimeout(3)
                with pytest.raises(OSError):
                    sock.connect((addr, port))
        metrics = _listeners(int(side.worker.env["LOOPWATCH_METRICS_PORT"]))
        print(f"{side.name}: API on {listeners}, metrics on {metrics} (documented default 0.0.0.0)")


def test_bearer_token_is_enforced_and_never_echoed(sides: tuple[Canaries, list[Side]]) -> None:
    _c, both = sides
    keyed = next(s for s in both if s.token)
    hop = next(s for s in both if not s.token)
    run_id = keyed.run_ids[0]
    wrong = "not-the-token-7c1d"
    for path in ("/loops", "/runs", f"/runs/{run_id}", "/loops?by=shape&since=1h"):
        assert call(keyed, path)[0] == 401
        status, text = call(keyed, path, token=wrong)
        assert status == 401 and wrong not in text and TOKEN not in text
        assert call(keyed, path, token=TOKEN + "x")[0] == 401
        assert call(keyed, path, token=TOKEN[:-1])[0] == 401
        assert call(keyed, path, Authorization=f"Basic {TOKEN}")[0] == 401
        assert call(keyed, path, Authorization=TOKEN)[0] == 401
        assert call(keyed, path, Authorization="Bearer")[0] == 401
        sep = "&" if "?" in path else "?"
        assert call(keyed, f"{path}{sep}token={TOKEN}")[0] == 401
        assert call(keyed, path, token=TOKEN)[0] == 200
        assert call(hop, path)[0] == 200  # no token configured: open
    status, text = call(keyed, "/healthz")  # liveness needs no token, shows none
    assert status == 200 and TOKEN not in text
    log = keyed.worker.log_path.read_text(errors="replace")
    assert TOKEN not in log, "the API token is in the worker log"


BAD_QUERIES = [
    "/loops?by=shape,colour",
    "/loops?by=",
    "/loops?by=,",
    "/loops?by=shape,shape",
    "/loops?by=SHAPE",
    "/loops?since=abc",
    "/loops?since=-1h",
    "/loops?since=0",
    "/loops?since=1y",
    "/loops?since=1.5h",
    "/loops?since=9999999999",
    "/loops?since=367d",
    "/loops?since=%00",
    "/loops?since=%EF%BC%91h",  # fullwidth digit one
    "/runs?since=abc",
    "/runs?since=-1h",
    "/runs?since=",
    "/hold-counts?since=",
    "/hold-counts?since=abc",
    "/runs/" + "x" * 513,
]


def test_malformed_query_parameters_are_400(sides: tuple[Canaries, list[Side]]) -> None:
    _c, both = sides
    for side in both:
        for path in BAD_QUERIES:
            status, text = call(side, path, token=side.token)
            assert status == 400, (side.name, path, status, text[:200])
            assert json.loads(text)["error"], (side.name, path)
        # odd but possible run ids: an answer, never a server error
        for path in (
            "/runs/%00",
            "/runs/%FF%FE",
            "/runs/%E2%98%83",
            "/runs/a%2Fb",
            "/runs/..%2F..",
        ):
            status, text = call(side, path, token=side.token)
            assert status in (200, 400, 404), (side.name, path, status, text[:200])
