"""Near-duplicate loops: argument_churn where the arguments are only rephrased and the
results bring nothing new (issue 29).

The seeds' argument churn is "same tool, slightly different arguments, same failure"; the
runbook names the general case: "different arguments still produce the same observation and
no progress". These detectors fire that shape (detector `near_duplicate`, or
`near_duplicate_turns` for model turns), from the keyed sketches the span path computed
(detectors/sketch.py): no argument or result is ever seen here.

A call that repeats the run's previous call with nothing new is identical_repetition's
episode, as is any call of a tool whose contract declares a version or state field. Any
other call is **stale** (brings nothing new) when its result repeats an earlier result of
the tool exactly, or, unless it is the tool's previous call again with a new result
(polling: progress), its items (a declared `new_items_field`, else the URLs / list entries
the span path found) were mostly seen before in the run (`seen_items`), or, without items,
its words overlap an earlier result of the tool by `result_similarity`. Only earlier calls the agent could have seen count: not those
of the same model turn (fan-out) or still running when it started.

An episode: the stale call, the earlier calls of the same tool whose arguments overlap its
own (or a linked call's) by `argument_similarity`, those of them that were stale too, and
the first of them (the call whose answer the others repeat); it fires once per tool and run
when it holds `min_calls` calls with more than one argument or result among them (one call
and one answer again and again is an exact shape's: identical_repetition, oscillation,
context_collapse). Model turns (agents that act by writing code or text, content capture
on) are the same with the turn's output as the arguments and the last message of the next
turn's input as the result; a turn that asked for tool calls, or was followed by any, is
left to the tool detectors.
"""

from __future__ import annotations

from typing import Any

from .base import Context
from .model import LLM, TOOL, Step
from .policy import Similarity
from .repetition import S_ACTION, S_COUNT
from .state import (
    SEEN_ITEMS_BITS,
    SEEN_ITEMS_GENERATION,
    WIN_ACTION,
    WIN_ASKETCH,
    WIN_CALL,
    WIN_END,
    WIN_IDENTITY,
    WIN_OUTCOME,
    WIN_POS,
    WIN_RSKETCH,
    WIN_SPAN,
    WIN_STALE,
    WIN_TOKENS,
    WIN_TOOL,
    WIN_TURN,
    bloom_bits,
)

SHAPE = "argument_churn"
DETECTOR = "near_duplicate"
TURNS_DETECTOR = "near_duplicate_turns"
K = 32  # hashes a sketch keeps (detectors/sketch.py computes them)
HASH_HEX = 8  # hex digits of one feature's hash
# Layout of one RunState.turns record (a model turn).
T_ACTION, T_OBSERVATION, T_SPAN, T_POS, T_TOKENS, T_STALE, T_ACTIONS, T_END, T_AGENT = range(9)


def similarity(a: str | None, b: str | None) -> float | None:
    """Estimated Jaccard overlap of two sketches' feature sets (detectors/sketch.py
    states the estimate and its error): among the hashes up to the least of the full
    sketches' largest ones, the share both hold. None without both."""
    if a is None or b is None:
        return None
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    sa, ta = _hashes(a)
    sb, tb = _hashes(b)
    if ta is None and tb is None:
        return len(sa & sb) / len(sa | sb)
    t = min(x for x in (ta, tb) if x is not None)  # (fixed-width hex: text order = numbers')
    union = [h for h in sa | sb if h <= t]
    return sum(1 for h in union if h in sa and h in sb) / len(union)


_PARSED: dict[str, tuple[frozenset[str], str | None]] = {}
_PARSED_CAP = 4096


def _hashes(sketch: str) -> tuple[frozenset[str], str | None]:
    """A sketch's hashes, and its largest when it is full (the set may have more). Memoized:
    a window entry is compared with each call after it."""
    found = _PARSED.get(sketch)
    if found is None:
        hashes = [sketch[i : i + HASH_HEX] for i in range(0, len(sketch), HASH_HEX)]
        found = frozenset(hashes), hashes[-1] if len(hashes) >= K else None
        if len(_PARSED) >= _PARSED_CAP:
            _PARSED.clear()
        _PARSED[sketch] = found
    return found


def near_duplicate(ctx: Context, step: Step) -> None:
    """A tool call: mark it stale or not (its window entry), then look for the episode."""
    if step.kind != TOOL:
        return
    sim = ctx.policy.similarity_for(step.name)  # off where a version or state is progress
    state = ctx.state
    entry = state.window[-1]  # this call's (appended by the pipeline before the detectors)
    if not sim.enabled or entry[WIN_SPAN] != step.span_id:
        return
    contract = ctx.contract(step.name)
    streak = state.streak
    if streak is not None and streak[S_ACTION] == step.action_fp and streak[S_COUNT] >= 2:
        return  # the previous call again, nothing new: identical_repetition's episode
    declared = contract is not None and contract.new_items_field is not None
    if declared:
        items: tuple[str, ...] | list[str] = step.item_fps
    else:
        found = step.result_items
        items = [found[i : i + HASH_HEX] for i in range(0, len(found), HASH_HEX)]
    seen = _see_items(state.seen_items, items) if items else None
    if step.error_code is not None or step.empty_result or step.result_fp is None:
        return  # failures are argument_churn's and retry_storm's; no result, no evidence
    name, start, turn, identity = step.name, step.start_ns, state.llm_turns, step.identity_fp
    # what the agent could have seen when it made this call: ended before it started and,
    # where model turns are traced, requested by an earlier turn (not this turn's fan-out);
    # and of the same record: a call on another record (another order, tenant, page) is
    # another action, and its answer news about that record, however alike their words
    earlier = [
        e
        for e in state.window[:-1]
        if e[WIN_TOOL] == name
        and e[WIN_IDENTITY] == identity
        and e[WIN_END] <= start
        and not (turn and e[WIN_TURN] == turn)
    ]
    if not earlier:
        return
    stale, basis, score = _stale(sim, step, entry, earlier, items, seen, declared)
    entry[WIN_STALE] = stale
    if not stale:
        return
    cluster, low = _linked(entry, earlier, sim.argument_similarity, WIN_ACTION, WIN_ASKETCH)
    members = [e for i, e in enumerate(cluster) if i == 0 or e[WIN_STALE]]
    count = len(members) + 1
    if count < sim.min_calls:
        return
    actions = {e[WIN_ACTION] for e in members} | {step.action_fp}
    outcomes = {e[WIN_OUTCOME] for e in members} | {entry[WIN_OUTCOME]}
    if len(actions) == 1 and len(outcomes) == 1:
        return  # one call, one answer, again: the exact shapes' (oscillation, collapse, ...)
    ctx.fire(
        SHAPE,
        f"{step.name}|near",
        step,
        count=count,
        first_position=members[0][WIN_POS],
        span_ids=[*(e[WIN_SPAN] for e in members), step.span_id],
        call_ids=[*(e[WIN_CALL] for e in members), step.call_id],
        fingerprint=step.action_fp,
        evidence={
            "argument_similarity": round(low, 2),
            "nothing_new": basis,
            _basis_key(basis): round(score, 2),
            "distinct_arguments": len(actions),
            "distinct_results": len(outcomes),
        },
        wasted_steps=count - 1,
        wasted_tokens=state.tokens - members[0][WIN_TOKENS],
        detector=DETECTOR,
    )


def _linked(
    current: list[Any],
    earlier: list[list[Any]],
    threshold: float,
    exact: int | None,
    sketch: int,
) -> tuple[list[list[Any]], float]:
    """The earlier records whose action overlaps the current one's, or that of one linked
    already, by `threshold` (rephrasings drift: the third drops what the first had and adds
    what the second had not), in their order; and the least overlap of the links. `exact`:
    the record's exact fingerprint, equal = overlap 1 (None: sketches only)."""
    linked = [current]
    low = 1.0
    rest = list(earlier)
    grown = True
    while grown:
        grown = False
        for e in list(rest):
            best = max(
                (
                    1.0
                    if exact is not None and e[exact] is not None and e[exact] == m[exact]
                    else similarity(e[sketch], m[sketch]) or 0.0
                )
                for m in linked
            )
            if best >= threshold:
                linked.append(e)
                rest.remove(e)
                low = min(low, best)
                grown = True
    ids = {id(e) for e in linked}
    return [e for e in earlier if id(e) in ids], low


def _basis_key(basis: str) -> str:
    """The evidence key of the score behind a stale verdict."""
    return {"items": "seen_items", "text": "result_similarity"}.get(basis, "result_repeated")


def _stale(
    sim: Similarity,
    step: Step,
    entry: list[Any],
    earlier: list[list[Any]],
    items: tuple[str, ...] | list[str],
    seen: float | None,
    declared: bool,
) -> tuple[bool, str, float]:
    """(nothing new?, on what basis, its score)."""
    outcome = entry[WIN_OUTCOME]
    if any(e[WIN_OUTCOME] == outcome for e in earlier):
        return True, "exact", 1.0
    if earlier[-1][WIN_ACTION] == step.action_fp:
        return False, "changed", 0.0  # the same call again, a new result: progress (polling)
    if not sim.compare_results:
        return True, "arguments_only", 1.0
    if seen is not None and (declared or len(items) >= 2):
        return seen >= sim.seen_items, "items", seen
    best = max(
        (s for e in earlier if (s := similarity(e[WIN_RSKETCH], step.result_sketch)) is not None),
        default=0.0,
    )
    return best >= sim.result_similarity, "text", best


def _see_items(seen: list[int], items: tuple[str, ...] | list[str]) -> float:
    """The share of these items (8-hex-digit hashes) already in the run's seen-items memory,
    which then holds them: two generations of a bloom filter (two bits an item), the older
    dropped when the newer has had SEEN_ITEMS_GENERATION items, so its error stays bounded
    however long the run."""
    if not seen:
        seen.extend((0, 0, 0))
    current, previous, added = seen
    known = 0
    masks = _MASKS
    for x in items:
        mask = masks.get(x)
        if mask is None:
            mask = _mask(x)
        if current & mask == mask or previous & mask == mask:
            known += 1
        else:
            current |= mask
            added += 1
            if added >= SEEN_ITEMS_GENERATION:
                current, previous, added = 0, current, 0
    seen[:] = (current, previous, added)
    return known / len(items)


_MASKS: dict[str, int] = {}  # item hash -> its two bits (items recur: a site's pages, ids)


def _mask(item: str) -> int:
    mask = bloom_bits(int(item, 16), SEEN_ITEMS_BITS)
    if len(_MASKS) >= _PARSED_CAP:
        _MASKS.clear()
    _MASKS[item] = mask
    return mask


def near_duplicate_turns(ctx: Context, step: Step) -> None:
    """A model turn: its input's last message is the observation of its agent's previous
    turn's output; that pair is stale when an earlier pair of the agent had (nearly) the
    same action and the same observation."""
    if step.kind != LLM or step.result_sketch is None:
        return  # not a whole chat call (messages in and out): a wrapper or a partial record
    sim = ctx.policy.similarity
    if not (sim.enabled and sim.model_turns):
        return
    state = ctx.state
    if state.action_steps > state.tool_calls:
        # a handoff: turns of several agents interleave, and which turn's input answers
        # which output is not in the spans (delegation_ping_pong judges the handoffs)
        return
    turns = state.turns
    agent = step.agent_name or state.current_agent
    own = [t for t in turns if t[T_AGENT] == agent]
    if own:
        last = own[-1]
        if step.start_ns < last[T_END]:
            # a model span inside the last one (a framework's wrapper around the client
            # call): one turn; if it asked for tools, the turn's action is theirs
            if step.wants_tools:
                last[T_ACTION] = None
            return
        if last[T_ACTIONS] != state.action_steps:
            last[T_ACTION] = None  # its action ran as tool calls or handoffs: judged there
        if last[T_ACTION] is not None:
            last[T_OBSERVATION] = step.result_sketch
            _judge_turn(ctx, step, sim, own)
    action = None if step.wants_tools else step.action_sketch
    turns.append(
        [action, None, step.span_id, state.position, state.tokens, False]
        + [state.action_steps, step.end_ns, agent]
    )
    keep = ctx.limits.window
    if len(turns) > keep:
        del turns[: len(turns) - keep]


def _judge_turn(ctx: Context, step: Step, sim: Similarity, turns: list[list[Any]]) -> None:
    current = turns[-1]
    complete = [t for t in turns[:-1] if t[T_ACTION] is not None and t[T_OBSERVATION] is not None]
    cluster, low = _linked(current, complete, sim.argument_similarity, None, T_ACTION)
    stale = any(
        (similarity(t[T_OBSERVATION], current[T_OBSERVATION]) or 0.0) >= sim.result_similarity
        for t in cluster
    )
    current[T_STALE] = stale
    if not stale:
        return
    members = [t for i, t in enumerate(cluster) if i == 0 or t[T_STALE]]
    count = len(members) + 1
    if count < sim.min_calls:
        return
    ctx.fire(
        SHAPE,
        "model_turns|near",
        step,
        count=count,
        first_position=members[0][T_POS],
        span_ids=[*(t[T_SPAN] for t in members), current[T_SPAN], step.span_id],
        fingerprint=None,
        evidence={"action_similarity": round(low, 2), "nothing_new": "observation"},
        wasted_steps=count - 1,
        wasted_tokens=ctx.state.tokens - members[0][T_TOKENS],
        detector=TURNS_DETECTOR,
    )
