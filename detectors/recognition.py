"""Span recognition as data: which spans are tool calls, model calls, agents, handoffs,
plans or summaries, and where each step field is, per instrumentation *profile*.

Profiles are YAML (the built-ins in detectors/profiles.yaml; a policy file adds or
replaces them under `profiles:`), compiled into small matcher trees by
detectors/profile_compiler.py.
Pure: streams/spanpath/normalize.py applies a compiled profile to each decoded span.

A profile:

    when:    {scope: [...], scope_prefix: [...], has_attribute: [...]}   # which spans it reads
    extends: generic            # inherit the parent's rules (after ours), fields we don't list,
                                # and termination entries (after ours)
    kinds:                      # first matching rule wins; no match: "other"
      - {kind: tool, match: {name: ai.toolCall}}
    fields:                     # per step field: attribute keys (first present wins), then
      tool_name: [ai.toolCall.name, {name_after: "execute_tool "}]   # derived sources
    termination: {exception_types: {...}, message_patterns: {...}, finish_reasons: {...}}

Profiles are tried in order; the first whose `when` holds reads the span (a profile with
no `when` reads every span: the built-in `generic` one is last).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .model import AGENT, HANDOFF, LLM, OTHER, PLAN, SUMMARY, TOOL

# `other` in a kind rule: the span is deliberately no step (and the generic fallback,
# streams/spanpath/fallback.py, leaves it alone), e.g. a wrapper around a model turn
KINDS = (TOOL, LLM, AGENT, HANDOFF, PLAN, SUMMARY, OTHER)

# Step fields read from span attributes (docs/CONTRACTS.md §2).
FIELDS = (
    "operation",
    "span_kind",
    "tool_name",
    "call_id",
    "arguments",
    "result",
    "error_type",
    "error_message",
    "prompt_version",
    "tool_version",
    "agent_name",
    "conversation",
    "input_tokens",
    "output_tokens",
    "handoff_from",
    "handoff_to",
    "plan_steps",
    "output_messages",
    "requested_calls",
    "finish_reason",
    "metadata",
    "model",  # the model a model turn ran on: prices (policy `prices:`)
    # a model turn's output (its action) and input (the last message: the observation of the
    # previous action), read only for similarity sketches (detectors/sketch.py)
    "model_output",
    "model_input",
)


class SpanFacts:
    """What a matcher can look at: the span's name, root-ness, raw attributes, its
    recognized field values (attribute sources only) and its tool name (computed on
    demand by the normalizer, which subclasses this)."""

    __slots__ = ("name", "root", "attrs", "view")

    def __init__(
        self, name: str, root: bool, attrs: Mapping[str, Any], view: Mapping[str, Any]
    ) -> None:
        self.name = name
        self.root = root
        self.attrs = attrs
        self.view = view

    def tool_name(self) -> str:
        return self.name


Matcher = Callable[[SpanFacts], bool]


@dataclass(slots=True)
class Refs:
    """What a profile's kind rules look at: which spans share a classification (a memo key)."""

    fields: set[str] = field(default_factory=set)
    attributes: set[str] = field(default_factory=set)
    tool: bool = False


@dataclass(frozen=True, slots=True)
class KindRule:
    kind: str
    match: Matcher
    label: str  # "<profile>#<index>" or the rule's id, for `loopwatch inspect`
    data: Any = None  # the match conditions as plain data (matcher_data), for native code


@dataclass(frozen=True, slots=True)
class Source:
    """A derived field source (not a plain attribute key)."""

    attribute: str | None = None
    event: str | None = None  # read `attribute` from the span's first event of this name
    path: tuple[str, ...] = ()
    plain: bool = False  # only a value that is not JSON (an agent name, not an object)
    format: str | None = None  # requested_calls: how the attribute lists calls
    name_after: str | None = None
    name_before: str | None = None
    span_name: bool = False
    argument: str | None = None
    tool_name_after: str | None = None
    when: Matcher | None = None
    when_data: Any = None  # `when` as plain data (matcher_data)


@dataclass(frozen=True, slots=True)
class Termination:
    exception_types: dict[str, str] = field(default_factory=dict)
    message_patterns: tuple[tuple[re.Pattern[str], str], ...] = ()
    finish_reasons: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    scopes: frozenset[str] = frozenset()
    scope_prefixes: tuple[str, ...] = ()
    has_attributes: tuple[str, ...] = ()
    kinds: tuple[KindRule, ...] = ()
    keys: dict[str, tuple[str, ...]] = field(default_factory=dict)  # field -> attribute keys
    derived: dict[str, tuple[Source, ...]] = field(default_factory=dict)
    termination: Termination = field(default_factory=Termination)
    # What the kind rules look at, so spans alike in these share one classification (the
    # normalizer memoizes it): the span name, root-ness, these fields and attributes.
    memo_fields: tuple[str, ...] = ()
    memo_attributes: tuple[str, ...] = ()
    memoizable: bool = False

    @property
    def reads_everything(self) -> bool:
        return not (self.scopes or self.scope_prefixes or self.has_attributes)

    def applies(self, scope: str, keys: Any) -> bool:
        """Whether this profile reads spans of this scope with these attribute keys."""
        if self.reads_everything:
            return True
        if self.scopes and scope in self.scopes:
            return True
        if self.scope_prefixes and scope.startswith(self.scope_prefixes):
            return True
        return any(k in keys for k in self.has_attributes)
