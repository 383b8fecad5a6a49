"""Holds in the guard (issue 38, the guard's side): what a hold matches (detectors/holds.py),
the policy's hold settings, and the guard's background client against a real HTTP server
answering GET /holds with ETags: a matching call is denied with the hold's id (a run hold
stops the run), nothing is asked on the decision path, an unreachable API keeps the last
set and fails open (or closed for side effects), and says so once a minute."""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from loopwatch_guard import DENY, STOP, Guard
from loopwatch_guard.holds import UNREACHABLE, HoldsClient

from detectors.errors import ConfigError
from detectors.holds import Call, Hold, HoldError, Scope, matches, parse_duration, scope_from
from detectors.policy import policy_from_mapping
from tests.guard_support import memory_exporter
from tests.unit.guard.test_runtime import KEY, guard_events

POLICY = {
    "policy_version": "holds-1",
    "guard": {"mode": "enforce"},
    "tools": {
        "lookup_order": {"identity": ["order_id"]},
        "issue_refund": {
            "side_effect": True,
            "idempotency_key_arg": "idempotency_key",
            "business_identity": ["order_id"],
            "reconcile_tool": "get_refund_status",
        },
        "get_refund_status": {},
    },
}


def hold(id: str, ttl_s: float = 600, **scope: Any) -> dict[str, Any]:
    now = time.time_ns()
    return Hold(
        id, Scope(**scope), "refunds went out twice", "oncall", now, now + int(ttl_s * 1e9)
    ).to_doc()


# ---------------------------------------------------------------------------- the model


def test_a_scope_must_name_something_and_only_known_fields() -> None:
    with pytest.raises(HoldError, match="matches every call is refused"):
        scope_from({})
    with pytest.raises(HoldError, match="unknown field 'team'"):
        scope_from({"team": "x"})
    with pytest.raises(HoldError, match="tool_version: needs scope.tool"):
        scope_from({"tool_version": "3"})
    with pytest.raises(HoldError, match="every side-effect tool already"):
        scope_from({"tool": "issue_refund", "side_effects": True})
    assert scope_from({"prompt_version": "v12", "side_effects": True}).describe() == (
        "every side-effect tool call, prompt version v12"
    )


@pytest.mark.parametrize(
    ("scope", "call", "hit"),
    [
        ({"tool": "issue_refund"}, {"tool": "issue_refund"}, True),
        (
            {"tool": "issue_refund", "tool_version": "2"},
            {"tool": "issue_refund", "tool_version": "3"},
            False,
        ),
        ({"side_effects": True}, {"tool": "lookup_order"}, False),
        ({"side_effects": True}, {"tool": "issue_refund", "side_effect": True}, True),
        ({"prompt_version": "v12"}, {"tool": "lookup_order", "prompt_version": "v11"}, False),
        ({"run": "r1"}, {"tool": "lookup_order", "run_id": "r1"}, True),
        ({"run": "r1"}, {"tool": "lookup_order", "run_id": "r2"}, False),
    ],
)
def test_every_field_of_the_scope_must_equal_the_calls(
    scope: dict[str, Any], call: dict[str, Any], hit: bool
) -> None:
    facts = {
        "run_id": "r0",
        "tool_version": None,
        "service": "support-bot",
        "agent": "support",
        "prompt_version": "v12",
        "side_effect": False,
        **call,
    }
    now = time.time_ns()
    h = Hold("h1", scope_from(scope), "", "", now, now + 10**12)
    assert matches(h, Call(**facts)) is hit


def test_durations_and_the_policys_hold_settings() -> None:
    assert parse_duration("90s", "ttl") == 90 and parse_duration("2h", "ttl") == 7200
    with pytest.raises(HoldError, match="expected a duration"):
        parse_duration("soon", "ttl")
    p = policy_from_mapping(
        {"holds": {"default_ttl": "30m", "max_ttl": "4h"}, "guard": {"holds_refresh_seconds": 1}}
    )
    assert (p.hold_default_ttl_seconds, p.hold_max_ttl_seconds, p.holds_refresh_seconds) == (
        1800,
        14400,
        1,
    )
    with pytest.raises(ConfigError, match="default_ttl: longer than holds.max_ttl"):
        policy_from_mapping({"holds": {"default_ttl": "2d", "max_ttl": "1d"}})


# ---------------------------------------------------------------------------- the client


class HoldsServer:
    """GET /holds with an ETag over the current set; counts requests and 304s."""

    def __init__(self) -> None:
        self.holds: list[dict[str, Any]] = []
        self.requests = 0
        self.not_modified = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                owner.requests += 1
                body = json.dumps({"holds": owner.holds}).encode()
                etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
                if self.headers.get("If-None-Match") == etag:
                    owner.not_modified += 1
                    self.send_response(304)
                    self.send_header("ETag", etag)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("ETag", etag)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[HoldsServer]:
    s = HoldsServer()
    yield s
    s.close()


def guarded(client: HoldsClient) -> Guard:
    return Guard(policy_from_mapping(POLICY), fingerprint_key=KEY, holds=client)


def test_a_held_side_effect_is_denied_with_the_holds_id_and_reads_still_run(
    server: HoldsServer,
) -> None:
    exporter = memory_exporter()
    server.holds = [hold("hold-1", prompt_version="v12", side_effects=True)]
    client = HoldsClient(server.url, refresh_seconds=0.2)
    client.start()
    try:
        run = guarded(client).run("r1", prompt_version="v12")
        from opentelemetry import trace

        with trace.get_tracer("qa").start_as_current_span("invoke_agent"):
            refund = run.before_tool(
                "issue_refund", {"order_id": "A1", "idempotency_key": "k"}, "c1"
            )
            read = run.before_tool("lookup_order", {"order_id": "A1"}, "c2")
        assert (refund.action, refund.hold_id, refund.enforced) == (DENY, "hold-1", True)
        assert "refunds went out twice" in (refund.message or "")
        assert read.action == "allow"
        [event] = guard_events(exporter.get_finished_spans())
        assert event["loopwatch.guard.hold_id"] == "hold-1"
        # released: the next refresh lets it through; an unchanged set costs a 304
        server.holds = []
        deadline = time.monotonic() + 5
        while client.holds and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.before_tool("issue_refund", {"order_id": "A2"}, "c3").action == "allow"
        time.sleep(0.5)
        assert server.not_modified >= 1
    finally:
        client.stop()


def test_a_run_hold_stops_exactly_that_run(server: HoldsServer) -> None:
    server.holds = [hold("hold-run", run="r-runaway")]
    client = HoldsClient(server.url, refresh_seconds=60)
    client.start()
    guard = guarded(client)
    stopped = guard.run("r-runaway").before_tool("lookup_order", {"order_id": "A1"}, "c1")
    other = guard.run("r-other").before_tool("lookup_order", {"order_id": "A1"}, "c1")
    assert (stopped.action, stopped.hold_id) == (STOP, "hold-run")
    assert other.action == "allow"
    # the stop ends the run: whatever it proposes next is stopped
    assert guard.run("r-runaway").before_tool("get_refund_status", {}, "c2").action == STOP
    client.stop()


def test_expired_holds_do_not_match(server: HoldsServer) -> None:
    server.holds = [hold("old", ttl_s=-1, tool="lookup_order")]
    client = HoldsClient(server.url, refresh_seconds=60)
    client.start()
    decision = guarded(client).run("r1").before_tool("lookup_order", {"order_id": "A1"}, "c1")
    assert decision.action == "allow"
    client.stop()


def test_the_decision_path_makes_no_request(server: HoldsServer) -> None:
    server.holds = [hold("hold-1", tool="issue_refund")]
    client = HoldsClient(server.url, refresh_seconds=3600)
    client.start()
    asked = server.requests
    run = guarded(client).run("r1")
    for i in range(50):
        run.before_tool("lookup_order", {"order_id": f"A{i}"}, f"c{i}")
    assert server.requests == asked
    client.stop()


def test_unreachable_keeps_the_last_set_fails_open_and_logs_once_a_minute(
    server: HoldsServer, caplog: pytest.LogCaptureFixture
) -> None:
    server.holds = [hold("hold-1", tool="lookup_order")]
    now = [time.time_ns()]
    client = HoldsClient(server.url, refresh_seconds=3600, clock=lambda: now[0])
    client.start()
    server.close()
    with caplog.at_level(logging.WARNING, logger="loopwatch_guard"):
        for _ in range(5):
            assert client.refresh() is False
        now[0] += 61 * 10**9
        client.refresh()
    assert client.failures == 6
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 2
    run = guarded(client).run("r1")
    assert run.before_tool("lookup_order", {"order_id": "A1"}, "c1").hold_id == "hold-1"
    assert run.before_tool("issue_refund", {"order_id": "A1"}, "c2").action == "allow"  # open


def test_side_effects_can_fail_closed_while_the_api_is_unreachable() -> None:
    client = HoldsClient("http://127.0.0.1:9", side_effects_fail_closed=True, timeout=0.2)
    client.start()
    run = guarded(client).run("r1")
    refund = run.before_tool("issue_refund", {"order_id": "A1"}, "c1")
    assert (refund.action, refund.hold_id) == (DENY, UNREACHABLE)
    assert run.before_tool("lookup_order", {"order_id": "A1"}, "c2").action == "allow"
    client.stop()


def test_the_index_finds_what_a_scan_of_every_hold_finds() -> None:
    """The client files holds by run, tool, prompt version, service or agent: on random
    holds and calls it answers as matching every hold in turn would."""
    import random

    from detectors.model import TOOL, Step

    rng = random.Random(38)
    pick = lambda *xs: rng.choice(xs)  # noqa: E731
    now = time.time_ns()
    holds = []
    for i in range(300):
        scope: dict[str, Any] = {}
        for name, values in (
            ("run", ("r1", "r2")),
            ("tool", ("lookup_order", "issue_refund")),
            ("prompt_version", ("v1", "v2")),
            ("service", ("s1", "s2")),
            ("agent", ("a1", "a2")),
        ):
            if rng.random() < 0.25:
                scope[name] = pick(*values)
        if rng.random() < 0.3 and "tool" not in scope:
            scope["side_effects"] = True
        if not scope:
            scope["agent"] = "a1"
        holds.append(Hold(f"h{i}", scope_from(scope), "", "", now, now + pick(-1, 10**12)))
    client = HoldsClient("http://127.0.0.1:9")
    client.holds = tuple(holds)
    guard = guarded(client)
    for _ in range(500):
        run = guard.run(
            pick("r1", "r2", "r3"),
            service=pick("s1", "s2", None),
            agent=pick("a1", "a2", None),
            prompt_version=pick("v1", "v2", None),
        )
        step = Step(run.run_id, "t", "s", None, TOOL, 0, 0)
        step.name = pick("lookup_order", "issue_refund", "get_refund_status")
        side = step.name == "issue_refund"
        found = client.match(run, step)
        expected = {
            h.id
            for h in holds
            if h.active(time.time_ns())
            and matches(
                h,
                Call(run.run_id, step.name, None, run.service, run.agent, run.prompt_version, side),
            )
        }
        assert (found.id if found else None) in (expected or {None}), (found, expected)
        guard.end(run.run_id)
