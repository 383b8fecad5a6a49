"""What every detector sees: the policy, the run's limits and state, and `fire`, which
emits a finding at most once per (run, shape, episode key)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .model import GUARD_IGNORED, Finding, Step
from .policy import Limits, Policy, ToolContract
from .state import FIRED_CAP, RunState

Detector = Callable[["Context", Step], None]


class Context:
    __slots__ = ("policy", "state", "limits", "findings")

    def __init__(self, policy: Policy, state: RunState) -> None:
        self.policy = policy
        self.state = state
        self.limits: Limits = policy.limits_for(state.task_type)
        self.findings: list[Finding] = []

    def contract(self, tool: str) -> ToolContract | None:
        return self.policy.tools.get(tool)

    def fire(
        self,
        shape: str,
        key: str,
        trigger: Step,
        *,
        count: int,
        first_position: int,
        span_ids: list[str],
        call_ids: list[str | None] | None = None,
        fingerprint: str | None = None,
        evidence: dict[str, Any] | None = None,
        wasted_steps: int = 0,
        wasted_tokens: int = 0,
        budget: str | None = None,
        detector: str | None = None,
    ) -> bool:
        marker = f"{shape}|{key}"
        state = self.state
        if marker in state.fired:
            return False
        if len(state.fired) >= FIRED_CAP:
            state.fired.pop(0)
        state.fired.append(marker)
        if shape not in state.shapes and shape != GUARD_IGNORED:  # (not a loop)
            state.shapes.append(shape)
            state.trigger_ns[shape] = trigger.start_ns
        contract = self.contract(trigger.name) if trigger.kind == "tool" else None
        state.wasted_steps += max(0, wasted_steps)
        state.wasted_tokens += max(0, wasted_tokens)
        self.findings.append(
            Finding(
                shape=shape,
                key=key,
                detector=detector or shape,
                trigger=trigger,
                count=count,
                first_position=first_position,
                last_position=state.position,
                span_ids=span_ids[-16:],
                call_ids=[c for c in (call_ids or []) if c][-16:],
                tool_name=trigger.name if trigger.kind == "tool" else None,
                tool_version=trigger.tool_version,
                fingerprint=fingerprint,
                evidence=evidence or {},
                wasted_steps=max(0, wasted_steps),
                wasted_tokens=max(0, wasted_tokens),
                side_effect=bool(contract and contract.side_effect),
                budget=budget,
                run_meta={
                    "prompt_version": trigger.prompt_version or state.prompt_version,
                    "agent_name": trigger.agent_name or state.agent_name,
                    "service_name": trigger.service_name or state.service_name,
                    "session_id": state.session_id,
                    "progress_observed": state.progress_observed,
                    "side_effect_committed": state.side_effect_committed,
                },
            )
        )
        return True
