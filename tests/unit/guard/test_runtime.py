"""The seeds' QA cases as runtime tests (loop-guard-qa.txt), through the plain integration
(a hand-written agent loop: `guarded` tools, `running`, `LoopGuardStop`), a scripted model
and fake tools that count their invocations outside the answers they return; the spans are
the real OpenTelemetry SDK's, replayed through loopwatch to see what the platform scores.
"""

from __future__ import annotations

from typing import Any

import pytest
from loopwatch_guard import ALLOW, DENY, RECONCILE, STOP, Guard, LoopGuardStop, running
from loopwatch_guard.integrations.plain import call
from opentelemetry import trace

from detectors.errors import ConfigError
from detectors.policy import policy_from_mapping
from tests.guard_support import FakeTool, export_message, memory_exporter
from tests.otlp_build import replay_messages

KEY = b"qa-key"
ORDER = {"status": "delivered", "version": 7}


def policy(mode: str = "enforce", **extra: Any) -> Any:
    return policy_from_mapping(
        {
            "policy_version": "qa-1",
            "guard": {"mode": mode},
            "defaults": {"allowed_repeats": 2, **extra.pop("defaults", {})},
            "tools": {
                "lookup_order": {"identity": ["order_id"]},
                "get_export_status": {
                    "progress": {"state_field": "status", "terminal_states": ["complete"]}
                },
                "search_orders": {"identity": ["tenant", "query"]},
                "issue_refund": {
                    "side_effect": True,
                    "idempotency_key_arg": "idempotency_key",
                    "business_identity": ["order_id"],
                    "reconcile_tool": "get_refund_status",
                },
                "get_refund_status": {},
            },
            **extra,
        },
        "qa-policy",
    )


def agent(
    guard: Guard,
    script: list[tuple[str, dict[str, Any]]],
    tools: dict[str, FakeTool],
    *,
    stubborn: bool = False,
    turns: list[int] | None = None,
) -> tuple[str, list[Any]]:
    """A scripted model's run: proposes the script's calls in order. A reasonable model
    answers once a tool says "Loop guard:" (the denial reached it); a stubborn one keeps
    proposing. `turns`: how many of the script's calls each model turn requests."""
    tracer = trace.get_tracer("qa-agent")
    answers: list[Any] = []
    with tracer.start_as_current_span(
        "invoke_agent support",
        attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support"},
    ):
        run = guard.run(agent="support", prompt_version="v1")
        plan = list(turns) if turns else [1] * len(script)
        with running(run):
            try:
                i = 0
                for n in plan:
                    requested = script[i : i + n]
                    run.after_model(input_tokens=100, output_tokens=20, tool_calls=requested)
                    for name, args in requested:
                        answer = call(run, name, tools[name], args)
                        answers.append(answer)
                        if not stubborn and str(answer).startswith("Loop guard:"):
                            return "final answer (the loop guard denied a repeated call)", answers
                    i += n
            except LoopGuardStop as stop:
                return f"final answer (stopped by the loop guard: {stop.decision.shape})", answers
    return "final answer", answers


def replayed(spans: Any, pol: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events, summaries = replay_messages([export_message(spans)], pol, KEY)
    assert len(summaries) == 1, summaries
    return events, summaries[0]


def guard_events(spans: Any) -> list[dict[str, Any]]:
    return [
        {"time": e.timestamp, **dict(e.attributes or {})}
        for s in spans
        for e in s.events
        if e.name == "loop_guard"
    ]


def tool_spans(spans: Any) -> list[Any]:
    return [s for s in spans if (s.attributes or {}).get("gen_ai.operation.name") == "execute_tool"]


# ---------------------------------------------------------------------------- boundaries


@pytest.mark.parametrize("repeats", [0, 1, 2, 3])
def test_the_third_stalled_identical_call_is_denied_not_the_second_or_fourth(repeats: int) -> None:
    exporter = memory_exporter()
    lookup = FakeTool("lookup_order", [ORDER])
    guard = Guard(policy(), fingerprint_key=KEY)
    script = [("lookup_order", {"order_id": "A12"})] * repeats
    result, answers = agent(guard, script, {"lookup_order": lookup})
    assert len(lookup.invocations) == min(repeats, 2)
    spans = exporter.get_finished_spans()
    denials = guard_events(spans)
    if repeats < 3:
        assert denials == [] and "loop guard" not in result
        return
    assert "loop guard" in result and answers[2].startswith(
        "Loop guard: lookup_order was not called"
    )
    assert "A12" in answers[2]  # the attempt history, for the model
    [denial] = denials
    assert denial["loopwatch.guard.decision"] == DENY
    assert denial["loopwatch.guard.shape"] == "identical_repetition"
    assert denial["loopwatch.guard.mode"] == "enforce"
    assert denial["loopwatch.guard.policy_version"] == "qa-1"
    assert "A12" not in repr(denial)  # ids and names only on the trace
    # the denied call never started a tool span
    assert denial["loopwatch.guard.call_id"] not in {
        s.attributes.get("gen_ai.tool.call.id") for s in tool_spans(spans)
    }


def test_a_stubborn_model_is_stopped_after_the_denial() -> None:
    memory_exporter()
    lookup = FakeTool("lookup_order", [ORDER])
    guard = Guard(policy(), fingerprint_key=KEY)
    script = [("lookup_order", {"order_id": "A12"})] * 6
    result, answers = agent(guard, script, {"lookup_order": lookup}, stubborn=True)
    assert len(lookup.invocations) == 2
    assert result == "final answer (stopped by the loop guard: identical_repetition)"
    assert len(answers) == 3  # two answers, the denial; the fourth proposal is the stop
    run = next(iter(guard._runs.values()))
    assert [d.action for d in run.decisions] == [DENY, STOP]
    assert run.decisions[0].event_id == run.decisions[1].event_id


# ---------------------------------------------------------------------------- negative controls


def test_status_polls_that_advance_are_never_denied() -> None:
    memory_exporter()
    status = FakeTool(
        "get_export_status",
        [
            {"status": "queued"},
            {"status": "running"},
            {"status": "running-2"},
            {"status": "complete"},
        ],
    )
    guard = Guard(policy(), fingerprint_key=KEY)
    script = [("get_export_status", {"export_id": "e1"})] * 4
    result, _ = agent(guard, script, {"get_export_status": status})
    assert len(status.invocations) == 4 and result == "final answer"


def test_the_same_call_for_two_tenants_is_two_actions() -> None:
    memory_exporter()
    search = FakeTool("search_orders", [{"orders": ["o-1", "o-2"]}])
    guard = Guard(policy(), fingerprint_key=KEY)
    script = [
        ("search_orders", {"tenant": "acme", "query": "late"}),
        ("search_orders", {"tenant": "globex", "query": "late"}),
    ] * 2
    result, _ = agent(guard, script, {"search_orders": search})
    assert len(search.invocations) == 4 and result == "final answer"
    run = next(iter(guard._runs.values()))
    assert run.state.distinct_actions == 2


def test_identical_calls_of_one_model_turn_are_not_a_sequence() -> None:
    memory_exporter()
    lookup = FakeTool("lookup_order", [ORDER])
    guard = Guard(policy(), fingerprint_key=KEY)
    script = [("lookup_order", {"order_id": "A12"})] * 3
    result, _ = agent(guard, script, {"lookup_order": lookup}, turns=[3])
    assert len(lookup.invocations) == 3 and result == "final answer"
    run = next(iter(guard._runs.values()))
    assert run.state.parallel_duplicate_calls == 2


# ---------------------------------------------------------------------------- side effects, goals, budgets


def test_a_timed_out_refund_is_reconciled_before_any_second_execution() -> None:
    exporter = memory_exporter()
    refund = FakeTool("issue_refund", [TimeoutError("upstream timed out"), {"ok": True}])
    status = FakeTool("get_refund_status", [{"refund": "applied"}])
    guard = Guard(policy(), fingerprint_key=KEY)
    tools = {"issue_refund": refund, "get_refund_status": status}
    run = guard.run("refund-run")
    with trace.get_tracer("qa").start_as_current_span("invoke_agent"), running(run):
        with pytest.raises(TimeoutError):
            call(
                run,
                "issue_refund",
                refund,
                {"order_id": "A12", "amount": 30, "idempotency_key": "k1"},
            )
        retry = run.before_tool(
            "issue_refund", {"order_id": "A12", "amount": 30, "idempotency_key": "k2"}, "retry-1"
        )
        assert retry.action == RECONCILE and retry.enforced
        assert "get_refund_status" in (retry.message or "")
        assert len(refund.invocations) == 1  # nothing ran a second time
        call(run, "get_refund_status", tools["get_refund_status"], {"order_id": "A12"})
        after = run.before_tool(
            "issue_refund", {"order_id": "A12", "amount": 30, "idempotency_key": "k2"}, "retry-2"
        )
        assert after.action == ALLOW  # reconciled: the agent may decide
    [event] = guard_events(exporter.get_finished_spans())
    assert event["loopwatch.guard.decision"] == RECONCILE
    assert event["loopwatch.guard.shape"] == "unsafe_side_effect_retry"


def test_a_second_refund_after_success_is_denied() -> None:
    memory_exporter()
    refund = FakeTool("issue_refund", [{"ok": True}])
    guard = Guard(policy(), fingerprint_key=KEY)
    script = [
        ("issue_refund", {"order_id": "A12", "amount": 30, "idempotency_key": "k1"}),
        ("issue_refund", {"order_id": "A12", "amount": 30, "idempotency_key": "k2"}),
    ]
    result, answers = agent(guard, script, {"issue_refund": refund})
    assert len(refund.invocations) == 1 and "loop guard" in result
    assert "already succeeded" in answers[1]


def test_a_retry_reusing_its_idempotency_key_is_allowed() -> None:
    memory_exporter()
    refund = FakeTool("issue_refund", [TimeoutError("timed out"), {"ok": True}])
    guard = Guard(policy(), fingerprint_key=KEY)
    run = guard.run("same-key")
    args = {"order_id": "A12", "amount": 30, "idempotency_key": "k1"}
    with running(run):
        with pytest.raises(TimeoutError):
            call(run, "issue_refund", refund, args)
        assert call(run, "issue_refund", refund, args) == {"ok": True}
    assert len(refund.invocations) == 2


def test_calling_again_once_the_goal_is_complete_stops_the_run() -> None:
    memory_exporter()
    status = FakeTool("get_export_status", [{"status": "running"}, {"status": "complete"}])
    guard = Guard(policy(), fingerprint_key=KEY)
    script = [("get_export_status", {"export_id": "e1"})] * 3
    result, _ = agent(guard, script, {"get_export_status": status}, stubborn=True)
    assert len(status.invocations) == 2
    assert result == "final answer (stopped by the loop guard: goal_already_satisfied)"


def test_a_spent_step_budget_stops_the_run() -> None:
    memory_exporter()
    lookup = FakeTool("lookup_order", [ORDER])
    guard = Guard(policy(defaults={"budgets": {"steps": 5}}), fingerprint_key=KEY)
    script = [("lookup_order", {"order_id": f"A{i}"}) for i in range(10)]
    result, _ = agent(guard, script, {"lookup_order": lookup}, stubborn=True)
    assert len(lookup.invocations) == 5
    assert result == "final answer (stopped by the loop guard: budget_exhausted)"


# ---------------------------------------------------------------------------- modes


def test_observe_mode_decides_and_records_but_never_blocks() -> None:
    exporter = memory_exporter()
    lookup = FakeTool("lookup_order", [ORDER])
    guard = Guard(policy(mode="observe"), fingerprint_key=KEY)
    script = [("lookup_order", {"order_id": "A12"})] * 4
    result, answers = agent(guard, script, {"lookup_order": lookup}, stubborn=True)
    assert len(lookup.invocations) == 4 and result == "final answer"
    assert all(a == ORDER for a in answers)
    [event] = guard_events(exporter.get_finished_spans())
    assert (event["loopwatch.guard.decision"], event["loopwatch.guard.mode"]) == (DENY, "observe")


def test_a_tools_own_mode_sits_over_the_policys() -> None:
    pol = policy_from_mapping(
        {"guard": {"mode": "observe"}, "tools": {"lookup_order": {"guard": "enforce"}}}
    )
    assert pol.guard_mode_for("lookup_order") == "enforce"
    assert pol.guard_mode_for("search") == "observe"
    assert policy_from_mapping({}).guard_mode == "observe"  # the default


@pytest.mark.parametrize(
    ("tool", "where"),
    [
        ({"side_effect": True, "guard": "enforce"}, "tools.send_email.guard"),
        ({"side_effect": True, "idempotency_key_arg": "key"}, "guard.mode"),
    ],
)
def test_a_side_effect_tool_is_enforced_only_with_its_key_and_reconcile_tool(
    tool: dict[str, Any], where: str
) -> None:
    raw: dict[str, Any] = {"tools": {"send_email": tool}}
    if where == "guard.mode":
        raw["guard"] = {"mode": "enforce"}
    with pytest.raises(ConfigError) as err:
        policy_from_mapping(raw, "p.yaml")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"p.yaml: {where}:")
    assert "reconcile_tool" in message and "tools.send_email.guard: observe" in message


def test_a_bad_guard_mode_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="guard.mode.*observe, enforce"):
        policy_from_mapping({"guard": {"mode": "block"}})


# ---------------------------------------------------------------------------- the platform's view


def _stalled_run(mode: str) -> tuple[Any, Guard, list[Any]]:
    exporter = memory_exporter()
    lookup = FakeTool("lookup_order", [ORDER])
    guard = Guard(policy(mode=mode), fingerprint_key=KEY)
    script = [("lookup_order", {"order_id": "A12"})] * 3
    agent(guard, script, {"lookup_order": lookup}, stubborn=True)
    return exporter.get_finished_spans(), guard, lookup.invocations


def test_in_observe_mode_the_guards_event_id_is_the_platforms() -> None:
    spans, guard, _ = _stalled_run("observe")
    events, summary = replayed(spans, policy(mode="observe"))
    [decision] = next(iter(guard._runs.values())).decisions
    [event] = [e for e in events if e["shape"] == "identical_repetition"]
    assert event["event_id"] == decision.event_id
    [trigger] = [
        s for s in tool_spans(spans) if f"{s.context.span_id:016x}" == event["trigger_span_id"]
    ]
    assert trigger.attributes["gen_ai.tool.call.id"] == decision.call_id
    assert summary["guard_fired"] is False  # observed, not enforced: the run went on


def test_an_enforced_denial_is_scored_loop_guard_before_dispatch() -> None:
    spans, _, invocations = _stalled_run("enforce")
    assert len(invocations) == 2
    events, summary = replayed(spans, policy())
    assert summary["termination_reason"] == "loop_guard"
    assert summary["termination_evidence"] == "stated"
    assert summary["guard_fired"] is True
    assert summary["guard_before_dispatch"] is True
    assert summary["tool_after_guard"] is False
    assert [e["shape"] for e in events if e["shape"] == "identical_repetition"] == []


def _ignoring_integration(span_first: bool) -> tuple[list[Any], Any]:
    """Two stalled lookups, then a third the guard denies (enforced) and an integration
    that dispatches it anyway. `span_first`: the framework opened the tool span before
    asking the guard (its own record of the guarded call, not an execution after it)."""
    exporter = memory_exporter()
    lookup = FakeTool("lookup_order", [ORDER])
    guard = Guard(policy(), fingerprint_key=KEY)
    tracer = trace.get_tracer("qa-agent")
    with tracer.start_as_current_span("invoke_agent support"):
        run = guard.run(agent="support")
        for _ in range(2):
            call(run, "lookup_order", lookup, {"order_id": "A12"})
        attrs = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "lookup_order",
            "gen_ai.tool.call.id": "ignored-1",
            "gen_ai.tool.call.arguments": '{"order_id": "A12"}',
            "gen_ai.tool.call.result": '{"status": "delivered", "version": 7}',
        }
        if span_first:
            with tracer.start_as_current_span("execute_tool lookup_order", attributes=attrs):
                with trace.use_span(trace.get_current_span()):
                    pass
                decision = run.before_tool("lookup_order", {"order_id": "A12"}, "ignored-1")
        else:
            decision = run.before_tool("lookup_order", {"order_id": "A12"}, "ignored-1")
            with tracer.start_as_current_span("execute_tool lookup_order", attributes=attrs):
                lookup(order_id="A12")  # dispatched although the guard said no
    assert decision.enforced and decision.action == DENY
    return exporter.get_finished_spans(), decision


def test_a_denied_call_that_still_ran_is_a_guard_ignored_finding() -> None:
    spans, decision = _ignoring_integration(span_first=False)
    events, summary = replayed(spans, policy())
    [ignored] = [e for e in events if e["shape"] == "guard_ignored"]
    assert ignored["call_ids"] == ["ignored-1"]
    assert ignored["severity"] == "critical"
    assert ignored["recommended_action"] == "stop_and_escalate"
    assert ignored["evidence"]["denied_before_start_ms"] > 0
    assert summary["guard_ignored"] == 1
    assert summary["tool_after_guard"] is True and summary["guard_before_dispatch"] is False
    assert "guard_ignored" not in summary["shapes"]  # not a loop: the run did not loop on it


def test_a_framework_span_around_the_guarded_call_is_not_an_execution() -> None:
    spans, _ = _ignoring_integration(span_first=True)
    events, summary = replayed(spans, policy())
    assert [e for e in events if e["shape"] == "guard_ignored"] == []
    assert summary["guard_ignored"] == 0


def test_guard_ignored_events_have_their_own_counter() -> None:
    from prometheus_client import CollectorRegistry

    from alerts.metrics import Metrics

    spans, _ = _ignoring_integration(span_first=False)
    events, _ = replayed(spans, policy())
    metrics = Metrics(CollectorRegistry())
    for event in events:
        metrics.observe_event(event)
    text = metrics.exposition().decode()
    assert 'loopwatch_guard_ignored_total{prompt_version="v1",tool_name="lookup_order"' in text
    assert 'shape="guard_ignored"' not in text  # no loop event series


def test_a_coroutine_tool_is_guarded_the_same_way() -> None:
    import asyncio

    from loopwatch_guard import guarded

    memory_exporter()
    ran: list[str] = []

    @guarded("lookup_order")
    async def lookup_order(order_id: str) -> dict[str, Any]:
        ran.append(order_id)
        return ORDER

    async def agent_loop() -> list[Any]:
        guard = Guard(policy(), fingerprint_key=KEY)
        with running(guard.run("async-run")):
            return [await lookup_order(order_id="A12") for _ in range(3)]

    answers = asyncio.run(agent_loop())
    assert len(ran) == 2 and str(answers[2]).startswith("Loop guard: lookup_order was not called")
    assert asyncio.run(lookup_order(order_id="A12")) == ORDER  # outside a run: as is
