"""identical_repetition and goal_already_satisfied: one action, repeated without progress.

A streak is a run of consecutive calls with the same action fingerprint. Progress (per the
tool contract, else a changed result) or a context reduction starts a new streak. The
finding fires at the call that makes the streak longer than `allowed_repeats` (a polling
tool's `max_polls` replaces it), i.e. at exactly the threshold call.
"""

from __future__ import annotations

from typing import Any

from .base import Context
from .model import TOOL, Step
from .policy import ToolContract
from .state import ITEM_BLOOM_BITS, MAP_CAP, bloom_mask, bounded_put

# Streak layout.
S_ACTION, S_COUNT, S_FIRST_POS, S_SPANS, S_CALLS = 0, 1, 2, 3, 4
S_VERSION, S_STATE, S_CURSOR, S_RESULT, S_SEQ, S_END, S_EPOCH, S_TOKENS = 5, 6, 7, 8, 9, 10, 11, 12
# The span that began the streak: the episode's identity (its event id). Not its position:
# a span released out of order (arriving beyond the allowed lateness) shifts positions, and
# must not give an unchanged episode a second id. (Streaks written before lack it.)
S_FIRST_SPAN = 13


def _progress(contract: ToolContract | None, prev: list[Any], step: Step, new_items: bool) -> bool:
    if contract is not None and (
        contract.version_field or contract.state_field or contract.new_items_field
    ):
        if contract.version_field is not None:
            before = prev[S_VERSION]
            if step.version is not None and (before is None or step.version > before):
                return True
        if contract.state_field is not None and step.state_fp != prev[S_STATE]:
            return True
        if contract.cursor_arg is not None:
            return step.cursor_fp != prev[S_CURSOR] and new_items
        # a result that lists only items seen before in the run brings nothing new
        return contract.new_items_field is not None and new_items
    # No declared rule: a changed result is progress. No result recorded = no evidence.
    return (
        step.result_fp is not None
        and prev[S_RESULT] is not None
        and step.result_fp != prev[S_RESULT]
    )


def _parallel(prev: list[Any], step: Step) -> bool:
    """Same model turn: same explicit sequence, or started before the previous call ended."""
    seq = prev[S_SEQ]
    if step.sequence is not None and seq is not None:
        return bool(step.sequence == seq)
    end = prev[S_END]
    return isinstance(end, int) and step.start_ns < end


def identical_repetition(ctx: Context, step: Step) -> None:
    if step.kind != TOOL or step.action_fp is None:
        return
    state = ctx.state
    contract = ctx.contract(step.name)
    new_items = False
    if step.item_fps:
        for item in step.item_fps:
            mask = bloom_mask(item, ITEM_BLOOM_BITS)
            if state.item_bloom & mask != mask:
                new_items = True
                state.item_bloom |= mask
    code = step.error_code
    transient = code is not None and code in ctx.policy.transient_error_codes
    streak = state.streak
    if transient:
        # Transient failures are retry_storm's to judge; they neither count nor reset progress.
        state.streak = None
        return
    if (
        streak is not None
        and streak[S_ACTION] == step.action_fp
        and streak[S_EPOCH] == state.reduction_epoch
    ):
        if _parallel(streak, step):
            state.parallel_duplicate_calls += 1
            return
        if _progress(contract, streak, step, new_items):
            state.progress_observed = True
        else:
            streak[S_COUNT] = int(streak[S_COUNT]) + 1
            spans = streak[S_SPANS]
            calls = streak[S_CALLS]
            spans.append(step.span_id)
            calls.append(step.call_id)
            del spans[:-8], calls[:-8]
            _remember(streak, step, state.reduction_epoch)
            allowed = ctx.limits.allowed_repeats
            if contract is not None and contract.state_field is not None and contract.max_polls:
                allowed = contract.max_polls
            count = int(streak[S_COUNT])
            if count > allowed:
                first_pos = int(streak[S_FIRST_POS])
                first_span = streak[S_FIRST_SPAN] if len(streak) > S_FIRST_SPAN else spans[0]
                ctx.fire(
                    "identical_repetition",
                    f"{step.action_fp}@{first_span}",
                    step,
                    count=count,
                    first_position=first_pos,
                    span_ids=list(spans),
                    call_ids=list(calls),
                    fingerprint=step.action_fp,
                    evidence={
                        "allowed_repeats": allowed,
                        "result_observed": step.result_fp is not None,
                        "error_code": code,
                        "progress_rule": _rule_name(contract),
                    },
                    wasted_steps=count - 1,
                    wasted_tokens=state.tokens - int(streak[S_TOKENS]),
                )
            return
    state.streak = [
        step.action_fp,
        1,
        state.position,
        [step.span_id],
        [step.call_id],
        None,
        None,
        None,
        None,
        None,
        0,
        state.reduction_epoch,
        state.tokens,
        step.span_id,
    ]
    _remember(state.streak, step, state.reduction_epoch)


def _remember(streak: list[Any], step: Step, epoch: int) -> None:
    streak[S_VERSION] = step.version
    streak[S_STATE] = step.state_fp
    streak[S_CURSOR] = step.cursor_fp
    streak[S_RESULT] = step.result_fp
    streak[S_SEQ] = step.sequence
    streak[S_END] = step.end_ns
    streak[S_EPOCH] = epoch


def _rule_name(contract: ToolContract | None) -> str:
    if contract is None:
        return "changed_result"
    if contract.version_field:
        return "version_advance"
    if contract.state_field:
        return "state_change"
    if contract.cursor_arg:
        return "new_cursor_new_items"
    if contract.new_items_field:
        return "new_items"
    return "changed_result"


def goal_already_satisfied(ctx: Context, step: Step) -> None:
    """The agent calls an action again after that action reported a terminal state."""
    if step.kind != TOOL or step.action_fp is None:
        return
    state = ctx.state
    seen = state.terminal.get(step.action_fp)
    if seen is not None:
        ctx.fire(
            "goal_already_satisfied",
            step.action_fp,
            step,
            count=2,
            first_position=int(seen[1]),
            span_ids=[str(seen[0]), step.span_id],
            call_ids=[step.call_id] if step.call_id else [],
            fingerprint=step.action_fp,
            evidence={"terminal_state_fp": seen[2]},
            wasted_steps=1,
        )
    elif step.state_terminal:
        bounded_put(
            state.terminal, step.action_fp, [step.span_id, state.position, step.state_fp], MAP_CAP
        )
