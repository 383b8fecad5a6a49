"""oscillation, replanning and delegation_ping_pong: the run revisits the same states."""

from __future__ import annotations

from .base import Context
from .fingerprint import stable_id
from .model import HANDOFF, TOOL, Step
from .state import (
    MAP_CAP,
    WIN_ACTION,
    WIN_CALL,
    WIN_OUTCOME,
    WIN_POS,
    WIN_SPAN,
    WIN_TOKENS,
    bounded_put,
)


def oscillation(ctx: Context, step: Step) -> None:
    """A cycle of p >= 2 distinct (action, result) states repeating: the window's tail is
    periodic with period p over 2p + 2 steps (A B A B A B; A B C A B C A B)."""
    if step.kind != TOOL:
        return
    window = ctx.state.window
    n = len(window)
    last = window[-1]
    states: list[tuple[str, str]] | None = None
    for period in range(2, n // 2 + 1):
        length = 2 * period + 2
        if length > n:
            break
        back = window[-1 - period]
        if back[WIN_ACTION] != last[WIN_ACTION] or back[WIN_OUTCOME] != last[WIN_OUTCOME]:
            continue  # cheap precheck: a period-p cycle repeats the newest state p steps back
        if states is None:
            states = [(e[WIN_ACTION], e[WIN_OUTCOME]) for e in window]
        tail = states[n - length :]
        if len(set(tail[-period:])) != period:
            continue
        if all(tail[i] == tail[i - period] for i in range(period, length)):
            cycle = sorted(f"{a}:{o}" for a, o in set(tail[-period:]))
            entries = window[n - length :]
            ctx.fire(
                "oscillation",
                "~".join(c[:16] for c in cycle),
                step,
                count=length,
                first_position=entries[0][WIN_POS],
                span_ids=[e[WIN_SPAN] for e in entries],
                call_ids=[e[WIN_CALL] for e in entries],
                fingerprint=stable_id(*cycle)[:16],
                evidence={"period": period, "states": len(cycle)},
                wasted_steps=length - period,
                wasted_tokens=ctx.state.tokens - entries[period][WIN_TOKENS],
            )
            return


def replanning(ctx: Context, step: Step) -> None:
    """The same plan (ordered planned steps) produced replan_min_repeats times."""
    if step.plan_fp is None:
        return
    plans = ctx.state.plans
    seen = plans.get(step.plan_fp)
    if seen is None:
        seen = [0, ctx.state.position, [], ctx.state.tokens]
    seen[0] += 1
    seen[2] = (seen[2] + [step.span_id])[-8:]
    bounded_put(plans, step.plan_fp, seen, MAP_CAP)
    if seen[0] >= ctx.limits.replan_min_repeats:
        ctx.fire(
            "replanning",
            step.plan_fp,
            step,
            count=seen[0],
            first_position=seen[1],
            span_ids=list(seen[2]),
            fingerprint=step.plan_fp,
            evidence={"plan_repeats": seen[0]},
            wasted_steps=seen[0] - 1,
            wasted_tokens=ctx.state.tokens - seen[3],
        )


def delegation_ping_pong(ctx: Context, step: Step) -> None:
    """One handoff edge traversed more than handoff_max_traversals times. One episode per
    pair of agents: A->B->A->B... fires once, at the first edge to cross, not again when
    the reverse edge crosses too."""
    if step.kind != HANDOFF:
        return
    state = ctx.state
    source = step.from_agent or state.current_agent or "?"
    target = step.to_agent or "?"
    state.current_agent = target
    edge = f"{source}->{target}"
    seen = state.edges.get(edge)
    if seen is None:
        seen = [0, state.position, [], state.tokens, []]
    seen[0] += 1
    seen[2] = (seen[2] + [step.span_id])[-8:]
    seen[4] = (seen[4] + [step.call_id])[-8:]
    bounded_put(state.edges, edge, seen, MAP_CAP)
    if seen[0] > ctx.limits.handoff_max_traversals:
        back = state.edges.get(f"{target}->{source}")
        ctx.fire(
            "delegation_ping_pong",
            "<->".join(sorted((source, target))),
            step,
            count=seen[0],
            first_position=seen[1],
            span_ids=list(seen[2]),
            call_ids=list(seen[4]),
            fingerprint=None,
            evidence={
                "edge": edge,
                "traversals": seen[0],
                "reverse_traversals": back[0] if back else 0,
            },
            wasted_steps=seen[0] - 1 + (back[0] - 1 if back else 0),
            wasted_tokens=state.tokens - seen[3],
        )
