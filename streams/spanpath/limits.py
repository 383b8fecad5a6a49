"""A run's declared step limit, read from its root or agent span: an integer attribute whose
key names a step, turn, iteration, call or recursion limit, in any namespace and spelling
(`max_steps`, `maxTurns`, `agent.max_iterations`, `recursion_limit`, `max_llm_calls`, ...).
The pipeline then says `turn_limit` (evidence `inferred`) for a run whose steps of that kind
reached it, whatever its final answer says (detectors/pipeline.py). Both span paths read it
the same way (native/src/normalize/termination.rs).

What is counted against it: model turns for step, turn and iteration limits (a framework's
step is a model decision and its tool calls), tool calls for tool-call limits, model turns
and tool calls together for a recursion limit (a graph's super-steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from detectors.model import LIMIT_ALL_STEPS as ALL_STEPS
from detectors.model import LIMIT_LLM_TURNS as LLM_TURNS
from detectors.model import LIMIT_TOOL_CALLS as TOOL_CALLS

# the key's last segment, lower case, without "_" and "-" -> what counts against it
LIMIT_NAMES: dict[str, str] = {
    "maxsteps": LLM_TURNS,
    "maxagentsteps": LLM_TURNS,
    "steplimit": LLM_TURNS,
    "maxturns": LLM_TURNS,
    "turnlimit": LLM_TURNS,
    "maxiterations": LLM_TURNS,
    "maxiter": LLM_TURNS,
    "iterationlimit": LLM_TURNS,
    "maxllmcalls": LLM_TURNS,
    "maxmodelcalls": LLM_TURNS,
    "requestlimit": LLM_TURNS,
    "maxtoolcalls": TOOL_CALLS,
    "toolcallslimit": TOOL_CALLS,
    "recursionlimit": ALL_STEPS,
}


def limit_name(key: str) -> str:
    """The key's last segment as LIMIT_NAMES spells it ("" when it is not ASCII)."""
    segment = key.rsplit(".", 1)[-1]
    if not segment.isascii():
        return ""
    return segment.lower().replace("_", "").replace("-", "")


def declared_limit(attrs: Mapping[str, Any]) -> tuple[int, str] | None:
    """(limit, what counts against it) from the first attribute that declares one."""
    for key, value in attrs.items():
        if type(value) is int and 0 < value < 2**63:
            counted = LIMIT_NAMES.get(limit_name(key))
            if counted is not None:
                return value, counted
    return None
