"""duplicate_side_effect and unsafe_side_effect_retry: writes repeated for one business object.

A ledger per business identity remembers the last attempt's outcome (ok / ambiguous /
failed) and idempotency key digest. Reusing the same key is a safe retry, never a finding.
"""

from __future__ import annotations

from .base import Context
from .model import TOOL, Step
from .state import MAP_CAP, bounded_put

# Ledger entry layout.
L_OUTCOME, L_KEY, L_SPAN, L_POS, L_CALL, L_RECONCILED = 0, 1, 2, 3, 4, 5


def side_effects(ctx: Context, step: Step) -> None:
    if step.kind != TOOL:
        return
    state = ctx.state
    _reconcile(ctx, step)
    contract = ctx.contract(step.name)
    if contract is None or not contract.side_effect or step.business_fp is None:
        return
    code = step.error_code
    if code is None and not step.status_error:
        outcome = "ok"
    elif code is not None and code in ctx.policy.ambiguous_error_codes:
        outcome = "ambiguous"
    else:
        outcome = "failed"
    previous = state.ledger.get(step.business_fp)
    if previous is not None:
        same_key = step.idempotency_fp is not None and step.idempotency_fp == previous[L_KEY]
        shape = None
        if not same_key and previous[L_OUTCOME] == "ok":
            shape = "duplicate_side_effect"
        elif not same_key and previous[L_OUTCOME] == "ambiguous" and not previous[L_RECONCILED]:
            shape = "unsafe_side_effect_retry"
        if shape is not None:
            ctx.fire(
                shape,
                f"{step.business_fp}@{previous[L_SPAN]}",
                step,
                count=2,
                first_position=previous[L_POS],
                span_ids=[previous[L_SPAN], step.span_id],
                call_ids=[previous[L_CALL], step.call_id],
                fingerprint=step.business_fp,
                evidence={
                    "previous_outcome": previous[L_OUTCOME],
                    "idempotency_key": "missing" if step.idempotency_fp is None else "different",
                },
                wasted_steps=1,
            )
    if outcome == "ok":
        state.side_effect_committed = True
    if previous is None or outcome != "failed" or previous[L_OUTCOME] == "failed":
        bounded_put(
            state.ledger,
            step.business_fp,
            [outcome, step.idempotency_fp, step.span_id, state.position, step.call_id, False],
            MAP_CAP,
        )


def _reconcile(ctx: Context, step: Step) -> None:
    """A call to a side-effect tool's declared reconcile_tool settles its ambiguous attempts."""
    if step.name in ctx.policy.reconcile_tools:
        for entry in ctx.state.ledger.values():
            if entry[L_OUTCOME] == "ambiguous":
                entry[L_RECONCILED] = True
