"""guard_ignored: the platform checks the guard. A call the in-process guard denied (an
enforced `loop_guard` decision naming its call id: deny, reconcile or stop) whose tool
then started after the denial ran although the guard said no: the integration ignored the
decision, or something dispatched around it. The seeds' execution-side contract: "the
denial must precede any tool-start event carrying that call ID".

A tool span of that call id that started before the denial is the framework's own record
of the guarded call (some frameworks open the tool span, then ask their guardrails inside
it): not an execution after the denial. The denial and the call arrive in either order:
a denial is remembered (at most MAP_CAP a run) for the calls released after it, and a
denial that arrives late (it rides on the agent's span, which ends last) is checked against
the run's window of recent tool calls (`window` [8]): an ignored call older than that is
not found. Bounded by design: the state keeps no list of every call.
"""

from __future__ import annotations

from typing import Any

from .base import Context
from .model import GUARD_IGNORED, TOOL, Step, denials
from .state import MAP_CAP, WIN_CALL, WIN_END, WIN_POS, WIN_SPAN, WIN_START, WIN_TOOL

SHAPE = GUARD_IGNORED


def note_denials(ctx: Context, step: Step) -> None:
    """Remember the step's denials; a call already seen that started after one fires."""
    state = ctx.state
    for denied_ns, _hold, call_id in denials(step):
        known = next((d for d in state.guard_denied if d[0] == call_id), None)
        if known is None:
            state.guard_denied.append([call_id, denied_ns])
            del state.guard_denied[:-MAP_CAP]
        elif denied_ns < known[1]:
            known[1] = denied_ns
        for recent in state.window:
            if recent[WIN_CALL] == call_id and recent[WIN_START] > denied_ns:
                _fire(ctx, _trigger(state.run_id, step, recent), denied_ns, int(recent[WIN_POS]))


def guard_ignored(ctx: Context, step: Step) -> None:
    """A tool call: fires when the guard denied its call id before it started."""
    call_id = step.call_id
    if step.kind != TOOL or not call_id:
        return
    state = ctx.state
    for denied in state.guard_denied:
        if denied[0] == call_id and step.start_ns > denied[1]:
            _fire(ctx, step, int(denied[1]), state.position)
            return


def _trigger(run_id: str, carrier: Step, entry: list[Any]) -> Step:
    """The call a late-arriving denial was ignored on (a window entry), as a step."""
    step = Step(
        run_id,
        carrier.trace_id,
        str(entry[WIN_SPAN]),
        None,
        TOOL,
        int(entry[WIN_START]),
        int(entry[WIN_END]),
    )
    step.name = str(entry[WIN_TOOL])
    step.call_id = str(entry[WIN_CALL])
    return step


def _fire(ctx: Context, step: Step, denied_ns: int, position: int) -> None:
    ctx.fire(
        SHAPE,
        str(step.call_id),
        step,
        count=1,
        first_position=position,
        span_ids=[step.span_id],
        call_ids=[step.call_id],
        evidence={
            "denied_before_start_ms": round((step.start_ns - denied_ns) / 1e6, 3),
        },
        wasted_steps=1,
    )
