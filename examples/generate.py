"""Generate the example OTLP corpus in examples/ with the real OpenTelemetry SDK.

Every scenario is one agent run (one trace) described in a tiny DSL (`tool`, `parallel`,
`handoff`, `plan`, `summarize`, `guard`, `model`) and rendered with the real
`opentelemetry-sdk`: a TracerProvider with a deterministic IdGenerator seeded by the run's
key, spans with explicit start/end times from 2026-11-29T12:00:00Z, parent/child through the
context API. The finished spans are collected in memory, cut into export batches the way a
BatchSpanProcessor would ship them (children before parents, the root last) and encoded with
the SDK's own OTLP encoder (`encode_spans`). Output files use the Collector `fileexporter`
formats:

* `*.pb`    -- each ExportTraceServiceRequest prefixed by its length, 4 bytes big-endian;
* `*.jsonl` -- one OTLP JSON document per line as the Collector writes it (lowerCamelCase,
               hex trace/span ids, int64 as decimal strings, enums as integers).

`expected.json` is the oracle for the golden tests. It is derived from the `trigger=` marks
in the scenario definitions below and the ids the generator assigned, never from running a
detector. The generator only checks its own arithmetic: a run crosses a budget of
examples/loopwatch.yaml exactly where the scenario says it does, and nowhere else.

    .venv/bin/python examples/generate.py [--out DIR]

The output is byte-identical across runs.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import random
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from google.protobuf.json_format import MessageToDict
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

HERE = Path(__file__).resolve().parent
POLICY = HERE / "loopwatch.yaml"
BASE_NS = int(datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC).timestamp()) * 1_000_000_000
MS = 1_000_000

GENAI = "genai"  # OpenTelemetry GenAI semantic conventions
OPENINFERENCE = "openinference"
AGENTS_SDK = "agents-sdk"  # OpenInference style: flat spans under the agent, no sequence
LANGGRAPH = "langgraph"  # OpenInference style: CHAIN node spans, metadata.langgraph_step

# Shapes (docs/CONTRACTS.md §5).
IDENTICAL = "identical_repetition"
CHURN = "argument_churn"
OSCILLATION = "oscillation"
REPLANNING = "replanning"
RETRY_STORM = "retry_storm"
PING_PONG = "delegation_ping_pong"
COLLAPSE = "context_collapse"
BUDGET_STEPS = "budget_exhausted/steps"
BUDGET_TOKENS = "budget_exhausted/tokens"
GOAL_SATISFIED = "goal_already_satisfied"
DUPLICATE_SIDE_EFFECT = "duplicate_side_effect"
UNSAFE_RETRY = "unsafe_side_effect_retry"


# --------------------------------------------------------------------------- the DSL


@dataclass(frozen=True)
class Err:
    """A failed tool call: `code` goes to error.type, `message` to the span status."""

    code: str
    message: str
    exception: str  # exception.type of the `exception` span event (OpenInference)


TIMEOUT = Err("timeout", "TimeoutError: the read operation timed out", "TimeoutError")
RATE_LIMITED = Err("429", "429 Too Many Requests", "httpx.HTTPStatusError")
UNAVAILABLE = Err("503", "503 Service Unavailable", "httpx.HTTPStatusError")
NOT_FOUND = Err("not_found", "order not found", "tools.errors.NotFoundError")


@dataclass
class Tool:
    name: str
    args: Any
    result: Any = None  # None: no result recorded (the call timed out)
    error: Err | None = None
    retry: bool = False  # re-dispatched by the runtime: no model turn before it
    gap_ms: int | None = None
    ms: int | None = None
    trigger: str | None = None
    context_tokens: int | None = None  # tokens the result adds to the model context
    retriever: bool = False  # an OpenInference RETRIEVER span instead of a TOOL span


@dataclass
class Parallel:
    """One model turn that requests several tool calls, executed concurrently."""

    tools: list[Tool]


@dataclass
class Handoff:
    src: str
    dst: str
    form: str = "span"  # "span": a handoff span; "tool": a transfer_to_<dst> tool call
    trigger: str | None = None


@dataclass
class Plan:
    steps: list[dict[str, Any]]
    trigger: str | None = None


@dataclass
class Summarize:
    keep_tokens: int  # context size after the summary replaced the history


@dataclass
class Guard:
    reason: str
    tool: str


@dataclass
class Llm:
    """An explicit model turn (tool-calling turns are otherwise inserted automatically)."""

    in_tokens: int | None = None
    out_tokens: int | None = None
    ms: int | None = None
    trigger: str | None = None
    final: bool = False  # the final answer (ends a `stop` run)


def tool(name: str, args: Any, result: Any = None, error: Err | None = None, **kw: Any) -> Tool:
    return Tool(name, args, result, error, **kw)


def parallel(*tools: Tool) -> Parallel:
    return Parallel(list(tools))


def handoff(src: str, dst: str, form: str = "span", trigger: str | None = None) -> Handoff:
    return Handoff(src, dst, form, trigger)


def plan(*steps: tuple[str, dict[str, Any]], trigger: str | None = None) -> Plan:
    return Plan([{"tool": name, "arguments": args} for name, args in steps], trigger)


def summarize(keep_tokens: int) -> Summarize:
    return Summarize(keep_tokens)


def guard(reason: str, tool_name: str) -> Guard:
    return Guard(reason, tool_name)


def llm(**kw: Any) -> Llm:
    return Llm(**kw)


@dataclass
class Run:
    key: str  # seeds ids and durations (set by example())
    convention: str
    steps: list[Any]
    end: str = "stop"  # stop | max_turns | recursion
    style: str = LANGGRAPH  # OpenInference only
    sequence: bool = False  # GenAI: agent.step.sequence on tool spans
    call_ids: bool = True  # OpenInference: tool_call.id on TOOL spans
    service: str = "support-bot"
    prompt_version: str = "support-v12"
    agent: str = "support"
    task_type: str = "support"
    user: str = "Has my order shipped?"
    answer: str = "Your order has been delivered."
    context_tokens: int = 1400  # system prompt + tools + user message
    start_ms: int = 0


def run(convention: str, *steps: Any, **kw: Any) -> Run:
    return Run("", convention, list(steps), **kw)


@dataclass
class Example:
    file: str  # <shape>__<variant>.<pb|jsonl> or negative__<name>.<pb|jsonl>
    summary: str  # one line for README.md
    runs: list[Run]
    redeliver: bool = False  # write every export message twice (at-least-once delivery)
    batches: int | None = None  # export messages per run (default: 2, or 3 for big runs)
    parallel_duplicate_calls: int = 0

    @property
    def fmt(self) -> str:
        return self.file.rsplit(".", 1)[1]


def example(file: str, summary: str, *runs: Run, **kw: Any) -> Example:
    """A file of the corpus. Its runs are seeded by the file name (and run number)."""
    stem = file.rsplit(".", 1)[0]
    for n, r in enumerate(runs, start=1):
        r.key = stem if len(runs) == 1 else f"{stem}/{n}"
    return Example(file, summary, list(runs), **kw)


def nth(n: int, trigger: str, at: int) -> str | None:
    """`trigger` on the at-th element of a generated sequence, None elsewhere."""
    return trigger if n == at else None


# ------------------------------------------------------------------------- scenarios

A12 = {"order_id": "A12"}
DELIVERED_7 = {"status": "delivered", "version": 7}
CUSTOMER_C7 = {"customer_id": "C7", "tier": "gold", "open_orders": ["B34"]}
ORDER_B34 = {"order_id": "B34", "status": "shipped", "version": 3}
NOT_FOUND_RESULT = {"ok": False, "code": "not_found", "retryable": False}
POLICY_7 = {"doc_id": "policy-7", "title": "Refund policy", "revision": 7}
REFUND_PLAN = (("search_kb", {"q": "refund policy"}), ("draft_reply", {"template": "refund"}))
KB_HITS = {"articles": ["kb-12", "kb-31"]}
TICKET_A = {"query": "T-9 refund status"}
TICKET_STATE = {"tickets": ["T-9"], "state_version": 7}
CUSTOMER_B = {"customer_id": "C-311"}
CUSTOMER_STATE = {"customer_id": "C-311", "tier": "gold", "state_version": 7}
RESOLVE_T9 = {"ticket_id": "T-9", "status": "resolved"}
REFUND_A77 = {"order_id": "A77", "amount_cents": 1200}  # no idempotency key
REFUND_A31 = {"order_id": "A31", "amount_cents": 1500, "idempotency_key": "rk-9"}
RATE_LIMITED_RESULT = {"ok": False, "code": "rate_limited"}
UNAVAILABLE_RESULT = {"ok": False, "code": "unavailable"}


def refund_a12(key: str) -> dict[str, Any]:
    return {"order_id": "A12", "amount_cents": 500, "idempotency_key": key}


def replanning_turn(n: int, tone: str, draft: dict[str, Any]) -> list[Any]:
    """One turn of the re-planning agent: the same plan, the same search, a new draft."""
    return [
        plan(*REFUND_PLAN, trigger=nth(n, REPLANNING, 3)),
        tool("search_kb", {"q": "refund policy"}, KB_HITS),
        tool("draft_reply", {"template": "refund", "tone": tone}, draft),
    ]


def scenarios() -> list[Example]:
    return positives() + negatives()


def positives() -> list[Example]:
    return [
        example(
            "identical_repetition__lookup_order.pb",
            "lookup_order A12 three times (key order and the documented default differ: the "
            "same action), same result; root `loop_guard` event after call 3, final answer",
            run(
                GENAI,
                tool("lookup_order", {"order_id": "A12"}, DELIVERED_7),
                tool("lookup_order", {"include_items": False, "order_id": "A12"}, DELIVERED_7),
                tool(
                    "lookup_order",
                    {"order_id": "A12", "include_items": False},
                    DELIVERED_7,
                    trigger=IDENTICAL,
                ),
                guard("repeated_action", "lookup_order"),
                sequence=True,
            ),
        ),
        example(
            "identical_repetition__get_order_404.jsonl",
            "get_order A-1182 -> not_found (status ERROR) 6 times, timestamps only; root ends "
            "with MaxTurnsExceeded",
            run(
                OPENINFERENCE,
                *[
                    tool(
                        "get_order",
                        {"order_id": "A-1182"},
                        NOT_FOUND_RESULT,
                        NOT_FOUND,
                        trigger=nth(n, IDENTICAL, 3),
                    )
                    for n in range(1, 7)
                ],
                style=AGENTS_SDK,
                call_ids=False,
                end="max_turns",
                prompt_version="support-v13",
                user="Has order A-1182 shipped?",
            ),
        ),
        example(
            "argument_churn__search_orders.jsonl",
            "search_orders with 3 different queries, each `no_results`",
            run(
                GENAI,
                tool(
                    "search_orders",
                    {"query": "Hossein Ahmadi"},
                    {"ok": False, "code": "no_results"},
                ),
                tool("search_orders", {"query": "Ahmadi H"}, {"ok": False, "code": "no_results"}),
                tool(
                    "search_orders",
                    {"query": "h.ahmadi@example.com"},
                    {"ok": False, "code": "no_results"},
                    trigger=CHURN,
                ),
                user="Find my orders, I am Hossein Ahmadi.",
                answer="I could not find orders under that name or e-mail.",
            ),
        ),
        example(
            "oscillation__customer_order.pb",
            "lookup_customer C7 / lookup_order B34 alternating A B A B A B, same results; "
            "LangGraph style (CHAIN nodes, metadata.langgraph_step)",
            run(
                OPENINFERENCE,
                tool("lookup_customer", {"customer_id": "C7"}, CUSTOMER_C7),
                tool("lookup_order", {"order_id": "B34"}, ORDER_B34),
                tool("lookup_customer", {"customer_id": "C7"}, CUSTOMER_C7),
                tool("lookup_order", {"order_id": "B34"}, ORDER_B34),
                tool("lookup_customer", {"customer_id": "C7"}, CUSTOMER_C7),
                tool("lookup_order", {"order_id": "B34"}, ORDER_B34, trigger=OSCILLATION),
                style=LANGGRAPH,
                prompt_version="support-v13",
            ),
        ),
        example(
            "replanning__support_planner.jsonl",
            "3 turns, each: a plan span with the same 2 steps, the same search_kb, a "
            "draft_reply with different args and results",
            run(
                GENAI,
                *replanning_turn(1, "formal", {"draft_id": "d-1", "chars": 812}),
                *replanning_turn(2, "friendly", {"draft_id": "d-2", "chars": 640}),
                *replanning_turn(3, "short", {"draft_id": "d-3", "chars": 233}),
                user="Can I get a refund for a damaged item?",
                answer="Yes: damaged items are refunded in full within 30 days.",
            ),
        ),
        example(
            "retry_storm__inventory_429.pb",
            "fetch_inventory SKU-9 -> 429 four times, 46-54 ms apart, no model turn between",
            run(
                GENAI,
                tool("fetch_inventory", {"sku": "SKU-9"}, RATE_LIMITED_RESULT, RATE_LIMITED, ms=84),
                *[
                    tool(
                        "fetch_inventory",
                        {"sku": "SKU-9"},
                        RATE_LIMITED_RESULT,
                        RATE_LIMITED,
                        retry=True,
                        gap_ms=gap,
                        ms=ms,
                        trigger=nth(n, RETRY_STORM, 4),
                    )
                    for n, gap, ms in ((2, 50, 79), (3, 46, 88), (4, 54, 81))
                ],
                user="Is SKU-9 in stock?",
                answer="The inventory service is busy right now; please try again later.",
            ),
        ),
        example(
            "delegation_ping_pong__router_billing.jsonl",
            "handoffs router->billing->router->billing->router->billing, as `handoff to X` "
            "spans and transfer_to_X tools",
            run(
                OPENINFERENCE,
                handoff("router", "billing", "span"),
                tool("get_invoice", {"invoice_id": "INV-5"}, {"invoice_id": "INV-5", "due": 4200}),
                handoff("billing", "router", "tool"),
                handoff("router", "billing", "tool"),
                tool("get_balance", {"customer_id": "C7"}, {"customer_id": "C7", "balance": 4200}),
                handoff("billing", "router", "span"),
                handoff("router", "billing", "span", trigger=PING_PONG),
                style=AGENTS_SDK,
                call_ids=False,
                agent="router",
                user="Why was I charged twice?",
                answer="I have passed your case to a billing specialist.",
            ),
        ),
        example(
            "context_collapse__policy_refetch.pb",
            "fetch_document policy-7, summarize_history, fetch, summarize, fetch (a different "
            "draft_reply between); LLM input tokens sawtooth",
            run(
                GENAI,
                tool("fetch_document", {"doc_id": "policy-7"}, POLICY_7, context_tokens=5200),
                tool(
                    "draft_reply",
                    {"template": "refund", "section": "eligibility"},
                    {"draft_id": "d-1", "chars": 420},
                ),
                summarize(keep_tokens=1900),
                tool("fetch_document", {"doc_id": "policy-7"}, POLICY_7, context_tokens=5200),
                tool(
                    "draft_reply",
                    {"template": "refund", "section": "amounts"},
                    {"draft_id": "d-2", "chars": 380},
                ),
                summarize(keep_tokens=2000),
                tool(
                    "fetch_document",
                    {"doc_id": "policy-7"},
                    POLICY_7,
                    context_tokens=5200,
                    trigger=COLLAPSE,
                ),
                user="Which parts of my order can be refunded?",
                answer="Items 1 and 3 are refundable under the policy.",
            ),
        ),
        example(
            "budget_exhausted__support_steps.jsonl",
            "21 lookup_order calls for 21 different orders, each a distinct success "
            "(task_type support: budget 20 steps)",
            run(
                GENAI,
                *[
                    tool(
                        "lookup_order",
                        {"order_id": f"A{100 + n}"},
                        {
                            "order_id": f"A{100 + n}",
                            "status": ("delivered", "shipped")[n % 2],
                            "version": n,
                        },
                        ms=120 + n * 7,
                        trigger=nth(n, BUDGET_STEPS, 21),
                    )
                    for n in range(1, 22)
                ],
                user="Check all my orders from last year.",
                answer="Here is the status of your 21 orders.",
            ),
        ),
        example(
            "budget_exhausted__tokens.jsonl",
            "research run whose LLM prompts grow with fetched pages; cumulative tokens pass "
            "200000 at the 7th LLM span",
            run(
                OPENINFERENCE,
                llm(in_tokens=8200, out_tokens=410),
                tool("web_search", {"q": "agent loop detection"}, {"urls": ["u1", "u2", "u3"]}),
                llm(in_tokens=14600, out_tokens=380),
                tool("fetch_page", {"url": "https://example.com/u1"}, {"chars": 24000}),
                llm(in_tokens=21900, out_tokens=520),
                parallel(
                    tool("web_search", {"q": "retry storm backoff"}, {"urls": ["u4", "u5"]}),
                    tool("web_search", {"q": "delegation ping pong"}, {"urls": ["u6"]}),
                ),
                llm(in_tokens=28300, out_tokens=450),
                tool("retrieve_notes", {"query": "loop taxonomy"}, ["n-3", "n-8"], retriever=True),
                llm(in_tokens=35800, out_tokens=610),
                tool("fetch_page", {"url": "https://example.com/u4"}, {"chars": 31000}),
                llm(in_tokens=43100, out_tokens=480),
                tool("fetch_page", {"url": "https://example.com/u6"}, {"chars": 27000}),
                llm(in_tokens=51700, out_tokens=530, trigger=BUDGET_TOKENS),
                tool("fetch_page", {"url": "https://example.com/u5"}, {"chars": 19000}),
                llm(in_tokens=59400, out_tokens=1450, final=True),
                service="research-bot",
                prompt_version="research-v4",
                agent="research",
                task_type="research",
                user="Write a survey of agent loop failure modes.",
                answer="Survey: seven loop shapes ...",
            ),
        ),
        example(
            "goal_already_satisfied__export_complete.pb",
            "get_export_status E1 -> queued, running, complete, then called again -> complete",
            run(
                GENAI,
                *[
                    tool(
                        "get_export_status",
                        {"export_id": "E1"},
                        {"export_id": "E1", "status": status},
                        trigger=nth(n, GOAL_SATISFIED, 4),
                    )
                    for n, status in enumerate(("queued", "running", "complete", "complete"), 1)
                ],
                user="Is my data export ready?",
                answer="Your export E1 is complete.",
            ),
        ),
        example(
            "duplicate_side_effect__refund_twice.pb",
            "handoff support->refunds (GenAI handoff span); issue_refund A12 with key rk-1 -> "
            "ok, a message, then issue_refund A12 with rk-2 -> ok",
            run(
                GENAI,
                tool("lookup_order", A12, DELIVERED_7),
                handoff("support", "refunds"),
                tool("issue_refund", refund_a12("rk-1"), {"ok": True, "refund_id": "rf-301"}),
                tool(
                    "send_message", {"order_id": "A12", "template": "refund_issued"}, {"ok": True}
                ),
                tool(
                    "issue_refund",
                    refund_a12("rk-2"),
                    {"ok": True, "refund_id": "rf-302"},
                    trigger=DUPLICATE_SIDE_EFFECT,
                ),
                prompt_version="support-v13",
                user="Please refund the damaged item in A12.",
                answer="Your refund has been issued.",
            ),
        ),
        example(
            "unsafe_side_effect_retry__refund_timeout.jsonl",
            "issue_refund A77 without idempotency key -> TimeoutError, retried the same -> ok",
            run(
                OPENINFERENCE,
                tool("issue_refund", REFUND_A77, None, TIMEOUT, ms=400),
                tool(
                    "issue_refund",
                    REFUND_A77,
                    {"ok": True, "refund_id": "rf-77"},
                    trigger=UNSAFE_RETRY,
                ),
                style=AGENTS_SDK,
                call_ids=False,
                user="Refund order A77 please.",
                answer="Your refund has been issued.",
            ),
        ),
        example(
            "runbook__ticket_loop.jsonl",
            "the incident runbook: steps 1-3 normal, 4-11 search_ticket(A)/get_customer(B) "
            "alternating with state_version 7, 12 update_ticket without key -> timeout, 13 "
            "update_ticket again with a new request_id -> ok; root ends with GraphRecursionError",
            run(
                GENAI,
                tool(
                    "get_ticket",
                    {"ticket_id": "T-9"},
                    {"ticket_id": "T-9", "status": "open", "state_version": 7},
                ),
                tool("lookup_order", {"order_id": "E90"}, {"status": "delivered", "version": 4}),
                tool("read_policy", {"policy_id": "refunds"}, {"policy_id": "refunds", "rev": 3}),
                tool("search_ticket", TICKET_A, TICKET_STATE),  # step 4
                tool("get_customer", CUSTOMER_B, CUSTOMER_STATE),
                tool("search_ticket", TICKET_A, TICKET_STATE),
                tool("get_customer", CUSTOMER_B, CUSTOMER_STATE),
                tool("search_ticket", TICKET_A, TICKET_STATE),
                tool("get_customer", CUSTOMER_B, CUSTOMER_STATE, trigger=OSCILLATION),  # step 9
                tool("search_ticket", TICKET_A, TICKET_STATE),
                tool("get_customer", CUSTOMER_B, CUSTOMER_STATE),  # step 11
                tool("update_ticket", RESOLVE_T9, None, TIMEOUT, ms=400),
                tool(
                    "update_ticket",
                    RESOLVE_T9 | {"request_id": "r-2"},
                    {"ok": True, "ticket_id": "T-9", "status": "resolved"},
                    trigger=UNSAFE_RETRY,
                ),
                sequence=True,
                end="recursion",
                prompt_version="support-v13",
                user="Close ticket T-9 once the refund is confirmed.",
            ),
        ),
    ]


def negatives() -> list[Example]:
    return [
        example(
            "negative__duplicate_delivery.pb",
            "a clean 3-call run; every export message is written twice (m1 m2 m1 m3 m2 m3)",
            run(
                OPENINFERENCE,
                tool("lookup_order", A12, DELIVERED_7),
                tool("get_shipment", A12, {"carrier": "DHL", "eta": "2026-12-01"}),
                tool("send_message", {"order_id": "A12", "template": "eta"}, {"ok": True}),
                style=LANGGRAPH,
            ),
            redeliver=True,
            batches=3,
        ),
        example(
            "negative__export_polling.pb",
            "get_export_status E2 -> queued, running, complete, then a final answer",
            run(
                GENAI,
                *[
                    tool(
                        "get_export_status",
                        {"export_id": "E2"},
                        {"export_id": "E2", "status": status},
                    )
                    for status in ("queued", "running", "complete")
                ],
                user="Is my data export ready?",
                answer="Your export E2 is complete.",
            ),
        ),
        example(
            "negative__pagination.pb",
            "search_cases refund with cursor null, p2, p3: new case ids on every page",
            run(
                OPENINFERENCE,
                tool(
                    "search_cases",
                    {"query": "refund", "cursor": None},
                    {"case_ids": ["c1", "c2"], "next": "p2"},
                ),
                tool(
                    "search_cases",
                    {"query": "refund", "cursor": "p2"},
                    {"case_ids": ["c3", "c4"], "next": "p3"},
                ),
                tool(
                    "search_cases",
                    {"query": "refund", "cursor": "p3"},
                    {"case_ids": ["c5"], "next": None},
                ),
                style=LANGGRAPH,
                user="List my refund cases.",
                answer="You have 5 refund cases.",
            ),
        ),
        example(
            "negative__different_orders.jsonl",
            "lookup_order A12, B34, C56, D78 (the identity field differs), each ok",
            run(
                GENAI,
                *[
                    tool("lookup_order", {"order_id": order}, {"status": "delivered", "version": 7})
                    for order in ("A12", "B34", "C56", "D78")
                ],
                user="Check my four orders.",
                answer="All four orders were delivered.",
            ),
        ),
        example(
            "negative__parallel_calls.pb",
            "one model turn issues 3 identical lookup_order A12 calls concurrently (same "
            "agent.step.sequence, overlapping times), then a final answer",
            run(
                GENAI,
                tool("get_customer", {"customer_id": "C7"}, CUSTOMER_C7),
                parallel(*[tool("lookup_order", A12, DELIVERED_7) for _ in range(3)]),
                sequence=True,
            ),
            parallel_duplicate_calls=2,
        ),
        example(
            "negative__idempotent_retry.pb",
            "issue_refund with idempotency_key rk-9 -> TimeoutError, retried with the same key",
            run(
                OPENINFERENCE,
                tool("issue_refund", REFUND_A31, None, TIMEOUT, ms=400),
                tool(
                    "issue_refund",
                    REFUND_A31,
                    {"ok": True, "refund_id": "rf-31", "deduplicated": False},
                ),
                style=AGENTS_SDK,
                call_ids=False,
                user="Refund order A31 please.",
                answer="Your refund has been issued.",
            ),
        ),
        example(
            "negative__version_advance.jsonl",
            "lookup_order A12 three times, version 7 -> 8 -> 9 (progress)",
            run(
                GENAI,
                tool("lookup_order", A12, {"status": "pending", "version": 7}),
                tool("lookup_order", A12, {"status": "pending", "version": 8}),
                tool("lookup_order", A12, {"status": "delivered", "version": 9}),
            ),
        ),
        example(
            "negative__backoff_retry.pb",
            "fetch_inventory -> 503 four times with gaps of 100 ms, 400 ms, 1.6 s, then success",
            run(
                GENAI,
                tool("fetch_inventory", {"sku": "SKU-9"}, UNAVAILABLE_RESULT, UNAVAILABLE, ms=90),
                *[
                    tool(
                        "fetch_inventory",
                        {"sku": "SKU-9"},
                        UNAVAILABLE_RESULT,
                        UNAVAILABLE,
                        retry=True,
                        gap_ms=gap,
                        ms=90,
                    )
                    for gap in (100, 400, 1600)
                ],
                tool(
                    "fetch_inventory",
                    {"sku": "SKU-9"},
                    {"ok": True, "sku": "SKU-9", "qty": 14},
                    retry=True,
                    gap_ms=6400,
                    ms=110,
                ),
                user="Is SKU-9 in stock?",
                answer="Yes, 14 units of SKU-9 are in stock.",
            ),
        ),
        example(
            "negative__clean_run.jsonl",
            "two concurrent clean runs in one file, export batches interleaved: support (4 "
            "steps incl. a 2-call turn and a RETRIEVER) and research (3 steps)",
            run(
                OPENINFERENCE,
                parallel(
                    tool("get_customer", {"customer_id": "C7"}, CUSTOMER_C7),
                    tool("lookup_order", A12, DELIVERED_7),
                ),
                tool("search_kb", {"query": "refund window"}, ["kb-12", "kb-31"], retriever=True),
                tool("draft_reply", {"template": "refund_window"}, {"draft_id": "d-9"}),
                style=LANGGRAPH,
                answer="Your order was delivered; refunds are open for 30 days.",
            ),
            run(
                OPENINFERENCE,
                tool("web_search", {"q": "otlp json encoding"}, {"urls": ["u1", "u2"]}),
                tool("fetch_page", {"url": "https://example.com/u1"}, {"chars": 9000}),
                tool("fetch_page", {"url": "https://example.com/u2"}, {"chars": 7000}),
                style=AGENTS_SDK,
                call_ids=False,
                service="research-bot",
                prompt_version="research-v4",
                agent="research",
                task_type="research",
                user="How does OTLP JSON encode ids?",
                answer="As hex strings.",
                start_ms=4500,
            ),
        ),
    ]


# --------------------------------------------------------------------- SDK plumbing


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("/".join(parts).encode()).digest()


class ScenarioIds(IdGenerator):
    """Deterministic ids: the n-th id of a run is a hash of (run key, kind, n)."""

    def __init__(self, seed: str) -> None:
        self.seed = seed
        self.spans = 0
        self.traces = 0

    def generate_span_id(self) -> int:
        self.spans += 1
        return int.from_bytes(_digest(self.seed, "span", str(self.spans))[:8]) or 1

    def generate_trace_id(self) -> int:
        self.traces += 1
        return int.from_bytes(_digest(self.seed, "trace", str(self.traces))[:16]) or 1


class Collect(SpanProcessor):
    """Keeps finished spans in memory, in the order they ended."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def dumps(value: Any, convention: str) -> str:
    """Tool payloads as instrumentations record them: GenAI compact, OpenInference json.dumps."""
    if convention == GENAI:
        return json.dumps(value, separators=(",", ":"))
    return json.dumps(value)


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def hexid(span: Span | ReadableSpan) -> str:
    return f"{span.get_span_context().span_id:016x}"


# ------------------------------------------------------------------------ rendering


@dataclass
class Rendered:
    run: Run
    trace_id: str
    spans: list[ReadableSpan]
    findings: list[dict[str, Any]]
    counters: dict[str, int] = field(default_factory=dict)


class Recorder:
    """Renders one Run into SDK spans, advancing a clock through the scenario."""

    def __init__(self, run: Run, start_ns: int) -> None:
        self.run = run
        self.genai = run.convention == GENAI
        self.collect = Collect()
        self.ids = ScenarioIds(run.key)
        provider = TracerProvider(
            sampler=ALWAYS_ON,
            resource=Resource(
                {
                    "service.name": run.service,
                    "prompt.version": run.prompt_version,
                    "deployment.environment": "example",
                    "telemetry.sdk.language": "python",
                    "telemetry.sdk.name": "opentelemetry",
                }
            ),
            id_generator=self.ids,
            span_limits=SpanLimits(
                max_span_attributes=256,
                max_event_attributes=64,
                max_link_attributes=64,
                max_attributes=256,
                max_events=64,
                max_links=64,
                max_attribute_length=SpanLimits.UNSET,
                max_span_attribute_length=SpanLimits.UNSET,
            ),
            shutdown_on_exit=False,
        )
        provider.add_span_processor(self.collect)
        self.tracer = provider.get_tracer(f"loopwatch.examples.{run.convention}", "1.0.0")
        self.rng = random.Random(run.key)
        self.t = start_ns
        self.context = run.context_tokens
        self.agent = run.agent
        self.multi_agent = any(isinstance(step, Handoff) for step in run.steps)
        self.counts: dict[str, int] = {}
        self.sequence = 0
        self.lg_step = 0
        self.calls = 0
        self.pending: Llm | None = None  # an explicit llm() step for the next turn
        self.after_plan = False  # the previous step was a plan span (it holds the model call)
        self.answered = False  # the final answer has been rendered
        self.findings: list[dict[str, Any]] = []
        self.budget = Budget(run)
        self.root = self._start_root()

    # -- clock and spans ---------------------------------------------------------------

    def advance(self, gap_ms: int | None, lo: int, hi: int, ms: int | None) -> tuple[int, int]:
        start = self.t + (gap_ms if gap_ms is not None else self.rng.randint(4, 25)) * MS
        end = start + (ms if ms is not None else self.rng.randint(lo, hi)) * MS
        self.t = end
        return start, end

    def span(
        self,
        name: str,
        start: int,
        attrs: dict[str, Any],
        kind: SpanKind = SpanKind.INTERNAL,
        parent: Span | None = None,
    ) -> Span:
        ctx = trace.set_span_in_context(parent or self.root)
        return self.tracer.start_span(name, ctx, kind, attrs, start_time=start)

    @contextmanager
    def node(self, name: str) -> Iterator[Span | None]:
        """A LangGraph node (CHAIN span) around model and tool spans; no-op elsewhere."""
        if self.genai or self.run.style != LANGGRAPH:
            yield None
            return
        self.lg_step += 1
        chain = self.span(
            name,
            self.t + 2 * MS,
            {
                "openinference.span.kind": "CHAIN",
                "metadata": self.metadata(name),
            },
        )
        self.t += 3 * MS
        yield chain
        self.t += 2 * MS
        chain.set_status(Status(StatusCode.OK))
        chain.end(self.t)

    def metadata(self, node: str) -> str:
        return json.dumps(
            {"langgraph_step": self.lg_step, "langgraph_node": node, "thread_id": self.run.key}
        )

    def oi_common(self, kind: str) -> dict[str, Any]:
        attrs: dict[str, Any] = {"openinference.span.kind": kind}
        if self.run.style == LANGGRAPH:
            attrs["metadata"] = self.metadata("agent" if kind == "LLM" else "tools")
        if self.multi_agent:
            attrs["agent.name"] = self.agent
        return attrs

    def mark(self, trigger: str | None, span: Span, call_id: str | None, where: str) -> None:
        """Record the expected finding whose trigger is `span` (the scenario's mark)."""
        if trigger is None:
            return
        shape, _, budget = trigger.partition("/")
        finding: dict[str, Any] = {
            "run_trace_id": self.trace_id,
            "shape": shape,
            "trigger_span_id": hexid(span),
            "trigger_call_id": call_id,
            "where": where,
        }
        if budget:
            finding["budget"] = budget
            self.budget.expect(budget, span)
        self.findings.append(finding)

    @property
    def trace_id(self) -> str:
        return f"{self.root.get_span_context().trace_id:032x}"

    # -- root --------------------------------------------------------------------------

    def _start_root(self) -> Span:
        run = self.run
        if self.genai:
            attrs: dict[str, Any] = {
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.provider.name": "openai",
                "gen_ai.agent.name": run.agent,
                "gen_ai.conversation.id": "conv_" + _digest(run.key, "conv").hex()[:20],
                "agent.task_type": run.task_type,
            }
            name = f"invoke_agent {run.agent}"
        else:
            attrs = {
                "openinference.span.kind": "AGENT",
                "agent.name": run.agent,
                "session.id": "sess_" + _digest(run.key, "session").hex()[:20],
                "agent.task_type": run.task_type,
                "input.value": run.user,
                "input.mime_type": "text/plain",
            }
            name = run.agent
        root = self.tracer.start_span(name, None, SpanKind.INTERNAL, attrs, start_time=self.t)
        self.t += 3 * MS
        return root

    def finish(self) -> Rendered:
        run, root = self.run, self.root
        if run.end == "stop":
            if not self.answered:
                self.model_turn(Llm(), final=True)
            self.t += 4 * MS
            if self.genai:
                root.set_attribute("gen_ai.agent.finish_reason", "stop")
            else:
                root.set_attribute("output.value", run.answer)
                root.set_attribute("output.mime_type", "text/plain")
                root.set_status(Status(StatusCode.OK))
        else:
            if run.end == "max_turns":
                exc, exc_msg = "agents.exceptions.MaxTurnsExceeded", "Max turns (6) exceeded"
                status = "Max turns exceeded: {'max_turns': 6}"
            else:
                exc = "langgraph.errors.GraphRecursionError"
                status = exc_msg = (
                    "Recursion limit of 25 reached without hitting a stop condition. You can "
                    "increase the limit by setting the `recursion_limit` config key."
                )
            self.t += 6 * MS
            root.add_event(
                "exception", {"exception.type": exc, "exception.message": exc_msg}, self.t
            )
            if self.genai:
                root.set_attribute("error.type", exc)
            root.set_status(Status(StatusCode.ERROR, status))
            self.t += 1 * MS
        root.end(self.t)
        self.budget.finish(root)
        spans = sorted(self.collect.spans, key=lambda s: s.end_time or 0)
        return Rendered(run, self.trace_id, spans, self.findings, self.budget.counters())

    # -- steps -------------------------------------------------------------------------

    def render(self, step: Any) -> None:
        if isinstance(step, Llm) and not step.final:
            self.pending = step  # shapes the model turn before the next action
            return
        if isinstance(step, Tool | Parallel | Handoff):
            retry = isinstance(step, Tool) and step.retry
            if not (retry or self.after_plan):
                calls = step.tools if isinstance(step, Parallel) else None
                self.model_turn(self.pending or Llm(), calls=calls)
            self.pending = None
        self.after_plan = False
        if isinstance(step, Tool):
            self.tools([step])
        elif isinstance(step, Parallel):
            self.tools(step.tools)
        elif isinstance(step, Handoff):
            self.handoff(step)
        elif isinstance(step, Llm):
            self.model_turn(step, final=True)
        elif isinstance(step, Plan):
            self.plan(step)
            self.after_plan = True  # the plan's own model call requested the next tool
        elif isinstance(step, Summarize):
            self.summarize(step)
        elif isinstance(step, Guard):
            self.t += 3 * MS
            self.root.add_event(
                "loop_guard",
                {"loop_guard.reason": step.reason, "loop_guard.tool": step.tool},
                self.t,
            )

    def model_turn(
        self,
        turn: Llm,
        calls: list[Tool] | None = None,
        final: bool = False,
        parent: Span | None = None,
    ) -> None:
        """One LLM call. Its requested tool calls are recorded only when there are several
        (a multi-call turn is a plan); a one-call turn is represented by the tool span."""
        tokens_in = turn.in_tokens or self.context
        tokens_out = turn.out_tokens or (
            self.rng.randint(90, 260)
            if final
            else self.rng.randint(28, 75) * max(1, len(calls or ()))
        )
        self.context = tokens_in + tokens_out
        with self.node("agent") as chain:
            start, end = self.advance(None, 550, 1900, turn.ms)
            calls = calls if calls and len(calls) > 1 else []
            if self.genai:
                attrs: dict[str, Any] = {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.provider.name": "openai",
                    "gen_ai.request.model": "gpt-4o",
                    "gen_ai.response.model": "gpt-4o-2024-08-06",
                    "gen_ai.prompt.version": self.run.prompt_version,
                    "gen_ai.usage.input_tokens": tokens_in,
                    "gen_ai.usage.output_tokens": tokens_out,
                    "gen_ai.response.finish_reasons": ["stop" if final else "tool_calls"],
                }
                if self.multi_agent:
                    attrs["gen_ai.agent.name"] = self.agent
                if calls:
                    parts = [
                        {
                            "type": "tool_call",
                            "id": self.call_id(i),
                            "name": c.name,
                            "arguments": c.args,
                        }
                        for i, c in enumerate(calls)
                    ]
                    attrs["gen_ai.output.messages"] = json.dumps(
                        [{"role": "assistant", "parts": parts, "finish_reason": "tool_calls"}],
                        separators=(",", ":"),
                    )
                span = self.span("chat gpt-4o", start, attrs, SpanKind.CLIENT, parent)
            else:
                attrs = self.oi_common("LLM") | {
                    "llm.model_name": "gpt-4o",
                    "llm.provider": "openai",
                    "llm.system": "openai",
                    "llm.prompt_template.version": self.run.prompt_version,
                    "llm.token_count.prompt": tokens_in,
                    "llm.token_count.completion": tokens_out,
                    "llm.token_count.total": tokens_in + tokens_out,
                }
                prefix = "llm.output_messages.0.message."
                attrs[prefix + "role"] = "assistant"
                if final:
                    attrs[prefix + "content"] = self.run.answer
                for i, c in enumerate(calls):
                    p = f"{prefix}tool_calls.{i}.tool_call."
                    attrs[p + "function.name"] = c.name
                    attrs[p + "function.arguments"] = json.dumps(c.args)
                    if self.run.call_ids:
                        attrs[p + "id"] = self.call_id(i)
                name = "ChatOpenAI" if self.run.style == LANGGRAPH else "response"
                span = self.span(name, start, attrs, SpanKind.INTERNAL, chain)
                span.set_status(Status(StatusCode.OK))
            span.end(end)
        self.count("LLM")
        self.answered = final
        self.budget.tokens(tokens_in + tokens_out, span)
        self.mark(turn.trigger, span, None, f"{self.nth('LLM')} LLM span")

    def call_id(self, offset: int = 0) -> str:
        return "call_" + _digest(self.run.key, "call", str(self.calls + offset)).hex()[:24]

    def tools(self, tools: list[Tool]) -> None:
        """The tool calls of one model turn; several run concurrently (2 ms apart)."""
        self.sequence += 1
        with self.node("tools") as chain:
            t0, ends = self.t, []
            for i, step in enumerate(tools):
                self.t = t0 + i * 2 * MS
                lo, hi = (50, 160) if step.retriever else (60, 380)
                start, end = self.advance(step.gap_ms, lo, hi, step.ms)
                ends.append(end)
                self.tool(step, start, end, chain)
            self.t = max(ends)

    def tool(self, step: Tool, start: int, end: int, chain: Span | None) -> None:
        call_id = self.call_id()
        self.calls += 1
        self.count(step.name)
        self.count("tool")
        err = step.error
        if self.genai:
            attrs: dict[str, Any] = {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": step.name,
                "gen_ai.tool.type": "function",
                "gen_ai.tool.call.id": call_id,
                "gen_ai.tool.call.arguments": dumps(step.args, GENAI),
                "gen_ai.tool.version": "3",
            }
            if step.result is not None:
                attrs["gen_ai.tool.call.result"] = dumps(step.result, GENAI)
            if self.run.sequence:
                attrs["agent.step.sequence"] = self.sequence
            if self.multi_agent:
                attrs["gen_ai.agent.name"] = self.agent
            if err:
                attrs["error.type"] = err.code
            span = self.span(f"execute_tool {step.name}", start, attrs)
        else:
            attrs = self.oi_common("RETRIEVER" if step.retriever else "TOOL")
            if step.retriever:
                attrs["input.value"] = step.args["query"]
                attrs["input.mime_type"] = "text/plain"
                for i, doc in enumerate(step.result):
                    attrs[f"retrieval.documents.{i}.document.id"] = doc
                    attrs[f"retrieval.documents.{i}.document.score"] = round(0.91 - 0.07 * i, 2)
            else:
                attrs["tool.name"] = step.name
                attrs["input.value"] = dumps(step.args, OPENINFERENCE)
                attrs["input.mime_type"] = "application/json"
                if step.result is not None:
                    attrs["output.value"] = dumps(step.result, OPENINFERENCE)
                    attrs["output.mime_type"] = "application/json"
                elif err:
                    attrs["error.type"] = err.code  # no output carries the code
                if self.run.call_ids:
                    attrs["tool_call.id"] = call_id
            span = self.span(step.name, start, attrs, SpanKind.INTERNAL, chain)
            if err:
                span.add_event(
                    "exception",
                    {"exception.type": err.exception, "exception.message": err.message},
                    end,
                )
            else:
                span.set_status(Status(StatusCode.OK))
        if err:
            span.set_status(Status(StatusCode.ERROR, err.message))
        span.end(end)
        self.context += step.context_tokens or len(dumps(step.result, GENAI)) // 4 + 30
        self.budget.action(span)
        recorded = self.genai or self.run.call_ids
        where = f"{self.nth('tool')} tool call ({self.nth(step.name)} {step.name})"
        self.mark(step.trigger, span, call_id if recorded else None, where)

    def handoff(self, step: Handoff) -> None:
        self.sequence += 1
        self.count("handoff")
        start, end = self.advance(None, 5, 30, None)
        if self.genai:
            span = self.span(
                f"handoff {step.dst}",
                start,
                {
                    "gen_ai.operation.name": "handoff",
                    "gen_ai.agent.name": step.src,
                    "gen_ai.handoff.from_agent": step.src,
                    "gen_ai.handoff.to_agent": step.dst,
                },
            )
        elif step.form == "span":
            span = self.span(
                f"handoff to {step.dst}", start, self.oi_common("TOOL") | {"agent.name": step.src}
            )
        else:
            name = f"transfer_to_{step.dst}"
            span = self.span(
                name,
                start,
                self.oi_common("TOOL")
                | {
                    "agent.name": step.src,
                    "tool.name": name,
                    "input.value": "{}",
                    "input.mime_type": "application/json",
                    "output.value": json.dumps({"assistant": step.dst}),
                    "output.mime_type": "application/json",
                },
            )
        if not self.genai:
            span.set_status(Status(StatusCode.OK))
        span.end(end)
        self.agent = step.dst
        self.budget.action(span)
        self.mark(step.trigger, span, None, f"{self.nth('handoff')} handoff")

    def plan(self, step: Plan) -> None:
        if not self.genai:
            raise ValueError("plan spans are a GenAI-convention construct")
        self.count("plan")
        self.t += self.rng.randint(4, 25) * MS
        span = self.span(
            f"plan {self.agent}",
            self.t,
            {
                "gen_ai.operation.name": "plan",
                "gen_ai.agent.name": self.agent,
                "gen_ai.plan.steps": json.dumps(step.steps, separators=(",", ":")),
            },
        )
        self.t += 2 * MS
        self.model_turn(Llm(), parent=span)
        self.t += 3 * MS
        span.end(self.t)
        self.mark(step.trigger, span, None, f"{self.nth('plan')} plan span")

    def summarize(self, step: Summarize) -> None:
        if not self.genai:
            raise ValueError("summarize_history is written in the GenAI convention")
        start, end = self.advance(None, 700, 1500, None)
        tokens_in, tokens_out = self.context, step.keep_tokens - self.run.context_tokens
        span = self.span(
            "summarize_history",
            start,
            {
                "gen_ai.operation.name": "summarize",
                "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "gpt-4o-mini",
                "gen_ai.prompt.version": self.run.prompt_version,
                "gen_ai.usage.input_tokens": tokens_in,
                "gen_ai.usage.output_tokens": tokens_out,
            },
            SpanKind.CLIENT,
        )
        span.end(end)
        self.context = step.keep_tokens
        self.budget.tokens(tokens_in + tokens_out, span)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def nth(self, what: str) -> str:
        return ordinal(self.counts[what])


class Budget:
    """Checks the scenario arithmetic against the budgets of examples/loopwatch.yaml: a run
    passes a budget exactly at the step its scenario marks, and passes no other budget."""

    def __init__(self, run: Run) -> None:
        policy = yaml.safe_load(POLICY.read_text())
        limits = dict(policy["defaults"]["budgets"])
        limits |= policy.get("task_types", {}).get(run.task_type, {}).get("budgets", {})
        self.key = run.key
        self.limits: dict[str, int] = limits
        self.used = {"steps": 0, "tokens": 0}
        self.crossed: dict[str, str] = {}
        self.expected: dict[str, str] = {}
        self.seconds = 0.0

    def _add(self, budget: str, amount: int, span: Span) -> None:
        self.used[budget] += amount
        if self.used[budget] > self.limits[budget] and budget not in self.crossed:
            self.crossed[budget] = hexid(span)

    def action(self, span: Span) -> None:
        self._add("steps", 1, span)

    def tokens(self, amount: int, span: Span) -> None:
        self._add("tokens", amount, span)

    def expect(self, budget: str, span: Span) -> None:
        self.expected[budget] = hexid(span)

    def finish(self, root: ReadableSpan) -> None:
        self.seconds = ((root.end_time or 0) - (root.start_time or 0)) / 1e9
        if self.seconds > self.limits["seconds"]:
            self.crossed["seconds"] = hexid(root)
        if self.crossed != self.expected:
            raise SystemExit(
                f"generate.py: run {self.key}: budgets passed at {self.crossed}, "
                f"but the scenario marks {self.expected} ({self.used}, "
                f"{self.seconds:.1f} s, limits {self.limits})"
            )

    def counters(self) -> dict[str, Any]:
        return {
            "actions": self.used["steps"],
            "tokens": self.used["tokens"],
            "duration_ms": round(self.seconds * 1000),
        }


def render(run: Run, start_ns: int) -> Rendered:
    recorder = Recorder(run, start_ns)
    for step in run.steps:
        recorder.render(step)
    return recorder.finish()


# ------------------------------------------------------------------------- exporting


def chunks(spans: list[ReadableSpan], n: int | None) -> list[list[ReadableSpan]]:
    """Cut a run's spans (in end order) into 2-3 export batches, as a BatchSpanProcessor
    would ship them: children before parents, the root in the last batch."""
    n = n or (2 if len(spans) < 16 else 3)
    size, extra = divmod(len(spans), n)
    out, at = [], 0
    for i in range(n):
        step = size + (1 if i < extra else 0)
        out.append(spans[at : at + step])
        at += step
    return out


def export_messages(example: Example, runs: list[Rendered]) -> list[bytes]:
    per_run = [chunks(r.spans, example.batches) for r in runs]
    messages = [
        encode_spans(
            [s for batches in per_run if i < len(batches) for s in batches[i]]
        ).SerializeToString(deterministic=True)
        for i in range(max(len(b) for b in per_run))
    ]
    if example.redeliver:  # at-least-once: each message again, after the next one
        resent = []
        for i, message in enumerate(messages):
            resent.append(message)
            if i:
                resent.append(messages[i - 1])
        messages = resent + messages[-1:]
    return messages


def hex_ids(value: Any) -> Any:
    """OTLP JSON (as the Collector writes it) carries trace/span ids as hex, not base64."""
    if isinstance(value, dict):
        return {
            k: base64.b64decode(v).hex()
            if k in ("traceId", "spanId", "parentSpanId")
            else hex_ids(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [hex_ids(v) for v in value]
    return value


def encode_file(fmt: str, messages: list[bytes]) -> bytes:
    if fmt == "pb":
        return b"".join(struct.pack(">I", len(m)) + m for m in messages)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    lines = []
    for raw in messages:
        message = ExportTraceServiceRequest.FromString(raw)
        doc = hex_ids(MessageToDict(message, use_integers_for_enums=True))
        lines.append(json.dumps(doc, separators=(",", ":"), ensure_ascii=False) + "\n")
    return "".join(lines).encode()


# ---------------------------------------------------------------------------- output


def describe(finding: dict[str, Any]) -> str:
    text = f"`{finding['shape']}` at {finding['where']}"
    return text + (f" (budget `{finding['budget']}`)" if "budget" in finding else "")


def convention_label(r: Run) -> str:
    if r.convention == GENAI:
        return "GenAI, agent.step.sequence" if r.sequence else "GenAI, timestamps"
    if r.style == LANGGRAPH:
        return "OpenInference (langgraph, langgraph_step)"
    return "OpenInference (agents-sdk, timestamps)"


def readme_block(examples: list[Example], expected: dict[str, Any]) -> str:
    lines = [
        "| file | convention, ordering | what happens | expected finding (trigger) |",
        "|---|---|---|---|",
    ]
    for ex in examples:
        entry = expected[ex.file]
        found = "; ".join(describe(f) for f in entry["findings"]) or "none"
        if ex.parallel_duplicate_calls:
            found += f" (parallel_duplicate_calls = {ex.parallel_duplicate_calls})"
        conventions = " + ".join(sorted({convention_label(r) for r in ex.runs}))
        lines.append(f"| `{ex.file}` | {conventions} | {ex.summary} | {found} |")
    return "\n".join(lines)


BEGIN, END = "<!-- scenarios:begin -->", "<!-- scenarios:end -->"


def update_readme(path: Path, block: str) -> None:
    if not path.exists():
        return
    text = path.read_text()
    if BEGIN not in text or END not in text:
        return
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory")
    out: Path = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*__*.pb"), *out.glob("*__*.jsonl")]:
        stale.unlink()

    examples = scenarios()
    expected: dict[str, Any] = {}
    for index, ex in enumerate(examples):
        start = BASE_NS + index * 600_000 * MS  # one example every 10 minutes
        runs = [render(r, start + r.start_ms * MS) for r in ex.runs]
        messages = export_messages(ex, runs)
        file_name = ex.file
        (out / file_name).write_bytes(encode_file(ex.fmt, messages))
        spans = sum(len(r.spans) for r in runs)
        expected[file_name] = {
            "runs": len(runs),
            "run_trace_ids": [r.trace_id for r in runs],
            "conventions": [r.run.convention for r in runs],
            "export_messages": len(messages),
            "spans": spans,
            "duplicate_spans": spans if ex.redeliver else 0,
            "parallel_duplicate_calls": ex.parallel_duplicate_calls,
            "run_stats": [{"trace_id": r.trace_id, **r.counters} for r in runs],
            "findings": [f for r in runs for f in r.findings],
        }
    doc = {
        "_comment": "Oracle for the golden tests, written by examples/generate.py from the "
        "scenario definitions (trigger marks), not by a detector. Policy: "
        "examples/loopwatch.yaml. `where` is informative only.",
        "files": expected,
    }
    (out / "expected.json").write_text(json.dumps(doc, indent=2) + "\n")
    if out.resolve() == HERE:
        update_readme(HERE / "README.md", readme_block(examples, expected))
    for name, entry in expected.items():
        shapes = ", ".join(f["shape"] for f in entry["findings"]) or "-"
        print(
            f"{name:55s} runs={entry['runs']} msgs={entry['export_messages']} "
            f"spans={entry['spans']:3d} findings: {shapes}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
