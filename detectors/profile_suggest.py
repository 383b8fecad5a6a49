"""A starter recognition profile from spans no profile recognized (`loopwatch inspect
--suggest-profile`). Pure: it sees span names, scopes, attribute keys and the kind of each
value, and whether a value equals a tool the policy declares; it never copies a value.

How the suggestion is read off the spans:
- `when`: the instrumentation scopes of the unrecognized spans (a profile that reads only
  them, so spans another profile reads are left alone); `extends: generic`.
- tool calls: a string attribute whose value is a declared tool name is the tool name key
  (`has: tool_name`); else a span name made of a fixed text and a declared tool name gives
  a name rule (`name_prefix` / `name_suffix`) and reads the tool name from the span name.
  On those spans, keys whose last part says input/arguments are the arguments, and
  output/result the result; a call-id key is the call id.
- model turns: integer keys that name input/prompt and output/completion tokens, and a
  finish-reason key (`has: [input_tokens, output_tokens]`).
Review it before use: it is read off one export, and says in comments what it matched.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MIN_AFFIX = 2  # a name rule needs a fixed text of at least this many characters


@dataclass
class Observed:
    """Unrecognized spans of one (scope, span name): how many, and per attribute key the
    kind of its value ('str', 'int', 'float', 'bool', 'json', 'other') and whether that
    value was a declared tool name."""

    scope: str
    name: str
    spans: int = 0
    kinds: dict[str, str] = field(default_factory=dict)
    tool_keys: set[str] = field(default_factory=set)


def value_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "json" if value.lstrip()[:1] in ("{", "[") else "str"
    return "other"


def observe(
    seen: dict[tuple[str, str], Observed],
    scope: str,
    name: str,
    attributes: Mapping[str, Any],
    tools: Iterable[str],
) -> None:
    """Add one unrecognized span to `seen`."""
    entry = seen.setdefault((scope, name), Observed(scope, name))
    entry.spans += 1
    declared = set(tools)
    for key, value in attributes.items():
        entry.kinds.setdefault(key, value_kind(value))
        if isinstance(value, str) and value in declared:
            entry.tool_keys.add(key)


def _last(key: str) -> str:
    """The key's last part, lowercase, without separators: 'acme.tool.callId' -> 'callid'."""
    part = re.split(r"[.:/]", key)[-1]
    return re.sub(r"[_\-]", "", part).lower()


ARGUMENT_PARTS = {"input", "inputs", "arguments", "args", "parameters", "params", "request"}
RESULT_PARTS = {"output", "outputs", "result", "results", "response", "return"}
CALL_ID_PARTS = {"callid", "toolcallid", "id"}


def _ranked(counter: Counter[str]) -> list[str]:
    return [key for key, _ in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))]


def _name_rule(names: list[str], tools: set[str]) -> tuple[str, str] | None:
    """('name_prefix', P) when the names are P + a declared tool, ('name_suffix', S) when
    they are a declared tool + S; None otherwise."""
    prefixes: Counter[str] = Counter()
    suffixes: Counter[str] = Counter()
    for name in names:
        for tool in tools:
            if name.endswith(tool) and len(name) - len(tool) >= MIN_AFFIX:
                prefixes[name[: -len(tool)]] += 1
            if name.startswith(tool) and len(name) - len(tool) >= MIN_AFFIX:
                suffixes[name[len(tool) :]] += 1
    best = max(
        [("name_prefix", p, n) for p, n in prefixes.items()]
        + [("name_suffix", s, n) for s, n in suffixes.items()],
        key=lambda t: (t[2], len(t[1])),
        default=None,
    )
    return None if best is None else (best[0], best[1])


def suggest(observed: Iterable[Observed], tools: Iterable[str]) -> dict[str, Any] | None:
    """The profile body for these spans, or None when nothing could be read off them."""
    spans = [o for o in observed if o.spans]
    if not spans:
        return None
    declared = set(tools)
    kinds: list[dict[str, Any]] = []
    fields: dict[str, list[Any]] = {}
    notes: list[str] = []

    tool_key_votes: Counter[str] = Counter()
    for o in spans:
        for key in o.tool_keys:
            tool_key_votes[key] += o.spans
    tool_spans: list[Observed]
    if tool_key_votes:
        keys = _ranked(tool_key_votes)
        fields["tool_name"] = list(keys)
        kinds.append({"kind": "tool", "match": {"has": "tool_name"}})
        tool_spans = [o for o in spans if o.tool_keys]
        notes.append(f"tool calls: spans carrying {', '.join(keys)}")
    else:
        rule = _name_rule([o.name for o in spans], declared)
        if rule is not None:
            how, text = rule
            kinds.append({"kind": "tool", "match": {how: text}})
            source = "name_after" if how == "name_prefix" else "name_before"
            fields["tool_name"] = [{source: text}]
            tool_spans = [
                o
                for o in spans
                if (o.name.startswith(text) if how == "name_prefix" else o.name.endswith(text))
            ]
            notes.append(f"tool calls: span names {how.replace('name_', '')} {text!r}")
        else:
            tool_spans = []

    arguments: Counter[str] = Counter()
    results: Counter[str] = Counter()
    call_ids: Counter[str] = Counter()
    for o in tool_spans:
        for key, kind in o.kinds.items():
            last = _last(key)
            if kind in ("json", "str") and last in ARGUMENT_PARTS:
                arguments[key] += o.spans
            elif kind in ("json", "str") and last in RESULT_PARTS:
                results[key] += o.spans
            elif kind in ("str", "int") and last in CALL_ID_PARTS and key not in o.tool_keys:
                call_ids[key] += o.spans
    if arguments:
        fields["arguments"] = _ranked(arguments)
    if results:
        fields["result"] = _ranked(results)
    if call_ids:
        fields["call_id"] = _ranked(call_ids)

    inputs: Counter[str] = Counter()
    outputs: Counter[str] = Counter()
    finish: Counter[str] = Counter()
    tool_ids = {id(o) for o in tool_spans}
    for o in spans:
        if id(o) in tool_ids:
            continue
        for key, kind in o.kinds.items():
            low = key.lower()
            if kind == "int" and "token" in low:
                if "input" in low or "prompt" in low:
                    inputs[key] += o.spans
                elif "output" in low or "completion" in low:
                    outputs[key] += o.spans
            elif "finish" in low and "reason" in low:
                finish[key] += o.spans
    if inputs or outputs:
        if inputs:
            fields["input_tokens"] = _ranked(inputs)
        if outputs:
            fields["output_tokens"] = _ranked(outputs)
        has = [f for f in ("input_tokens", "output_tokens") if f in fields]
        kinds.append({"kind": "llm", "match": {"has": has if len(has) > 1 else has[0]}})
        notes.append(f"model turns: spans carrying {', '.join(_ranked(inputs + outputs))}")
    if finish:
        fields["finish_reason"] = _ranked(finish)

    if not kinds:
        return None
    scopes: Counter[str] = Counter()
    for o in spans:
        if o.scope:
            scopes[o.scope] += o.spans
    body: dict[str, Any] = {
        "description": "suggested by loopwatch inspect --suggest-profile; "
        + "; ".join(notes)
        + ". Review before use."
    }
    if scopes:
        body["when"] = {"scope": _ranked(scopes)}
    body["extends"] = "generic"
    body["kinds"] = kinds
    body["fields"] = fields
    return body


def profile_name(observed: Iterable[Observed]) -> str:
    """A name from the most common scope's first part ('acme.agentkit' -> 'acme_suggested':
    never a built-in profile's name, which it would replace)."""
    scopes: Counter[str] = Counter()
    for o in observed:
        if o.scope:
            scopes[o.scope] += o.spans
    if not scopes:
        return "suggested"
    first = re.split(r"[.:/\s]", _ranked(scopes)[0])[0].lower()
    name = re.sub(r"[^a-z0-9_]", "_", first).strip("_")
    return f"{name}_suggested" if name else "suggested"
