"""Build decoded spans for detector tests: a tiny run DSL with deterministic ids and times,
and the canary runs of the privacy tests."""

from __future__ import annotations

import json
import uuid
from typing import Any

from detectors.fingerprint import Fingerprinter
from detectors.policy import Policy, policy_from_mapping
from streams.replay.runs import Replay
from streams.spanpath.spans import STATUS_ERROR, STATUS_OK, STATUS_UNSET, SpanEvent, SpanRecord

# In the past: spans ending over a day after the wall clock are rejected as invalid.
BASE_NS = 1_790_000_000_000_000_000  # 2026-09-21
MS = 1_000_000

EXAMPLE_POLICY: dict[str, Any] = {
    "policy_version": "test.1",
    "defaults": {
        "allowed_repeats": 2,
        "window": 8,
        "budgets": {"steps": 40, "tokens": 200000, "seconds": 300},
    },
    "task_types": {
        "attribute": "agent.task_type",
        "support": {"budgets": {"steps": 20, "seconds": 60}},
    },
    "tools": {
        "lookup_order": {
            "identity": ["order_id", "include_items"],
            "defaults": {"include_items": False},
            "progress": {"version_field": "version"},
        },
        "get_export_status": {
            "progress": {"state_field": "status", "terminal_states": ["complete", "failed"]},
            "max_polls": 5,
        },
        "search_cases": {"progress": {"cursor_arg": "cursor", "new_items_field": "case_ids"}},
        "search_orders": {"normalize": {"query": ["trim", "lowercase"]}},
        "issue_refund": {
            "side_effect": True,
            "idempotency_key_arg": "idempotency_key",
            "business_identity": ["order_id"],
            "reconcile_tool": "get_refund_status",
        },
        "get_refund_status": {},
        "update_ticket": {
            "side_effect": True,
            "idempotency_key_arg": "idempotency_key",
            "business_identity": ["ticket_id"],
        },
    },
}


def example_policy(**overrides: Any) -> Policy:
    raw = json.loads(json.dumps(EXAMPLE_POLICY))
    raw.update(overrides)
    return policy_from_mapping(raw, "<test policy>")


class Run:
    """Spans of one run (one trace), in runtime order, with a clock that moves forward."""

    def __init__(
        self,
        trace: int = 1,
        prompt_version: str = "support-v12",
        task_type: str | None = None,
        sequenced: bool = False,
    ) -> None:
        self.trace_id = f"{trace:032x}"
        self.root_id = self._span_id(0)
        self.spans: list[SpanRecord] = []
        self.clock = BASE_NS + trace * 1_000_000 * MS
        self.start = self.clock
        self.counter = 0
        self.sequenced = sequenced
        self.seq = 0
        self.resource = {"service.name": "support-bot", "prompt.version": prompt_version}
        self.task_type = task_type
        # Where the prompt version is: the resource (every span), or only the root span
        # (as instrumentations put run metadata on the agent span, which ends last).
        self.version_on_root: str | None = None

    def version_only_on_root(self) -> Run:
        self.version_on_root = self.resource.pop("prompt.version")
        return self

    def _span_id(self, n: int) -> str:
        return f"{int(self.trace_id, 16) % 0xFFFF:04x}{n:012x}"

    def _next(self) -> str:
        self.counter += 1
        return self._span_id(self.counter)

    def _attrs(self, extra: dict[str, Any]) -> dict[str, Any]:
        attrs = dict(extra)
        if self.task_type:
            attrs["agent.task_type"] = self.task_type
        return attrs

    def tool(
        self,
        name: str,
        args: Any = None,
        result: Any = None,
        *,
        error: str | None = None,
        gap_ms: int = 20,
        dur_ms: int = 100,
        seq: int | None = None,
        call_id: str | None = None,
        parallel: bool = False,
    ) -> SpanRecord:
        if not parallel:
            self.clock += gap_ms * MS
        start = self.clock
        end = start + dur_ms * MS
        if not parallel:
            self.clock = end
        span_id = self._next()
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call_id or f"call_{self.counter}",
            "gen_ai.tool.version": "3",
        }
        if args is not None:
            attrs["gen_ai.tool.call.arguments"] = json.dumps(args)
        if result is not None:
            attrs["gen_ai.tool.call.result"] = json.dumps(result)
        if error is not None:
            attrs["error.type"] = error
        if self.sequenced or seq is not None:
            if seq is None and not parallel:
                self.seq += 1
            attrs["agent.step.sequence"] = seq if seq is not None else self.seq
        span = SpanRecord(
            self.trace_id,
            span_id,
            self.root_id,
            f"execute_tool {name}",
            1,
            start,
            end,
            STATUS_ERROR if error else STATUS_UNSET,
            "",
            self._attrs(attrs),
            self.resource,
        )
        self.spans.append(span)
        return span

    def llm(
        self,
        input_tokens: int = 100,
        output_tokens: int = 20,
        *,
        dur_ms: int = 500,
        tool_calls: list[tuple[str, Any]] | None = None,
        model: str | None = None,
    ) -> SpanRecord:
        self.clock += 10 * MS
        start, end = self.clock, self.clock + dur_ms * MS
        self.clock = end
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
        }
        if model is not None:
            attrs["gen_ai.response.model"] = model
        if tool_calls:
            parts = [{"type": "tool_call", "name": n, "arguments": a} for n, a in tool_calls]
            attrs["gen_ai.output.messages"] = json.dumps([{"role": "assistant", "parts": parts}])
        span = SpanRecord(
            self.trace_id,
            self._next(),
            self.root_id,
            "chat gpt-4o",
            3,
            start,
            end,
            STATUS_UNSET,
            "",
            self._attrs(attrs),
            self.resource,
        )
        self.spans.append(span)
        return span

    def other(self, name: str, attrs: dict[str, Any], dur_ms: int = 50) -> SpanRecord:
        self.clock += 10 * MS
        start, end = self.clock, self.clock + dur_ms * MS
        self.clock = end
        span = SpanRecord(
            self.trace_id,
            self._next(),
            self.root_id,
            name,
            1,
            start,
            end,
            STATUS_UNSET,
            "",
            self._attrs(attrs),
            self.resource,
        )
        self.spans.append(span)
        return span

    def plan(self, steps: list[dict[str, Any]]) -> SpanRecord:
        return self.other(
            "plan", {"gen_ai.operation.name": "plan", "gen_ai.plan.steps": json.dumps(steps)}
        )

    def summary(self) -> SpanRecord:
        return self.other("summarize_history", {"gen_ai.operation.name": "summarize"})

    def handoff(self, source: str, target: str) -> SpanRecord:
        return self.other(
            f"handoff to {target}",
            {
                "gen_ai.operation.name": "handoff",
                "gen_ai.handoff.from_agent": source,
                "gen_ai.handoff.to_agent": target,
            },
        )

    def root(
        self,
        *,
        status: int = STATUS_OK,
        message: str = "",
        events: list[SpanEvent] | None = None,
        attrs: dict[str, Any] | None = None,
    ) -> SpanRecord:
        self.clock += 50 * MS
        base = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support"}
        if self.version_on_root is not None:
            base["gen_ai.prompt.version"] = self.version_on_root
        base.update(attrs or {})
        span = SpanRecord(
            self.trace_id,
            self.root_id,
            None,
            "invoke_agent support",
            1,
            self.start,
            self.clock,
            status,
            message,
            self._attrs(base),
            self.resource,
            events or [],
        )
        self.spans.append(span)
        return span


def replay(
    batches: list[list[SpanRecord]], policy: Policy | None = None, key: bytes | None = b"test-key"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    replay = Replay(policy or example_policy(), Fingerprinter(key), events.append, summaries.append)
    for batch in batches:
        replay.feed(batch)
    replay.close()
    return events, summaries


def shapes(events: list[dict[str, Any]]) -> list[str]:
    return [e["shape"] for e in events]


# ---------------------------------------------------------------------------- canaries


class Canaries:
    """Unique `CANARY-<kind>-<uuid4>` strings, one per place customer text lives; `find`
    reports the kinds of any of them in a text, also lowercased or cut to the first 16 hex
    digits of the uuid (a changed copy is still a leak)."""

    def __init__(self) -> None:
        self.made: dict[str, str] = {}

    def __call__(self, kind: str) -> str:
        value = f"CANARY-{kind}-{uuid.uuid4().hex}"
        self.made[value] = kind
        return value

    def find(self, text: str) -> list[str]:
        low = text.lower()
        return sorted(
            {
                kind
                for value, kind in self.made.items()
                if value.lower() in low or value.rsplit("-", 1)[1][:16] in low
            }
        )

    def find_bytes(self, data: bytes | None) -> list[str]:
        return self.find(data.decode("latin-1")) if data else []

    def assert_absent(self, where: str, text: str) -> None:
        leaked = self.find(text)
        assert not leaked, f"canaries {leaked} leaked into {where}"


CANARY_DETECTORS = {"near_duplicate", "near_duplicate_turns"}  # ... beside the shapes
CANARY_SHAPES = {  # what `canary_runs` fires (budgets of 8 steps and 5000 tokens)
    "identical_repetition",
    "goal_already_satisfied",
    "argument_churn",
    "retry_storm",
    "replanning",
    "duplicate_side_effect",
    "unsafe_side_effect_retry",
    "delegation_ping_pong",
    "oscillation",
    "context_collapse",
    "budget_exhausted",
}


def canary_runs(c: Canaries) -> list[Run]:
    """Six runs (traces 101-106) whose loops make every detector emit, with canaries in
    every free-text place: tool arguments (values and keys) and results, status and
    exception messages and stacktraces, LLM input/output messages and system instructions,
    plan arguments, OpenInference values, OpenLLMetry envelopes, kvlist values, root input
    and output, unrecognized span and resource attributes. Shared by the embedded
    (tests/unit/spanpath/test_privacy.py) and the worker (tests/integration/test_canary.py) canary
    tests, both with budgets of 8 steps and 5000 tokens."""
    runs = []

    # 1. identical repetition + goal satisfied + context collapse + budget; error root
    run = Run(trace=101)
    run.resource["customer.email"] = c("resource-attr")
    note = c("arg-note")
    for _ in range(3):
        span = run.tool(
            "lookup_order",
            {"order_id": "A12", "note": note, c("arg-key"): 1},
            {"status": "shipped", "version": 1, "detail": c("result-detail")},
        )
        span.attributes["user.email"] = c("span-attr")
    export, url = c("arg-export"), c("result-url")
    for _ in range(3):
        run.tool(
            "get_export_status",
            {"export_id": export},
            {"status": "complete", "download_url": url},
        )
    run.summary()
    doc = c("result-doc")
    for _ in range(3):
        run.llm(5000, 20)
        run.tool("fetch_doc", {"doc": "handbook"}, {"text": doc})
        run.llm(100, 20)
    run.root(
        status=STATUS_ERROR,
        message=f"Max turns exceeded for customer {c('status-root')}",
        events=[
            SpanEvent(
                "exception",
                run.clock,
                {
                    "exception.type": "agents.exceptions.MaxTurnsExceeded",
                    "exception.message": c("exception-message"),
                    "exception.stacktrace": f"Traceback ...\n  {c('exception-stacktrace')}",
                },
            )
        ],
        attrs={
            "output.value": json.dumps(
                {"messages": [{"data": {"content": c("root-output-message")}}]}
            ),
            "input.value": c("root-input"),
        },
    )
    runs.append(run)

    # 2. argument churn, retry storm with status/exception messages, error results
    run = Run(trace=102)
    for _ in range(3):
        run.tool(
            "search_orders",
            {"query": c("arg-query")},
            {"ok": False, "code": "not_found", "message": c("result-error-message")},
        )
    sku = c("arg-sku")
    for _ in range(5):
        span = run.tool("get_quote", {"sku": sku}, error="429", gap_ms=5)
        span.status_message = f"429 Too Many Requests for {c('status-tool')}"
        span.events.append(
            SpanEvent(
                "exception",
                span.end_ns,
                {"exception.type": "RateLimitError", "exception.message": c("exception-tool")},
            )
        )
    run.root()
    runs.append(run)

    # 3. replanning (plan spans and LLM turns requesting several calls), model input/output
    run = Run(trace=103)
    plan_arg = c("plan-arg")
    for _ in range(3):
        run.plan(
            [
                {"tool": "lookup_order", "arguments": {"order_id": plan_arg}},
                {
                    "tool": "issue_refund",
                    "args": {"order_id": plan_arg, "reason": c("plan-reason")},
                },
            ]
        )
    llm_arg = c("llm-tool-call-arg")
    for _ in range(3):
        span = run.llm(
            200,
            30,
            tool_calls=[
                ("lookup_order", {"order_id": llm_arg}),
                ("search_orders", {"query": llm_arg}),
            ],
        )
        messages = json.loads(span.attributes["gen_ai.output.messages"])
        messages[0]["parts"].append({"type": "text", "content": c("llm-output-text")})
        span.attributes["gen_ai.output.messages"] = json.dumps(messages)
        span.attributes["gen_ai.input.messages"] = json.dumps([{"content": c("llm-input")}])
        span.attributes["gen_ai.system_instructions"] = c("llm-system")
    run.root()
    runs.append(run)

    # 4. side effects: duplicate refund (no idempotency key), unsafe retry after a timeout
    run = Run(trace=104)
    refund_order = c("arg-refund-order")
    for _ in range(2):
        run.tool(
            "issue_refund",
            {"order_id": refund_order, "amount": 12.5, "memo": c("arg-memo")},
            {"ok": True, "refund_id": c("result-refund-id")},
        )
    ticket = c("arg-ticket")
    span = run.tool(
        "update_ticket",
        {"ticket_id": ticket, "body": c("arg-body"), "idempotency_key": c("idem")},
        error="timeout",
    )
    span.status_message = c("status-timeout")
    run.tool(
        "update_ticket",
        {"ticket_id": ticket, "body": c("arg-body-2"), "idempotency_key": c("idem")},
        {"ok": True},
    )
    run.root()
    runs.append(run)

    # 5. other conventions: OpenInference input/output.value, OpenLLMetry envelopes, kvlist
    #    arguments, oscillation and a handoff ping-pong
    run = Run(trace=105)
    a, b, out_a, out_b = c("oi-input-a"), c("oi-input-b"), c("oi-output-a"), c("oi-output-b")
    for i in range(6):
        run.other(
            "lookup.tool",
            {
                "openinference.span.kind": "TOOL",
                "tool.name": "lookup",
                "input.value": a if i % 2 == 0 else b,
                "output.value": json.dumps(
                    {
                        "type": "tool",
                        "data": {"content": out_a if i % 2 == 0 else out_b, "tool_call_id": "c9"},
                    }
                ),
            },
        )
    for _ in range(3):
        run.other(
            "search.tool",
            {
                "traceloop.entity.input": json.dumps(
                    {"inputs": {"q": c("oll-input")}, "input_str": c("oll-input-str")}
                ),
                "traceloop.entity.output": json.dumps({"output": c("oll-output")}),
            },
        )
        run.other(
            "execute_tool kv",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "kv",
                "gen_ai.tool.call.arguments": {"q": c("kvlist-arg"), "nested": [c("kvlist-item")]},
                "gen_ai.tool.call.result": {"r": c("kvlist-result")},
            },
        )
    for _ in range(3):
        run.handoff("support", "billing")
        run.handoff("billing", "support")
    run.root(attrs={"gen_ai.agent.finish_reason": "stop"})
    runs.append(run)

    # 6. near-duplicates: rephrased searches whose results list the same pages (customer
    #    text in the queries, titles and URLs), and a code agent repeating its model turns
    run = Run(trace=106)
    secret = c("near-query")
    pages = [
        {"url": f"https://{c('near-url')}.example/{i}", "title": c("near-title")} for i in range(4)
    ]
    for query in (f"{secret} refund status", f"refund {secret} status 2026", f"status {secret}"):
        run.tool("web_search", {"query": query}, pages)
    code, observation = c("turn-code"), c("turn-observation")
    for _ in range(4):
        run.other(
            "chat model",
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.input.messages": json.dumps([{"role": "user", "content": observation}]),
                "gen_ai.output.messages": json.dumps(
                    [{"role": "assistant", "parts": [{"type": "text", "content": code}]}]
                ),
            },
        )
    run.root()
    runs.append(run)
    return runs
