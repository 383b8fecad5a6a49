"""loopwatch's loop detectors in the agent's process: the decision before each tool call.

    from loopwatch_guard import Guard
    guard = Guard.from_policy("policy.yaml")
    run = guard.run(run_id)
    d = run.before_tool("lookup_order", {"order_id": "A12"}, call_id="c1")
    if d.enforced: ...            # deny / reconcile: give d.message to the model; stop: end the run
    run.after_tool("c1", result={...})

docs/CONTRACTS.md §8 has the contract; integrations/ the framework hooks.
"""

from __future__ import annotations

from .decision import ALLOW, DENY, RECONCILE, STOP, Decision
from .guard import Guard, GuardRun
from .integrations.plain import LoopGuardStop, guarded, running

__all__ = [
    "ALLOW",
    "DENY",
    "RECONCILE",
    "STOP",
    "Decision",
    "Guard",
    "GuardRun",
    "LoopGuardStop",
    "guarded",
    "running",
]
