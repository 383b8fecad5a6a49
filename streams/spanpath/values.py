"""Values read from span attributes: JSON text parsed, counts, identifiers and short codes
bounded, framework envelopes around tool arguments and results unwrapped. Nothing here keeps
a value: the callers reduce them to digests (streams/spanpath/normalize.py)."""

from __future__ import annotations

import zlib
from typing import Any

from detectors.toolcall import as_json

_MISSING = object()


def first(attrs: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = attrs.get(key, _MISSING)
        if value is not _MISSING and value is not None and value != "":
            return value
    return None


def as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


MAX_COUNT = (1 << 63) - 1
MAX_IDENT = 256


def as_count(value: Any) -> int:
    """A token count: an integer in [0, 2**63); anything else (negative, huge, junk) is 0."""
    n = as_int(value)
    return n if n is not None and 0 <= n <= MAX_COUNT else 0


def ident(value: Any) -> str:
    """A name or id as text, at most MAX_IDENT characters (longer ones keep a checksum)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= MAX_IDENT:
        return text
    crc = zlib.crc32(text.encode("utf-8", "replace"))
    return f"{text[: MAX_IDENT - 9]}~{crc:08x}"


_OLL_ENVELOPE_KEYS = frozenset({"inputs", "input_str", "tags", "metadata", "kwargs"})
_KWARGS_ENVELOPE_KEYS = frozenset({"args", "kwargs", "sanitize_inputs_outputs"})


def unwrap_arguments(args: Any) -> Any:
    # OpenLLMetry wraps tool inputs: {"input_str": "{'order_id': 'A12'}", "tags": [...],
    # "metadata": {...}, "inputs": {"order_id": "A12"}, "kwargs": {"tool_call_id": ...}}.
    if isinstance(args, dict) and args and set(args) <= _OLL_ENVELOPE_KEYS:
        if "inputs" in args:
            return as_json(args["inputs"])
        if "input_str" in args:
            return as_json(args["input_str"])
    # OpenInference (LlamaIndex): {"kwargs": {...}} (and "args": [] when there are none);
    # smolagents' Tool.__call__ adds its own flag, "sanitize_inputs_outputs".
    if (
        isinstance(args, dict)
        and isinstance(args.get("kwargs"), dict)
        and set(args) <= _KWARGS_ENVELOPE_KEYS
        and not args.get("args")
    ):
        return args["kwargs"]
    return args


def unwrap_result(result: Any) -> tuple[Any, Any, str | None]:
    """LangChain ToolMessage envelopes -> (the tool's own result as parsed, as sent, tool_call_id).

    Returns (result, None, None) when the result is not such an envelope.

    OpenInference: {"type": "tool", "data": {"content": "...", "tool_call_id": ...}}
    OpenLLMetry:   {"output": {"lc": 1, "id": [..., "ToolMessage"], "kwargs": {"content": ...}},
                    "kwargs": {...}}
    LlamaIndex:    {"blocks": [...], "tool_name": ..., "raw_input": ..., "raw_output": ...}
    """
    if isinstance(result, dict) and "output" in result and set(result) <= {"output", "kwargs"}:
        result = as_json(result["output"])
    if not isinstance(result, dict):
        return result, None, None
    if "raw_output" in result and "tool_name" in result and "raw_input" in result:
        # LlamaIndex ToolOutput: {"blocks"/"content", "tool_name", "raw_input", "raw_output"}
        own = result["raw_output"]
        return as_json(own), own if isinstance(own, str) else None, None
    inner = None
    if result.get("type") == "tool" and isinstance(result.get("data"), dict):
        inner = result["data"]
    elif result.get("lc") == 1 and isinstance(result.get("kwargs"), dict):
        ident = result.get("id")
        if isinstance(ident, list) and ident and ident[-1] == "ToolMessage":
            inner = result["kwargs"]
    if inner is None or "content" not in inner:
        return result, None, None
    call_id = inner.get("tool_call_id")
    content = inner["content"]
    return as_json(content), content, (str(call_id) if call_id else None)


def str_or_none(value: Any) -> str | None:
    if value is None or value == "":
        return None
    return ident(value)
