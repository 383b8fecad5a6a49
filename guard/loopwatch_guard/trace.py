"""The guard's decisions on the trace: each one other than `allow` is an OpenTelemetry span
event `loop_guard` on the current span (docs/CONTRACTS.md §8), which loopwatch's span path
reads back (termination `loop_guard`, `guard_before_dispatch`, and a denied call that still
ran). Ids, names, codes and modes only: never the model's message or an argument."""

from __future__ import annotations

from opentelemetry import trace

from .decision import Decision

EVENT = "loop_guard"
PREFIX = "loopwatch.guard."


def attributes(decision: Decision, policy_version: str) -> dict[str, str]:
    attrs = {
        PREFIX + "decision": decision.action,
        PREFIX + "mode": decision.mode,
        PREFIX + "policy_version": policy_version,
    }
    for key, value in (
        ("shape", decision.shape),
        ("call_id", decision.call_id),
        ("tool", decision.tool),
        ("event_id", decision.event_id),
        ("hold_id", decision.hold_id),
        ("recovery", decision.recovery),
    ):
        if value is not None:
            attrs[PREFIX + key] = value
    return attrs


def record(decision: Decision, policy_version: str) -> bool:
    """Add the decision to the current span; False when there is no recording span (the
    agent runs without tracing: the decision still holds, it is just not on a trace)."""
    span = trace.get_current_span()
    if not span.is_recording():
        return False
    span.add_event(EVENT, attributes=attributes(decision, policy_version))
    return True


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span as 32 and 16 hex digits, or None."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
