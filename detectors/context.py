"""context_collapse: the same document fetched again and again across context reductions."""

from __future__ import annotations

from .base import Context
from .model import LLM, SUMMARY, TOOL, Step
from .state import bounded_put


def note_context(ctx: Context, step: Step) -> None:
    """Advance the run's reduction epoch on a summarization span or an input-token drop."""
    state = ctx.state
    if step.kind == SUMMARY:
        state.reduction_epoch += 1
    elif step.kind == LLM and step.input_tokens > 0:
        previous = state.last_llm_input
        if previous and step.input_tokens < previous * (1 - ctx.limits.token_drop_ratio):
            state.reduction_epoch += 1
        state.last_llm_input = step.input_tokens


def context_collapse(ctx: Context, step: Step) -> None:
    if step.kind != TOOL or step.action_fp is None or step.error_code is not None:
        return
    state = ctx.state
    seen = state.docs.get(step.action_fp)
    if seen is None:
        seen = [0, state.position, [], state.reduction_epoch, state.tokens, []]
    seen[0] += 1
    keep = ctx.limits.collapse_min_fetches
    spans, calls = seen[2], seen[5]  # this entry's own lists (state, never shared)
    spans.append(step.span_id)
    calls.append(step.call_id)
    del spans[:-keep], calls[:-keep]
    bounded_put(state.docs, step.action_fp, seen, ctx.limits.window)
    reductions = state.reduction_epoch - seen[3]
    if seen[0] >= ctx.limits.collapse_min_fetches and reductions >= 1:
        ctx.fire(
            "context_collapse",
            step.action_fp,
            step,
            count=seen[0],
            first_position=seen[1],
            span_ids=list(seen[2]),
            call_ids=list(seen[5]),
            fingerprint=step.action_fp,
            evidence={"fetches": seen[0], "context_reductions": reductions},
            wasted_steps=seen[0] - 1,
            wasted_tokens=state.tokens - seen[4],
        )
