"""A guarded run's spans, exported by the real OpenTelemetry SDK, streamed through
`loopwatch worker` on the real broker (issue 37): the worker scores them as the replay does.
An observed stall gives the platform's event with the guard's own event id; an enforced
denial gives `termination_reason loop_guard` (stated) with `guard_before_dispatch`; a denial
the integration ignored gives a guard_ignored event."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from loopwatch_guard import DENY, Guard, LoopGuardStop
from loopwatch_guard.integrations.plain import call
from opentelemetry import trace

from detectors.policy import load_policy, policy_from_mapping
from tests.guard_support import FakeTool, export_message, memory_exporter
from tests.otlp_build import replay_messages
from tests.support.kafka import require_broker
from tests.support.worker_proc import EXAMPLE_POLICY, FINGERPRINT_KEY, WorkerProc, write_policy

pytestmark = pytest.mark.kafka

ORDER = {"order_id": "A12", "status": "delivered", "version": 7}


def _guard(mode: str) -> Guard:
    raw = yaml.safe_load(EXAMPLE_POLICY.read_text())
    raw["tools"]["lookup_order"]["guard"] = mode
    return Guard(policy_from_mapping(raw), fingerprint_key=FINGERPRINT_KEY.encode())


def _run(guard: Guard, calls: int, *, ignore_denial: bool = False) -> tuple[str, list[Any]]:
    """One agent run of `calls` identical stalled lookups; returns (trace id, decisions)."""
    tracer = trace.get_tracer("guarded-agent")
    lookup = FakeTool("lookup_order", [ORDER])
    with tracer.start_as_current_span("invoke_agent support") as span:
        run = guard.run(agent="support")
        for i in range(calls):
            if ignore_denial and i == 2:
                decision = run.before_tool("lookup_order", {"order_id": "A12"}, "ignored-3")
                assert decision.enforced and decision.action == DENY
                attrs = {
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "lookup_order",
                    "gen_ai.tool.call.id": "ignored-3",
                    "gen_ai.tool.call.arguments": '{"order_id": "A12"}',
                    "gen_ai.tool.call.result": json.dumps(ORDER),
                }
                with tracer.start_as_current_span("execute_tool lookup_order", attributes=attrs):
                    lookup(order_id="A12")  # dispatched anyway
                break
            try:
                call(run, "lookup_order", lookup, {"order_id": "A12"})
            except LoopGuardStop:
                break  # the run ends, as an agent's loop does on the guard's stop
        trace_id = f"{span.get_span_context().trace_id:032x}"
    return trace_id, list(run.decisions)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_broker()
    workdir = tmp_path_factory.mktemp("guard")
    policy = write_policy(workdir / "policy.yaml", finalize_grace_seconds=2, idle_timeout_seconds=5)
    exporter = memory_exporter()
    runs = {
        "observed": _run(_guard("observe"), 3),
        "enforced": _run(_guard("enforce"), 4),
        "ignored": _run(_guard("enforce"), 3, ignore_denial=True),
    }
    messages = [export_message(exporter.get_finished_spans())]
    events, summaries = replay_messages(messages, load_policy(policy), FINGERPRINT_KEY.encode())
    worker = WorkerProc(workdir, policy)
    try:
        worker.start()
        worker.wait_ready()
        worker.produce((None, m) for m in messages)
        ids = {trace_id for trace_id, _ in runs.values()}
        finished = worker.read(
            "runs",
            until=lambda rs: {json.loads(r.value())["run_id"] for r in rs} >= ids,
            timeout=90,
        )
        stream_events = worker.read(
            "events",
            until=lambda rs: (
                {json.loads(r.value())["event_id"] for r in rs} >= {e["event_id"] for e in events}
            ),
            timeout=30,
        )
        yield {
            "runs": runs,
            "replay": (events, {s["run_id"]: s for s in summaries}),
            "stream": (
                [json.loads(r.value()) for r in stream_events],
                {s["run_id"]: s for s in (json.loads(r.value()) for r in finished)},
            ),
        }
    finally:
        worker.cleanup()


@pytest.mark.parametrize("path", ["replay", "stream"])
def test_an_observed_stall_is_the_platforms_event_with_the_guards_id(
    streamed: dict[str, Any], path: str
) -> None:
    trace_id, decisions = streamed["runs"]["observed"]
    events, summaries = streamed[path]
    [decision] = decisions
    [event] = [e for e in events if e["trace_id"] == trace_id]
    assert (event["shape"], event["event_id"]) == ("identical_repetition", decision.event_id)
    assert summaries[trace_id]["guard_fired"] is False


@pytest.mark.parametrize("path", ["replay", "stream"])
def test_an_enforced_denial_is_scored_loop_guard_before_dispatch(
    streamed: dict[str, Any], path: str
) -> None:
    trace_id, decisions = streamed["runs"]["enforced"]
    events, summaries = streamed[path]
    assert [d.action for d in decisions] == ["deny", "stop"]
    summary = summaries[trace_id]
    assert summary["termination_reason"] == "loop_guard"
    assert summary["termination_evidence"] == "stated"
    assert summary["guard_before_dispatch"] is True and summary["tool_after_guard"] is False
    assert summary["tool_calls"] == 2 and summary["guard_ignored"] == 0
    assert [e for e in events if e["trace_id"] == trace_id] == []


@pytest.mark.parametrize("path", ["replay", "stream"])
def test_an_ignored_denial_is_a_guard_ignored_event(streamed: dict[str, Any], path: str) -> None:
    trace_id, _ = streamed["runs"]["ignored"]
    events, summaries = streamed[path]
    [event] = [e for e in events if e["trace_id"] == trace_id and e["shape"] == "guard_ignored"]
    assert event["call_ids"] == ["ignored-3"] and event["severity"] == "critical"
    assert summaries[trace_id]["guard_ignored"] == 1
