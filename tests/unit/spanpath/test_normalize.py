"""Span → Step under the three conventions; nothing raw survives normalization."""

from __future__ import annotations

import json

from detectors.fingerprint import Fingerprinter
from detectors.model import AGENT, HANDOFF, LLM, OTHER, PLAN, SUMMARY, TOOL, denials
from detectors.policy import policy_from_mapping
from streams.spanpath.normalize import Normalizer
from streams.spanpath.spans import STATUS_ERROR, STATUS_OK, SpanEvent, SpanRecord
from tests.spankit import EXAMPLE_POLICY

TRACE = "0af7651916cd43dd8448eb211c80319c"
RES = {"service.name": "support-bot", "prompt.version": "support-v13", "tool.version": "9"}


def span(
    name,
    attrs,
    *,
    parent="b7ad6b7169203331",
    status=0,
    message="",
    events=None,
    resource=RES,
    sid="00f067aa0ba902b7",
):
    return SpanRecord(
        TRACE, sid, parent, name, 1, 10, 20, status, message, attrs, resource, events or []
    )


def normalizer(**overrides):
    raw = json.loads(json.dumps(EXAMPLE_POLICY))
    raw.update(overrides)
    return Normalizer(policy_from_mapping(raw, "<t>"), Fingerprinter(b"k"))


def test_genai_tool_span():
    n = normalizer()
    step = n.step(
        span(
            "execute_tool lookup_order",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "lookup_order",
                "gen_ai.tool.call.id": "call_1",
                "gen_ai.tool.call.arguments": '{"order_id": "A12"}',
                "gen_ai.tool.call.result": '{"status": "delivered", "version": 7}',
                "agent.step.sequence": 3,
            },
        )
    )
    assert step.kind == TOOL and step.name == "lookup_order" and step.call_id == "call_1"
    assert step.sequence == 3 and step.version == 7.0
    assert step.prompt_version == "support-v13" and step.tool_version == "9"  # from the resource
    same = n.step(
        span(
            "execute_tool lookup_order",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "lookup_order",
                "gen_ai.tool.call.arguments": '{"include_items": false, "order_id": "A12"}',
            },
        )
    )
    assert same.action_fp == step.action_fp  # key order + documented default
    other = n.step(
        span(
            "execute_tool lookup_order",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "lookup_order",
                "gen_ai.tool.call.arguments": '{"order_id": "A13"}',
            },
        )
    )
    assert other.action_fp != step.action_fp


def test_openinference_tool_span_with_langgraph_step_in_metadata():
    step = normalizer().step(
        span(
            "lookup_order",
            {
                "openinference.span.kind": "TOOL",
                "tool.name": "lookup_order",
                "input.value": '{"order_id": "A12"}',
                "output.value": '{"status": "delivered", "version": 7}',
                "metadata": '{"langgraph_step": 4, "thread_id": "t1"}',
            },
        )
    )
    assert step.kind == TOOL and step.sequence == 4 and step.version == 7.0


def test_openllmetry_tool_span_and_wrapped_inputs():
    n = normalizer()
    step = n.step(
        span(
            "lookup_order.tool",
            {
                "traceloop.entity.input": '{"inputs": {"order_id": "A12"}}',
                "traceloop.entity.output": '{"status": "delivered", "version": 7}',
            },
        )
    )
    genai = n.step(
        span(
            "execute_tool lookup_order",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "lookup_order",
                "gen_ai.tool.call.arguments": '{"order_id": "A12"}',
            },
        )
    )
    assert step.kind == TOOL and step.name == "lookup_order"
    assert step.action_fp == genai.action_fp


def test_bare_string_input_is_the_single_argument_and_kvlist_arguments_work():
    n = normalizer()
    a = n.step(
        span(
            "search",
            {
                "openinference.span.kind": "TOOL",
                "tool.name": "search",
                "input.value": "refund policy",
            },
        )
    )
    b = n.step(
        span(
            "search",
            {
                "openinference.span.kind": "TOOL",
                "tool.name": "search",
                "input.value": "refund policy",
            },
        )
    )
    c = n.step(
        span(
            "search",
            {"openinference.span.kind": "TOOL", "tool.name": "search", "input.value": "other"},
        )
    )
    assert a.action_fp == b.action_fp != c.action_fp
    kv = n.step(
        span(
            "execute_tool t",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "t",
                "gen_ai.tool.call.arguments": {"x": 1},
            },
        )
    )
    js = n.step(
        span(
            "execute_tool t",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "t",
                "gen_ai.tool.call.arguments": '{"x": 1}',
            },
        )
    )
    assert kv.action_fp == js.action_fp


def test_error_codes_from_each_source():
    n = normalizer()
    base = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t"}
    assert n.step(span("x", {**base, "error.type": "429"})).error_code == "429"
    assert (
        n.step(
            span("x", {**base, "gen_ai.tool.call.result": '{"ok": false, "code": "not_found"}'})
        ).error_code
        == "not_found"
    )
    exc = SpanEvent(
        "exception", 15, {"exception.type": "httpx.ReadTimeout", "exception.message": "secret text"}
    )
    assert n.step(span("x", base, status=STATUS_ERROR, events=[exc])).error_code == "readtimeout"
    assert (
        n.step(
            span("x", base, status=STATUS_ERROR, message="upstream 503 for customer Bob")
        ).error_code
        == "503"
    )
    assert (
        n.step(span("x", base, status=STATUS_ERROR, message="customer Bob is angry")).error_code
        == "error"
    )


def test_kinds():
    n = normalizer()
    assert (
        n.step(
            span("chat gpt-4o", {"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 10})
        ).kind
        == LLM
    )
    assert (
        n.step(
            span("ChatOpenAI", {"openinference.span.kind": "LLM", "llm.token_count.prompt": 5})
        ).input_tokens
        == 5
    )
    assert (
        n.step(span("plan", {"gen_ai.operation.name": "plan", "gen_ai.plan.steps": "[]"})).kind
        == PLAN
    )
    assert n.step(span("summarize_history", {})).kind == SUMMARY
    assert (
        n.step(
            span("handoff to billing", {"openinference.span.kind": "TOOL", "agent.name": "router"})
        ).kind
        == HANDOFF
    )
    transfer = n.step(
        span(
            "transfer_to_router",
            {"openinference.span.kind": "TOOL", "tool.name": "transfer_to_router"},
        )
    )
    assert transfer.kind == HANDOFF and transfer.to_agent == "router"
    assert n.step(span("something", {})).kind == OTHER
    assert (
        n.step(
            span("invoke_agent support", {"gen_ai.operation.name": "invoke_agent"}, parent=None)
        ).kind
        == AGENT
    )


def test_termination_mapping_from_exceptions_messages_and_finish_reason():
    n = normalizer()

    def root(**kw):
        return n.step(
            span(
                "invoke_agent",
                {"gen_ai.operation.name": "invoke_agent", **kw.pop("attrs", {})},
                parent=None,
                **kw,
            )
        )

    graph = SpanEvent("exception", 5, {"exception.type": "langgraph.errors.GraphRecursionError"})
    assert root(status=STATUS_ERROR, events=[graph]).termination == "turn_limit"
    assert (
        root(status=STATUS_ERROR, message="Max turns exceeded: {'max_turns': 6}").termination
        == "turn_limit"
    )
    assert (
        root(status=STATUS_OK, attrs={"gen_ai.agent.finish_reason": "stop"}).termination
        == "final_answer"
    )
    guard = SpanEvent("loop_guard", 7, {"loop_guard.reason": "repeated_action"})
    step = root(events=[guard])
    assert step.termination == "loop_guard" and step.guard_ns == 7
    # nothing stated: the pipeline decides at finalization (test_termination_evidence)
    assert root(status=STATUS_ERROR, message="something else").termination is None


def test_the_guards_decisions_on_a_span():
    """loopwatch_guard's loop_guard events: an enforced denial names its call (with the
    event's time); an observe-mode one is no stop and names nothing; a decision that is not
    a string (a map, a list: found by the differential test) is none."""

    n = normalizer()

    def root(**kw):
        attrs = {"gen_ai.operation.name": "invoke_agent"}
        return n.step(span("invoke_agent", attrs, parent=None, **kw))

    def ev(**attrs):
        return SpanEvent("loop_guard", 9, {f"loopwatch.guard.{k}": v for k, v in attrs.items()})

    enforced = ev(decision="deny", mode="enforce", call_id="c3")
    step = root(events=[enforced, ev(decision="stop", call_id="c4")])
    assert step.denied_calls == ("9 - c3", "9 - c4")
    # a hold's decision names the hold; an id that is not one (spaces, too long, not a
    # string) is recorded as none, so no customer text rides on it
    held = ev(decision="stop", call_id="c 5", hold_id="hold-0a1b2c3d4e")
    odd_ids = [
        ev(decision="deny", call_id=f"c{i}", hold_id=h)
        for i, h in enumerate(["a b", "x" * 65, 7, ""])
    ]
    step = root(events=[held, *odd_ids])
    assert step.denied_calls == ("9 hold-0a1b2c3d4e c 5", "9 - c0", "9 - c1", "9 - c2", "9 - c3")
    assert [tuple(d) for d in denials(step)][:2] == [(9, "hold-0a1b2c3d4e", "c 5"), (9, None, "c0")]
    assert step.termination == "loop_guard" and step.guard_ns == 9
    observed = root(events=[ev(decision="deny", mode="observe", call_id="c3")])
    assert observed.denied_calls == () and observed.termination != "loop_guard"
    for odd in ({}, ["deny"], 1):
        assert root(events=[ev(decision=odd, call_id="c3")]).denied_calls == ()
    assert root(events=[ev(decision="allow", call_id="c3")]).denied_calls == ()


def test_run_key_conversation_and_attribute():
    conv = normalizer(run_key="conversation")
    s = span("x", {"gen_ai.conversation.id": "conv-1"})
    assert conv.run_id(s) == "conv-1"
    assert conv.run_id(span("x", {})) == TRACE  # falls back to the trace
    custom = normalizer(run_key="app.run_id")
    assert custom.run_id(span("x", {}, resource={"app.run_id": "r-9"})) == "r-9"


def test_no_raw_argument_or_result_survives_in_a_step():
    canary_arg, canary_res = "CANARY-ARG-7f3a", "CANARY-RES-91bc"
    step = normalizer().step(
        span(
            "execute_tool issue_refund",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "issue_refund",
                "gen_ai.tool.call.arguments": json.dumps(
                    {"order_id": canary_arg, "idempotency_key": canary_arg}
                ),
                "gen_ai.tool.call.result": json.dumps({"ok": True, "note": canary_res}),
            },
        )
    )
    wire = json.dumps(step.to_list())
    assert canary_arg not in wire and canary_res not in wire
    assert step.business_fp and step.idempotency_fp


def test_step_wire_round_trip_is_exact():
    from detectors.model import Step

    step = normalizer().step(
        span(
            "search_cases",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "search_cases",
                "gen_ai.tool.call.arguments": '{"query": "x", "cursor": null}',
                "gen_ai.tool.call.result": '{"case_ids": []}',
            },
        )
    )
    back = Step.from_list(json.loads(json.dumps(step.to_list())))
    assert back == step and back.item_fps == ()
