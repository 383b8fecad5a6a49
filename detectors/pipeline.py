"""The per-run pipeline: dedup → reorder → detectors → findings, and finalization.

Three pure functions over a RunState, used identically by the replay driver and the stream
worker (one behaviour, two drivers):

    ingest(policy, state, step)            dedup, tree bookkeeping, buffer
    release(policy, state, watermark_ns)   feed the steps that are ready, in runtime order
    finalize(policy, state)                flush, then the run summary

Ordering: explicit sequence first (a step without one takes the sequence of the latest
sequenced step that started before it), then (start, end, span id). A sequenced step is
ready as soon as the sequences before it are all present; any step is ready once the run's
event time has moved `allowed_lateness_seconds` past its end. A step arriving behind what
was already released is counted as late and still fed, never dropped.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import Any

from .base import Context, Detector
from .budget import budget_exhausted
from .churn import argument_churn, retry_storm
from .context import context_collapse, note_context
from .cycles import delegation_ping_pong, oscillation, replanning
from .guard_check import guard_ignored, note_denials
from .model import (
    AGENT,
    HANDOFF,
    LIMIT_ALL_STEPS,
    LIMIT_TOOL_CALLS,
    LLM,
    OTHER,
    PLAN,
    SUMMARY,
    TOOL,
    Finding,
    Step,
)
from .policy import Policy
from .prices import price_of, wasted_cost
from .repetition import goal_already_satisfied, identical_repetition
from .side_effects import side_effects
from .similarity import near_duplicate, near_duplicate_turns
from .state import (
    BLOOM_BITS,
    DEDUP_CAP,
    MAP_CAP,
    UNRESOLVED_CAP,
    WIN_ACTION,
    WIN_OUTCOME,
    RunState,
    bloom_mask,
)

DETECTORS: tuple[Detector, ...] = (
    note_context,
    identical_repetition,
    goal_already_satisfied,
    argument_churn,
    near_duplicate,
    near_duplicate_turns,
    retry_storm,
    oscillation,
    replanning,
    delegation_ping_pong,
    context_collapse,
    side_effects,
    guard_ignored,
    budget_exhausted,
)
# Which detectors look at which step kind (the hot path skips the rest).
_BY_KIND: dict[str, tuple[Detector, ...]] = {
    TOOL: (
        identical_repetition,
        goal_already_satisfied,
        argument_churn,
        near_duplicate,
        retry_storm,
        oscillation,
        context_collapse,
        side_effects,
        guard_ignored,
        budget_exhausted,
    ),
    HANDOFF: (delegation_ping_pong, budget_exhausted),
    LLM: (note_context, replanning, near_duplicate_turns, budget_exhausted),
    PLAN: (replanning, budget_exhausted),
    SUMMARY: (note_context, budget_exhausted),
}


def new_state(run_id: str) -> RunState:
    return RunState(run_id=run_id)


def ingest(policy: Policy, state: RunState, step: Step) -> list[Finding]:
    """Take one delivered span. Returns findings only for late spans (fed immediately)."""
    state.spans += 1
    if not state.trace_id:
        state.trace_id = step.trace_id
    span_id = step.span_id
    digest = step.content_digest[:8]
    dedup = state.dedup
    known = dedup.get(span_id)
    if known is not None:
        if known == digest:
            state.duplicate_spans += 1
        else:
            state.conflicts += 1  # same id, different content: integrity error
        return []
    if len(dedup) >= DEDUP_CAP:
        del dedup[next(iter(dedup))]
    dedup[span_id] = digest
    _track_tree(state, step)
    # the guard's denials ride on any span (the agent's, mostly): a call they name that
    # already ran after them fires now
    denied: list[Finding] = []
    if step.denied_calls:
        ctx = Context(policy, state)
        note_denials(ctx, step)
        denied = ctx.findings
    end = step.end_ns
    if end > state.max_end_ns:
        state.max_end_ns = end
    # Run-level labels from any span of the run, whichever arrives first (instrumentations
    # put them on the root or agent span, which ends last, or on every span).
    if state.prompt_version is None:
        state.prompt_version = step.prompt_version
    kind = step.kind
    if kind == AGENT or step.is_root:
        _note_container(state, step)
        return denied
    if kind == OTHER:
        return denied
    last_key = state.last_key
    if last_key is not None:
        seq = step.sequence
        key = [seq if seq is not None else (state.released_seq or 0), step.start_ns, end, span_id]
        if key <= last_key:
            state.late_spans += 1
            ctx = Context(policy, state)
            _process(ctx, step)
            return denied + ctx.findings
    state.pending.append(step)
    if len(state.pending) > policy.max_pending_steps:
        state.forced_releases += 1
        return denied + _release(policy, state, None, force_one=True)
    return denied


def feed(policy: Policy, state: RunState, step: Step) -> list[Finding]:
    """Process one step as it happens, in runtime order, without the dedup and reorder
    buffer: the guard's driver (it sees each call when it is made, so its order is the
    runtime's). The detectors and their state are the ones `release` feeds."""
    state.spans += 1
    if not state.trace_id:
        state.trace_id = step.trace_id
    if step.end_ns > state.max_end_ns:
        state.max_end_ns = step.end_ns
    if state.prompt_version is None:
        state.prompt_version = step.prompt_version
    ctx = Context(policy, state)
    _process(ctx, step)
    return ctx.findings


def release(policy: Policy, state: RunState, watermark_ns: int | None = None) -> list[Finding]:
    """Feed every buffered step that is ready at this event-time watermark: by default the
    run's latest span end (spans arrive in export order, as in a replay); a driver whose
    arrivals may be out of order passes the event time it can vouch for instead."""
    if not state.pending:
        return []
    return _release(policy, state, watermark_ns, force_one=False)


def finalize(policy: Policy, state: RunState) -> tuple[list[Finding], dict[str, Any]]:
    """Flush the buffer and summarize the run. The state is marked finalized."""
    findings = _release(policy, state, None, force_all=True) if state.pending else []
    state.finalized = True
    return findings, summarize(policy, state)


def summarize(policy: Policy, state: RunState) -> dict[str, Any]:
    """The run's summary as its state stands (changes nothing): with nothing pending, what
    `finalize` would give."""
    if state.conflicts:
        outcome = "integrity_error"
    elif not state.root_seen or state.unresolved or state.unresolved_overflow:
        outcome = "incomplete_trace"
    else:
        outcome = "complete"
    termination, evidence = _termination(state)
    ended_in_loop = termination == "final_answer" and _ends_in_a_repeat(state)
    guard_fired = state.guard_ns is not None
    tool_after_guard = guard_fired and state.tool_after_guard
    stalled = "identical_repetition" in state.shapes or ended_in_loop
    stalled_ns = state.trigger_ns.get("identical_repetition")
    guard_before_dispatch = (
        guard_fired
        and not tool_after_guard
        and (stalled_ns is None or (state.guard_ns is not None and state.guard_ns <= stalled_ns))
    )
    summary: dict[str, Any] = {
        "run_id": state.run_id,
        "trace_id": state.trace_id,
        "outcome": outcome,
        "termination_reason": termination,
        "termination_evidence": evidence,
        "steps": state.position,
        "tool_calls": state.tool_calls,
        "distinct_actions": state.distinct_actions,
        "duplicate_spans": state.duplicate_spans,
        "late_spans": state.late_spans,
        "integrity_conflicts": state.conflicts,
        "parallel_duplicate_calls": state.parallel_duplicate_calls,
        "shapes": sorted(state.shapes),
        "stalled_repeat": stalled,
        "progress_observed": state.progress_observed,
        "guard_fired": guard_fired,
        "guard_before_dispatch": guard_before_dispatch,
        "tool_after_guard": tool_after_guard,
        # a final answer that only follows the loop's repeated results is not a safe
        # terminal response: it hides the loop (the seeds' QA: "a polite apology")
        "terminal_response": outcome == "complete"
        and termination in ("final_answer", "loop_guard")
        and not ended_in_loop,
        "ended_in_loop": ended_in_loop,
        "prompt_version": state.prompt_version,
        "agent_name": state.agent_name,
        "service_name": state.service_name,
        "session_id": state.session_id,
        "task_type": state.task_type,
        "tokens": state.tokens,
        "wasted_steps": state.wasted_steps,
        "wasted_tokens": state.wasted_tokens,
        "tool_versions": [list(pair) for pair in state.tool_versions],
        "duration_seconds": round((state.last_end_ns - state.start_ns) / 1e9, 3)
        if state.start_ns
        else 0.0,
        # event time, as OTLP spells it: what orders versions by their first run
        "start_time_unix_nano": state.start_ns or 0,
        "end_time_unix_nano": state.last_end_ns,
    }
    if state.guard_denied:  # runs an enforced guard denied calls of: how many ran anyway
        summary["guard_ignored"] = sum(m.startswith("guard_ignored|") for m in state.fired)
    if policy.prices:  # money only where the policy prices models
        summary["cost"] = round(state.cost, 6)
        summary["wasted_cost"] = round(
            wasted_cost(state.wasted_tokens, state.cost, state.priced_tokens), 6
        )
    return summary


# ---------------------------------------------------------------------------- internals


def _termination(state: RunState) -> tuple[str, str]:
    """(termination_reason, evidence): "stated" by a span (exception, message, finish
    reason, guard event), "inferred" from the run (its last model turn asked for tool
    calls and no turn followed: a step limit cut it off; several frameworks end a run at
    their limit normally, saying nothing), "default" (a root ended: final_answer, or
    tool_error when it failed) or "none" (no root: unknown)."""
    # the run's declared step limit was reached: a framework that then asks the model for a
    # final answer ends "normally" (streams/spanpath/limits.py)
    limit = state.limit
    if (
        limit is not None
        and state.termination in (None, "final_answer")
        and _steps_against(state, limit[1]) >= limit[0]
    ):
        return "turn_limit", "inferred"
    if state.termination is not None:
        return state.termination, "stated"
    if not state.root_seen:
        return "unknown", "none"
    if state.last_turn_wants_tools and not state.root_error:
        return "turn_limit", "inferred"
    return ("tool_error" if state.root_error else "final_answer"), "default"


def _note_tool_version(state: RunState, tool: str, version: str) -> None:
    pairs = state.tool_versions
    if len(pairs) < MAP_CAP and [tool, version] not in pairs:
        pairs.append([tool, version])


def _ends_in_a_repeat(state: RunState) -> bool:
    """A loop fired, and the run's last tool call repeated an earlier one of the window with
    the same outcome: the final model turn saw nothing new, the loop was still going."""
    window = state.window
    if not state.shapes or len(window) < 2:
        return False
    last = window[-1]
    action, outcome = last[WIN_ACTION], last[WIN_OUTCOME]
    if action is None:
        return False
    return any(e[WIN_ACTION] == action and e[WIN_OUTCOME] == outcome for e in window[:-1])


def _steps_against(state: RunState, counted: str | None) -> int:
    """The run's steps of the kind its declared limit counts (streams/spanpath/limits.py)."""
    if counted == LIMIT_TOOL_CALLS:
        return state.tool_calls
    if counted == LIMIT_ALL_STEPS:
        return state.llm_turns + state.tool_calls
    return state.llm_turns


def _track_tree(state: RunState, step: Step) -> None:
    span_id = step.span_id
    state.seen_bloom |= bloom_mask(span_id, BLOOM_BITS)
    unresolved = state.unresolved
    if span_id in unresolved:
        unresolved.remove(span_id)
    parent = step.parent_span_id
    # cheapest test first: most spans name the same parent (the root, which ends last)
    if parent is None or parent in unresolved or parent in state.dedup:
        return
    mask = bloom_mask(parent, BLOOM_BITS)
    if state.seen_bloom & mask == mask:
        return
    if len(unresolved) < UNRESOLVED_CAP:
        unresolved.append(parent)
    else:
        state.unresolved_overflow = True


def _note_container(state: RunState, step: Step) -> None:
    if step.step_limit is not None and state.limit is None:
        state.limit = [step.step_limit, step.limit_counts]
    if step.guard_ns is not None:
        state.guard_ns = (
            step.guard_ns if state.guard_ns is None else min(state.guard_ns, step.guard_ns)
        )
    if step.is_root:
        state.root_seen = True
        state.root_end_ns = step.end_ns
        state.root_error = step.status_error
        # A root that merely ended without error says "final_answer" by default: that must
        # not hide a turn limit an agent span reported (OpenAI Agents SDK: the root "Agent
        # workflow" ends OK, the agent span carries "Max turns exceeded").
        if step.termination is not None and not (
            step.termination == "final_answer"
            and not step.status_error
            and state.termination not in (None, "final_answer")
        ):
            state.termination = step.termination
        if state.prompt_version is None:
            state.prompt_version = step.prompt_version
        if state.agent_name is None:
            state.agent_name = step.agent_name
        if state.session_id is None:
            state.session_id = step.session_id
        if state.service_name is None:
            state.service_name = step.service_name
        if state.task_type is None:
            state.task_type = step.task_type
    else:
        if step.agent_name is not None:
            state.agent_name = step.agent_name
        if (
            step.termination is not None
            and step.termination != "final_answer"
            and (not state.root_seen or state.termination in (None, "final_answer"))
        ):
            state.termination = step.termination
    if state.guard_ns is not None and state.guard_ns < state.last_end_ns:
        state.tool_after_guard = state.tool_after_guard or _tool_started_after(
            state, state.guard_ns
        )


def _tool_started_after(state: RunState, when: int) -> bool:
    return any(entry[5] > when for entry in state.window)


_BY_TIME = attrgetter("start_ns", "end_ns", "span_id")
_END = attrgetter("end_ns")
_BY_KEY = itemgetter(0)


def _ordered(state: RunState) -> list[tuple[list[Any], Step]]:
    return _keyed(state.pending, state.released_seq or 0)


def _keyed(steps: list[Step], carried: int) -> list[tuple[list[Any], Step]]:
    """The steps with their runtime-order keys, in that order. An unsequenced step takes
    the sequence of the latest sequenced step before it in time (`carried` before any)."""
    keyed = []
    for step in sorted(steps, key=_BY_TIME):
        seq = step.sequence
        if seq is not None:
            carried = seq
        keyed.append(([carried, step.start_ns, step.end_ns, step.span_id], step))
    keyed.sort(key=_BY_KEY)
    return keyed


def runtime_order(steps: list[Step]) -> list[Step]:
    """A run's steps in the order `release` feeds them to the detectors when all of them
    are there; copies with the same id and time in the order of their content digest."""
    by_digest = sorted(steps, key=attrgetter("content_digest"))
    return [step for _, step in _keyed(by_digest, 0)]


def _release(
    policy: Policy,
    state: RunState,
    watermark_ns: int | None,
    *,
    force_one: bool = False,
    force_all: bool = False,
) -> list[Finding]:
    event_time = state.max_end_ns if watermark_ns is None else watermark_ns
    # Unforced, a step releases only once the event time is past its end: an arrival on
    # unkeyed input usually waits for the input clock (watermark 0), so skip the sort.
    if not state.pending or (
        not (force_all or force_one) and event_time < min(map(_END, state.pending))
    ):
        return []
    keyed = _ordered(state)
    horizon = event_time - int(policy.allowed_lateness_seconds * 1e9)
    contiguous = _contiguous_upto(state, keyed) if policy.release_on_sequence else None
    ctx = Context(policy, state)
    released = 0
    for key, step in keyed:
        end, seq = step.end_ns, step.sequence
        # A contiguous sequence releases at once, but never past what the event time
        # vouches for: with spans of a run on several input partitions (the worker's input
        # clock), a model span that ended before this step may still be on its way.
        if not (
            force_all
            or (force_one and released == 0)
            or end <= horizon
            or (
                contiguous is not None
                and end <= event_time
                and (key[0] < contiguous or (seq is not None and seq <= contiguous))
            )
        ):
            break
        state.last_key = key
        if seq is not None and (state.released_seq is None or seq > state.released_seq):
            state.released_seq = seq
        _process(ctx, step)
        released += 1
    if released == len(keyed):
        state.pending = []  # the common case: everything buffered was ready
    elif released:
        done = {id(step) for _, step in keyed[:released]}
        state.pending = [step for step in state.pending if id(step) not in done]
    return ctx.findings


def _contiguous_upto(state: RunState, keyed: list[tuple[list[Any], Step]]) -> int | None:
    """Highest sequence s such that every sequence up to s is present or released."""
    sequences = sorted({step.sequence for _, step in keyed if step.sequence is not None})
    if not sequences:
        return None
    expected = state.released_seq + 1 if state.released_seq is not None else None
    if expected is None:
        if sequences[0] > 1:  # runtimes count from 0 or 1; anything else waits for lateness
            return None
        expected = sequences[0]
    upto = None
    for seq in sequences:
        if seq < expected:
            continue
        if seq != expected:
            break
        upto = seq
        expected = seq + 1
    if upto is None and state.released_seq is not None:
        return state.released_seq
    return upto


def _process(ctx: Context, step: Step) -> None:
    state = ctx.state
    state.position += 1
    kind = step.kind
    if step.prompt_version is not None:
        state.prompt_version = step.prompt_version
    agent = step.agent_name
    if agent is not None and kind != HANDOFF:
        state.agent_name = agent
        # the agent in control, in runtime order: the source of a handoff whose span
        # does not name one (its agent is an ancestor span's)
        state.current_agent = agent
    if state.service_name is None:
        state.service_name = step.service_name
    if state.session_id is None:
        state.session_id = step.session_id
    if state.task_type is None and step.task_type is not None:
        state.task_type = step.task_type
        ctx.limits = ctx.policy.limits_for(step.task_type)
    start, end = step.start_ns, step.end_ns
    if state.start_ns is None or start < state.start_ns:
        state.start_ns = start
    if end > state.last_end_ns:
        state.last_end_ns = end
    state.tokens += step.input_tokens + step.output_tokens
    if kind == LLM:
        state.llm_turns += 1
    if step.model is not None and ctx.policy.prices:
        price = price_of(ctx.policy.prices, step.model)
        if price is not None:
            state.cost += price.cost(step.input_tokens, step.output_tokens)
            state.priced_tokens += step.input_tokens + step.output_tokens
    if kind == TOOL:
        state.tool_calls += 1
        state.action_steps += 1
        if step.tool_version is not None:
            _note_tool_version(state, step.name, step.tool_version)
        action = step.action_fp
        if action is not None:
            mask = bloom_mask(action, BLOOM_BITS)
            if state.distinct_bloom & mask != mask:
                state.distinct_bloom |= mask
                state.distinct_actions += 1
        if state.guard_ns is not None and start > state.guard_ns:
            state.tool_after_guard = True
        code = step.error_code
        result = step.result_fp
        window = state.window
        window.append(
            [
                step.name,
                action,
                result if result is not None else code,  # the outcome
                code,
                step.empty_result,
                start,
                end,
                step.span_id,
                step.call_id,
                state.position,
                state.tokens,
                step.action_sketch,
                step.result_sketch,  # (none for a result with items: compared by them)
                False,  # stale: detectors/similarity.py decides
                state.llm_turns,
                step.identity_fp,
            ]
        )
        keep = ctx.limits.window
        if len(window) > keep:
            del window[: len(window) - keep]
    elif kind == HANDOFF:
        state.action_steps += 1
    elif kind == LLM:
        state.last_turn_wants_tools = step.wants_tools
    for detector in _BY_KIND.get(kind, DETECTORS):
        detector(ctx, step)
