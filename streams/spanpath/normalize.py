"""Span → Step: the attribute conventions of docs/CONTRACTS.md §2 as data, plus the tool contract.

Raw arguments and results are parsed here, reduced to keyed digests and a few declared
fields, and dropped: nothing customer-provided leaves this module except as a digest.
"""

from __future__ import annotations

import json
import json.scanner
import re
import time
import zlib
from typing import Any

from detectors.fingerprint import Fingerprinter
from detectors.model import AGENT, HANDOFF, LLM, OTHER, PLAN, TOOL, Step
from detectors.policy import Policy, ToolContract
from detectors.recognition import Profile, Source, SpanFacts
from streams.spanpath.spans import STATUS_ERROR, SpanRecord

MAX_ITEMS = 64
# Finish reasons of a model turn that asked for tool calls (OpenAI, Vercel, pydantic-ai,
# Anthropic/Bedrock spellings).
TOOL_CALL_FINISH_REASONS = frozenset(
    {"tool_calls", "tool-calls", "tool_call", "tool_use", "function_call"}
)
# A span ending more than a day after the wall clock is a broken clock or forged input:
# it would drag replay's watermark (and every run's lateness and finalization) with it.
MAX_FUTURE_NS = 24 * 3600 * 10**9
MAX_CODE_LEN = 64
# Attribute key sets remembered by Normalizer._view (instrumentations send a few each).
MAX_PLANS = 1024
MAX_KIND_MEMO = 256  # kinds remembered: a few names and tools per instrumentation
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
        if text[:1] in _JSON_STARTS or text in ("null", "true", "false"):
            try:
                return _loads(text)
            except (ValueError, RecursionError):  # RecursionError: nested too deeply
                return value
    return value


_JSON_STARTS = frozenset('{["-0123456789')
# The C scanner, when available (typeshed mistypes make_scanner's argument).
_scan_json = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _loads(text: str) -> Any:
    """json.loads of a stripped string, without its per-call Python layers (hot path)."""
    try:
        value, end = _scan_json(text, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("extra data after JSON")
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


MAX_COUNT = (1 << 63) - 1
MAX_IDENT = 256
_CODE_LIKE = re.compile(rf"[A-Za-z0-9_.:/-]{{1,{MAX_CODE_LEN}}}").fullmatch


def _as_count(value: Any) -> int:
    """A token count: an integer in [0, 2**63); anything else (negative, huge, junk) is 0."""
    n = _as_int(value)
    return n if n is not None and 0 <= n <= MAX_COUNT else 0


def _ident(value: Any) -> str:
    """A name or id as text, at most MAX_IDENT characters (longer ones keep a checksum)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= MAX_IDENT:
        return text
    crc = zlib.crc32(text.encode("utf-8", "replace"))
    return f"{text[: MAX_IDENT - 9]}~{crc:08x}"


def _short_code(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    code = str(value).strip()
    if not code:
        return None
    # Exception types arrive fully qualified: keep the class name only.
    if "." in code and " " not in code:
        code = code.rsplit(".", 1)[-1]
    if not _CODE_LIKE(code):
        return "error"  # a sentence is customer text, not a code: never copy it
    return code.lower()


# What Normalizer.step raises for a span it cannot map (the caller counts and skips it).
STEP_ERRORS = (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError)


_OLL_ENVELOPE_KEYS = frozenset({"inputs", "input_str", "tags", "metadata", "kwargs"})


def _unwrap_arguments(args: Any) -> Any:
    # OpenLLMetry wraps tool inputs: {"input_str": "{'order_id': 'A12'}", "tags": [...],
    # "metadata": {...}, "inputs": {"order_id": "A12"}, "kwargs": {"tool_call_id": ...}}.
    if isinstance(args, dict) and args and set(args) <= _OLL_ENVELOPE_KEYS:
        if "inputs" in args:
            return _as_json(args["inputs"])
        if "input_str" in args:
            return _as_json(args["input_str"])
    # OpenInference (LlamaIndex): {"kwargs": {...}} (and "args": [] when there are none).
    if (
        isinstance(args, dict)
        and isinstance(args.get("kwargs"), dict)
        and set(args) <= {"args", "kwargs"}
        and not args.get("args")
    ):
        return args["kwargs"]
    return args


def _unwrap_result(result: Any) -> tuple[Any, Any, str | None]:
    """LangChain ToolMessage envelopes -> (the tool's own result as parsed, as sent, tool_call_id).

    Returns (result, None, None) when the result is not such an envelope.

    OpenInference: {"type": "tool", "data": {"content": "...", "tool_call_id": ...}}
    OpenLLMetry:   {"output": {"lc": 1, "id": [..., "ToolMessage"], "kwargs": {"content": ...}},
                    "kwargs": {...}}
    LlamaIndex:    {"blocks": [...], "tool_name": ..., "raw_input": ..., "raw_output": ...}
    """
    if isinstance(result, dict) and "output" in result and set(result) <= {"output", "kwargs"}:
        result = _as_json(result["output"])
    if not isinstance(result, dict):
        return result, None, None
    if "raw_output" in result and "tool_name" in result and "raw_input" in result:
        # LlamaIndex ToolOutput: {"blocks"/"content", "tool_name", "raw_input", "raw_output"}
        own = result["raw_output"]
        return _as_json(own), own if isinstance(own, str) else None, None
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
    return _as_json(content), content, (str(call_id) if call_id else None)


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


_ENVELOPE_FIELDS = frozenset({"ok", "next", "cursor"})


def _is_empty(result: Any) -> bool:
    """None, "", [], {} or an object whose payload fields (all but ok/next/cursor) are
    all such: no results."""
    if isinstance(result, dict):
        if not result:
            return True
        payload = False
        for key, value in result.items():
            if key in _ENVELOPE_FIELDS:
                continue
            if not (value is None or value == "" or value == [] or value == {}):
                return False
            payload = True
        return payload
    return result is None or result == "" or result == []


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
            value = _as_json(value)
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
        self._conversation = c["conversation"]
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
        self._profiles = policy.profiles
        self._known_codes = (
            policy.transient_error_codes | policy.missing_data_codes | policy.ambiguous_error_codes
        )
        self._status_codes = sorted(policy.transient_error_codes | policy.missing_data_codes)
        # Fields every profile reads the same way (policy settings, not conventions).
        common: dict[str, tuple[str, ...]] = {
            # OpenLLMetry copies LangChain metadata to traceloop.association.properties.<key>.
            "sequence": self._sequence
            + tuple("traceloop.association.properties." + key for key in self._sequence)
        }
        if self._task_attr is not None:
            common["task_type"] = (self._task_attr,)
        if self._run_keys is not None:
            common["run_key"] = self._run_keys
        # One pass over a span's attributes finds every field (first key wins), per
        # profile: attribute key -> [(field, rank)].
        self._keymaps: dict[str, dict[str, list[tuple[str, int]]]] = {}
        for profile in self._profiles:
            keymap: dict[str, list[tuple[str, int]]] = {}
            for name, keys in (*profile.keys.items(), *common.items()):
                for rank, key in enumerate(keys):
                    keymap.setdefault(key, []).append((name, rank))
            self._keymaps[profile.name] = keymap
        self._resources: dict[int, tuple[Any, ...]] = {}
        self._plans: dict[tuple[str, tuple[str, ...]], tuple[Profile, _Plan]] = {}
        self._kinds: dict[tuple[Any, ...], tuple[str, str | None]] = {}

    # ------------------------------------------------------------------ public

    def run_id(self, span: SpanRecord) -> str:
        _, v = self._read(span)
        return self._run_id(span, v, self._resource(span.resource))

    def profile_of(self, span: SpanRecord) -> Profile:
        """The recognition profile that reads this span."""
        return self._read(span)[0]

    def _run_id(self, span: SpanRecord, v: dict[str, Any], res: tuple[Any, ...]) -> str:
        if self._run_keys is not None:
            value = v.get("run_key")
            if value is None:
                value = res[5]
            if value is not None:
                return _ident(value)
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

    def _resource(self, resource: dict[str, Any]) -> tuple[Any, ...]:
        """(resource, service, prompt_version, tool_version, task_type, run key), cached:
        every span of one ResourceSpans shares its resource dict."""
        cached = self._resources.get(id(resource))
        if cached is not None and cached[0] is resource:
            return cached
        if len(self._resources) > 4096:
            self._resources.clear()
        info = (
            resource,
            _str_or_none(resource.get("service.name")),
            _str_or_none(_first(resource, self._resource_prompt_version)),
            _str_or_none(_first(resource, self._resource_tool_version)),
            _str_or_none(resource.get(self._task_attr)) if self._task_attr else None,
            _first(resource, self._run_keys) if self._run_keys else None,
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
        step.service_name = res[1]
        derived = profile.derived
        prompt_version = v.get("prompt_version")
        if prompt_version is None and "prompt_version" in derived:
            prompt_version = self._field(profile, "prompt_version", facts)
        step.prompt_version = _ident(prompt_version) if prompt_version is not None else res[2]
        agent = v.get("agent_name")
        if agent is None and "agent_name" in derived:
            agent = self._field(profile, "agent_name", facts)
        step.agent_name = _str_or_none(agent)
        step.session_id = _str_or_none(v.get("conversation"))
        task_type = v.get("task_type")
        step.task_type = _ident(task_type) if task_type is not None else res[4]
        if "input_tokens" in v:
            step.input_tokens = _as_count(v["input_tokens"])
        if "output_tokens" in v:
            step.output_tokens = _as_count(v["output_tokens"])

        if kind == TOOL:
            self._fill_tool(step, span, v, res, facts)
        elif kind == HANDOFF:
            self._fill_handoff(step, span, v, facts)
        elif kind == PLAN:
            step.plan_fp = self._plan_fp(_plan_calls(_as_json(v.get("plan_steps"))))
        elif kind == LLM:
            calls = self._requested_calls(span.attributes, v, profile, facts)
            if len(calls) >= 2:  # a single requested call is an action, not a plan
                step.plan_fp = self._plan_fp(calls)
            finish = self._field(profile, "finish_reason", facts)
            if isinstance(finish, list):
                finish = finish[-1] if finish else None
            step.wants_tools = bool(calls) or (
                isinstance(finish, str) and finish.lower() in TOOL_CALL_FINISH_REASONS
            )
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
        return _ident(name if name is not None else facts.name)

    def _sequence_of(self, v: dict[str, Any]) -> int | None:
        if "sequence" in v:
            seq = _as_int(v["sequence"])
            if seq is not None:
                return seq
        meta = v.get("metadata")
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

    def _fill_tool(
        self, step: Step, span: SpanRecord, v: dict[str, Any], res: tuple[Any, ...], facts: _Facts
    ) -> None:
        tool = facts.tool_name()
        contract = self.policy.tools.get(tool)
        step.name = tool
        step.call_id = _str_or_none(v.get("call_id"))
        tool_version = v.get("tool_version")
        step.tool_version = _ident(tool_version) if tool_version is not None else res[3]
        profile = facts.profile
        raw_args = self._field(profile, "arguments", facts)
        wrapped = _as_json(raw_args) if raw_args is not None else {}
        args = _unwrap_arguments(wrapped)
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
            result, sent, envelope_call_id = _unwrap_result(_as_json(raw_result))
            if sent is not None:
                raw_result = sent  # digest the tool's own result, not the framework envelope
            if step.call_id is None:
                step.call_id = envelope_call_id

        step.action_fp = self._action_fp(tool, args, contract)
        code = self._error_code(span, facts, result)
        step.error_code = code
        if has_result:
            # Results come from tool code (stable serialization): digest the text as sent.
            if isinstance(raw_result, str):
                step.result_fp = self.fp.of_text("result", raw_result)
            else:
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

    def _error_code(self, span: SpanRecord, facts: _Facts, result: Any) -> str | None:
        error_type = self._field(facts.profile, "error_type", facts)
        code = self._stated_code(span, error_type, result)
        if code is None or code in self._known_codes:
            return code
        # A framework's native failure (a raised exception, a JS throw, a retry request)
        # names its exception type, not the cause: look for a transient cause in the
        # messages. Matched, never copied.
        for text in self._error_messages(span, self._field(facts.profile, "error_message", facts)):
            for pattern, transient in self.policy.transient_message_patterns:
                if pattern.search(text):
                    return transient
        return code

    @staticmethod
    def _error_messages(span: SpanRecord, message: Any) -> list[str]:
        texts = [
            e.attributes["exception.message"]
            for e in span.events
            if e.name == "exception" and isinstance(e.attributes.get("exception.message"), str)
        ]
        if span.status_message:
            texts.append(span.status_message)
        if isinstance(message, str):
            texts.append(message)
        return texts

    def _stated_code(self, span: SpanRecord, error_type: Any, result: Any) -> str | None:
        code = _short_code(error_type)
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
            for known in self._status_codes:
                if known in message:
                    return known
            return "error"
        return None

    # ------------------------------------------------------------------ handoffs, plans

    def _fill_handoff(self, step: Step, span: SpanRecord, v: dict[str, Any], facts: _Facts) -> None:
        profile = facts.profile
        raw_args = self._field(profile, "arguments", facts)
        args = _unwrap_arguments(_as_json(raw_args)) if raw_args is not None else None
        to_agent = self._field(profile, "handoff_to", facts, args)
        from_agent = self._field(profile, "handoff_from", facts, args)
        step.to_agent = _str_or_none(to_agent)
        step.from_agent = _str_or_none(from_agent)
        step.name = f"{step.from_agent or '?'}->{step.to_agent or '?'}"
        step.call_id = _str_or_none(v.get("call_id"))

    def _requested_calls(
        self, attrs: dict[str, Any], v: dict[str, Any], profile: Profile, facts: _Facts
    ) -> list[tuple[str, Any]]:
        """The tool calls one model turn requested, in order."""
        raw = v.get("output_messages")
        if raw is not None:
            return _genai_message_calls(_as_json(raw))
        for source in profile.derived.get("requested_calls", ()):
            if source.when is not None and not source.when(facts):
                continue
            key = source.attribute or ""
            if source.format == "openinference_flat":
                calls = _flat_calls(attrs, key)
            elif key in attrs:
                value = _as_json(attrs[key])
                calls = (
                    _genai_message_calls(value)
                    if source.format == "genai_messages"
                    else _call_list(value)
                )
            else:
                continue
            if calls:
                return calls
        return []

    def _plan_fp(self, calls: list[tuple[str, Any]]) -> str | None:
        if not calls:
            return None
        normalized = [
            [tool, self._contract_args(a, self.policy.tool(tool)) if isinstance(a, dict) else a]
            for tool, a in calls
        ]
        return self.fp.of_value("plan", normalized)

    # ------------------------------------------------------------------ termination

    def _fill_termination(
        self, step: Step, span: SpanRecord, v: dict[str, Any], profile: Profile, facts: _Facts
    ) -> None:
        if step.kind == OTHER and not step.is_root:
            return
        if step.kind == OTHER:
            step.kind = AGENT  # the root of a run: carries termination, not an action
        step.name = step.agent_name or _ident(span.name)
        table = profile.termination
        reason: str | None = None
        for event in span.events:
            if event.name == "loop_guard":
                step.guard_ns = (
                    event.time_ns if step.guard_ns is None else min(step.guard_ns, event.time_ns)
                )
                reason = "loop_guard"
        if reason is None:
            types = [v.get("error_type")] + [
                e.attributes.get("exception.type") for e in span.events if e.name == "exception"
            ]
            for exc_type in types:
                if exc_type is None:
                    continue
                short = str(exc_type).rsplit(".", 1)[-1]
                reason = table.exception_types.get(str(exc_type)) or table.exception_types.get(
                    short
                )
                if reason is not None:
                    break
        if reason is None and span.status_message:
            for pattern, mapped in table.message_patterns:
                if pattern.search(span.status_message):
                    reason = mapped
                    break
        if reason is None:
            finish = self._field(profile, "finish_reason", facts)
            if isinstance(finish, list) and finish:
                finish = finish[-1]
            if finish is not None:
                reason = table.finish_reasons.get(str(finish).lower())
        if reason is None and step.is_root:
            # langgraph.prebuilt.create_react_agent stops itself when remaining_steps runs out:
            # no exception, root OK, the last AI message is a fixed text. Matched, never copied.
            last = _last_message_text(span.attributes.get("output.value"))
            if last is not None and _OUT_OF_STEPS.search(last):
                reason = "turn_limit"
        # Nothing said why: the pipeline decides at finalization (inferred from the run, or
        # the default for a root that ended OK / failed), and says which in the summary.
        step.termination = reason

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


def _genai_message_calls(messages: Any) -> list[tuple[str, Any]]:
    """GenAI `gen_ai.output.messages`: [{"parts": [{"type": "tool_call", "name", "arguments"}]}]."""
    calls: list[tuple[str, Any]] = []
    if isinstance(messages, list):
        for message in messages:
            parts = message.get("parts") if isinstance(message, dict) else None
            for part in parts if isinstance(parts, list) else ():
                if isinstance(part, dict) and part.get("type") == "tool_call":
                    calls.append((str(part.get("name")), _as_json(part.get("arguments"))))
    return calls


def _flat_calls(attrs: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """OpenInference flattens: <prefix>N.tool_call.function.{name,arguments}."""
    calls: list[tuple[str, Any]] = []
    index = 0
    while True:
        name = attrs.get(f"{prefix}{index}.tool_call.function.name")
        if name is None:
            return calls
        args = attrs.get(f"{prefix}{index}.tool_call.function.arguments")
        calls.append((str(name), _as_json(args)))
        index += 1


_CALL_NAME_KEYS = ("toolName", "tool_name", "name", "function")
_CALL_ARGS_KEYS = ("input", "args", "arguments", "parameters")


def _call_list(value: Any) -> list[tuple[str, Any]]:
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
        calls.append((name, _as_json(args)))
    return calls


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


_OUT_OF_STEPS = re.compile(r"(?i)need more steps to process this request")


def _last_message_text(output: Any) -> str | None:
    """The content of the last message of an OpenInference LangGraph output.value."""
    if not isinstance(output, str) or '"messages"' not in output:
        return None
    doc = _as_json(output)
    messages = doc.get("messages") if isinstance(doc, dict) else None
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    data = messages[-1].get("data", messages[-1])
    content = data.get("content") if isinstance(data, dict) else None
    return content if isinstance(content, str) else None


def _str_or_none(value: Any) -> str | None:
    if value is None or value == "":
        return None
    return _ident(value)
