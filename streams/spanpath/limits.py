"""A run's declared step limit, read from its root or agent span: an integer attribute whose
key names a step, turn, iteration, call or recursion limit, in any namespace and spelling
(`max_steps`, `maxTurns`, `agent.max_iterations`, `recursion_limit`, `max_llm_calls`, ...);
else the same kind of key with an integer value inside a JSON object an attribute holds (the
kwargs of an input, `input.value` = `{"kwargs": {"max_steps": 6}}`; a positional-argument
object, `<x>.argument.1` = `{"maxSteps": 6}`), at most MAX_JSON_DEPTH objects deep, nearer
levels first. Lists are not entered (a message history is no place for the agent's options),
and a value is parsed only when its text names a limit at all (`max` or `limit`, any case).
The pipeline then says `turn_limit` (evidence `inferred`) for a run whose steps of that kind
reached it, whatever its final answer says (detectors/pipeline.py). Both span paths read it
the same way (native/src/normalize/termination.rs).

What is counted against it: model turns for step, turn and iteration limits (a framework's
step is a model decision and its tool calls), tool calls for tool-call limits, model turns
and tool calls together for a recursion limit (a graph's super-steps).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from detectors.model import LIMIT_ALL_STEPS as ALL_STEPS
from detectors.model import LIMIT_LLM_TURNS as LLM_TURNS
from detectors.model import LIMIT_TOOL_CALLS as TOOL_CALLS
from detectors.toolcall import as_json

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


MAX_JSON_DEPTH = 3  # levels of objects read inside one attribute's JSON value

# every LIMIT_NAMES key holds one of these: a value whose text has neither is not parsed
_MAY_NAME_A_LIMIT = re.compile(r"max|limit", re.IGNORECASE | re.ASCII).search


class DeclaredLimit(NamedTuple):
    limit: int
    counts: str  # what counts against it (LLM_TURNS, TOOL_CALLS, ALL_STEPS)
    where: str  # the attribute, and the path inside its JSON value: "input.value:kwargs.max_steps"


def _counts_against(key: str, value: Any) -> str | None:
    """What counts against the limit `key` declares with `value`; None: it declares none."""
    if type(value) is int and 0 < value < 2**63:
        return LIMIT_NAMES.get(limit_name(key))
    return None


def declared_limit(attrs: Mapping[str, Any]) -> DeclaredLimit | None:
    """The first attribute that declares a limit; else the first JSON value that holds one."""
    for key, value in attrs.items():
        counted = _counts_against(key, value)
        if counted is not None:
            return DeclaredLimit(value, counted, key)
    for key, value in attrs.items():
        if isinstance(value, str) and _MAY_NAME_A_LIMIT(value):
            value = as_json(value)
        if isinstance(value, dict):
            found = _limit_inside(value)
            if found is not None:
                n, counted, path = found
                return DeclaredLimit(n, counted, f"{key}:{path}")
    return None


def _limit_inside(doc: dict[str, Any]) -> tuple[int, str, str] | None:
    """Breadth-first through nested objects: (limit, what counts, dotted path) or None."""
    level: list[tuple[str, dict[str, Any]]] = [("", doc)]
    for _ in range(MAX_JSON_DEPTH):
        deeper: list[tuple[str, dict[str, Any]]] = []
        for prefix, obj in level:
            for key, value in obj.items():
                counted = _counts_against(key, value)
                if counted is not None:
                    return value, counted, prefix + key
                if isinstance(value, dict):
                    deeper.append((f"{prefix}{key}.", value))
        level = deeper
    return None
