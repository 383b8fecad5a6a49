"""Span → Step: the attribute conventions of docs/CONTRACTS.md §2 as data, plus the tool contract.

The recognition profiles (detectors/recognition.py) say which spans are tools, model calls,
agents, handoffs, plans or summaries, and which attributes hold their fields. `Normalizer`
is split as the native one is (native/src/normalize/): `View` (view.py) reads a span's view
through them and classifies it, this module assembles the Step (step.rs), `Tool` (tool.py)
fills tool and handoff steps with the tool contract and error codes (error_codes.py),
`Terminations` (termination.py) roots and agents; requested calls are calls.py. Raw
arguments and results are parsed there, reduced to keyed digests and a few declared
fields, and dropped: nothing customer-provided leaves the span path except as a digest.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

from detectors.contract import plan_fp
from detectors.fingerprint import Fingerprinter
from detectors.model import AGENT, HANDOFF, LLM, PLAN, TOOL, Step
from detectors.policy import Policy
from detectors.recognition import Profile
from detectors.toolcall import CallReducer, as_json
from streams.spanpath import fallback
from streams.spanpath.calls import last_input_message, plan_calls, requested_calls
from streams.spanpath.error_codes import ErrorCodes
from streams.spanpath.spans import STATUS_ERROR, SpanRecord
from streams.spanpath.termination import Terminations, denied_calls
from streams.spanpath.tool import Tool
from streams.spanpath.values import as_count, as_int, ident, str_or_none
from streams.spanpath.view import Facts, ResourceInfo, View

# Finish reasons of a model turn that asked for tool calls (OpenAI, Vercel, pydantic-ai,
# Anthropic/Bedrock spellings).
TOOL_CALL_FINISH_REASONS = frozenset(
    {"tool_calls", "tool-calls", "tool_call", "tool_use", "function_call"}
)
# A span ending more than a day after the wall clock is a broken clock or forged input:
# it would drag replay's watermark (and every run's lateness and finalization) with it.
MAX_FUTURE_NS = 24 * 3600 * 10**9
# What Normalizer.step raises for a span it cannot map (the caller counts and skips it).
STEP_ERRORS = (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError)


class Normalizer(Tool, Terminations):
    """Maps decoded spans to Steps under one policy and one fingerprint key.

    Which spans are tools, model calls, agents, handoffs, plans or summaries, and which
    attributes hold their fields, is the policy's recognition profiles (data:
    detectors/profiles.yaml and the policy's `profiles:`); this class applies them.
    """

    def __init__(self, policy: Policy, fingerprinter: Fingerprinter) -> None:
        View.__init__(self, policy)
        self.policy = policy
        self.fp = fingerprinter
        self._sequence = policy.sequence_attributes
        self._errors = ErrorCodes(policy)
        self._calls = CallReducer(policy, fingerprinter)
        self._sketch = self._calls.sketch
        similarity = policy.similarity
        self._turn_sketches = similarity.enabled and similarity.model_turns

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
        facts = Facts(self, span, v, profile)
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
