"""Why a run's root (or an agent span) stopped, as its profile's termination table maps it:
a ``loop_guard`` event, an exception type, a status message pattern, a finish reason, or the
fixed text of an agent that ran out of steps. None: the span did not say (the pipeline
infers it at finalization)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from detectors.model import AGENT, OTHER, Step
from detectors.recognition import Profile, Termination
from detectors.toolcall import as_json
from streams.spanpath.limits import declared_limit
from streams.spanpath.spans import SpanRecord
from streams.spanpath.values import ident
from streams.spanpath.view import Facts, View

# loopwatch_guard's decision events (guard/loopwatch_guard/trace.py)
GUARD_MODE = "loopwatch.guard.mode"
GUARD_DECISION = "loopwatch.guard.decision"
GUARD_CALL_ID = "loopwatch.guard.call_id"
GUARD_HOLD_ID = "loopwatch.guard.hold_id"
ENFORCED_DECISIONS = frozenset({"deny", "reconcile", "stop"})
MAX_DENIED_CALLS = 8


# the fixed text of an agent that ran out of steps (LangGraph's recursion limit)
OUT_OF_STEPS = re.compile(r"(?i)need more steps to process this request")


def last_message_text(output: Any) -> str | None:
    """The content of the last message of an OpenInference LangGraph output.value."""
    if not isinstance(output, str) or '"messages"' not in output:
        return None
    doc = as_json(output)
    messages = doc.get("messages") if isinstance(doc, dict) else None
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    data = messages[-1].get("data", messages[-1])
    content = data.get("content") if isinstance(data, dict) else None
    return content if isinstance(content, str) else None


def denied_calls(span: SpanRecord) -> tuple[str, ...]:
    """The calls the span's enforced guard decisions kept from being dispatched, as
    "<event time ns> <hold id or -> <call id>" (detectors/model.py `denials`): its
    `loop_guard` events not in observe mode whose decision is deny, reconcile or stop and
    that name a call id (distinct ids, in order, at most MAX_DENIED_CALLS). The hold id is
    the on-call hold that decided it, when it is one (`hold_token`), else "-"."""
    found: list[str] = []
    out: list[str] = []
    for event in span.events:
        if event.name != "loop_guard":
            continue
        attrs = event.attributes
        call_id = attrs.get(GUARD_CALL_ID)
        decision = attrs.get(GUARD_DECISION)  # (any value: a list or a map is no decision)
        if (
            attrs.get(GUARD_MODE) != "observe"
            and isinstance(decision, str)
            and decision in ENFORCED_DECISIONS
            and isinstance(call_id, str)
            and call_id
            and call_id not in found
            and len(found) < MAX_DENIED_CALLS
        ):
            found.append(call_id)
            out.append(f"{event.time_ns} {hold_token(attrs.get(GUARD_HOLD_ID))} {call_id}")
    return tuple(out)


def hold_token(value: Any) -> str:
    """A decision's hold id as the denial records it: 1-64 characters of letters, digits
    and ``._:-`` (the worker's ids are ``hold-`` and 10 hex digits); anything else, "-"."""
    if isinstance(value, str) and 0 < len(value) <= 64 and _HOLD_ID(value):
        return value
    return "-"


_HOLD_ID = re.compile(r"[A-Za-z0-9._:-]+").fullmatch


def termination_reason(
    step: Step,
    span: SpanRecord,
    error_type: Any,
    table: Termination,
    finish_reason: Callable[[], Any],
) -> str | None:
    """The stated reason; also sets `step.guard_ns` (the first loop guard event)."""
    reason: str | None = None
    for event in span.events:
        # an observe-mode guard decided and recorded, and the run went on: not a stop
        if event.name == "loop_guard" and event.attributes.get(GUARD_MODE) != "observe":
            step.guard_ns = (
                event.time_ns if step.guard_ns is None else min(step.guard_ns, event.time_ns)
            )
            reason = "loop_guard"
    if reason is None:
        types = [error_type] + [
            e.attributes.get("exception.type") for e in span.events if e.name == "exception"
        ]
        for exc_type in types:
            if exc_type is None:
                continue
            short = str(exc_type).rsplit(".", 1)[-1]
            reason = table.exception_types.get(str(exc_type)) or table.exception_types.get(short)
            if reason is not None:
                break
    if reason is None and span.status_message:
        for pattern, mapped in table.message_patterns:
            if pattern.search(span.status_message):
                reason = mapped
                break
    if reason is None:
        finish = finish_reason()
        if isinstance(finish, list) and finish:
            finish = finish[-1]
        if finish is not None:
            reason = table.finish_reasons.get(str(finish).lower())
    if reason is None and step.is_root:
        # langgraph.prebuilt.create_react_agent stops itself when remaining_steps runs out:
        # no exception, root OK, the last AI message is a fixed text. Matched, never copied.
        last = last_message_text(span.attributes.get("output.value"))
        if last is not None and OUT_OF_STEPS.search(last):
            reason = "turn_limit"
    return reason


class Terminations(View):
    """The Normalizer's root and agent steps: why they stopped, and a limit they declared."""

    def _fill_termination(
        self, step: Step, span: SpanRecord, v: dict[str, Any], profile: Profile, facts: Facts
    ) -> None:
        if step.kind == OTHER and not step.is_root:
            return
        if step.kind == OTHER:
            step.kind = AGENT  # the root of a run: carries termination, not an action
        step.name = step.agent_name or ident(span.name)
        limit = declared_limit(span.attributes)
        if limit is not None:
            step.step_limit, step.limit_counts = limit.limit, limit.counts
        # None: nothing said why; the pipeline decides at finalization (inferred from the run,
        # or the default for a root that ended OK / failed), and says which in the summary.
        step.termination = termination_reason(
            step,
            span,
            v.get("error_type"),
            profile.termination,
            lambda: self._field(profile, "finish_reason", facts),
        )
