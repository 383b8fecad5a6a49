"""Tool and handoff steps: names, call ids, arguments and results reduced to digests
(native: normalize/tool.rs)."""

from __future__ import annotations

from typing import Any

from detectors.model import Step
from detectors.policy import Policy
from detectors.toolcall import CallReducer, as_json
from streams.spanpath.error_codes import ErrorCodes
from streams.spanpath.spans import SpanRecord
from streams.spanpath.values import ident, str_or_none, unwrap_arguments, unwrap_result
from streams.spanpath.view import Facts, ResourceInfo, View


class Tool(View):
    """The Normalizer's tool and handoff steps (it sets `policy`, `_errors`, `_calls`)."""

    policy: Policy
    _errors: ErrorCodes
    _calls: CallReducer

    def _fill_tool(
        self, step: Step, span: SpanRecord, v: dict[str, Any], res: ResourceInfo, facts: Facts
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

    def _fill_handoff(self, step: Step, span: SpanRecord, v: dict[str, Any], facts: Facts) -> None:
        profile = facts.profile
        raw_args = self._field(profile, "arguments", facts)
        args = unwrap_arguments(as_json(raw_args)) if raw_args is not None else None
        to_agent = self._field(profile, "handoff_to", facts, args)
        from_agent = self._field(profile, "handoff_from", facts, args)
        step.to_agent = str_or_none(to_agent)
        step.from_agent = str_or_none(from_agent)
        step.name = f"{step.from_agent or '?'}->{step.to_agent or '?'}"
        step.call_id = str_or_none(v.get("call_id"))
