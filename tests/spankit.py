"""Build decoded spans for detector tests: a tiny run DSL with deterministic ids and times."""

from __future__ import annotations

import json
from typing import Any

from detectors.fingerprint import Fingerprinter
from detectors.policy import Policy, policy_from_mapping
from streams.engine import Engine
from streams.spans import STATUS_ERROR, STATUS_OK, STATUS_UNSET, SpanEvent, SpanRecord

BASE_NS = 1_796_000_000_000_000_000  # 2026-11-29-ish
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
    ) -> SpanRecord:
        self.clock += 10 * MS
        start, end = self.clock, self.clock + dur_ms * MS
        self.clock = end
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
        }
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
    engine = Engine(policy or example_policy(), Fingerprinter(key), events.append, summaries.append)
    for batch in batches:
        engine.feed(batch)
    engine.close()
    return events, summaries


def shapes(events: list[dict[str, Any]]) -> list[str]:
    return [e["shape"] for e in events]
