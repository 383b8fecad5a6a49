"""argument_churn and retry_storm: the same tool failing the same way, in the recent window."""

from __future__ import annotations

from .base import Context
from .model import TOOL, Step
from .state import (
    WIN_ACTION,
    WIN_CALL,
    WIN_CODE,
    WIN_EMPTY,
    WIN_END,
    WIN_POS,
    WIN_SPAN,
    WIN_START,
    WIN_TOKENS,
    WIN_TOOL,
)

BACKOFF_FACTOR = 1.5  # each gap at least this much longer than the previous = backoff


def argument_churn(ctx: Context, step: Step) -> None:
    """Same tool >= churn_min_calls times in the window, differing arguments, same failure."""
    if step.kind != TOOL:
        return
    code = step.error_code
    if code is not None and code in ctx.policy.transient_error_codes:
        return
    outcome = code if code is not None else ("empty" if step.empty_result else None)
    if outcome is None:
        return
    matches = [
        e
        for e in ctx.state.window
        if e[WIN_TOOL] == step.name
        and (e[WIN_CODE] if e[WIN_CODE] is not None else ("empty" if e[WIN_EMPTY] else None))
        == outcome
    ]
    actions = {e[WIN_ACTION] for e in matches}
    if len(matches) >= ctx.limits.churn_min_calls and len(actions) >= 2:
        ctx.fire(
            "argument_churn",
            f"{step.name}|{outcome}",
            step,
            count=len(matches),
            first_position=matches[0][WIN_POS],
            span_ids=[e[WIN_SPAN] for e in matches],
            call_ids=[e[WIN_CALL] for e in matches],
            fingerprint=step.action_fp,
            evidence={"error_code": outcome, "distinct_arguments": len(actions)},
            wasted_steps=len(matches) - 1,
            wasted_tokens=ctx.state.tokens - matches[0][WIN_TOKENS],
        )


def retry_storm(ctx: Context, step: Step) -> None:
    """>= retry_storm_min_calls calls ending in the same transient code, gaps not growing."""
    code = step.error_code
    if step.kind != TOOL or code is None or code not in ctx.policy.transient_error_codes:
        return
    attempts = [e for e in ctx.state.window if e[WIN_TOOL] == step.name and e[WIN_CODE] == code]
    needed = ctx.limits.retry_storm_min_calls
    if len(attempts) < needed:
        return
    recent = attempts[-needed:]
    gaps = [max(0, b[WIN_START] - a[WIN_END]) for a, b in zip(recent, recent[1:], strict=False)]
    backing_off = all(
        later >= earlier * BACKOFF_FACTOR and later > 0
        for earlier, later in zip(gaps, gaps[1:], strict=False)
    )
    if backing_off:
        return
    ctx.fire(
        "retry_storm",
        f"{step.name}|{code}",
        step,
        count=len(attempts),
        first_position=attempts[0][WIN_POS],
        span_ids=[e[WIN_SPAN] for e in attempts],
        call_ids=[e[WIN_CALL] for e in attempts],
        fingerprint=step.action_fp,
        evidence={"error_code": code, "gaps_ms": [g // 1_000_000 for g in gaps]},
        wasted_steps=len(attempts) - 1,
        wasted_tokens=ctx.state.tokens - attempts[0][WIN_TOKENS],
    )
