"""The generic fallback: what a span is by what it carries, for spans no profile's kind rule
matched (a framework nobody configured, a renamed span). Pure: the rule and its key tables;
both span paths apply it (streams/spanpath/normalize.py, native/src/normalize/fallback.rs)
and the differential test holds them to the same steps.

A span that is not the root and that no kind rule matched is

* a **model turn** when it carries a model, token or finish-reason attribute (`MODEL`:
  GenAI, OpenInference and OpenLLMetry keys, or any namespace's `<x>.request.model`,
  `<x>.usage.input_tokens`, `<x>.finish_reason`, ...);
* else a **tool call** when it carries a tool name (a non-empty string) under a tool key
  (`gen_ai.tool.name`, `tool.name`, or any namespace's `<x>.tool.name` / `<x>.tool_name` /
  `<x>.toolName`).

Its fields the profile did not read come from the same kind of keys: a tool's arguments and
result (`gen_ai.tool.call.arguments` / `.result`, `gen_ai.tool.input` / `.output`,
`input.value` / `output.value`, `<x>.tool.input` / `.output`, ..., camelCase layouts'
`<x>.args` / `<x>.arguments` and `<x>.result` / `<x>.output` under any prefix, and plain
`input` / `output` only when they hold a JSON object or array; the call id from
`<x>.tool.call.id`, `<x>.toolCallId`, ...), a model turn's tokens and model. Its
error comes from the span status and exception events, as for any tool. A key is looked for
among the exact keys first (in the order below), then among the span's attributes in their
order for the first one ending with a suffix. Never a span name: names are what differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from detectors.model import LLM, TOOL
from detectors.toolcall import as_json

LABEL = "generic-fallback"  # the rule label `loopwatch inspect` shows for these spans


@dataclass(frozen=True, slots=True)
class Keys:
    exact: tuple[str, ...]
    suffixes: tuple[str, ...] = ()
    json_only: tuple[str, ...] = ()  # keys read only when they hold a JSON object or array

    def as_data(self) -> dict[str, list[str]]:
        return {
            "exact": list(self.exact),
            "suffixes": list(self.suffixes),
            "json_only": list(self.json_only),
        }


MODEL = Keys(
    (
        "gen_ai.request.model",
        "gen_ai.response.model",
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens",
        "gen_ai.response.finish_reasons",
        "llm.model_name",
        "llm.request.model",
        "llm.response.model",
        "llm.token_count.prompt",
        "llm.token_count.completion",
        "llm.token_count.total",
        "llm.usage.total_tokens",
    ),
    (
        ".request.model",
        ".response.model",
        ".model_name",
        ".usage.input_tokens",
        ".usage.output_tokens",
        ".usage.prompt_tokens",
        ".usage.completion_tokens",
        ".usage.total_tokens",
        ".finish_reason",
        ".finish_reasons",
    ),
)
TOOL_NAME = Keys(
    ("gen_ai.tool.name", "tool.name"),
    (".tool.name", ".tool_name", ".toolName", ".toolCall.name", ".tool_call.name"),
)

# field -> where it is read from, per kind
FIELDS: dict[str, dict[str, Keys]] = {
    TOOL: {
        "tool_name": TOOL_NAME,
        "arguments": Keys(
            ("gen_ai.tool.call.arguments", "gen_ai.tool.input", "tool.parameters", "input.value"),
            # any prefix: <x>.tool.args, <x>.toolCall.args, <x>.tool.call.arguments, ...
            (".tool.input", ".toolCall.input", ".args", ".arguments"),
            ("input",),
        ),
        "result": Keys(
            ("gen_ai.tool.call.result", "gen_ai.tool.output", "output.value"),
            # any prefix: <x>.tool.result, <x>.toolCall.result, <x>.tool.output, ...
            (".result", ".output"),
            ("output",),
        ),
        "call_id": Keys(
            ("gen_ai.tool.call.id", "tool_call.id"),
            (".tool.call.id", ".tool_call_id", ".toolCallId", ".toolCall.id", ".tool_call.id"),
        ),
    },
    LLM: {
        "input_tokens": Keys(
            ("gen_ai.usage.input_tokens", "llm.token_count.prompt"),
            (".usage.input_tokens", ".usage.prompt_tokens"),
        ),
        "output_tokens": Keys(
            ("gen_ai.usage.output_tokens", "llm.token_count.completion"),
            (".usage.output_tokens", ".usage.completion_tokens"),
        ),
        "model": Keys(
            ("gen_ai.response.model", "gen_ai.request.model", "llm.model_name"),
            (".response.model", ".request.model", ".model_name"),
        ),
    },
}


def _usable(value: Any) -> bool:
    return value is not None and value != ""


def _is_json_container(value: Any) -> bool:
    if isinstance(value, dict | list):
        return True
    if not isinstance(value, str):
        return False
    return isinstance(as_json(value), dict | list)


def find(attrs: Mapping[str, Any], keys: Keys, strings_only: bool = False) -> str | None:
    """The attribute key `keys` reads from this span, or None."""

    def ok(value: Any) -> bool:
        return _usable(value) and (not strings_only or isinstance(value, str))

    for key in keys.exact:
        if key in attrs and ok(attrs[key]):
            return key
    for key in keys.json_only:
        if key in attrs and ok(attrs[key]) and _is_json_container(attrs[key]):
            return key
    if keys.suffixes:
        for key, value in attrs.items():
            if key.endswith(keys.suffixes) and ok(value):
                return key
    return None


def classify(attrs: Mapping[str, Any]) -> tuple[str, dict[str, str]] | None:
    """(kind, field -> attribute key) for a span no kind rule matched; None: still `other`."""
    if find(attrs, MODEL) is not None:
        kind = LLM
    elif find(attrs, TOOL_NAME, strings_only=True) is not None:
        kind = TOOL
    else:
        return None
    picks = {}
    for name, keys in FIELDS[kind].items():
        key = find(attrs, keys, strings_only=name == "tool_name")
        if key is not None:
            picks[name] = key
    return kind, picks


def spec() -> dict[str, Any]:
    """The rule's tables for the native span path."""
    return {
        "model": MODEL.as_data(),
        "fields": {
            kind: {name: keys.as_data() for name, keys in fields.items()}
            for kind, fields in FIELDS.items()
        },
    }
