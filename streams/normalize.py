"""Span → Step: the attribute conventions of contracts.md §2 as data, plus the tool contract.

Raw arguments and results are parsed here, reduced to keyed digests and a few declared
fields, and dropped: nothing customer-provided leaves this module except as a digest.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from detectors.fingerprint import Fingerprinter
from detectors.model import AGENT, HANDOFF, LLM, OTHER, PLAN, SUMMARY, TOOL, Step
from detectors.policy import Policy, ToolContract
from streams.spans import STATUS_ERROR, SpanRecord

MAX_ITEMS = 64
MAX_CODE_LEN = 64
_LLM_OPERATIONS = frozenset({"chat", "text_completion", "generate_content", "completion"})
_AGENT_OPERATIONS = frozenset({"invoke_agent", "create_agent"})
_MISSING = object()


def _first(attrs: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = attrs.get(key, _MISSING)
        if value is not _MISSING and value is not None and value != "":
            return value
    return None


def _as_json(value: Any) -> Any:
    """Parse a JSON string; other values (already structured, or not JSON) are returned as is."""
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return value.hex()
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in ("{", "[", '"') or text in ("null", "true", "false"):
            try:
                return json.loads(text)
            except ValueError:
                return value
        try:
            return json.loads(text) if text[:1].isdigit() or text[:1] == "-" else value
        except ValueError:
            return value
    return value


def _as_int(value: Any) -> int | None:
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


def _short_code(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    code = str(value).strip()
    if not code:
        return None
    # Exception types arrive fully qualified: keep the class name only.
    if "." in code and " " not in code:
        code = code.rsplit(".", 1)[-1]
    return code.lower()[:MAX_CODE_LEN]


def _unwrap_arguments(args: Any) -> Any:
    # OpenLLMetry wraps tool inputs: {"inputs": {...}} / {"input_str": "..."}.
    if isinstance(args, dict) and len(args) == 1:
        for key in ("inputs", "input_str", "kwargs"):
            if key in args:
                return _as_json(args[key])
    return args


def _apply_ops(value: Any, ops: tuple[str, ...]) -> Any:
    for op in ops:
        if isinstance(value, str):
            if op == "trim":
                value = value.strip()
            elif op == "lowercase":
                value = value.lower()
            elif op == "collapse_whitespace":
                value = " ".join(value.split())
        elif op == "sort" and isinstance(value, list):
            value = sorted(value, key=lambda v: json.dumps(v, sort_keys=True, default=str))
    return value


def _is_empty(result: Any) -> bool:
    if result is None or result == "" or result == [] or result == {}:
        return True
    if isinstance(result, dict):
        payload = [v for k, v in result.items() if k not in ("ok", "next", "cursor")]
        return bool(payload) and all(v is None or v == [] or v == {} or v == "" for v in payload)
    return False


class Normalizer:
    """Maps decoded spans to Steps under one policy and one fingerprint key."""

    def __init__(self, policy: Policy, fingerprinter: Fingerprinter) -> None:
        self.policy = policy
        self.fp = fingerprinter
        c = policy.conventions
        self._op = c["operation"]
        self._oikind = c["span_kind"]
        self._tool_name = c["tool_name"]
        self._call_id = c["call_id"]
        self._arguments = c["arguments"] + ("traceloop.entity.input",)
        self._result = c["result"] + ("traceloop.entity.output",)
        self._error_type = c["error_type"]
        self._prompt_version = c["prompt_version"]
        self._resource_prompt_version = c["resource_prompt_version"]
        self._tool_version = c["tool_version"]
        self._resource_tool_version = c["resource_tool_version"]
        self._agent_name = c["agent_name"]
        self._conversation = c["conversation"]
        self._input_tokens = c["input_tokens"]
        self._output_tokens = c["output_tokens"]
        self._handoff_from = c["handoff_from"]
        self._handoff_to = c["handoff_to"]
        self._plan_steps = c["plan_steps"]
        self._output_messages = c["output_messages"]
        self._finish_reason = c["finish_reason"]
        self._metadata = c["metadata"]
        self._summary_ops = frozenset(c["summary_operations"])
        self._summary_markers = c["summary_name_markers"]
        self._sequence = policy.sequence_attributes
        self._task_attr = policy.task_type_attribute
        run_key = policy.run_key
        self._run_keys: tuple[str, ...] | None
        if run_key == "trace":
            self._run_keys = None
        elif run_key == "conversation":
            self._run_keys = self._conversation
        else:
            self._run_keys = (run_key,)

    # ------------------------------------------------------------------ public

    def run_id(self, span: SpanRecord) -> str:
        if self._run_keys is not None:
            value = _first(span.attributes, self._run_keys)
            if value is None:
                value = _first(span.resource, self._run_keys)
            if value is not None:
                return str(value)
        return span.trace_id

    def step(self, span: SpanRecord) -> Step:
        attrs = span.attributes
        kind = self._classify(span)
        step = Step(
            run_id=self.run_id(span),
            trace_id=span.trace_id,
            span_id=span.span_id,
            parent_span_id=span.parent_span_id,
            kind=kind,
            start_ns=span.start_ns,
            end_ns=span.end_ns,
            sequence=self._sequence_of(attrs),
            content_digest=self._content_digest(span),
            is_root=span.parent_span_id is None,
            status_error=span.status_code == STATUS_ERROR,
        )
        step.service_name = _str_or_none(span.resource.get("service.name"))
        step.prompt_version = _str_or_none(
            _first(attrs, self._prompt_version)
            or _first(span.resource, self._resource_prompt_version)
        )
        step.agent_name = _str_or_none(_first(attrs, self._agent_name))
        step.session_id = _str_or_none(_first(attrs, self._conversation))
        if self._task_attr is not None:
            step.task_type = _str_or_none(
                attrs.get(self._task_attr) or span.resource.get(self._task_attr)
            )
        step.input_tokens = _as_int(_first(attrs, self._input_tokens)) or 0
        step.output_tokens = _as_int(_first(attrs, self._output_tokens)) or 0

        if kind == TOOL:
            self._fill_tool(step, span)
        elif kind == HANDOFF:
            self._fill_handoff(step, span)
        elif kind == PLAN:
            raw = _as_json(_first(attrs, self._plan_steps))
            step.plan_fp = self._plan_fp(_plan_calls(raw))
        elif kind == LLM:
            calls = self._requested_calls(attrs)
            if len(calls) >= 2:  # a single requested call is an action, not a plan
                step.plan_fp = self._plan_fp(calls)
        if step.is_root or kind == AGENT:
            self._fill_termination(step, span)
        return step

    # ------------------------------------------------------------------ classification

    def _classify(self, span: SpanRecord) -> str:
        attrs = span.attributes
        op = _first(attrs, self._op)
        oik = _first(attrs, self._oikind)
        name = span.name
        if op == "handoff" or _first(attrs, self._handoff_to) is not None:
            return HANDOFF
        if op == "execute_tool" or oik == "TOOL" or oik == "RETRIEVER" or name.endswith(".tool"):
            tool = self._tool_name_of(span)
            if name.startswith("handoff to ") or tool.startswith("transfer_to_"):
                return HANDOFF
            return TOOL
        if op == "plan":
            return PLAN
        if op in self._summary_ops:
            return SUMMARY
        if op in _LLM_OPERATIONS or oik == "LLM":
            return LLM
        if op in _AGENT_OPERATIONS or oik == "AGENT":
            return AGENT
        lowered = name.lower()
        if any(marker in lowered for marker in self._summary_markers):
            return SUMMARY
        return OTHER

    def _tool_name_of(self, span: SpanRecord) -> str:
        name = _first(span.attributes, self._tool_name)
        if name is not None:
            return str(name)
        span_name = span.name
        if span_name.startswith("execute_tool "):
            return span_name[len("execute_tool ") :]
        if span_name.endswith(".tool"):
            return span_name[: -len(".tool")]
        return span_name

    def _sequence_of(self, attrs: dict[str, Any]) -> int | None:
        for key in self._sequence:
            if key in attrs:
                seq = _as_int(attrs[key])
                if seq is not None:
                    return seq
        meta = _first(attrs, self._metadata)
        if meta is not None:
            meta = _as_json(meta)
            if isinstance(meta, dict):
                for key in self._sequence:
                    if key in meta:
                        seq = _as_int(meta[key])
                        if seq is not None:
                            return seq
        return None

    # ------------------------------------------------------------------ tools

    def _fill_tool(self, step: Step, span: SpanRecord) -> None:
        attrs = span.attributes
        tool = self._tool_name_of(span)
        contract = self.policy.tool(tool)
        step.name = tool
        step.call_id = _str_or_none(_first(attrs, self._call_id))
        step.tool_version = _str_or_none(
            _first(attrs, self._tool_version) or _first(span.resource, self._resource_tool_version)
        )
        raw_args = _first(attrs, self._arguments)
        args = _unwrap_arguments(_as_json(raw_args)) if raw_args is not None else {}
        if not isinstance(args, dict):
            args = {"input": args}  # a bare string/number input is the single argument
        raw_result = _first(attrs, self._result)
        has_result = raw_result is not None
        result = _as_json(raw_result) if has_result else None

        step.action_fp = self._action_fp(tool, args, contract)
        code = self._error_code(span, result)
        step.error_code = code
        if has_result:
            step.result_fp = self.fp.of_value("result", result)
            step.empty_result = _is_empty(result)
        elif code is not None:
            step.result_fp = self.fp.of_text("code", code)
        if contract is not None:
            self._fill_contract(step, contract, args, result)

    def _contract_args(self, args: dict[str, Any], contract: ToolContract | None) -> dict[str, Any]:
        if contract is None:
            return args
        merged = dict(contract.defaults)
        merged.update(args)
        for arg, ops in contract.normalize.items():
            if arg in merged:
                merged[arg] = _apply_ops(merged[arg], ops)
        return merged

    def _action_fp(self, tool: str, args: dict[str, Any], contract: ToolContract | None) -> str:
        merged = self._contract_args(args, contract)
        if contract is not None:
            if contract.identity is not None:
                merged = {k: merged.get(k) for k in contract.identity}
            else:
                # The cursor selects a page and the idempotency key an attempt; neither
                # defines the action (progress rules look at them separately).
                for arg in (contract.cursor_arg, contract.idempotency_key_arg):
                    if arg is not None:
                        merged.pop(arg, None)
        return self.fp.of_value(tool, merged)

    def _fill_contract(
        self, step: Step, contract: ToolContract, args: dict[str, Any], result: Any
    ) -> None:
        res = result if isinstance(result, dict) else {}
        if contract.version_field is not None:
            version = res.get(contract.version_field)
            if isinstance(version, int | float) and not isinstance(version, bool):
                step.version = float(version)
        if contract.state_field is not None:
            state = res.get(contract.state_field)
            if state is not None:
                step.state_fp = self.fp.of_value("state", state)
                step.state_terminal = str(state) in contract.terminal_states
        if contract.cursor_arg is not None:
            step.cursor_fp = self.fp.of_value("cursor", args.get(contract.cursor_arg))
        if contract.new_items_field is not None:
            items = res.get(contract.new_items_field)
            if isinstance(items, list):
                step.item_fps = tuple(self.fp.of_value("item", i)[:8] for i in items[:MAX_ITEMS])
        if contract.side_effect:
            merged = self._contract_args(args, contract)
            identity = contract.business_identity or contract.identity
            business = {k: merged.get(k) for k in identity} if identity else merged
            if contract.idempotency_key_arg is not None and identity is None:
                business = {k: v for k, v in business.items() if k != contract.idempotency_key_arg}
            step.business_fp = self.fp.of_value(contract.name, business)
            if contract.idempotency_key_arg is not None:
                key = args.get(contract.idempotency_key_arg)
                if key not in (None, ""):
                    step.idempotency_fp = self.fp.of_value("idempotency", key)

    def _error_code(self, span: SpanRecord, result: Any) -> str | None:
        code = _short_code(_first(span.attributes, self._error_type))
        if code is not None:
            return code
        if isinstance(result, dict) and result.get("ok") is False:
            inner = result.get("code") or result.get("error_code")
            if inner is None and isinstance(result.get("error"), dict):
                inner = result["error"].get("code")
            return _short_code(inner) or "error"
        if span.status_code == STATUS_ERROR:
            for event in span.events:
                if event.name == "exception":
                    exc = _short_code(event.attributes.get("exception.type"))
                    if exc is not None:
                        return exc
            # Status messages may hold customer text: only match known codes, never copy.
            message = span.status_message.lower()
            for known in sorted(self.policy.transient_error_codes | self.policy.missing_data_codes):
                if known in message:
                    return known
            return "error"
        return None

    # ------------------------------------------------------------------ handoffs, plans

    def _fill_handoff(self, step: Step, span: SpanRecord) -> None:
        attrs = span.attributes
        to_agent = _first(attrs, self._handoff_to)
        from_agent = _first(attrs, self._handoff_from)
        if to_agent is None:
            name = span.name
            tool = self._tool_name_of(span)
            if name.startswith("handoff to "):
                to_agent = name[len("handoff to ") :]
            elif tool.startswith("transfer_to_"):
                to_agent = tool[len("transfer_to_") :]
        step.to_agent = _str_or_none(to_agent)
        step.from_agent = _str_or_none(from_agent) or step.agent_name
        step.name = f"{step.from_agent or '?'}->{step.to_agent or '?'}"
        step.call_id = _str_or_none(_first(attrs, self._call_id))

    def _requested_calls(self, attrs: dict[str, Any]) -> list[tuple[str, Any]]:
        raw = _first(attrs, self._output_messages)
        calls: list[tuple[str, Any]] = []
        if raw is not None:
            messages = _as_json(raw)
            if isinstance(messages, list):
                for message in messages:
                    parts = message.get("parts") if isinstance(message, dict) else None
                    for part in parts if isinstance(parts, list) else ():
                        if isinstance(part, dict) and part.get("type") == "tool_call":
                            calls.append((str(part.get("name")), _as_json(part.get("arguments"))))
            return calls
        # OpenInference flattens: llm.output_messages.0.message.tool_calls.N.tool_call.function.*
        prefix = "llm.output_messages.0.message.tool_calls."
        index = 0
        while True:
            name = attrs.get(f"{prefix}{index}.tool_call.function.name")
            if name is None:
                break
            calls.append(
                (str(name), _as_json(attrs.get(f"{prefix}{index}.tool_call.function.arguments")))
            )
            index += 1
        return calls

    def _plan_fp(self, calls: list[tuple[str, Any]]) -> str | None:
        if not calls:
            return None
        normalized = [
            [tool, self._contract_args(a, self.policy.tool(tool)) if isinstance(a, dict) else a]
            for tool, a in calls
        ]
        return self.fp.of_value("plan", normalized)

    # ------------------------------------------------------------------ termination

    def _fill_termination(self, step: Step, span: SpanRecord) -> None:
        if step.kind == OTHER and not step.is_root:
            return
        if step.kind == OTHER:
            step.kind = AGENT  # the root of a run: carries termination, not an action
        step.name = step.agent_name or span.name
        policy = self.policy
        reason: str | None = None
        for event in span.events:
            if event.name == "loop_guard":
                step.guard_ns = (
                    event.time_ns if step.guard_ns is None else min(step.guard_ns, event.time_ns)
                )
                reason = "loop_guard"
        if reason is None:
            types = [_first(span.attributes, self._error_type)] + [
                e.attributes.get("exception.type") for e in span.events if e.name == "exception"
            ]
            for exc_type in types:
                if exc_type is None:
                    continue
                short = str(exc_type).rsplit(".", 1)[-1]
                reason = policy.exception_types.get(str(exc_type)) or policy.exception_types.get(
                    short
                )
                if reason is not None:
                    break
        if reason is None and span.status_message:
            for pattern, mapped in policy.message_patterns:
                if pattern.search(span.status_message):
                    reason = mapped
                    break
        if reason is None:
            finish = _first(span.attributes, self._finish_reason)
            if isinstance(finish, list) and finish:
                finish = finish[-1]
            if finish is not None:
                reason = policy.finish_reasons.get(str(finish).lower())
        if reason is None and step.is_root:
            reason = "tool_error" if span.status_code == STATUS_ERROR else "final_answer"
        step.termination = reason

    @staticmethod
    def _content_digest(span: SpanRecord) -> str:
        h = hashlib.blake2b(digest_size=8)
        h.update(
            f"{span.name}|{span.start_ns}|{span.end_ns}|{span.status_code}|{span.parent_span_id}".encode()
        )
        for key in sorted(span.attributes):
            h.update(f"\x1f{key}={span.attributes[key]!r}".encode("utf-8", "replace"))
        return h.hexdigest()


def _plan_calls(raw: Any) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict):
                tool = item.get("tool") or item.get("name")
                calls.append((str(tool), _as_json(item.get("arguments", item.get("args")))))
            else:
                calls.append((str(item), None))
    return calls


def _str_or_none(value: Any) -> str | None:
    if value is None or value == "":
        return None
    return str(value)
