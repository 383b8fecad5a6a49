"""What the guard tells the model when it does not dispatch a call: the recovery table of
loop-detection-and-recovery.txt in words (inject the attempt history, constrain the
toolset, force a final answer, reconcile first, escalate).

These texts stay in the agent's process: they go back to the model as the tool's answer
or with the framework's stop, never onto the trace, so they may name the call's own
arguments (the model wrote them)."""

from __future__ import annotations

import json
from typing import Any

MAX_ARGS_TEXT = 200


def args_text(args: dict[str, Any], names: tuple[str, ...] | None) -> str:
    """The arguments as the model wrote them (those a contract names, when it does),
    shortened."""
    shown = {k: args[k] for k in names if k in args} if names else args
    try:
        text = json.dumps(shown, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        text = repr(shown)
    return text if len(text) <= MAX_ARGS_TEXT else text[: MAX_ARGS_TEXT - 1] + "…"


def outcome_text(code: str | None, empty: bool) -> str:
    if code is not None:
        return f"the error {code}"
    if empty:
        return "no results"
    return "the same result"


def for_repeat(
    recovery: str, tool: str, done: int, args: str, code: str | None, empty: bool
) -> str:
    """A repeated action without progress (identical_repetition, retry_storm, oscillation,
    context_collapse and the other exact shapes)."""
    outcome = outcome_text(code, empty)
    head = (
        f"Loop guard: {tool} was not called. You have already called {tool} {done} "
        f"time{'s' if done != 1 else ''} with these arguments {args}, and each call returned "
        f"{outcome}; calling it again will not change that."
    )
    if recovery == "deterministic_fallback":
        return (
            f"{head} The data is not there: do not retry it. Tell the user what is missing, "
            "or use another source."
        )
    if recovery == "force_final_answer":
        return f"{head} Give your final answer now, with what you already have."
    if recovery == "stop_and_escalate":
        return f"{head} Stop and hand the case to a human."
    if recovery == "constrain_toolset":
        return (
            f"Loop guard: {tool} was not called. It keeps answering what it already answered: "
            f"do not call {tool} again for now; decide with what you have."
        )
    if recovery == "human_handoff":
        return f"{head} Hand the case to a human."
    return f"{head} Change your approach, or answer with what you have."


def for_duplicate_write(tool: str, args: str) -> str:
    return (
        f"Loop guard: {tool} was not called. It already succeeded for {args}, and a second "
        "call without the same idempotency key would do it twice. Do not retry: report what "
        "was done, or hand the case to a human."
    )


def for_reconcile(tool: str, args: str, reconcile_tool: str | None) -> str:
    first = f"call {reconcile_tool} first" if reconcile_tool else "find out first"
    return (
        f"Loop guard: {tool} was not called. Its previous call for {args} did not return a "
        f"clear outcome and may have been applied: {first} to learn whether it was, before "
        "any retry (reuse the same idempotency key if you retry)."
    )


def for_budget(budget: str | None) -> str:
    return (
        f"Loop guard: this run has used up its {budget or 'step'} budget. Stop calling tools "
        "and give your final answer with what you have."
    )


def for_goal_reached(tool: str) -> str:
    return (
        f"Loop guard: {tool} was not called. It already reported a final state for this "
        "request: give your final answer now."
    )


def for_escalation(tool: str) -> str:
    return (
        f"Loop guard: {tool} was proposed again after the guard denied it. The run stops "
        "here: give your final answer with what you have."
    )


def for_hold(reason: str | None, hold_id: str) -> str:
    return (
        f"Loop guard: this call is on hold by the on-call ({hold_id}"
        f"{': ' + reason if reason else ''}). Do not retry it; tell the user the action is "
        "paused."
    )
