"""The guard: loopwatch's own detectors in the agent's process, asked before each tool call.

One `Guard` per process (the policy, the fingerprint key, the holds); one `GuardRun` per
agent run, fed the run's calls as they happen:

    d = run.before_tool(name, arguments, call_id)   # allow | deny | reconcile | stop
    run.after_tool(d.call_id, result=..., error=...)
    run.after_model(input_tokens, output_tokens, tool_calls)

**How a call is judged before it runs.** The run's state is the platform's own `RunState`,
fed by the same `detectors.pipeline` the worker releases spans into, and the call's
digests come from the same `detectors.toolcall.CallReducer` the span path uses. Before a
call is dispatched its arguments are known, its outcome is not. The guard assumes the
stalled outcome: an action it has seen returns what it returned last time (a call never
seen has no outcome yet). It feeds the proposed call, with that outcome, to a copy of the
state; a finding the detectors fire at that call is the platform's finding at that call,
with the same episode key, hence the same event id. So with `allowed_repeats: 2` the third
stalled identical call is denied, not the second and not the fourth; a status poll whose
state advanced is never denied (its last outcome was progress); a call on another tenant is
another action. Shapes that need the call's own new outcome (near-duplicates whose results
bring nothing new, churn over differing arguments) fire after the fact, as on the platform.

**Escalation** (docs/CONTRACTS.md §8): the first denial of an episode carries the attempt
history for the model; the same stalled proposal again after it is `stop`.

**Bounded per run**: the RunState (bounded by the policy's window and the detectors' caps),
the last outcome of at most OUTCOME_CAP actions, at most PENDING_CAP calls in flight and
DENIED_CAP denied episodes. No I/O on the decision path: holds are fetched in the
background (holds.py), the trace event is an in-memory span event.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import messages, trace
from .decision import ALLOW, DENY, RECONCILE, STOP, Decision
from .detectors import pipeline
from .detectors.contract import plan_fp
from .detectors.fingerprint import Fingerprinter
from .detectors.model import LLM, TOOL, Finding, Step
from .detectors.policy import Policy, load_policy
from .detectors.recovery import event_id, recommended_action
from .detectors.state import RunState
from .detectors.toolcall import CallReducer, as_json, refine_code, result_code, short_code

log = logging.getLogger("loopwatch_guard")

OUTCOME_CAP = 32  # actions whose last outcome a run remembers (the stalled hypothesis)
PENDING_CAP = 64  # calls decided and not yet completed
DENIED_CAP = 16  # denied episodes remembered (escalation to stop)
RUNS_CAP = 1024  # runs a Guard keeps for integrations that look runs up by id

# The shape a finding has, and what the guard does before dispatch.
_STOP_SHAPES = frozenset({"budget_exhausted", "goal_already_satisfied"})
_RECONCILE_SHAPES = frozenset({"unsafe_side_effect_retry"})
_DECISION_RANK = {ALLOW: 0, DENY: 1, RECONCILE: 2, STOP: 3}

# A step's outcome fields: what an action returned (copied onto a proposal of it).
_OUTCOME = (
    "result_fp",
    "error_code",
    "empty_result",
    "status_error",
    "version",
    "state_fp",
    "state_terminal",
    "item_fps",
    "result_sketch",
    "result_items",
)


class Guard:
    """The policy, the fingerprint key and (with `holds_url`) the on-call's holds of one
    agent process. Thread-safe: runs are independent; the runs map has a lock."""

    def __init__(
        self,
        policy: Policy,
        *,
        fingerprint_key: bytes | None = None,
        holds: Any = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.policy = policy
        self.fp = Fingerprinter(fingerprint_key)
        self.reducer = CallReducer(policy, self.fp)
        self.holds = holds
        self.clock = clock
        self._runs: OrderedDict[str, GuardRun] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_policy(cls, path: str | Path, holds_url: str | None = None, **kwargs: Any) -> Guard:
        """The worker's policy file and the worker's LOOPWATCH_FINGERPRINT_KEY (the same key
        gives the same fingerprints, hence the same event ids)."""
        key = os.environ.get("LOOPWATCH_FINGERPRINT_KEY", "")
        if not key:
            log.warning(
                "loopwatch_guard: LOOPWATCH_FINGERPRINT_KEY is not set: fingerprints are "
                "unkeyed SHA-256 (set the worker's key so both give the same ids)"
            )
        policy = load_policy(path)
        holds = None
        if holds_url is not None:
            from .holds import HoldsClient  # (the one module that makes network calls)

            holds = HoldsClient(
                holds_url,
                token=os.environ.get("LOOPWATCH_API_TOKEN") or None,
                refresh_seconds=policy.holds_refresh_seconds,
                side_effects_fail_closed=policy.side_effects_fail_closed,
            )
            holds.start()
        return cls(
            policy,
            fingerprint_key=key.encode("utf-8") if key else None,
            holds=holds,
            **kwargs,
        )

    def run(
        self,
        run_id: str | None = None,
        service: str | None = None,
        agent: str | None = None,
        prompt_version: str | None = None,
        task_type: str | None = None,
    ) -> GuardRun:
        """The run with this id (its state kept across calls), or a new one. Without an id,
        the current trace's id (the platform's run key by default), else a fresh one."""
        ids = trace.current_ids()
        if run_id is None:
            run_id = ids[0] if ids is not None else os.urandom(16).hex()
        with self._lock:
            found = self._runs.get(run_id)
            if found is not None:
                self._runs.move_to_end(run_id)
                return found
            run = GuardRun(
                self,
                run_id,
                trace_id=ids[0] if ids is not None else run_id,
                service=service,
                agent=agent,
                prompt_version=prompt_version,
                task_type=task_type,
            )
            self._runs[run_id] = run
            if len(self._runs) > RUNS_CAP:
                self._runs.popitem(last=False)
            return run

    def end(self, run_id: str) -> None:
        """Forget a run (its state is freed; the platform keeps the record)."""
        with self._lock:
            self._runs.pop(run_id, None)


class GuardRun:
    """One agent run as the guard sees it. Not thread-safe across calls of one run, which
    an agent makes in order (parallel calls of one model turn: call before_tool for each,
    then after_tool for each)."""

    def __init__(
        self,
        guard: Guard,
        run_id: str,
        *,
        trace_id: str,
        service: str | None = None,
        agent: str | None = None,
        prompt_version: str | None = None,
        task_type: str | None = None,
    ) -> None:
        self.guard = guard
        self.policy = guard.policy
        self.run_id = run_id
        self.trace_id = trace_id
        self.service = service
        self.agent = agent
        self.prompt_version = prompt_version
        self.task_type = task_type
        self.state = RunState(run_id=run_id)
        self.state.task_type = task_type
        self._outcomes: OrderedDict[str, tuple[Any, ...]] = OrderedDict()
        self._pending: OrderedDict[str, tuple[Step, Decision]] = OrderedDict()
        self._denied: OrderedDict[str, str] = OrderedDict()  # event id -> shape
        self._ids = itertools.count(1)
        self._turn = 0  # model turns reported (after_model): a turn's calls share it
        self.stopped: Decision | None = None  # the enforced stop that ended the run
        self.decisions: list[Decision] = []  # the run's decisions other than allow (bounded)
        self.ignored: list[str] = []  # call ids dispatched although their denial was enforced

    # ------------------------------------------------------------------ the public calls

    def before_tool(
        self,
        name: str,
        arguments: Any = None,
        call_id: str | None = None,
        tool_version: str | None = None,
    ) -> Decision:
        """The decision for this call, before it is dispatched. Decisions other than allow
        go on the current span as a `loop_guard` event."""
        now = self.guard.clock()
        if call_id is None:
            call_id = f"lwg-{next(self._ids)}"
        args = _arguments(arguments, self.policy, name)
        step = self._tool_step(name, call_id, tool_version, now)
        self.guard.reducer.action(step, name, args)
        decision = self._decide(step, args)
        self._pending[call_id] = (step, decision)
        if len(self._pending) > PENDING_CAP:
            self._pending.popitem(last=False)
        if decision.action != ALLOW:
            trace.record(decision, self.policy.policy_version)
            self.decisions.append(decision)
            del self.decisions[:-DENIED_CAP]
        return decision

    def after_tool(
        self,
        call_id: str | None,
        result: Any = None,
        error: BaseException | str | None = None,
        span_id: str | None = None,
    ) -> None:
        """The call's result or error (an exception, or an error code string). `span_id`:
        the tool span's id, when the caller knows it (what the platform's episode ids are
        made of); else the current span's, else the call's own id."""
        if call_id is None and self._pending:
            call_id = next(reversed(self._pending))
        entry = self._pending.pop(call_id, None) if call_id is not None else None
        if entry is None:
            log.debug("loopwatch_guard: after_tool for an unknown call %s", call_id)
            return
        step, decision = entry
        if decision.enforced:
            self.ignored.append(str(call_id))  # it ran although the guard denied it
            del self.ignored[:-DENIED_CAP]
        step.end_ns = max(self.guard.clock(), step.start_ns)
        if span_id is None:
            ids = trace.current_ids()
            if ids is not None and ids[1] != step.span_id:
                span_id = ids[1]
        if span_id is not None:
            step.span_id = span_id
        code: str | None = None
        if error is not None:
            step.status_error = True
            if isinstance(error, BaseException):
                code = (
                    refine_code(self.policy, short_code(type(error).__name__), [str(error)])
                    or "error"
                )
            else:
                code = short_code(error) or "error"
        parsed = as_json(result) if result is not None else None
        if code is None:
            code = result_code(parsed)
        self.guard.reducer.outcome(
            step,
            step.name,
            has_result=result is not None,
            result=parsed,
            raw_result=result,
            code=code,
        )
        self.record(step)

    def after_model(
        self,
        input_tokens: int = 0,
        output_tokens: int = 0,
        tool_calls: Iterable[Any] = (),
    ) -> None:
        """A model turn: its tokens and the tool calls it requested ((name, arguments)
        pairs or {"name", "arguments"} mappings). The calls of one turn are parallel, not a
        sequence: they share the turn."""
        self._turn += 1
        now = self.guard.clock()
        step = Step(
            self.run_id,
            self.trace_id,
            f"lwg-turn-{self._turn}",
            None,
            LLM,
            now,
            now,
            self._turn,
        )
        self._label(step)
        step.input_tokens = max(0, int(input_tokens))
        step.output_tokens = max(0, int(output_tokens))
        calls = [_requested(c, self.policy) for c in tool_calls]
        if len(calls) >= 2:  # a single requested call is an action, not a plan
            step.plan_fp = plan_fp(self.guard.fp, self.policy, calls)
        step.wants_tools = bool(calls)
        pipeline.feed(self.policy, self.state, step)

    # ------------------------------------------------------------------ steps, decisions

    def propose(self, step: Step, args: dict[str, Any] | None = None) -> Decision:
        """The decision for a tool step whose action digests are filled and whose outcome is
        not known yet (before_tool's core; the differential test feeds recorded steps)."""
        return self._decide(step, args or {})

    def record(self, step: Step) -> list[Finding]:
        """Feed a completed step (its outcome known) to the run's state; returns what the
        platform's detectors fire at it."""
        if step.kind == TOOL and step.action_fp is not None:
            self._outcomes[step.action_fp] = tuple(getattr(step, f) for f in _OUTCOME)
            self._outcomes.move_to_end(step.action_fp)
            if len(self._outcomes) > OUTCOME_CAP:
                self._outcomes.popitem(last=False)
        return pipeline.feed(self.policy, self.state, step)

    def state_bytes(self) -> int:
        """An estimate of this run's memory: the state and the guard's own maps."""
        from .sizes import run_bytes

        return run_bytes(self)

    def _tool_step(self, name: str, call_id: str, tool_version: str | None, now: int) -> Step:
        step = Step(
            self.run_id,
            self.trace_id,
            f"call:{call_id}",
            None,
            TOOL,
            now,
            now,
            self._turn if self._turn else None,
        )
        step.name = name
        step.call_id = call_id
        step.tool_version = tool_version
        self._label(step)
        return step

    def _label(self, step: Step) -> None:
        step.prompt_version = self.prompt_version
        step.agent_name = self.agent
        step.service_name = self.service
        step.task_type = self.task_type

    def _decide(self, step: Step, args: dict[str, Any]) -> Decision:
        policy = self.policy
        mode = policy.guard_mode_for(step.name)

        def make(action: str, **fields: Any) -> Decision:
            return Decision(action, call_id=step.call_id, tool=step.name, mode=mode, **fields)

        if self.stopped is not None:
            return make(
                STOP,
                shape=self.stopped.shape,
                reason="the guard stopped this run",
                message=self.stopped.message,
                event_id=self.stopped.event_id,
                recovery="force_final_answer",
            )
        holds = self.guard.holds
        if holds is not None:
            hold = holds.match(self, step)
            if hold is not None:
                decision = make(
                    STOP if hold.scope_is_run else DENY,
                    reason=f"on hold ({hold.id})",
                    message=messages.for_hold(hold.reason, hold.id),
                    hold_id=hold.id,
                    recovery="stop_and_escalate",
                )
                return self._enforce(decision)
        finding = self._predict(step)
        if finding is None:
            return make(ALLOW)
        eid = event_id(self.run_id, finding.shape, finding.key)
        recovery = recommended_action(finding, policy)
        contract = policy.tools.get(step.name)
        shown = messages.args_text(
            args, contract.business_identity or contract.identity if contract else None
        )
        evidence = dict(finding.evidence)
        evidence["count"] = finding.count
        if eid in self._denied:
            decision = make(
                STOP,
                shape=finding.shape,
                reason=f"{finding.shape}: proposed again after its denial",
                message=messages.for_escalation(step.name),
                event_id=eid,
                recovery="force_final_answer",
                evidence=evidence,
            )
            return self._enforce(decision)
        action, message = self._recovery(finding, recovery, step, shown)
        decision = make(
            action,
            shape=finding.shape,
            reason=_reason(finding),
            message=message,
            event_id=eid,
            recovery=recovery,
            evidence=evidence,
        )
        if action in (DENY, RECONCILE):
            self._denied[eid] = finding.shape
            if len(self._denied) > DENIED_CAP:
                self._denied.popitem(last=False)
        return self._enforce(decision)

    def _enforce(self, decision: Decision) -> Decision:
        if decision.action == STOP and decision.enforced:
            self.stopped = decision
        return decision

    def _predict(self, step: Step) -> Finding | None:
        """The finding the detectors fire at this call if it returns what the same action
        returned last time (none for an action not seen yet): on a copy of the state."""
        probe = copy.copy(step)
        if step.action_fp is not None:
            last = self._outcomes.get(step.action_fp)
            if last is not None:
                for name, value in zip(_OUTCOME, last, strict=True):
                    setattr(probe, name, value)
        trial = self.state.clone()
        findings = pipeline.feed(self.policy, trial, probe)  # (all of them fire at the probe)
        if not findings:
            return None
        return max(findings, key=lambda f: _DECISION_RANK[_action_of(f)])

    def _recovery(self, finding: Finding, recovery: str, step: Step, shown: str) -> tuple[str, str]:
        action = _action_of(finding)
        tool = step.name
        if finding.shape == "budget_exhausted":
            return action, messages.for_budget(finding.budget)
        if finding.shape == "goal_already_satisfied":
            return action, messages.for_goal_reached(tool)
        if finding.shape == "unsafe_side_effect_retry":
            contract = self.policy.tools.get(tool)
            return action, messages.for_reconcile(
                tool, shown, contract.reconcile_tool if contract else None
            )
        if finding.shape == "duplicate_side_effect":
            return action, messages.for_duplicate_write(tool, shown)
        done = max(1, finding.count - 1)
        last = dict(zip(_OUTCOME, self._outcomes.get(step.action_fp or "", ()), strict=False))
        code, empty = last.get("error_code"), bool(last.get("empty_result"))
        return action, messages.for_repeat(recovery, tool, done, shown, code, empty)


def _action_of(finding: Finding) -> str:
    if finding.shape in _STOP_SHAPES:
        return STOP
    if finding.shape in _RECONCILE_SHAPES:
        return RECONCILE
    return DENY


def _reason(finding: Finding) -> str:
    """A one-line account without content (names, counts and codes only)."""
    tool = finding.tool_name or finding.trigger.name
    if finding.shape == "budget_exhausted":
        return f"budget_exhausted: the run's {finding.budget} budget is used up"
    return f"{finding.shape}: {tool}, {finding.count} calls ({finding.detector})"


def _arguments(arguments: Any, policy: Policy, tool: str) -> dict[str, Any]:
    """A call's arguments as the span path reads them: JSON text parsed; a bare value is
    the single argument (the contract's first identity argument, else `input`)."""
    args = as_json(arguments) if arguments is not None else {}
    if isinstance(args, dict):
        return args
    contract = policy.tools.get(tool)
    single = contract.identity[0] if contract and contract.identity else "input"
    return {single: args}


def _requested(call: Any, policy: Policy) -> tuple[str, Any]:
    if isinstance(call, dict):
        name, args = call.get("name"), call.get("arguments", call.get("args"))
    else:
        name, args = call
    return str(name), _arguments(args, policy, str(name))
