"""Holds on the real broker and worker (issue 38): `loopwatch hold add` through the on-call
API with the token; a guarded agent in another process (the plain integration) is denied its
next refund within the refresh interval plus a second while its reads still run;
`hold release` lets it through again; the hold survives a worker restart; without the token
nothing is written (401); a run hold stops exactly that run; with the worker stopped the
guard keeps its last set and fails open."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from streams.spanpath.spans import SpanEvent
from tests.support.kafka import require_broker
from tests.support.worker_proc import REPO, WorkerProc, write_policy

pytestmark = pytest.mark.kafka

TOKEN = "holds-test-token"
REFRESH = 0.5

# The agent: reads a command per line on stdin ("refund ORDER", "lookup ORDER", "run RUN
# TOOL"), answers one JSON line with the guard's decision for it (the tool runs if allowed).
AGENT = r"""
import json, sys
from loopwatch_guard import Guard
guard = Guard.from_policy(sys.argv[1], holds_url=sys.argv[2])
calls = 0
for line in sys.stdin:
    verb, *rest = line.split()
    if verb == "run":
        run_id, tool = rest
        d = guard.run(run_id, prompt_version="v1").before_tool(tool, {"order_id": "A1"})
    else:
        run = guard.run("agent-run", prompt_version="v1")
        tool = "issue_refund" if verb == "refund" else "lookup_order"
        args = {"order_id": rest[0], "amount": 5, "idempotency_key": rest[0]}
        d = run.before_tool(tool, args if tool == "issue_refund" else {"order_id": rest[0]})
        if d.allowed:
            calls += 1
            run.after_tool(d.call_id, result={"ok": True, "order": rest[0]})
    print(json.dumps({"action": d.action, "hold_id": d.hold_id, "calls": calls,
                      "failures": guard.holds.failures}), flush=True)
"""


class Agent:
    def __init__(self, policy: Path, url: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWATCH_")}
        env["PYTHONPATH"] = str(REPO)
        env["LOOPWATCH_API_TOKEN"] = TOKEN  # the worker has one: reading needs it too
        self.proc = subprocess.Popen(
            [sys.executable, "-c", AGENT, str(policy), url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def until(self, line: str, action: str, timeout: float) -> tuple[dict[str, Any], float]:
        """Ask again (a new order each time: no loop of our own) until `action` comes."""
        start = time.monotonic()
        for attempt in itertools.count():
            answer = self.ask(line.replace("{n}", str(attempt)))
            waited = time.monotonic() - start
            if answer["action"] == action or waited > timeout:
                return answer, waited
            time.sleep(0.05)
        raise AssertionError("unreachable")

    def close(self) -> str:
        assert self.proc.stdin is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        self.proc.wait(10)
        return self.proc.stderr.read()


def hold(
    worker: WorkerProc, *args: str, token: str | None = TOKEN
) -> subprocess.CompletedProcess[str]:
    return hold_cli(worker, "hold", *args, "--by", "oncall", token=token)


def hold_cli(
    worker: WorkerProc, *args: str, token: str | None = TOKEN
) -> subprocess.CompletedProcess[str]:
    """`loopwatch ARGS --url <the worker's API>` with the token (or none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWATCH_")}
    if token is not None:
        env["LOOPWATCH_API_TOKEN"] = token
    url = f"http://127.0.0.1:{worker.web_port}"
    return subprocess.run(
        [sys.executable, "-m", "streams.cli", *args, "--url", url],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_broker()
    workdir = tmp_path_factory.mktemp("holds")
    policy = write_policy(
        workdir / "policy.yaml",
        guard={"mode": "enforce", "holds_refresh_seconds": REFRESH},
        holds={"default_ttl": "1h", "max_ttl": "4h"},
    )
    raw = yaml.safe_load(policy.read_text())
    raw["tools"]["update_ticket"]["guard"] = "observe"  # no reconcile tool declared for it
    policy.write_text(yaml.safe_dump(raw, sort_keys=False))
    worker = WorkerProc(workdir, policy, LOOPWATCH_API_TOKEN=TOKEN)
    worker.start()
    worker.wait_ready()
    agent = Agent(policy, f"http://127.0.0.1:{worker.web_port}")
    try:
        yield {"worker": worker, "agent": agent, "policy": policy}
    finally:
        agent.close()
        worker.cleanup()


def test_a_side_effect_hold_denies_the_next_refund_and_lets_reads_run(
    setup: dict[str, Any],
) -> None:
    worker, agent = setup["worker"], setup["agent"]
    assert agent.ask("refund o-1")["action"] == "allow"
    placed = hold(
        worker, "add", "--prompt-version", "v1", "--side-effects", "--reason", "double refunds"
    )
    assert placed.returncode == 0, placed.stderr
    hold_id = placed.stdout.split()[0]
    assert "every side-effect tool call, prompt version v1" in placed.stdout
    denied, waited = agent.until("refund o-2-{n}", "deny", timeout=REFRESH + 5)
    assert denied["hold_id"] == hold_id and waited <= REFRESH + 1.0, (denied, waited)
    assert agent.ask("lookup o-2")["action"] == "allow"  # reads still run
    released = hold(worker, "release", hold_id)
    assert released.returncode == 0 and "released by oncall" in released.stdout
    allowed, waited = agent.until("refund o-3-{n}", "allow", timeout=REFRESH + 5)
    assert allowed["action"] == "allow" and waited <= REFRESH + 1.0
    listed = hold(worker, "list", "--all")
    assert hold_id in listed.stdout and "released" in listed.stdout and "by oncall" in listed.stdout


def test_without_the_token_nothing_is_written(setup: dict[str, Any]) -> None:
    worker = setup["worker"]
    refused = hold(worker, "add", "--tool", "lookup_order", "--reason", "x", token=None)
    assert refused.returncode == 2 and "LOOPWATCH_API_TOKEN" in refused.stderr, refused.stderr
    wrong = hold(worker, "add", "--tool", "lookup_order", "--reason", "x", token="wrong")
    assert wrong.returncode == 2 and "refused" in wrong.stderr, wrong.stderr
    status, doc = worker.api("/holds?all=1", token=TOKEN)
    assert status == 200 and all(h["scope"] != {"tool": "lookup_order"} for h in doc["holds"])


def test_bad_holds_are_one_line_and_exit_2(setup: dict[str, Any]) -> None:
    worker = setup["worker"]
    for args, says in (
        (("add", "--reason", "x"), "at least one of --service"),
        (("add", "--tool", "t", "--reason", "x", "--ttl", "9h"), "over the policy's maximum"),
        (("release", "hold-nope"), "no hold 'hold-nope'"),
    ):
        done = hold(worker, *args)
        assert done.returncode == 2 and says in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1


def test_a_run_hold_stops_exactly_that_run(setup: dict[str, Any]) -> None:
    worker, agent = setup["worker"], setup["agent"]
    placed = hold(worker, "add", "--run", "runaway-1", "--reason", "58 minutes of loops")
    assert placed.returncode == 0, placed.stderr
    stopped, _ = agent.until("run runaway-1 lookup_order", "stop", timeout=REFRESH + 5)
    assert stopped["action"] == "stop"
    assert agent.ask("run other-run lookup_order")["action"] == "allow"
    hold(worker, "release", placed.stdout.split()[0])


def test_a_hold_survives_a_worker_restart_and_the_guard_fails_open_meanwhile(
    setup: dict[str, Any],
) -> None:
    worker, agent = setup["worker"], setup["agent"]
    placed = hold(worker, "add", "--tool", "issue_refund", "--reason", "incident 42", "--ttl", "2h")
    assert placed.returncode == 0, placed.stderr
    hold_id = placed.stdout.split()[0]
    agent.until("refund o-9-{n}", "deny", timeout=REFRESH + 5)
    worker.stop()
    # unreachable: the guard keeps its last set (the hold still applies) and counts failures
    time.sleep(REFRESH * 4)
    answer = agent.ask("refund o-10")
    assert answer["action"] == "deny" and answer["failures"] >= 1
    worker.start()
    worker.wait_ready()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, doc = worker.api("/holds", token=TOKEN)
        if status == 200 and doc.get("loaded"):
            break
        time.sleep(0.2)
    assert hold_id in {h["id"] for h in doc["holds"]}
    hold(worker, "release", hold_id)


def test_a_runs_verdict_for_dispatchers_without_the_guard(setup: dict[str, Any]) -> None:
    """GET /verdicts/RUN: looping (the episode's shape and event id) once the worker saw the
    loop; held once a run hold names it; unknown for a run nobody saw."""
    from tests.otlp_build import encode_request
    from tests.spankit import Run

    worker = setup["worker"]
    run = Run(trace=0x38A)
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A12"}, {"status": "delivered", "version": 7})
    worker.produce([(None, encode_request(run.spans))])
    deadline = time.monotonic() + 30
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status, doc = worker.api(f"/verdicts/{run.trace_id}", token=TOKEN)
        if status == 200 and doc["verdict"] == "looping":
            break
        time.sleep(0.3)
    assert doc["verdict"] == "looping", doc
    assert [loop["shape"] for loop in doc["loops"]] == ["identical_repetition"]
    assert len(doc["loops"][0]["event_id"]) == 32
    placed = hold(worker, "add", "--run", run.trace_id, "--reason", "stop it")
    assert placed.returncode == 0, placed.stderr
    status, doc = worker.api(f"/verdicts/{run.trace_id}", token=TOKEN)
    assert doc["verdict"] == "held" and doc["holds"][0]["stops_run"] is True
    status, doc = worker.api("/verdicts/0123456789abcdef0123456789abcdef", token=TOKEN)
    assert (status, doc["verdict"], doc["found"]) == (200, "unknown", False)
    assert worker.api(f"/verdicts/{run.trace_id}")[0] == 401  # the token, as every read
    hold(worker, "release", placed.stdout.split()[0])


def test_tool_calls_under_a_hold_are_counted_per_hold(setup: dict[str, Any]) -> None:
    """An unguarded agent's tool spans under an active hold: the worker counts them
    (loopwatch_hold_violations_total, the HoldNotEnforced rule's series), once each however
    often they are delivered; calls of other tools are not counted. A guarded run's denial
    (its `loop_guard` event names the hold, as loopwatch_guard writes it) is counted for the
    hold, and `loopwatch query holds` shows per hold the calls denied, the runs affected and
    the calls that still ran."""
    from loopwatch_guard.decision import Decision
    from loopwatch_guard.trace import EVENT, attributes

    from tests.otlp_build import encode_request
    from tests.spankit import Run

    worker = setup["worker"]
    placed = hold(worker, "add", "--tool", "get_export_status", "--reason", "polling storm")
    assert placed.returncode == 0, placed.stderr
    hold_id = placed.stdout.split()[0]
    before = worker.metric("loopwatch_hold_violations_total")
    unguarded = Run(trace=0x38B)
    unguarded.clock = unguarded.start = time.time_ns() + 10**9  # the calls run now, held
    for _ in range(2):
        unguarded.tool("get_export_status", {"export_id": "e1"}, {"status": "running"})
    unguarded.tool("lookup_order", {"order_id": "A1"}, {"status": "delivered", "version": 1})
    worker.produce([(None, encode_request(unguarded.spans))])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if worker.metric("loopwatch_hold_violations_total") >= before + 2:
            break
        time.sleep(0.3)
    text = worker.metrics_text()
    assert worker.metric("loopwatch_hold_violations_total") == before + 2, text[-2000:]
    assert "loopwatch_hold_violations_total{prompt_version=" in text
    assert (
        'tool_name="lookup_order"'
        not in text.split("loopwatch_hold_violations_total", 1)[1].split("# HELP", 1)[0]
    )
    # the same spans again (an exporter's retry), with a guarded run whose call was denied
    guarded = Run(trace=0x38C)
    guarded.clock = guarded.start = time.time_ns() + 10**9
    guarded.tool("lookup_order", {"order_id": "A2"}, {"status": "delivered", "version": 1})
    decision = Decision(
        "deny", call_id="call-held-1", tool="get_export_status", mode="enforce", hold_id=hold_id
    )
    guarded.root(events=[SpanEvent(EVENT, guarded.clock, attributes(decision, "p1"))])
    worker.produce([(None, encode_request(unguarded.spans + guarded.spans))])
    deadline = time.monotonic() + 30
    while True:
        shown = query_holds(worker)
        row = next(r for r in shown["holds"] if r["id"] == hold_id)
        if row["denied"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert (row["denied"], row["executed"], row["runs"]) == (1, 2, 2), row
    assert worker.metric("loopwatch_hold_violations_total") == before + 2  # not twice
    table = hold_cli(worker, "query", "holds")
    assert table.returncode == 0, table.stderr
    line = next(x for x in table.stdout.splitlines() if x.startswith(hold_id))
    assert line.split()[1] == "active" and "2 calls still ran" in table.stdout, table.stdout
    hold(worker, "release", hold_id)


def query_holds(worker: WorkerProc) -> dict[str, Any]:
    done = hold_cli(worker, "query", "holds", "--json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))
