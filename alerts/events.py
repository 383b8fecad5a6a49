"""The `loop_detected` event and the run summary (docs/CONTRACTS.md §6).

Events carry digests, names, codes and ids only. `event_id` is a pure function of
(run, shape, episode key), so redelivery, replay and restarts never mint a second id.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from detectors.model import Finding
from detectors.policy import Policy
from detectors.recovery import CRITICAL_SHAPES, event_id, recommended_action

SHAPES = (
    "identical_repetition",
    "argument_churn",
    "oscillation",
    "replanning",
    "retry_storm",
    "delegation_ping_pong",
    "context_collapse",
    "budget_exhausted",
    "goal_already_satisfied",
    "duplicate_side_effect",
    "unsafe_side_effect_retry",
)
# What an event's `shape` can be: the loop shapes, and guard_ignored, the platform's check on
# the in-process guard (detectors/guard_check.py; not a loop).
EVENT_SHAPES = (*SHAPES, "guard_ignored")
EVENT_FIELDS = (
    "event",
    "event_id",
    "run_id",
    "trace_id",
    "session_id",
    "shape",
    "severity",
    "detector",
    "tool_name",
    "tool_version",
    "prompt_version",
    "agent_name",
    "service_name",
    "fingerprint",
    "count",
    "first_sequence",
    "last_sequence",
    "trigger_span_id",
    "span_ids",
    "call_ids",
    "evidence",
    "recommended_action",
    "wasted_steps",
    "wasted_tokens",
    "budget",
    "detected_at",
    "policy_version",
    "observe_only",
    # true: prompt_version was not known yet when the event fired; the run summary's
    # prompt_version and `deferred_events` give its slice (and its metrics count there)
    "labels_pending",
)


def severity(finding: Finding) -> str:
    if finding.shape in CRITICAL_SHAPES or finding.side_effect:
        return "critical"
    return "warning"


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def build_event(finding: Finding, run_id: str, policy: Policy) -> dict[str, Any]:
    """A loop_detected event; every field is derived from released steps (deterministic)."""
    trigger = finding.trigger
    meta = finding.run_meta
    return {
        "event": "loop_detected",
        "event_id": event_id(run_id, finding.shape, finding.key),
        "run_id": run_id,
        "trace_id": trigger.trace_id,
        "session_id": meta.get("session_id"),
        "shape": finding.shape,
        "severity": severity(finding),
        "detector": finding.detector,
        "tool_name": finding.tool_name,
        "tool_version": finding.tool_version,
        "prompt_version": meta.get("prompt_version"),
        "agent_name": meta.get("agent_name"),
        "service_name": meta.get("service_name"),
        "fingerprint": finding.fingerprint,
        "count": finding.count,
        "first_sequence": finding.first_position,
        "last_sequence": finding.last_position,
        "trigger_span_id": trigger.span_id,
        "span_ids": list(finding.span_ids),
        "call_ids": list(finding.call_ids),
        "evidence": dict(finding.evidence),
        "recommended_action": recommended_action(finding, policy),
        "wasted_steps": finding.wasted_steps,
        "wasted_tokens": finding.wasted_tokens,
        "budget": finding.budget,
        "detected_at": _iso(trigger.end_ns),
        "policy_version": policy.policy_version,
        "observe_only": True,
        "labels_pending": False,
    }
