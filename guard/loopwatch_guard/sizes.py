"""What one guarded run holds, in bytes: its RunState as the worker would serialize it (the
state is bounded by the policy's window and the detectors' caps), plus the guard's own maps
(last outcomes, calls in flight, denied episodes), estimated from their fields."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .guard import GuardRun


def _json_len(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str))


def run_bytes(run: GuardRun) -> int:
    state = _json_len(run.state.to_dict())
    outcomes = sum(len(k) + _json_len(list(v)) for k, v in run._outcomes.items())
    pending = sum(len(k) + _json_len(step.to_list()) for k, (step, _d) in run._pending.items())
    denied = sum(len(k) + len(v) for k, v in run._denied.items())
    return state + outcomes + pending + denied
