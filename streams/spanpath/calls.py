"""The tool calls a model turn requested and the steps a plan lists, in the spellings the
frameworks use (OTel GenAI messages, OpenInference's flat attributes, call lists), and the
fixed text an agent that ran out of steps ends with."""

from __future__ import annotations

import re
from typing import Any

from detectors.recognition import Profile, SpanFacts
from detectors.toolcall import as_json


def requested_calls(
    attrs: dict[str, Any], v: dict[str, Any], profile: Profile, facts: SpanFacts
) -> list[tuple[str, Any]]:
    """The tool calls one model turn requested, in order."""
    raw = v.get("output_messages")
    if raw is not None:
        return genai_message_calls(as_json(raw))
    for source in profile.derived.get("requested_calls", ()):
        if source.when is not None and not source.when(facts):
            continue
        key = source.attribute or ""
        if source.format == "openinference_flat":
            calls = flat_calls(attrs, key)
        elif key in attrs:
            value = as_json(attrs[key])
            calls = (
                genai_message_calls(value)
                if source.format == "genai_messages"
                else call_list(value)
            )
        else:
            continue
        if calls:
            return calls
    return []


def genai_message_calls(messages: Any) -> list[tuple[str, Any]]:
    """GenAI `gen_ai.output.messages`: [{"parts": [{"type": "tool_call", "name", "arguments"}]}]."""
    calls: list[tuple[str, Any]] = []
    if isinstance(messages, list):
        for message in messages:
            parts = message.get("parts") if isinstance(message, dict) else None
            for part in parts if isinstance(parts, list) else ():
                if isinstance(part, dict) and part.get("type") == "tool_call":
                    calls.append((str(part.get("name")), as_json(part.get("arguments"))))
    return calls


def flat_calls(attrs: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """OpenInference flattens: <prefix>N.tool_call.function.{name,arguments}."""
    calls: list[tuple[str, Any]] = []
    index = 0
    while True:
        name = attrs.get(f"{prefix}{index}.tool_call.function.name")
        if name is None:
            return calls
        args = attrs.get(f"{prefix}{index}.tool_call.function.arguments")
        calls.append((str(name), as_json(args)))
        index += 1


_CALL_NAME_KEYS = ("toolName", "tool_name", "name", "function")
_CALL_ARGS_KEYS = ("input", "args", "arguments", "parameters")


def call_list(value: Any) -> list[tuple[str, Any]]:
    """A JSON list of calls: [{"toolName"|"name"|"function": ..., "input"|"args"|...}]
    (an OpenAI-style {"function": {"name", "arguments"}} entry too)."""
    calls: list[tuple[str, Any]] = []
    if not isinstance(value, list):
        return calls
    for item in value:
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("function"), dict):
            item = item["function"]
        name = next((item[k] for k in _CALL_NAME_KEYS if isinstance(item.get(k), str)), None)
        if name is None:
            continue
        args = next((item[k] for k in _CALL_ARGS_KEYS if k in item), None)
        calls.append((name, as_json(args)))
    return calls


def plan_calls(raw: Any) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict):
                tool = item.get("tool") or item.get("name")
                calls.append((str(tool), as_json(item.get("arguments", item.get("args")))))
            else:
                calls.append((str(item), None))
    return calls


# Flat message lists: OpenInference's llm.input_messages.N.message.content, OpenLLMetry's
# gen_ai.prompt.N.content.
_FLAT_INPUT = re.compile(
    r"(?:llm\.input_messages\.([0-9]+)\.message|gen_ai\.prompt\.([0-9]+))\.content"
)


def last_input_message(attrs: dict[str, Any], raw: Any) -> Any:
    """The last message a model turn read (the observation of the previous turn's action):
    the last of a JSON messages list (or of an object's `messages`), else the flat message
    of the highest index. None otherwise: a prompt that is not a list of messages is the
    whole history, not one observation."""
    if raw is not None:
        doc = as_json(raw)
        if isinstance(doc, dict):
            doc = doc.get("messages")
        if isinstance(doc, list) and doc:
            return doc[-1]
    last, found = -1, None
    for key in attrs:
        if key.startswith(("llm.input_messages.", "gen_ai.prompt.")):
            match = _FLAT_INPUT.fullmatch(key)
            if match is None:
                continue
            index = match[1] or match[2]
            if len(index) < 10 and int(index) > last:
                last, found = int(index), attrs[key]
    return found
