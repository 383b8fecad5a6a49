"""The recovery table of loop-detection-and-recovery.txt applied to one episode, and the
episode's event id: what the platform's `loop_detected` event says (alerts/events.py) and
what the guard tells the agent (guard/loopwatch_guard) come from here, so both name the
same episode and the same recovery."""

from __future__ import annotations

from .fingerprint import stable_id
from .model import Finding
from .policy import Policy
from .similarity import DETECTOR as NEAR_DUPLICATE
from .similarity import TURNS_DETECTOR

# guard_ignored: a call the guard denied ran anyway (detectors/guard_check.py)
CRITICAL_SHAPES = frozenset({"duplicate_side_effect", "unsafe_side_effect_retry", "guard_ignored"})
NEAR_DUPLICATE_DETECTORS = frozenset({NEAR_DUPLICATE, TURNS_DETECTOR})


def event_id(run_id: str, shape: str, key: str) -> str:
    """Deterministic: the same run, shape and episode key give the same id in every
    process (redelivery, restarts, the guard and the worker)."""
    return stable_id("loop_detected", run_id, shape, key)


def recommended_action(finding: Finding, policy: Policy) -> str:
    """The recovery table of loop-detection-and-recovery.txt, applied to this episode."""
    if finding.shape in CRITICAL_SHAPES or finding.side_effect:
        return "stop_and_escalate"
    if finding.shape == "delegation_ping_pong":
        return "human_handoff"
    if finding.detector in NEAR_DUPLICATE_DETECTORS:
        # the tool (or the model's own action) keeps answering what it already answered:
        # take it away for a turn and make the model decide (the runbook's strategy 2)
        return "constrain_toolset"
    code = finding.trigger.error_code
    if (code is not None and code in policy.missing_data_codes) or finding.trigger.empty_result:
        return "deterministic_fallback"
    if finding.shape == "goal_already_satisfied" or finding.run_meta.get("progress_observed"):
        return "force_final_answer"
    if finding.run_meta.get("side_effect_committed"):
        return "stop_and_escalate"
    return "inject_attempt_history"
