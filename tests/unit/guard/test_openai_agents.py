"""The seeds' QA cases through the OpenAI Agents SDK integration: the real Runner, its tool
input/output guardrails and run hooks, a ScriptedModel (no network) and function tools that
count their invocations outside what they return."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from agents import Agent, RunConfig, Runner, ToolInputGuardrailTripwireTriggered, function_tool
from agents.testing.model import ModelStep, ScriptedModel, assistant_message, function_call
from loopwatch_guard import DENY, RECONCILE, STOP, Guard
from loopwatch_guard.integrations.openai_agents import OpenAIAgentsGuard
from opentelemetry import trace

from tests.guard_support import FakeTool, memory_exporter
from tests.unit.guard.test_runtime import KEY, ORDER, guard_events, policy


def model(script: list[tuple[str, dict[str, Any]]], stubborn: bool) -> ScriptedModel:
    """Proposes the script's calls one a turn; a reasonable model answers once a tool
    output says "Loop guard:", a stubborn one keeps proposing."""
    calls = iter(script)
    ids = itertools.count(1)

    def respond(call: Any) -> Any:
        last = call.input[-1] if isinstance(call.input, list) and call.input else None
        output = last.get("output") if isinstance(last, dict) else None
        if not stubborn and isinstance(output, str) and output.startswith("Loop guard:"):
            return [assistant_message("final answer (the loop guard denied a repeated call)")]
        nxt = next(calls, None)
        if nxt is None:
            return [assistant_message("final answer")]
        return [function_call(nxt[0], nxt[1], call_id=f"call-{next(ids)}")]

    return ScriptedModel([ModelStep.respond(respond) for _ in range(len(script) + 2)])


def counting(name: str, answers: list[Any], seen: list[dict[str, Any]]) -> Any:
    """The SDK reads a tool's schema from its signature: one per tool, over a FakeTool."""
    tool = FakeTool(name, answers, seen)

    def lookup_order(order_id: str) -> Any:
        return tool(order_id=order_id)

    def get_export_status(export_id: str) -> Any:
        return tool(export_id=export_id)

    def search_orders(tenant: str, query: str) -> Any:
        return tool(tenant=tenant, query=query)

    def issue_refund(order_id: str, amount: int, idempotency_key: str) -> Any:
        return tool(order_id=order_id, amount=amount, idempotency_key=idempotency_key)

    def get_refund_status(order_id: str) -> Any:
        return tool(order_id=order_id)

    fns = {
        f.__name__: f
        for f in (lookup_order, get_export_status, search_orders, issue_refund, get_refund_status)
    }
    return function_tool(fns[name])


def run_agent(
    guard: Guard,
    script: list[tuple[str, dict[str, Any]]],
    tools: dict[str, tuple[list[Any], list[dict[str, Any]]]],
    *,
    stubborn: bool = False,
) -> tuple[str, OpenAIAgentsGuard]:
    guarded = OpenAIAgentsGuard(guard)
    agent = guarded.guard_agent(
        Agent(
            name="support",
            tools=[counting(name, answers, seen) for name, (answers, seen) in tools.items()],
            model=model(script, stubborn),
        )
    )

    async def go() -> str:
        with trace.get_tracer("qa").start_as_current_span("invoke_agent support"):
            try:
                result = await Runner.run(
                    agent,
                    "where is my order?",
                    hooks=guarded.hooks(run_id="agents-run"),
                    max_turns=50,
                    run_config=RunConfig(tracing_disabled=True),
                )
                return str(result.final_output)
            except ToolInputGuardrailTripwireTriggered as stop:
                decision = stop.output.output_info
                return f"final answer (stopped by the loop guard: {decision.shape})"

    return asyncio.run(go()), guarded


@pytest.mark.parametrize("repeats", [0, 1, 2, 3])
def test_the_third_stalled_identical_call_is_denied(repeats: int) -> None:
    exporter = memory_exporter()
    seen: list[dict[str, Any]] = []
    script = [("lookup_order", {"order_id": "A12"})] * repeats
    result, _ = run_agent(
        Guard(policy(), fingerprint_key=KEY), script, {"lookup_order": ([ORDER], seen)}
    )
    assert len(seen) == min(repeats, 2)
    events = guard_events(exporter.get_finished_spans())
    if repeats < 3:
        assert result == "final answer" and events == []
    else:
        assert result == "final answer (the loop guard denied a repeated call)"
        [event] = events
        assert (event["loopwatch.guard.decision"], event["loopwatch.guard.call_id"]) == (
            DENY,
            "call-3",
        )


def test_a_stubborn_model_is_stopped_by_the_sdks_own_tripwire() -> None:
    memory_exporter()
    seen: list[dict[str, Any]] = []
    script = [("lookup_order", {"order_id": "A12"})] * 6
    result, guarded = run_agent(
        Guard(policy(), fingerprint_key=KEY),
        script,
        {"lookup_order": ([ORDER], seen)},
        stubborn=True,
    )
    assert len(seen) == 2
    assert result == "final answer (stopped by the loop guard: identical_repetition)"
    [run] = guarded.guard._runs.values()
    assert [d.action for d in run.decisions] == [DENY, STOP]


def test_polls_that_advance_and_two_tenants_are_never_denied() -> None:
    memory_exporter()
    polls: list[dict[str, Any]] = []
    searches: list[dict[str, Any]] = []
    script = [("get_export_status", {"export_id": "e1"})] * 3 + [
        ("search_orders", {"tenant": "acme", "query": "late"}),
        ("search_orders", {"tenant": "globex", "query": "late"}),
    ] * 2
    result, guarded = run_agent(
        Guard(policy(), fingerprint_key=KEY),
        script,
        {
            "get_export_status": (
                [{"status": "queued"}, {"status": "running"}, {"status": "done-1"}],
                polls,
            ),
            "search_orders": ([{"orders": ["o-1", "o-2"]}], searches),
        },
    )
    assert (len(polls), len(searches), result) == (3, 4, "final answer")
    [run] = guarded.guard._runs.values()
    assert run.decisions == []


def test_a_timed_out_refund_is_reconciled_first() -> None:
    memory_exporter()
    refunds: list[dict[str, Any]] = []
    statuses: list[dict[str, Any]] = []
    script = [
        ("issue_refund", {"order_id": "A12", "amount": 30, "idempotency_key": "k1"}),
        ("issue_refund", {"order_id": "A12", "amount": 30, "idempotency_key": "k2"}),
        ("get_refund_status", {"order_id": "A12"}),
    ]
    result, guarded = run_agent(
        Guard(policy(), fingerprint_key=KEY),
        script,
        {
            "issue_refund": ([TimeoutError("upstream timed out"), {"ok": True}], refunds),
            "get_refund_status": ([{"refund": "applied"}], statuses),
        },
        stubborn=True,
    )
    assert len(refunds) == 1 and len(statuses) == 1 and result == "final answer"
    [run] = guarded.guard._runs.values()
    assert [(d.action, d.shape) for d in run.decisions] == [(RECONCILE, "unsafe_side_effect_retry")]


def test_calling_again_after_the_goal_is_complete_stops() -> None:
    memory_exporter()
    polls: list[dict[str, Any]] = []
    script = [("get_export_status", {"export_id": "e1"})] * 3
    result, _ = run_agent(
        Guard(policy(), fingerprint_key=KEY),
        script,
        {"get_export_status": ([{"status": "running"}, {"status": "complete"}], polls)},
        stubborn=True,
    )
    assert len(polls) == 2
    assert result == "final answer (stopped by the loop guard: goal_already_satisfied)"
