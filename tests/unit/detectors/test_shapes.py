"""Golden tests per loop shape: the finding appears at exactly the threshold call, with the
expected trigger span, and never before; negative controls stay silent."""

from __future__ import annotations

import pytest

from streams.spanpath.spans import STATUS_ERROR, SpanEvent
from tests.spankit import Run, example_policy, replay, shapes

ORDER = {"order_id": "A12"}
DELIVERED = {"status": "delivered", "version": 7}


def only(events, shape):
    found = [e for e in events if e["shape"] == shape]
    assert len(found) == 1, [e["shape"] for e in events]
    return found[0]


# ---------------------------------------------------------------- identical_repetition


@pytest.mark.parametrize("calls", [0, 1, 2, 3, 4])
def test_identical_repetition_fires_at_exactly_the_third_call(calls):
    run = Run()
    spans = [run.tool("lookup_order", ORDER, DELIVERED) for _ in range(calls)]
    run.root()
    events, _ = replay([run.spans])
    if calls < 3:
        assert events == []
    else:
        event = only(events, "identical_repetition")
        assert event["trigger_span_id"] == spans[2].span_id
        assert event["count"] == 3
        assert event["span_ids"] == [s.span_id for s in spans[:3]]
        assert (event["first_sequence"], event["last_sequence"]) == (1, 3)
        assert event["wasted_steps"] == 2


def test_seed_lookup_order_canonical_arguments_and_default_are_one_action():
    run = Run()
    a = run.tool("lookup_order", {"order_id": "A12"}, DELIVERED)
    run.tool("lookup_order", {"include_items": False, "order_id": "A12"}, DELIVERED)
    c = run.tool("lookup_order", {"order_id": "A12", "include_items": False}, DELIVERED)
    run.root(
        events=[SpanEvent("loop_guard", c.end_ns + 1, {"loop_guard.reason": "repeated_action"})]
    )
    events, runs = replay([run.spans])
    event = only(events, "identical_repetition")
    assert event["trigger_span_id"] == c.span_id
    assert event["span_ids"][0] == a.span_id
    assert event["prompt_version"] == "support-v12" and event["tool_name"] == "lookup_order"
    assert runs[0]["termination_reason"] == "loop_guard"
    assert runs[0]["stalled_repeat"] is True and runs[0]["guard_fired"] is True
    assert runs[0]["guard_before_dispatch"] is False  # the 3rd call was dispatched before the guard


def test_identity_field_difference_is_another_action():
    run = Run()
    for order in ("A12", "B34", "A12", "B34x"):
        run.tool("lookup_order", {"order_id": order}, DELIVERED)
    run.tool("lookup_order", {"order_id": "A12", "include_items": True}, DELIVERED)
    run.root()
    assert replay([run.spans])[0] == []


def test_version_advance_is_progress():
    run = Run()
    for version in (7, 8, 9):
        run.tool("lookup_order", ORDER, {"status": "pending", "version": version})
    run.root()
    events, runs = replay([run.spans])
    assert events == []
    assert runs[0]["progress_observed"] is True


def test_mutation_same_version_in_the_middle_fires():
    run = Run()
    spans = [
        run.tool("lookup_order", ORDER, {"status": "pending", "version": v}) for v in (7, 8, 8, 8)
    ]
    run.root()
    event = only(replay([run.spans])[0], "identical_repetition")
    assert event["trigger_span_id"] == spans[3].span_id


def test_get_order_404_loop_fires_with_deterministic_fallback():
    run = Run()
    spans = [
        run.tool(
            "get_order", {"order_id": "A-1182"}, {"ok": False, "code": "not_found"}, error=None
        )
        for _ in range(6)
    ]
    run.root(status=STATUS_ERROR, message="Max turns exceeded: {'max_turns': 6}")
    events, runs = replay([run.spans])
    event = only(events, "identical_repetition")
    assert event["trigger_span_id"] == spans[2].span_id
    assert event["recommended_action"] == "deterministic_fallback"
    assert runs[0]["termination_reason"] == "turn_limit"


def test_results_not_recorded_still_detects_with_weaker_evidence():
    run = Run()
    spans = [run.tool("lookup_order", ORDER, None) for _ in range(3)]
    run.root()
    event = only(replay([run.spans])[0], "identical_repetition")
    assert event["trigger_span_id"] == spans[2].span_id
    assert event["evidence"]["result_observed"] is False


def test_changed_result_without_contract_is_progress():
    run = Run()
    for n in range(4):
        run.tool("get_weather", {"city": "Oslo"}, {"temp": n})
    run.root()
    assert replay([run.spans])[0] == []


def test_parallel_identical_calls_in_one_turn_are_not_a_loop():
    run = Run(sequenced=True)
    run.tool("lookup_order", ORDER, DELIVERED, seq=1)
    run.tool("lookup_order", ORDER, DELIVERED, seq=1, parallel=True)
    run.tool("lookup_order", ORDER, DELIVERED, seq=1, parallel=True)
    run.root()
    events, runs = replay([run.spans])
    assert events == []
    assert runs[0]["parallel_duplicate_calls"] == 2


def test_pagination_with_new_cursor_and_new_items_is_progress():
    run = Run()
    run.tool(
        "search_cases",
        {"query": "refund", "cursor": None},
        {"case_ids": ["c1", "c2"], "next": "p2"},
    )
    run.tool(
        "search_cases",
        {"query": "refund", "cursor": "p2"},
        {"case_ids": ["c3", "c4"], "next": "p3"},
    )
    run.tool(
        "search_cases", {"query": "refund", "cursor": "p3"}, {"case_ids": ["c5"], "next": None}
    )
    run.root()
    assert replay([run.spans])[0] == []


def test_pagination_returning_the_same_page_is_a_loop():
    run = Run()
    page = {"case_ids": ["c1", "c2"], "next": "p2"}
    spans = [
        run.tool("search_cases", {"query": "refund", "cursor": c}, page) for c in (None, "p2", "p3")
    ]
    run.root()
    event = only(replay([run.spans])[0], "identical_repetition")
    assert event["trigger_span_id"] == spans[2].span_id


def test_normalize_declared_by_contract_merges_queries():
    run = Run()
    spans = [
        run.tool("search_orders", {"query": q}, {"ok": True, "orders": ["o1"]})
        for q in ("Hossein", "Hossein ", "hossein")
    ]
    run.root()
    event = only(replay([run.spans])[0], "identical_repetition")
    assert event["trigger_span_id"] == spans[2].span_id


def test_no_normalization_beyond_the_contract():
    """Fingerprints stay exact (three actions, no identical_repetition); the seeds' own
    example is argument churn: rephrased arguments, the same answer, nothing gained."""
    run = Run()
    for q in ("Hossein", "Hossein ", "hossein"):
        run.tool("find_customer", {"query": q}, {"ok": True, "ids": ["x"]})
    run.root()
    events, summaries = replay([run.spans])
    assert summaries[0]["distinct_actions"] == 3
    event = only(events, "argument_churn")
    assert event["detector"] == "near_duplicate"
    assert event["evidence"]["nothing_new"] == "exact"
    assert event["evidence"]["distinct_arguments"] == 3


def test_polling_uses_max_polls_for_unchanged_state():
    run = Run()
    spans = [
        run.tool("get_export_status", {"export_id": "E1"}, {"status": "running"}) for _ in range(6)
    ]
    run.root()
    event = only(replay([run.spans])[0], "identical_repetition")
    assert event["trigger_span_id"] == spans[5].span_id  # max_polls: 5 in the test policy


# ---------------------------------------------------------------- goal_already_satisfied


def test_export_polling_that_advances_is_silent_and_a_call_after_complete_fires():
    run = Run()
    for status in ("queued", "running", "complete"):
        run.tool("get_export_status", {"export_id": "E1"}, {"status": status})
    run.root()
    assert replay([run.spans])[0] == []

    run = Run(trace=2)
    for status in ("queued", "running", "complete"):
        run.tool("get_export_status", {"export_id": "E1"}, {"status": status})
    again = run.tool("get_export_status", {"export_id": "E1"}, {"status": "complete"})
    run.root()
    event = only(replay([run.spans])[0], "goal_already_satisfied")
    assert event["trigger_span_id"] == again.span_id
    assert event["recommended_action"] == "force_final_answer"


# ---------------------------------------------------------------- argument_churn


@pytest.mark.parametrize("calls", [2, 3])
def test_argument_churn_fires_at_third_differing_failure(calls):
    run = Run()
    queries = ["Hossein Ahmadi", "Ahmadi H", "h.ahmadi@example.com"][:calls]
    spans = [
        run.tool("search_orders", {"query": q}, {"ok": False, "code": "no_results"})
        for q in queries
    ]
    run.root()
    events = replay([run.spans])[0]
    if calls < 3:
        assert events == []
    else:
        event = only(events, "argument_churn")
        assert event["trigger_span_id"] == spans[2].span_id
        assert event["evidence"]["error_code"] == "no_results"


def test_different_orders_all_found_is_not_churn():
    run = Run()
    for order in ("A12", "B34", "C56", "D78"):
        run.tool(
            "lookup_order", {"order_id": order}, {"status": "delivered", "version": 1, "id": order}
        )
    run.root()
    assert replay([run.spans])[0] == []


# ---------------------------------------------------------------- oscillation


@pytest.mark.parametrize("calls", [5, 6])
def test_oscillation_fires_at_the_sixth_alternating_call(calls):
    run = Run()
    spans = []
    for i in range(calls):
        if i % 2 == 0:
            spans.append(run.tool("lookup_customer", {"customer_id": "C7"}, {"id": "C7"}))
        else:
            spans.append(
                run.tool("lookup_order", {"order_id": "B34"}, {"status": "shipped", "version": 3})
            )
    run.root()
    events = replay([run.spans])[0]
    if calls < 6:
        assert events == []
    else:
        event = only(events, "oscillation")
        assert event["trigger_span_id"] == spans[5].span_id
        assert event["evidence"]["period"] == 2


def test_three_state_cycle_fires_after_eight_calls():
    run = Run()
    tools = [("a", {"x": 1}), ("b", {"y": 1}), ("c", {"z": 1})]
    spans = [run.tool(tools[i % 3][0], tools[i % 3][1], {"r": tools[i % 3][0]}) for i in range(8)]
    run.root()
    event = only(replay([run.spans])[0], "oscillation")
    assert event["trigger_span_id"] == spans[7].span_id
    assert event["evidence"]["period"] == 3


# ---------------------------------------------------------------- replanning


@pytest.mark.parametrize("plans", [2, 3])
def test_replanning_fires_at_the_third_identical_plan(plans):
    run = Run()
    steps = [
        {"tool": "search_kb", "arguments": {"q": "refund policy"}},
        {"tool": "draft_reply", "arguments": {}},
    ]
    plan_spans = []
    for i in range(plans):
        plan_spans.append(run.plan(steps))
        run.tool("search_kb", {"q": "refund policy"}, {"docs": ["d1"]})
        run.tool("draft_reply", {"tone": str(i)}, {"draft": i})
    run.root()
    events = replay([run.spans])[0]
    if plans < 3:
        assert events == []
    else:
        assert only(events, "replanning")["trigger_span_id"] == plan_spans[2].span_id


def test_llm_turn_requesting_the_same_tool_list_is_a_plan():
    run = Run()
    calls = [("search_kb", {"q": "x"}), ("draft_reply", {"t": 1})]
    llms = [run.llm(tool_calls=calls) for _ in range(3)]
    run.root()
    assert only(replay([run.spans])[0], "replanning")["trigger_span_id"] == llms[2].span_id


# ---------------------------------------------------------------- retry_storm


@pytest.mark.parametrize("calls", [3, 4])
def test_retry_storm_fires_at_the_fourth_constant_gap_429(calls):
    run = Run()
    spans = [
        run.tool(
            "fetch_inventory",
            {"sku": "SKU-9"},
            {"ok": False, "code": "rate_limited"},
            error="429",
            gap_ms=50,
        )
        for _ in range(calls)
    ]
    run.root()
    events = replay([run.spans])[0]
    if calls < 4:
        assert events == []
    else:
        event = only(events, "retry_storm")
        assert event["trigger_span_id"] == spans[3].span_id
        assert event["evidence"]["error_code"] == "429"


def test_backoff_retries_are_not_a_storm():
    run = Run()
    for gap in (0, 100, 400, 1600):
        run.tool("fetch_inventory", {"sku": "SKU-9"}, None, error="503", gap_ms=gap)
    run.tool("fetch_inventory", {"sku": "SKU-9"}, {"ok": True, "qty": 3})
    run.root()
    assert replay([run.spans])[0] == []


# ---------------------------------------------------------------- delegation_ping_pong


def test_ping_pong_fires_at_the_third_traversal_of_an_edge():
    run = Run()
    hops = [("router", "billing"), ("billing", "router")] * 3
    spans = [run.handoff(a, b) for a, b in hops[:5]]
    run.root()
    event = only(replay([run.spans])[0], "delegation_ping_pong")
    assert event["trigger_span_id"] == spans[4].span_id
    assert event["evidence"]["edge"] == "router->billing"
    assert event["recommended_action"] == "human_handoff"

    run = Run(trace=2)
    for a, b in hops[:4]:
        run.handoff(a, b)
    run.root()
    assert replay([run.spans])[0] == []


# ---------------------------------------------------------------- context_collapse


def test_context_collapse_fires_on_third_fetch_across_summaries():
    run = Run()
    fetches = []
    for i in range(3):
        fetches.append(run.tool("fetch_document", {"doc_id": "policy-7"}, {"text_digest": "same"}))
        if i < 2:
            run.summary()
    run.root()
    events = replay([run.spans])[0]
    event = only(events, "context_collapse")
    assert event["trigger_span_id"] == fetches[2].span_id
    assert "identical_repetition" not in shapes(events)


def test_refetch_across_token_drop_counts_as_collapse():
    run = Run()
    fetches = []
    tokens = [1000, 9000, 2000, 9000, 2500]
    for i in range(3):
        fetches.append(run.tool("fetch_document", {"doc_id": "policy-7"}, {"text_digest": "same"}))
        if i < 2:
            run.llm(input_tokens=tokens[2 * i])
            run.llm(input_tokens=tokens[2 * i + 1])
            run.llm(input_tokens=tokens[2 * i + 1] // 4)
    run.root()
    assert only(replay([run.spans])[0], "context_collapse")["trigger_span_id"] == fetches[2].span_id


# ---------------------------------------------------------------- budget_exhausted


def test_step_budget_per_task_type_fires_at_the_21st_call():
    run = Run(task_type="support")
    spans = [
        run.tool("lookup_order", {"order_id": f"O-{i}"}, {"status": "ok", "version": i})
        for i in range(22)
    ]
    run.root()
    event = only(replay([run.spans])[0], "budget_exhausted")
    assert event["trigger_span_id"] == spans[20].span_id
    assert event["budget"] == "steps"


def test_token_budget_fires_at_the_llm_span_that_passes_it():
    run = Run()
    llms = [run.llm(input_tokens=60_000, output_tokens=1_000) for _ in range(4)]
    run.root()
    event = only(replay([run.spans])[0], "budget_exhausted")
    assert event["trigger_span_id"] == llms[3].span_id and event["budget"] == "tokens"


def test_seconds_budget():
    run = Run()
    spans = [
        run.tool("lookup_order", {"order_id": f"O-{i}"}, {"v": i}, gap_ms=100_000) for i in range(4)
    ]
    run.root()
    event = only(replay([run.spans])[0], "budget_exhausted")
    assert event["budget"] == "seconds" and event["trigger_span_id"] == spans[3].span_id


# ---------------------------------------------------------------- side effects


def test_duplicate_side_effect_with_a_different_key_pages():
    run = Run()
    run.tool(
        "issue_refund",
        {"order_id": "A12", "amount_cents": 500, "idempotency_key": "rk-1"},
        {"ok": True},
    )
    second = run.tool(
        "issue_refund",
        {"order_id": "A12", "amount_cents": 500, "idempotency_key": "rk-2"},
        {"ok": True},
    )
    run.root()
    event = only(replay([run.spans])[0], "duplicate_side_effect")
    assert event["trigger_span_id"] == second.span_id
    assert event["severity"] == "critical" and event["recommended_action"] == "stop_and_escalate"


def test_seed_refund_timeout_then_retry_without_key_is_unsafe():
    run = Run()
    run.tool("issue_refund", {"order_id": "A77", "amount_cents": 1200}, None, error="timeout")
    second = run.tool("issue_refund", {"order_id": "A77", "amount_cents": 1200}, {"ok": True})
    run.root()
    event = only(replay([run.spans])[0], "unsafe_side_effect_retry")
    assert event["trigger_span_id"] == second.span_id


def test_retry_with_same_idempotency_key_is_safe():
    run = Run()
    run.tool("issue_refund", {"order_id": "A77", "idempotency_key": "rk-9"}, None, error="timeout")
    run.tool("issue_refund", {"order_id": "A77", "idempotency_key": "rk-9"}, {"ok": True})
    run.root()
    assert replay([run.spans])[0] == []


def test_reconciliation_between_timeout_and_retry_is_safe():
    run = Run()
    run.tool("issue_refund", {"order_id": "A77"}, None, error="timeout")
    run.tool("get_refund_status", {"order_id": "A77"}, {"found": False})
    run.tool("issue_refund", {"order_id": "A77"}, {"ok": True})
    run.root()
    assert replay([run.spans])[0] == []


def test_refunds_for_two_orders_are_not_duplicates():
    run = Run()
    run.tool("issue_refund", {"order_id": "A1", "idempotency_key": "k1"}, {"ok": True})
    run.tool("issue_refund", {"order_id": "A2", "idempotency_key": "k2"}, {"ok": True})
    run.root()
    assert replay([run.spans])[0] == []


# ---------------------------------------------------------------- the incident runbook, steps 4-13


def test_runbook_ticket_loop():
    run = Run(sequenced=True)
    run.tool("get_ticket", {"ticket_id": "T-9"}, {"state_version": 6})
    run.tool("classify", {"ticket_id": "T-9"}, {"label": "billing"})
    run.tool("get_sla", {"ticket_id": "T-9"}, {"hours": 4})
    alternating = []
    for i in range(8):  # steps 4..11
        if i % 2 == 0:
            alternating.append(
                run.tool("search_ticket", {"q": "T-9"}, {"state_version": 7, "hits": 1})
            )
        else:
            alternating.append(
                run.tool("get_customer", {"id": "C1"}, {"state_version": 7, "tier": "gold"})
            )
    run.tool("update_ticket", {"ticket_id": "T-9", "status": "resolved"}, None, error="timeout")
    step13 = run.tool(
        "update_ticket",
        {"ticket_id": "T-9", "status": "resolved", "request_id": "r-2"},
        {"ok": True},
    )
    run.root(
        status=STATUS_ERROR,
        events=[
            SpanEvent(
                "exception",
                run.clock,
                {
                    "exception.type": "langgraph.errors.GraphRecursionError",
                    "exception.message": "Recursion limit of 25",
                },
            )
        ],
    )
    events, runs = replay([run.spans])
    assert only(events, "oscillation")["trigger_span_id"] == alternating[5].span_id  # step 9
    assert only(events, "unsafe_side_effect_retry")["trigger_span_id"] == step13.span_id
    assert runs[0]["termination_reason"] == "turn_limit"
    assert sorted(shapes(events)) == ["oscillation", "unsafe_side_effect_retry"]


# ---------------------------------------------------------------- delivery and finalization


def test_same_span_delivered_twice_is_a_duplicate_not_a_loop():
    run = Run()
    run.tool("lookup_order", ORDER, DELIVERED)
    run.tool("lookup_order", ORDER, DELIVERED)
    run.root()
    events, runs = replay([run.spans, run.spans])
    assert events == []
    assert runs[0]["duplicate_spans"] == len(run.spans)
    assert runs[0]["outcome"] == "complete"


def test_same_id_different_content_is_an_integrity_error():
    run = Run()
    span = run.tool("lookup_order", ORDER, DELIVERED)
    run.root()
    import dataclasses

    tampered = dataclasses.replace(span, end_ns=span.end_ns + 5)
    events, runs = replay([run.spans, [tampered]])
    assert runs[0]["outcome"] == "integrity_error"


def test_missing_root_is_incomplete_and_never_clean():
    run = Run()
    run.tool("lookup_order", ORDER, DELIVERED)
    events, runs = replay([run.spans])
    assert runs[0]["outcome"] == "incomplete_trace"
    assert runs[0]["terminal_response"] is False


def test_out_of_order_batches_with_explicit_sequences_give_the_same_finding():
    run = Run(sequenced=True)
    spans = [run.tool("lookup_order", ORDER, DELIVERED) for _ in range(3)]
    root = run.root()
    ordered, _ = replay([run.spans])
    shuffled, _ = replay([[spans[2]], [spans[0], root], [spans[1]]])
    assert [e["event_id"] for e in ordered] == [e["event_id"] for e in shuffled]
    assert shuffled[0]["trigger_span_id"] == spans[2].span_id


def test_event_id_is_deterministic_and_key_independent_of_batching():
    run = Run()
    for _ in range(4):
        run.tool("lookup_order", ORDER, DELIVERED)
    run.root()
    a, _ = replay([run.spans])
    b, _ = replay([[s] for s in run.spans])
    assert [e["event_id"] for e in a] == [e["event_id"] for e in b]
    assert len({e["event_id"] for e in a}) == len(a)


def test_fingerprints_are_keyed():
    run = Run()
    for _ in range(3):
        run.tool("lookup_order", ORDER, DELIVERED)
    run.root()
    with_key, _ = replay([run.spans], key=b"k1")
    other_key, _ = replay([run.spans], key=b"k2")
    assert with_key[0]["fingerprint"] != other_key[0]["fingerprint"]
    assert with_key[0]["event_id"] != ""


def test_task_type_selects_allowed_repeats():
    policy = example_policy(
        task_types={"attribute": "agent.task_type", "research": {"allowed_repeats": 4}}
    )
    run = Run(task_type="research")
    spans = [run.tool("lookup_order", ORDER, DELIVERED) for _ in range(5)]
    run.root()
    event = only(replay([run.spans], policy)[0], "identical_repetition")
    assert event["trigger_span_id"] == spans[4].span_id


# ---------------------------------------------------------------- fully sequenced runs release early


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(order=st.permutations(range(9)), dup=st.lists(st.integers(0, 8), max_size=4))
def test_sequenced_runs_are_order_independent_with_early_release(order, dup):
    run = Run(sequenced=True)
    args = [
        ORDER,
        ORDER,
        {"order_id": "B"},
        ORDER,
        ORDER,
        ORDER,
        {"order_id": "C"},
        {"order_id": "C"},
        {"order_id": "C"},
    ]
    for a in args:
        run.tool("lookup_order", a, DELIVERED)
    root = run.root()
    tools = run.spans[:-1]
    baseline, _ = replay([run.spans])
    shuffled = [[tools[i]] for i in order] + [[tools[i]] for i in dup] + [[root]]
    events, runs = replay(shuffled)
    assert [e["event_id"] for e in events] == [e["event_id"] for e in baseline]
    assert [e["trigger_span_id"] for e in events] == [tools[5].span_id, tools[8].span_id]
    assert runs[0]["late_spans"] == 0 and runs[0]["duplicate_spans"] == len(dup)
