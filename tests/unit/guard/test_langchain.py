"""The seeds' QA cases through the LangChain 1.x integration: a real `create_agent` graph
with LoopGuardMiddleware, a scripted chat model (no network) and tools that count their
invocations outside what they return."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import StructuredTool
from loopwatch_guard import DENY, RECONCILE, STOP, Guard
from loopwatch_guard.integrations.langchain import LoopGuardMiddleware
from opentelemetry import trace

from tests.guard_support import FakeTool, memory_exporter
from tests.unit.guard.test_runtime import KEY, ORDER, guard_events, policy


class ScriptedChat(BaseChatModel):
    """Proposes the script's calls one a turn; a reasonable model answers once a tool
    says "Loop guard:", a stubborn one keeps proposing."""

    script: list[Any]
    stubborn: bool = False
    turn: int = 0

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        last = messages[-1]
        if (
            not self.stubborn
            and isinstance(last, ToolMessage)
            and str(last.content).startswith("Loop guard:")
        ):
            reply = AIMessage(content="final answer (the loop guard denied a repeated call)")
        elif self.turn < len(self.script):
            name, args = self.script[self.turn]
            self.turn += 1
            reply = AIMessage(
                content="",
                tool_calls=[
                    {"name": name, "args": args, "id": f"call-{self.turn}", "type": "tool_call"}
                ],
                usage_metadata={"input_tokens": 100, "output_tokens": 20, "total_tokens": 120},
            )
        else:
            reply = AIMessage(content="final answer")
        return ChatResult(generations=[ChatGeneration(message=reply)])

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self


def counting(name: str, answers: list[Any], seen: list[dict[str, Any]]) -> StructuredTool:
    params = {
        "lookup_order": ["order_id"],
        "get_export_status": ["export_id"],
        "search_orders": ["tenant", "query"],
        "issue_refund": ["order_id", "amount", "idempotency_key"],
        "get_refund_status": ["order_id"],
    }[name]

    fake = FakeTool(name, answers, seen)

    def tool(**kwargs: Any) -> Any:  # (LangChain reads a function's annotations, not a callable's)
        return fake(**kwargs)

    from pydantic import create_model

    schema = create_model(f"{name}_args", **{p: (Any, ...) for p in params})  # type: ignore[call-overload]
    return StructuredTool.from_function(tool, name=name, description=name, args_schema=schema)


def run_agent(
    guard: Guard,
    script: list[tuple[str, dict[str, Any]]],
    tools: dict[str, tuple[list[Any], list[dict[str, Any]]]],
    *,
    stubborn: bool = False,
) -> str:
    agent = create_agent(
        ScriptedChat(script=script, stubborn=stubborn),
        [counting(name, answers, seen) for name, (answers, seen) in tools.items()],
        middleware=[LoopGuardMiddleware(guard)],
    )
    with trace.get_tracer("qa").start_as_current_span("invoke_agent support"):
        out = agent.invoke(
            {"messages": [{"role": "user", "content": "where is my order?"}]},
            {"run_id": uuid.uuid4(), "recursion_limit": 100},
        )
    return str(out["messages"][-1].content)


@pytest.mark.parametrize("repeats", [0, 1, 2, 3])
def test_the_third_stalled_identical_call_is_denied(repeats: int) -> None:
    exporter = memory_exporter()
    seen: list[dict[str, Any]] = []
    script = [("lookup_order", {"order_id": "A12"})] * repeats
    result = run_agent(
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


def test_a_stubborn_model_is_stopped_and_the_graph_ends() -> None:
    memory_exporter()
    seen: list[dict[str, Any]] = []
    guard = Guard(policy(), fingerprint_key=KEY)
    script = [("lookup_order", {"order_id": "A12"})] * 6
    result = run_agent(guard, script, {"lookup_order": ([ORDER], seen)}, stubborn=True)
    assert len(seen) == 2
    assert result.startswith("Stopped by the loop guard (identical_repetition)")
    [run] = guard._runs.values()
    assert [d.action for d in run.decisions] == [DENY, STOP]


def test_polls_that_advance_and_two_tenants_are_never_denied() -> None:
    memory_exporter()
    polls: list[dict[str, Any]] = []
    searches: list[dict[str, Any]] = []
    guard = Guard(policy(), fingerprint_key=KEY)
    script = [("get_export_status", {"export_id": "e1"})] * 3 + [
        ("search_orders", {"tenant": "acme", "query": "late"}),
        ("search_orders", {"tenant": "globex", "query": "late"}),
    ] * 2
    result = run_agent(
        guard,
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
    [run] = guard._runs.values()
    assert run.decisions == []


def test_a_timed_out_refund_is_reconciled_first() -> None:
    memory_exporter()
    refunds: list[dict[str, Any]] = []
    statuses: list[dict[str, Any]] = []
    guard = Guard(policy(), fingerprint_key=KEY)
    script = [
        ("issue_refund", {"order_id": "A12", "amount": 30, "idempotency_key": "k1"}),
        ("issue_refund", {"order_id": "A12", "amount": 30, "idempotency_key": "k2"}),
        ("get_refund_status", {"order_id": "A12"}),
    ]
    result = run_agent(
        guard,
        script,
        {
            "issue_refund": ([{"ok": False, "code": "timeout"}, {"ok": True}], refunds),
            "get_refund_status": ([{"refund": "applied"}], statuses),
        },
        stubborn=True,
    )
    assert len(refunds) == 1 and len(statuses) == 1 and result == "final answer"
    [run] = guard._runs.values()
    assert [(d.action, d.shape) for d in run.decisions] == [(RECONCILE, "unsafe_side_effect_retry")]


def test_calling_again_after_the_goal_is_complete_stops() -> None:
    memory_exporter()
    polls: list[dict[str, Any]] = []
    script = [("get_export_status", {"export_id": "e1"})] * 3
    result = run_agent(
        Guard(policy(), fingerprint_key=KEY),
        script,
        {"get_export_status": ([{"status": "running"}, {"status": "complete"}], polls)},
        stubborn=True,
    )
    assert len(polls) == 2
    assert result.startswith("Stopped by the loop guard (goal_already_satisfied)")
