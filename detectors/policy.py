"""Policy and tool contracts (contracts.md §4), strictly validated.

Unknown keys, wrong types and references to unknown tools are a ConfigError naming the
file, the key path and what was expected: never a silent default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from detectors.errors import ConfigError

MAX_SECONDS = 1e9  # ~31 years: keeps int(seconds * 1e9) a finite int
NORMALIZE_OPS = frozenset({"trim", "lowercase", "collapse_whitespace", "sort"})
TERMINATION_REASONS = (
    "final_answer",
    "loop_guard",
    "turn_limit",
    "deadline",
    "tool_error",
    "cancelled",
    "unknown",
)

DEFAULT_TRANSIENT_CODES = (
    "429",
    "503",
    "502",
    "504",
    "timeout",
    "timed_out",
    "rate_limit",
    "rate_limited",
    "ratelimiterror",
    "too_many_requests",
    "service_unavailable",
    "timeouterror",
    "apitimeouterror",
    "readtimeout",
    "connecttimeout",
    "deadline_exceeded",
    "unavailable",
)
DEFAULT_AMBIGUOUS_CODES = (
    "timeout",
    "timed_out",
    "timeouterror",
    "apitimeouterror",
    "readtimeout",
    "deadline_exceeded",
    "504",
)
DEFAULT_MISSING_DATA_CODES = ("404", "not_found", "notfound", "no_results", "empty")

# Attribute-convention key lists (contracts.md §2). First match wins; all overridable
# under `conventions:` in the policy file.
DEFAULT_CONVENTIONS: dict[str, tuple[str, ...]] = {
    "operation": ("gen_ai.operation.name",),
    "span_kind": ("openinference.span.kind",),
    "tool_name": ("gen_ai.tool.name", "tool.name"),
    "call_id": ("gen_ai.tool.call.id", "tool_call.id", "tool.id"),
    "arguments": ("gen_ai.tool.call.arguments", "input.value", "tool.parameters"),
    "result": ("gen_ai.tool.call.result", "output.value"),
    "error_type": ("error.type",),
    "prompt_version": ("gen_ai.prompt.version", "llm.prompt_template.version"),
    "resource_prompt_version": ("prompt.version",),
    "tool_version": ("gen_ai.tool.version", "tool.version"),
    "resource_tool_version": ("tool.version",),
    "agent_name": ("gen_ai.agent.name", "agent.name"),
    "conversation": ("gen_ai.conversation.id", "session.id"),
    "input_tokens": ("gen_ai.usage.input_tokens", "llm.token_count.prompt"),
    "output_tokens": ("gen_ai.usage.output_tokens", "llm.token_count.completion"),
    "handoff_from": ("gen_ai.handoff.from_agent",),
    "handoff_to": ("gen_ai.handoff.to_agent",),
    "plan_steps": ("gen_ai.plan.steps",),
    "output_messages": ("gen_ai.output.messages",),
    "finish_reason": ("gen_ai.agent.finish_reason", "gen_ai.response.finish_reasons"),
    "metadata": ("metadata",),
    "summary_operations": ("summarize", "summarization", "compact", "compress"),
    "summary_name_markers": ("summar", "compact", "compress"),
}

DEFAULT_EXCEPTION_TYPES: dict[str, str] = {
    "MaxTurnsExceeded": "turn_limit",
    "GraphRecursionError": "turn_limit",
    "RecursionError": "turn_limit",
    "TimeoutError": "deadline",
    "DeadlineExceeded": "deadline",
    "CancelledError": "cancelled",
    "KeyboardInterrupt": "cancelled",
    "LoopGuardTriggered": "loop_guard",
}
DEFAULT_MESSAGE_PATTERNS: dict[str, str] = {
    r"(?i)max turns exceeded": "turn_limit",
    r"(?i)recursion limit of \d+ reached": "turn_limit",
    r"(?i)deadline exceeded|timed out": "deadline",
    r"(?i)loop guard": "loop_guard",
    r"(?i)cancel": "cancelled",
}
DEFAULT_FINISH_REASONS: dict[str, str] = {
    "stop": "final_answer",
    "end_turn": "final_answer",
    "final_answer": "final_answer",
    "completed": "final_answer",
    "loop_guard": "loop_guard",
    "max_turns": "turn_limit",
    "turn_limit": "turn_limit",
    "length": "turn_limit",
    "timeout": "deadline",
    "deadline": "deadline",
    "cancelled": "cancelled",
    "tool_error": "tool_error",
    "error": "tool_error",
}


@dataclass(frozen=True, slots=True)
class Budgets:
    steps: int = 40
    tokens: int = 200_000
    seconds: float = 300.0


@dataclass(frozen=True, slots=True)
class Limits:
    """Thresholds; `defaults` and each task type are one of these."""

    allowed_repeats: int = 2
    window: int = 8
    budgets: Budgets = field(default_factory=Budgets)
    churn_min_calls: int = 3
    replan_min_repeats: int = 3
    retry_storm_min_calls: int = 4
    handoff_max_traversals: int = 2
    collapse_min_fetches: int = 3
    token_drop_ratio: float = 0.3


@dataclass(frozen=True, slots=True)
class ToolContract:
    name: str
    identity: tuple[str, ...] | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    normalize: dict[str, tuple[str, ...]] = field(default_factory=dict)
    version_field: str | None = None
    state_field: str | None = None
    terminal_states: frozenset[str] = frozenset()
    cursor_arg: str | None = None
    new_items_field: str | None = None
    max_polls: int | None = None
    side_effect: bool = False
    idempotency_key_arg: str | None = None
    business_identity: tuple[str, ...] | None = None
    reconcile_tool: str | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    policy_version: str = "default"
    run_key: str = "trace"
    sequence_attributes: tuple[str, ...] = (
        "agent.step.sequence",
        "gen_ai.step.sequence",
        "langgraph_step",
    )
    allowed_lateness_seconds: float = 5.0
    finalize_grace_seconds: float = 10.0
    idle_timeout_seconds: float = 600.0
    max_pending_steps: int = 64
    # Release a sequenced step as soon as every sequence before it arrived (low latency).
    # Unsequenced spans of the same run (often LLM spans) that arrive after their slot was
    # released are then counted late; set false to hold everything for the lateness bound.
    release_on_sequence: bool = True
    defaults: Limits = field(default_factory=Limits)
    task_type_attribute: str | None = None
    task_types: dict[str, Limits] = field(default_factory=dict)
    tools: dict[str, ToolContract] = field(default_factory=dict)
    transient_error_codes: frozenset[str] = frozenset(DEFAULT_TRANSIENT_CODES)
    ambiguous_error_codes: frozenset[str] = frozenset(DEFAULT_AMBIGUOUS_CODES)
    missing_data_codes: frozenset[str] = frozenset(DEFAULT_MISSING_DATA_CODES)
    conventions: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: dict(DEFAULT_CONVENTIONS)
    )
    exception_types: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_EXCEPTION_TYPES))
    message_patterns: tuple[tuple[re.Pattern[str], str], ...] = tuple(
        (re.compile(p), r) for p, r in DEFAULT_MESSAGE_PATTERNS.items()
    )
    finish_reasons: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_FINISH_REASONS))
    reconcile_tools: frozenset[str] = frozenset()  # derived: tools named as some reconcile_tool

    def limits_for(self, task_type: str | None) -> Limits:
        if task_type is not None:
            limits = self.task_types.get(task_type)
            if limits is not None:
                return limits
        return self.defaults

    def tool(self, name: str) -> ToolContract | None:
        return self.tools.get(name)


# ---------------------------------------------------------------------------- loading


class _Reader:
    """Walks a parsed YAML mapping, raising ConfigError with file + key path + expectation."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(
        self, path: str, expected: str, got: Any = None, *, show_got: bool = True
    ) -> ConfigError:
        detail = f", got {_describe(got)}" if show_got else ""
        return ConfigError(f"{self.source}: {path or '<top level>'}: expected {expected}{detail}")

    def mapping(self, value: Any, path: str, allowed: set[str] | None) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, "a mapping", value)
        for key in value:
            if not isinstance(key, str):
                raise self.fail(path, "string keys", key)
            if allowed is not None and key not in allowed:
                raise ConfigError(
                    f"{self.source}: {_join(path, key)}: unknown key; expected one of "
                    + ", ".join(sorted(allowed))
                )
        return value

    def string(self, value: Any, path: str) -> str:
        if isinstance(value, bool) or not isinstance(value, str | int | float) or value == "":
            raise self.fail(path, "a non-empty string", value)
        return str(value)

    def integer(self, value: Any, path: str, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(path, f"an integer >= {minimum}", value)
        return value

    def number(self, value: Any, path: str, minimum: float = 0.0) -> float:
        # `not minimum <= value <= MAX_SECONDS` also refuses NaN (every comparison is false)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (minimum <= value <= MAX_SECONDS)
        ):
            raise self.fail(path, f"a number >= {minimum} (and <= {MAX_SECONDS:g})", value)
        return float(value)

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, "true or false", value)
        return value

    def strings(self, value: Any, path: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise self.fail(path, "a list of strings", value)
        return tuple(self.string(v, f"{path}[{i}]") for i, v in enumerate(value))


def _join(path: str, key: str) -> str:
    key = key or "''"  # YAML allows an empty key: still say where
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"boolean {value}"
    if isinstance(value, int | float):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


_LIMIT_KEYS = {
    "allowed_repeats",
    "window",
    "budgets",
    "churn_min_calls",
    "replan_min_repeats",
    "retry_storm_min_calls",
    "handoff_max_traversals",
    "collapse_min_fetches",
    "token_drop_ratio",
}
_TOOL_KEYS = {
    "identity",
    "defaults",
    "normalize",
    "progress",
    "max_polls",
    "side_effect",
    "idempotency_key_arg",
    "business_identity",
    "reconcile_tool",
}
_PROGRESS_KEYS = {
    "version_field",
    "state_field",
    "terminal_states",
    "cursor_arg",
    "new_items_field",
}
_TOP_KEYS = {
    "policy_version",
    "run_key",
    "sequence_attributes",
    "allowed_lateness_seconds",
    "finalize_grace_seconds",
    "idle_timeout_seconds",
    "max_pending_steps",
    "release_on_sequence",
    "defaults",
    "task_types",
    "tools",
    "transient_error_codes",
    "ambiguous_error_codes",
    "missing_data_codes",
    "conventions",
    "termination",
}


def _limits(r: _Reader, raw: Any, path: str, base: Limits) -> Limits:
    m = r.mapping(raw, path, _LIMIT_KEYS)
    changes: dict[str, Any] = {}
    for key in (
        "allowed_repeats",
        "churn_min_calls",
        "replan_min_repeats",
        "retry_storm_min_calls",
        "handoff_max_traversals",
        "collapse_min_fetches",
    ):
        if key in m:
            changes[key] = r.integer(m[key], _join(path, key), minimum=1)
    if "window" in m:
        changes["window"] = r.integer(m["window"], _join(path, "window"), minimum=2)
    if "token_drop_ratio" in m:
        ratio = r.number(m["token_drop_ratio"], _join(path, "token_drop_ratio"))
        if ratio >= 1:
            raise r.fail(_join(path, "token_drop_ratio"), "a number between 0 and 1", ratio)
        changes["token_drop_ratio"] = ratio
    if "budgets" in m:
        bpath = _join(path, "budgets")
        b = r.mapping(m["budgets"], bpath, {"steps", "tokens", "seconds"})
        budgets = base.budgets
        if "steps" in b:
            budgets = replace(budgets, steps=r.integer(b["steps"], _join(bpath, "steps"), 1))
        if "tokens" in b:
            budgets = replace(budgets, tokens=r.integer(b["tokens"], _join(bpath, "tokens"), 1))
        if "seconds" in b:
            budgets = replace(budgets, seconds=r.number(b["seconds"], _join(bpath, "seconds")))
        changes["budgets"] = budgets
    return replace(base, **changes)


def _tool(r: _Reader, name: str, raw: Any, path: str) -> ToolContract:
    m = r.mapping(raw, path, _TOOL_KEYS)
    kw: dict[str, Any] = {"name": name}
    if "identity" in m:
        kw["identity"] = r.strings(m["identity"], _join(path, "identity"))
    if "defaults" in m:
        kw["defaults"] = dict(r.mapping(m["defaults"], _join(path, "defaults"), None))
    if "normalize" in m:
        npath = _join(path, "normalize")
        norm: dict[str, tuple[str, ...]] = {}
        for arg, ops in r.mapping(m["normalize"], npath, None).items():
            opstuple = r.strings(ops, _join(npath, arg))
            for op in opstuple:
                if op not in NORMALIZE_OPS:
                    raise ConfigError(
                        f"{r.source}: {_join(npath, arg)}: unknown normalization {op!r}; "
                        f"expected one of {', '.join(sorted(NORMALIZE_OPS))}"
                    )
            norm[arg] = opstuple
        kw["normalize"] = norm
    if "progress" in m:
        ppath = _join(path, "progress")
        p = r.mapping(m["progress"], ppath, _PROGRESS_KEYS)
        for key in ("version_field", "state_field", "cursor_arg", "new_items_field"):
            if key in p:
                kw[key] = r.string(p[key], _join(ppath, key))
        if "terminal_states" in p:
            if "state_field" not in p:
                raise ConfigError(
                    f"{r.source}: {ppath}.terminal_states: needs progress.state_field"
                )
            kw["terminal_states"] = frozenset(
                r.strings(p["terminal_states"], _join(ppath, "terminal_states"))
            )
        if ("cursor_arg" in p) != ("new_items_field" in p):
            raise ConfigError(
                f"{r.source}: {ppath}: cursor_arg and new_items_field go together "
                "(progress = a new cursor that returns new items)"
            )
    if "max_polls" in m:
        kw["max_polls"] = r.integer(m["max_polls"], _join(path, "max_polls"), minimum=1)
    if "side_effect" in m:
        kw["side_effect"] = r.boolean(m["side_effect"], _join(path, "side_effect"))
    if "idempotency_key_arg" in m:
        kw["idempotency_key_arg"] = r.string(
            m["idempotency_key_arg"], _join(path, "idempotency_key_arg")
        )
    if "business_identity" in m:
        kw["business_identity"] = r.strings(
            m["business_identity"], _join(path, "business_identity")
        )
    if "reconcile_tool" in m:
        kw["reconcile_tool"] = r.string(m["reconcile_tool"], _join(path, "reconcile_tool"))
    for key in ("idempotency_key_arg", "business_identity", "reconcile_tool"):
        if key in kw and not kw.get("side_effect"):
            raise ConfigError(
                f"{r.source}: {_join(path, key)}: only meaningful with side_effect: true"
            )
    return ToolContract(**kw)


def policy_from_mapping(raw: Any, source: str = "<policy>") -> Policy:
    r = _Reader(source)
    m = r.mapping(raw, "", _TOP_KEYS)
    kw: dict[str, Any] = {}
    if "policy_version" in m:
        kw["policy_version"] = r.string(m["policy_version"], "policy_version")
    if "run_key" in m:
        kw["run_key"] = r.string(m["run_key"], "run_key")
    if "sequence_attributes" in m:
        kw["sequence_attributes"] = r.strings(m["sequence_attributes"], "sequence_attributes")
    for key in ("allowed_lateness_seconds", "finalize_grace_seconds", "idle_timeout_seconds"):
        if key in m:
            kw[key] = r.number(m[key], key)
    if "max_pending_steps" in m:
        kw["max_pending_steps"] = r.integer(m["max_pending_steps"], "max_pending_steps", minimum=1)
    if "release_on_sequence" in m:
        kw["release_on_sequence"] = r.boolean(m["release_on_sequence"], "release_on_sequence")
    defaults = _limits(r, m.get("defaults"), "defaults", Limits())
    kw["defaults"] = defaults
    if "task_types" in m:
        tt = r.mapping(m["task_types"], "task_types", None)
        if "attribute" not in tt:
            raise r.fail("task_types.attribute", "the attribute that selects the task type", None)
        kw["task_type_attribute"] = r.string(tt["attribute"], "task_types.attribute")
        kw["task_types"] = {
            name: _limits(r, value, f"task_types.{name}", defaults)
            for name, value in tt.items()
            if name != "attribute"
        }
    tools: dict[str, ToolContract] = {}
    if "tools" in m:
        for name, value in r.mapping(m["tools"], "tools", None).items():
            tools[name] = _tool(r, name, value, f"tools.{name}")
    for name, contract in tools.items():
        if contract.reconcile_tool is not None and contract.reconcile_tool not in tools:
            raise ConfigError(
                f"{source}: tools.{name}.reconcile_tool: unknown tool {contract.reconcile_tool!r}; "
                "expected a tool declared under tools:"
            )
    kw["tools"] = tools
    kw["reconcile_tools"] = frozenset(c.reconcile_tool for c in tools.values() if c.reconcile_tool)
    for key in ("transient_error_codes", "ambiguous_error_codes", "missing_data_codes"):
        if key in m:
            kw[key] = frozenset(c.lower() for c in r.strings(m[key], key))
    if "conventions" in m:
        conv = dict(DEFAULT_CONVENTIONS)
        for key, value in r.mapping(
            m["conventions"], "conventions", set(DEFAULT_CONVENTIONS)
        ).items():
            conv[key] = r.strings(value, f"conventions.{key}")
        kw["conventions"] = conv
    if "termination" in m:
        t = r.mapping(
            m["termination"],
            "termination",
            {"exception_types", "message_patterns", "finish_reasons"},
        )
        exc = dict(DEFAULT_EXCEPTION_TYPES)
        pats = dict(DEFAULT_MESSAGE_PATTERNS)
        fins = dict(DEFAULT_FINISH_REASONS)
        for key, target in (
            ("exception_types", exc),
            ("message_patterns", pats),
            ("finish_reasons", fins),
        ):
            for k, v in r.mapping(t.get(key), f"termination.{key}", None).items():
                reason = r.string(v, f"termination.{key}.{k}")
                if reason not in TERMINATION_REASONS:
                    raise r.fail(
                        f"termination.{key}.{k}", "one of " + ", ".join(TERMINATION_REASONS), reason
                    )
                target[k] = reason
        compiled = []
        for pattern, reason in pats.items():
            try:
                compiled.append((re.compile(pattern), reason))
            except (re.error, OverflowError, RecursionError) as exc_:
                raise ConfigError(
                    f"{source}: termination.message_patterns: invalid regex {pattern!r}: {exc_}"
                ) from None
        kw["exception_types"] = exc
        kw["message_patterns"] = tuple(compiled)
        kw["finish_reasons"] = fins
    return Policy(**kw)


def load_policy(path: str | Path | None) -> Policy:
    """Load and validate a policy file; None gives the built-in defaults."""
    if path is None:
        return Policy()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read policy file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: policy file is not UTF-8 text") from None
    try:
        raw = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{p}: invalid YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        if isinstance(exc, yaml.reader.ReaderError):  # a bad character: no mark, no problem
            where = f" at character {exc.position + 1}"
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or "invalid YAML"
        raise ConfigError(f"{p}: invalid YAML{where}: {problem}") from None
    return policy_from_mapping(raw, str(p))
