"""budget_exhausted: the run passed its steps, tokens or seconds budget (per task type)."""

from __future__ import annotations

from .base import Context
from .model import Step


def budget_exhausted(ctx: Context, step: Step) -> None:
    state = ctx.state
    budgets = ctx.limits.budgets
    start = state.start_ns if state.start_ns is not None else step.start_ns
    elapsed = (state.last_end_ns - start) / 1e9
    # every step of every run comes here: leave at once while all three are within budget
    if not (
        state.action_steps > budgets.steps
        or state.tokens > budgets.tokens
        or elapsed > budgets.seconds
    ):
        return
    for name, used, limit in (
        ("steps", state.action_steps, budgets.steps),
        ("tokens", state.tokens, budgets.tokens),
        ("seconds", elapsed, budgets.seconds),
    ):
        if used > limit and name not in state.budgets_fired:
            state.budgets_fired.append(name)
            ctx.fire(
                "budget_exhausted",
                name,
                step,
                count=state.action_steps,
                first_position=1,
                span_ids=[step.span_id],
                call_ids=[step.call_id] if step.call_id else [],
                evidence={
                    "budget": name,
                    "used": round(used, 3),
                    "limit": limit,
                    "task_type": state.task_type,
                },
                budget=name,
            )
