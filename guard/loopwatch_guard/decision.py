"""What the guard answers before a tool call (docs/CONTRACTS.md §8)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ALLOW, DENY, RECONCILE, STOP = "allow", "deny", "reconcile", "stop"
ACTIONS = (ALLOW, DENY, RECONCILE, STOP)


@dataclass(frozen=True, slots=True)
class Decision:
    """`action` is what the guard decided; `mode` whether it acts on it: in `observe` the
    call goes ahead whatever the action (the decision is only recorded), in `enforce` a
    call that is not allowed must not be dispatched (`enforced`).

    `message` is for the model (it may quote the call's own arguments: it stays in the
    agent's process, never on the trace); `reason` is a one-line account without content
    for logs; `event_id` is the id the platform's `loop_detected` event of the same
    episode carries."""

    action: str
    call_id: str | None = None
    tool: str | None = None
    mode: str = "observe"
    shape: str | None = None
    reason: str | None = None
    message: str | None = None
    event_id: str | None = None
    hold_id: str | None = None
    recovery: str | None = None  # the recovery table's action (recommended_action)
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def enforced(self) -> bool:
        """The caller must not dispatch this call (a decision other than allow, enforced)."""
        return self.action != ALLOW and self.mode == "enforce"

    @property
    def allowed(self) -> bool:
        return not self.enforced
