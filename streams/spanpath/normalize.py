"""Span → Step: the attribute conventions of docs/CONTRACTS.md §2 as data, plus the tool contract.

The recognition profiles (detectors/recognition.py) say which spans are tools, model calls,
agents, handoffs, plans or summaries, and which attributes hold their fields; `Normalizer`
reads a span's view through them, classifies it and assembles its Step, with the tool
contract (contract.py), error codes (error_codes.py), requested calls (calls.py) and
termination (termination.py). Raw arguments and results are parsed here, reduced to keyed
digests and a few declared fields, and dropped: nothing customer-provided leaves the span
path except as a digest.
"""

from __future__ import annotations

import time
import zlib
from typing import Any, NamedTuple

from detectors.contract import plan_fp
from detectors.fingerprint import Fingerprinter
from detectors.model import AGENT, HANDOFF, LLM, OTHER, PLAN, TOOL, Step
from detectors.policy import Policy
from detectors.recognition import Profile, Source, SpanFacts
from detectors.toolcall import CallReducer, as_json
from streams.spanpath import fallback
from streams.spanpath.calls import last_input_message, plan_calls, requested_calls
from streams.spanpath.error_codes import ErrorCodes
from streams.spanpath.limits import declared_limit
from streams.spanpath.runkey import common_fields, run_keys
from streams.spanpath.spans import STATUS_ERROR, SpanRecord
from streams.spanpath.termination import denied_calls, termination_reason
from streams.spanpath.values import (
    as_count,
    as_int,
    first,
    ident,
    str_or_none,
    unwrap_arguments,
    unwrap_result,
)

# Finish reasons of a model turn that asked for tool calls (OpenAI, Vercel, pydantic-ai,
# Anthropic/Bedrock spellings).
TOOL_CALL_FINISH_REASONS = frozenset(
    {"tool_calls", "tool-calls", "tool_call", "tool_use", "function_call"}
)
# A span ending more than a day after the wall clock is a broken clock or forged input:
# it would drag replay's watermark (and every run's lateness and finalization) with it.
MAX_FUTURE_NS = 24 * 3600 * 10**9
# Attribute key sets remembered by Normalizer._view (instrumentations send a few each).
MAX_PLANS = 1024
MAX_KIND_MEMO = 256  # kinds remembered: a few names and tools per instrumentation

# What Normalizer.step raises for a span it cannot map (the caller counts and skips it).
STEP_ERRORS = (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError)

# A span's plan: field -> its attribute keys present, in rank order.
_Plan = tuple[tuple[str, tuple[str, ...]], ...]


class _Facts(SpanFacts):
    """A span as the recognition matchers see it; the tool name is resolved once, on
    first use (most rules never ask)."""

    __slots__ = ("span", "profile", "_normalizer", "_tool")

    def __init__(
        self, normalizer: Normalizer, span: SpanRecord, view: dict[str, Any], profile: Profile
    ) -> None:
        # (SpanFacts.__init__ inlined: one object per span on the hot path)
        self.name = span.name
        self.root = span.parent_span_id is None
        self.attrs = span.attributes
        self.view = view
        self.span = span
        self.profile = profile
        self._normalizer = normalizer
        self._tool: str | None = None

    def tool_name(self) -> str:
        if self._tool is None:
            self._tool = self._normalizer._tool_name_of(self)
        return self._tool


def _derive(source: Source, facts: _Facts, args: Any) -> Any:
    """The value of one derived field source for this span, or None."""
    if source.when is not None and not source.when(facts):
        return None
    if source.attribute is not None:
        if source.event is None:
            value = facts.attrs.get(source.attribute)
        else:
            value = next(
                (
                    e.attributes.get(source.attribute)
                    for e in facts.span.events
                    if e.name == source.event and source.attribute in e.attributes
                ),
                None,
            )
        if value is None:
            return None
        if source.plain:
            if not isinstance(value, str) or value[:1] in "{[":
                return None
            return value
        for key in source.path:
            value = as_json(value)
            if isinstance(value, dict):
                value = value.get(key)
            elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
                value = value[int(key)]
            else:
                return None
        return value
    name = facts.name
    if source.name_after is not None:
        return name[len(source.name_after) :] if name.startswith(source.name_after) else None
    if source.name_before is not None:
        return name[: -len(source.name_before)] if name.endswith(source.name_before) else None
    if source.span_name:
        return name
    if source.argument is not None:
        return args.get(source.argument) if isinstance(args, dict) else None
    if source.tool_name_after is not None:
        tool = facts.tool_name()
        prefix = source.tool_name_after
        return tool[len(prefix) :] if tool.startswith(prefix) else None
    return None


class ResourceInfo(NamedTuple):
    """What a span's steps take from its resource (native: `Res`, normalize/mod.rs)."""

    resource: dict[str, Any]
    service: str | None
    prompt_version: str | None
    tool_version: str | None
    task_type: str | None
    run_key: Any


class Normalizer:
    """Maps decoded spans to Steps under one policy and one fingerprint key.

    Which spans are tools, model calls, agents, handoffs, plans or summaries, and which
    attributes hold their fields, is the policy's recognition profiles (data:
    detectors/profiles.yaml and the policy's `profiles:`); this class applies them.
    """

    def __init__(self, policy: Policy, fingerprinter: Fingerprinter) -> None:
        self.policy = policy
        self.fp = fingerprinter
        c = policy.conventions
        self._resource_prompt_version = c["resource_prompt_version"]
        self._resource_tool_version = c["resource_tool_version"]
        self._sequence = policy.sequence_attributes
        self._task_attr = policy.task_type_attribute
        self._run_keys = run_keys(policy)
        self._profiles = policy.profiles
        self._errors = ErrorCodes(policy)
        self._calls = CallReducer(policy, fingerprinter)
        self._sketch = self._calls.sketch
        similarity = policy.similarity
        self._turn_sketches = similarity.enabled and similarity.model_turns
        common = common_fields(policy)  # fields every profile reads the same way
        # One pass over a span's attributes finds every field (first key wins), per
        # profile: attribute key -> [(field, rank)].
        self._keymaps: dict[str, dict[str, list[tuple[str, int]]]] = {}
        for profile in self._profiles:
            keymap: dict[str, list[tuple[str, int]]] = {}
            for name, keys in (*profile.keys.items(), *common.items()):
                for rank, key in enumerate(keys):
                    keymap.setdefault(key, []).append((name, rank))
            self._keymaps[profile.name] = keymap
        self._resources: dict[int, ResourceInfo] = {}
        self._plans: dict[tuple[str, tuple[str, ...]], tuple[Profile, _Plan]] = {}
        self._kinds: dict[tuple[Any, ...], tuple[str, str | None]] = {}

    # ------------------------------------------------------------------ public

    def run_id(self, span: SpanRecord) -> str:
        _, v = self._read(span)
        return self._run_id(span, v, self._resource(span.resource))

    def profile_of(self, span: SpanRecord) -> Profile:
        """The recognition profile that reads this span."""
        return self._read(span)[0]

    def _run_id(self, span: SpanRecord, v: dict[str, Any], res: ResourceInfo) -> str:
        if self._run_keys is not None:
            value = v.get("run_key")
            if value is None:
                value = res.run_key
            if value is not None:
                return ident(value)
        return span.trace_id

    def _read(self, span: SpanRecord) -> tuple[Profile, dict[str, Any]]:
        """The span's profile, and field -> value of its first attribute key present and
        not empty (attribute sources only; derived sources are read where needed)."""
        attrs = span.attributes
        cache_key = (span.scope_name, tuple(attrs))
        found = self._plans.get(cache_key)
        if found is None:
            found = self._plan(*cache_key)
        profile, plan = found
        view: dict[str, Any] = {}
        for name, candidates in plan:
            for key in candidates:
                value = attrs[key]
                if value is not None and value != "":
                    view[name] = value
                    break
        return profile, view

    def _plan(self, scope: str, keys: tuple[str, ...]) -> tuple[Profile, _Plan]:
        # Spans of one instrumentation share their scope and attribute keys: which profile
        # reads them, which fields they can fill and from which keys in rank order is
        # worked out once per (scope, key set).
        profile = next(p for p in self._profiles if p.applies(scope, keys))
        keymap = self._keymaps[profile.name]
        ranked: dict[str, list[tuple[int, str]]] = {}
        for key in keys:
            for name, rank in keymap.get(key, ()):
                ranked.setdefault(name, []).append((rank, key))
        plan = tuple((name, tuple(key for _, key in sorted(hits))) for name, hits in ranked.items())
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[(scope, keys)] = (profile, plan)
        return profile, plan

    def _resource(self, resource: dict[str, Any]) -> ResourceInfo:
        """What the steps take from the span's resource, cached: every span of one
        ResourceSpans shares its resource dict."""
        cached = self._resources.get(id(resource))
        if cached is not None and cached.resource is resource:
            return cached
        if len(self._resources) > 4096:
            self._resources.clear()
        info = ResourceInfo(
            resource,
            str_or_none(resource.get("service.name")),
            str_or_none(first(resource, self._resource_prompt_version)),
            str_or_none(first(resource, self._resource_tool_version)),
            str_or_none(resource.get(self._task_attr)) if self._task_attr else None,
            first(resource, self._run_keys) if self._run_keys else None,
        )
        self._resources[id(resource)] = info
        return info

    def step(self, span: SpanRecord) -> Step:
        """The span as a Step; raises one of STEP_ERRORS for a span that cannot be one."""
        return self._step(span)[0]

    def explain(self, span: SpanRecord) -> tuple[Step, Profile, str | None]:
        """The step, the profile that read the span and the label of the kind rule that
        matched (None: no rule, the span is `other`). For `loopwatch inspect`."""
        return self._step(span)

    def _step(self, span: SpanRecord) -> tuple[Step, Profile, str | None]:
        if span.end_ns > time.time_ns() + MAX_FUTURE_NS:
            raise ValueError("span ends more than a day in the future")
        profile, v = self._read(span)
        res = self._resource(span.resource)
        facts = _Facts(self, span, v, profile)
        kind, rule = self._classify(profile, facts)
        if rule is None and span.parent_span_id is not None:  # no kind rule matched
            found = fallback.classify(span.attributes)
            if found is not None:  # a framework nobody configured: read by meaning
                kind, rule = found[0], fallback.LABEL
                for name, key in found[1].items():
                    v.setdefault(name, span.attributes[key])
                facts._tool = None
        step = Step(
            self._run_id(span, v, res),
            span.trace_id,
            span.span_id,
            span.parent_span_id,
            kind,
            span.start_ns,
            span.end_ns,
            self._sequence_of(v),
            self._content_digest(span, v),
        )
        step.is_root = span.parent_span_id is None
        step.status_error = span.status_code == STATUS_ERROR
        if span.events:
            step.denied_calls = denied_calls(span)
        step.service_name = res.service
        derived = profile.derived
        prompt_version = v.get("prompt_version")
        if prompt_version is None and "prompt_version" in derived:
            prompt_version = self._field(profile, "prompt_version", facts)
        step.prompt_version = (
            ident(prompt_version) if prompt_version is not None else res.prompt_version
        )
        agent = v.get("agent_name")
        if agent is None and "agent_name" in derived:
            agent = self._field(profile, "agent_name", facts)
        step.agent_name = str_or_none(agent)
        step.session_id = str_or_none(v.get("conversation"))
        task_type = v.get("task_type")
        step.task_type = ident(task_type) if task_type is not None else res.task_type
        if "input_tokens" in v:
            step.input_tokens = as_count(v["input_tokens"])
        if "output_tokens" in v:
            step.output_tokens = as_count(v["output_tokens"])

        if kind == TOOL:
            self._fill_tool(step, span, v, res, facts)
        elif kind == HANDOFF:
            self._fill_handoff(step, span, v, facts)
        elif kind == PLAN:
            step.plan_fp = plan_fp(self.fp, self.policy, plan_calls(as_json(v.get("plan_steps"))))
        elif kind == LLM:
            calls = requested_calls(span.attributes, v, profile, facts)
            if len(calls) >= 2:  # a single requested call is an action, not a plan
                step.plan_fp = plan_fp(self.fp, self.policy, calls)
            step.model = str_or_none(v.get("model"))
            finish = self._field(profile, "finish_reason", facts)
            if isinstance(finish, list):
                finish = finish[-1] if finish else None
            step.wants_tools = bool(calls) or (
                isinstance(finish, str) and finish.lower() in TOOL_CALL_FINISH_REASONS
            )
            if self._turn_sketches:
                output = v.get("model_output")
                if output is not None:
                    step.action_sketch = self._sketch.of_value(as_json(output))
                observation = last_input_message(span.attributes, v.get("model_input"))
                if observation is not None:
                    step.result_sketch = self._sketch.of_value(as_json(observation))
        if step.is_root or kind == AGENT:
            self._fill_termination(step, span, v, profile, facts)
        return step, profile, rule

    # ------------------------------------------------------------------ classification

    def _classify(self, profile: Profile, facts: _Facts) -> tuple[str, str | None]:
        key: tuple[Any, ...] | None = None
        if profile.memoizable:
            view, attrs = facts.view, facts.attrs
            key = (
                profile.name,
                facts.name,
                facts.root,
                *[view.get(f) for f in profile.memo_fields],
                *[attrs.get(a) for a in profile.memo_attributes],
            )
            try:
                found = self._kinds.get(key)
            except TypeError:  # an unhashable value (a list attribute): no memo
                key, found = None, None
            if found is not None:
                return found
        found = (OTHER, None)
        for rule in profile.kinds:
            if rule.match(facts):
                found = (rule.kind, rule.label)
                break
        if key is not None:
            if len(self._kinds) >= MAX_KIND_MEMO:
                self._kinds.clear()
            self._kinds[key] = found
        return found

    def _field(self, profile: Profile, name: str, facts: _Facts, args: Any = None) -> Any:
        """A field from its attribute keys, else from its derived sources (in order)."""
        value = facts.view.get(name)
        if value is not None:
            return value
        for source in profile.derived.get(name, ()):
            value = _derive(source, facts, args)
            if value is not None and value != "":
                return value
        return None

    def _tool_name_of(self, facts: _Facts) -> str:
        name = self._field(facts.profile, "tool_name", facts)
        return ident(name if name is not None else facts.name)

    def _sequence_of(self, v: dict[str, Any]) -> int | None:
        if "sequence" in v:
            seq = as_int(v["sequence"])
            if seq is not None:
                return seq
        meta = v.get("metadata")
        if meta is not None:
            meta = as_json(meta)
            if isinstance(meta, dict):
                for key in self._sequence:
                    if key in meta:
                        seq = as_int(meta[key])
                        if seq is not None:
                            return seq
        return None

    # ------------------------------------------------------------------ tools

    def _fill_tool(
        self, step: Step, span: SpanRecord, v: dict[str, Any], res: ResourceInfo, facts: _Facts
    ) -> None:
        tool = facts.tool_name()
        contract = self.policy.tools.get(tool)
        step.name = tool
        step.call_id = str_or_none(v.get("call_id"))
        tool_version = v.get("tool_version")
        step.tool_version = ident(tool_version) if tool_version is not None else res.tool_version
        profile = facts.profile
        raw_args = self._field(profile, "arguments", facts)
        wrapped = as_json(raw_args) if raw_args is not None else {}
        args = unwrap_arguments(wrapped)
        if step.call_id is None and args is not wrapped and isinstance(wrapped, dict):
            kw = wrapped.get("kwargs")
            if isinstance(kw, dict) and kw.get("tool_call_id"):
                step.call_id = str(kw["tool_call_id"])
        if not isinstance(args, dict):
            # A bare string/number input is the single argument. OpenInference's LangChain
            # instrumentation records a one-argument call as just its value ("A12"): under
            # a contract it is the first identity argument.
            single = contract.identity[0] if contract and contract.identity else "input"
            args = {single: args}
        raw_result = self._field(profile, "result", facts)
        has_result = raw_result is not None
        result = None
        if has_result:
            result, sent, envelope_call_id = unwrap_result(as_json(raw_result))
            if sent is not None:
                raw_result = sent  # digest the tool's own result, not the framework envelope
            if step.call_id is None:
                step.call_id = envelope_call_id
        code = self._errors.code(
            span,
            self._field(profile, "error_type", facts),
            result,
            lambda: self._field(profile, "error_message", facts),
        )
        self._calls.reduce(
            step, tool, args, has_result=has_result, result=result, raw_result=raw_result, code=code
        )

    # ------------------------------------------------------------------ handoffs, plans

    def _fill_handoff(self, step: Step, span: SpanRecord, v: dict[str, Any], facts: _Facts) -> None:
        profile = facts.profile
        raw_args = self._field(profile, "arguments", facts)
        args = unwrap_arguments(as_json(raw_args)) if raw_args is not None else None
        to_agent = self._field(profile, "handoff_to", facts, args)
        from_agent = self._field(profile, "handoff_from", facts, args)
        step.to_agent = str_or_none(to_agent)
        step.from_agent = str_or_none(from_agent)
        step.name = f"{step.from_agent or '?'}->{step.to_agent or '?'}"
        step.call_id = str_or_none(v.get("call_id"))

    # ------------------------------------------------------------------ termination

    def _fill_termination(
        self, step: Step, span: SpanRecord, v: dict[str, Any], profile: Profile, facts: _Facts
    ) -> None:
        if step.kind == OTHER and not step.is_root:
            return
        if step.kind == OTHER:
            step.kind = AGENT  # the root of a run: carries termination, not an action
        step.name = step.agent_name or ident(span.name)
        limit = declared_limit(span.attributes)
        if limit is not None:
            step.step_limit, step.limit_counts = limit.limit, limit.counts
        # None: nothing said why; the pipeline decides at finalization (inferred from the run,
        # or the default for a root that ended OK / failed), and says which in the summary.
        step.termination = termination_reason(
            step,
            span,
            v.get("error_type"),
            profile.termination,
            lambda: self._field(profile, "finish_reason", facts),
        )

    @staticmethod
    def _content_digest(span: SpanRecord, v: dict[str, Any]) -> str:
        # Only compared for the same span id, to tell a telemetry duplicate from an integrity
        # conflict: a CRC over the span's identity, timing, status and payload (stable across
        # processes, unlike hash()).
        text = repr(
            (
                span.name,
                span.start_ns,
                span.end_ns,
                span.status_code,
                span.parent_span_id,
                len(span.attributes),
                v.get("arguments"),
                v.get("result"),
                v.get("input_tokens"),
                v.get("output_tokens"),
            )
        )
        return f"{zlib.crc32(text.encode('utf-8', 'replace')):08x}"
