"""The shared model: a Step (one normalized span, content already reduced to digests) and a
Finding (one loop episode crossing its threshold).

A Step never carries raw tool arguments or results: the normalizer (streams/spanpath/normalize.py)
reduces them to keyed digests and a few declared, non-sensitive fields (error codes, a
numeric version, whether a state is terminal) before the step leaves the decoding process.
Steps are plain data so they can cross the internal Kafka topic and be replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Final, NamedTuple

NS: Final = 1_000_000_000  # span times are ns since the epoch; everything that keeps time too

# Step kinds. Only these reach the detectors; other spans are dropped by the normalizer
# (but still count towards trace completeness through the run's span bookkeeping).
TOOL = "tool"  # one tool execution
HANDOFF = "handoff"  # control passes from one agent to another
PLAN = "plan"  # a plan (or an LLM turn that requested several tool calls)
LLM = "llm"  # a model call (tokens, context size)
SUMMARY = "summary"  # a context reduction (summarization span)
AGENT = "agent"  # an agent / root span: termination evidence, no action
OTHER = "other"  # any other span of the run: kept only for tree completeness


# Not a loop shape: the platform's check on the in-process guard (detectors/guard_check.py).
# Its events go out like the loops', but it neither makes a run "looped" (the summary's
# shapes, loop rates) nor counts as a loop event in the metrics.
GUARD_IGNORED = "guard_ignored"

# What counts against a declared step limit (Step.limit_counts)
LIMIT_LLM_TURNS, LIMIT_TOOL_CALLS, LIMIT_ALL_STEPS = "llm", "tool", "steps"


@dataclass(slots=True)
class Step:
    """One span of a run, normalized. Field order is the wire order (see to_list)."""

    run_id: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    kind: str
    start_ns: int
    end_ns: int
    # Explicit runtime sequence (agent.step.sequence, langgraph_step, ...) when present.
    sequence: int | None = None
    # Digest of the span's full content: same id + different content = integrity conflict.
    content_digest: str = ""
    name: str = ""  # tool name for tools, agent name for agents
    call_id: str | None = None
    tool_version: str | None = None
    prompt_version: str | None = None
    agent_name: str | None = None
    service_name: str | None = None
    session_id: str | None = None
    task_type: str | None = None
    # Fingerprints (keyed digests, hex).
    action_fp: str | None = None  # tool + identity args (contract applied)
    result_fp: str | None = None  # digest of the result; None when results were not recorded
    error_code: str | None = None  # short code: "404", "not_found", "timeout", "RateLimitError"
    empty_result: bool = False  # result present and empty (no_results, [], {}, null)
    # Progress evidence declared by the tool contract.
    version: float | None = None  # version_field of the result
    state_fp: str | None = None  # state_field of the result (digest)
    state_terminal: bool = False  # state_field value is one of terminal_states
    cursor_fp: str | None = None  # cursor_arg of the call (digest)
    item_fps: tuple[str, ...] = ()  # new_items_field ids (short digests, bounded)
    # Side effects.
    business_fp: str | None = None  # business_identity args digest
    idempotency_fp: str | None = None  # idempotency key digest, None when missing
    # Handoffs.
    from_agent: str | None = None
    to_agent: str | None = None
    # Plans and model calls.
    plan_fp: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    # Termination evidence (root / agent spans).
    is_root: bool = False
    status_error: bool = False
    termination: str | None = None  # a termination_reason from the mapping table
    guard_ns: int | None = None  # time of a loop_guard span event, if any
    # A model turn that asked for tool calls (its finish reason or requested calls): a run
    # whose last turn did, with nothing said about why it stopped, was cut off by a limit.
    wants_tools: bool = False
    # The model a model turn ran on (gen_ai.response.model, ...): prices its tokens.
    model: str | None = None
    # A root or agent span's declared step limit and what counts against it (LIMIT_*
    # below): streams/spanpath/limits.py.
    step_limit: int | None = None
    limit_counts: str | None = None
    # Similarity sketches (detectors/sketch.py: up to 16 keyed 8-hex-digit hashes,
    # no content): a tool call's arguments and result; a model turn's output (its action)
    # and the last message of its input (the observation of the previous turn's action).
    action_sketch: str | None = None
    result_sketch: str | None = None
    result_items: str = ""  # the result's item hashes, 8 hex digits each, at most 32
    # What names the record a tool call acts on (its contract's identity, else identifier
    # keys and values: detectors/sketch.py), digested: compared exactly.
    identity_fp: str | None = None
    # The calls an enforced loopwatch_guard decision on this span kept from being
    # dispatched, "<event time ns> <hold id or -> <call id>" (its `loop_guard` events:
    # deny, reconcile or stop; at most 8; read with `denials`): a tool of that call id
    # starting after it ran although the guard denied it (detectors/guard_check.py); a
    # hold's denials are counted for it (detectors/holds.py `account`).
    denied_calls: tuple[str, ...] = ()

    def to_list(self) -> list[Any]:
        """Compact positional form for the wire (internal topic) and for state."""
        return list(_step_values(self))

    @classmethod
    def from_list(cls, values: list[Any]) -> Step:
        step = cls(*values[: len(STEP_FIELDS)])
        if not isinstance(step.item_fps, tuple):  # JSON gives lists back
            step.item_fps = tuple(step.item_fps)
        if not isinstance(step.denied_calls, tuple):
            step.denied_calls = tuple(step.denied_calls)
        return step

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class Denial(NamedTuple):
    """One entry of `Step.denied_calls`."""

    at_ns: int
    hold_id: str | None  # the on-call hold that decided it, if one did
    call_id: str


def denials(step: Step) -> list[Denial]:
    """The step's denied calls, parsed; unreadable entries are skipped. An entry of two
    fields ("<ns> <call id>", written before hold ids were) has no hold."""
    out = []
    for text in step.denied_calls:
        parts = text.split(" ", 2)
        if len(parts) == 2:
            parts.insert(1, "-")
        at, hold, call_id = parts
        if call_id and at.isdigit():
            out.append(Denial(int(at), None if hold == "-" else hold, call_id))
    return out


STEP_FIELDS: tuple[str, ...] = tuple(Step.__dataclass_fields__)
_step_values = attrgetter(*STEP_FIELDS)  # one C call for every field (3x faster than getattr)
step_values = _step_values  # a step's fields as a tuple, in STEP_FIELDS order


@dataclass(slots=True)
class Finding:
    """One loop episode that crossed its threshold at `trigger` (a released step)."""

    shape: str
    key: str  # episode key within the run: fingerprint, edge or budget name
    detector: str
    trigger: Step
    count: int
    first_position: int
    last_position: int
    span_ids: list[str] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    tool_name: str | None = None
    tool_version: str | None = None
    fingerprint: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    wasted_steps: int = 0
    wasted_tokens: int = 0
    side_effect: bool = False
    budget: str | None = None
    # Run facts as they were when the finding fired (events must not depend on what the
    # run did later in the same release batch): prompt_version, agent_name, ...
    run_meta: dict[str, Any] = field(default_factory=dict)
