"""Policy and tool contracts (docs/CONTRACTS.md §4), strictly validated.

Unknown keys, wrong types and references to unknown tools are a ConfigError naming the
file, the key path and what was expected: never a silent default.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from .config_reader import ConfigReader, join
from .errors import ConfigError
from .holds import parse_duration
from .policy_defaults import (
    BUILTIN_PROFILES,
    BUILTIN_PROFILES_FILE,
    DEFAULT_AMBIGUOUS_CODES,
    DEFAULT_CONVENTIONS,
    DEFAULT_EXCEPTION_TYPES,
    DEFAULT_FINISH_REASONS,
    DEFAULT_MESSAGE_PATTERNS,
    DEFAULT_MESSAGE_REGEXES,
    DEFAULT_MISSING_DATA_CODES,
    DEFAULT_TRANSIENT_CODES,
    DEFAULT_TRANSIENT_MESSAGE_PATTERNS,
    NORMALIZE_OPS,
    SUMMARY_RULE_IDS,
    TERMINATION_REASONS,
)
from .prices import Price, read_prices
from .profile_compiler import compile_profiles
from .recognition import FIELDS as RECOGNITION_FIELDS
from .recognition import Profile, Termination


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
class Similarity:
    """Near-duplicate calls (detectors/similarity.py): the policy's `similarity:`, and a
    tool's own `similarity:` over it."""

    enabled: bool = True  # off: no sketches are computed, nothing near-duplicate fires
    min_calls: int = 3  # near-duplicate calls of one tool in the window
    argument_similarity: float = 0.4  # estimated overlap of the arguments' words
    result_similarity: float = 0.7  # a result this close to an earlier one is nothing new
    seen_items: float = 0.6  # ... as is a result whose items were mostly seen in the run
    compare_results: bool = True  # false: similar arguments alone make the loop
    result_items: bool = True  # false: a result's items are not read, its words are
    arguments: tuple[str, ...] | None = None  # (a tool's) the arguments compared; None: all
    model_turns: bool = True  # (policy-wide) model turns repeating their action/observation


_NO_SIMILARITY = Similarity(enabled=False)


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
    similarity: Similarity | None = None  # None: the policy's
    guard_mode: str | None = None  # the guard's mode for this tool (None: the policy's)


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
    message_patterns: tuple[tuple[re.Pattern[str], str], ...] = DEFAULT_MESSAGE_REGEXES
    finish_reasons: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_FINISH_REASONS))
    transient_message_patterns: tuple[tuple[re.Pattern[str], str], ...] = tuple(
        (re.compile(p), c) for p, c in DEFAULT_TRANSIENT_MESSAGE_PATTERNS.items()
    )
    # Span recognition profiles, in the order they are tried (see detectors/recognition.py).
    profiles: tuple[Profile, ...] = field(default_factory=lambda: default_profiles())
    reconcile_tools: frozenset[str] = frozenset()  # derived: tools named as some reconcile_tool
    # What models' tokens cost (detectors/prices.py); empty: no money anywhere.
    prices: dict[str, Price] = field(default_factory=dict)
    similarity: Similarity = field(default_factory=Similarity)
    # The in-process guard (guard/loopwatch_guard): observe (decide and record, never
    # block) or enforce; a tool's own `guard:` over it.
    guard_mode: str = "observe"
    # Holds (detectors/holds.py): the guard's refresh of the active set, whether side-effect
    # calls fail closed while the holds API cannot be reached, and a hold's TTL.
    holds_refresh_seconds: float = 5.0
    side_effects_fail_closed: bool = False
    hold_default_ttl_seconds: float = 2 * 3600.0
    hold_max_ttl_seconds: float = 24 * 3600.0

    def limits_for(self, task_type: str | None) -> Limits:
        if task_type is not None:
            limits = self.task_types.get(task_type)
            if limits is not None:
                return limits
        return self.defaults

    def tool(self, name: str) -> ToolContract | None:
        return self.tools.get(name)

    @property
    def known_error_codes(self) -> frozenset[str]:
        return self.transient_error_codes | self.missing_data_codes | self.ambiguous_error_codes

    def guard_mode_for(self, tool: str) -> str:
        contract = self.tools.get(tool)
        if contract is not None and contract.guard_mode is not None:
            return contract.guard_mode
        return self.guard_mode

    def similarity_for(self, tool: str) -> Similarity:
        """A tool's near-duplicate settings. Off for a tool whose contract declares a version
        or state field: its progress is that field (identical_repetition's rules), so its
        calls are never sketched."""
        contract = self.tools.get(tool)
        if contract is None:
            return self.similarity
        if contract.version_field is not None or contract.state_field is not None:
            return _NO_SIMILARITY
        return contract.similarity if contract.similarity is not None else self.similarity


# ---------------------------------------------------------------------------- loading


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
    "similarity",
    "guard",
}
_SIMILARITY_KEYS = {
    "enabled",
    "min_calls",
    "argument_similarity",
    "result_similarity",
    "seen_items",
    "compare_results",
    "result_items",
}
_TOP_SIMILARITY_KEYS = _SIMILARITY_KEYS | {"model_turns"}
_TOOL_SIMILARITY_KEYS = _SIMILARITY_KEYS | {"arguments"}
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
    "profiles",
    "transient_message_patterns",
    "prices",
    "similarity",
    "guard",
    "holds",
}
GUARD_MODES = ("observe", "enforce")


def _limits(r: ConfigReader, raw: Any, path: str, base: Limits) -> Limits:
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
            changes[key] = r.integer(m[key], join(path, key), minimum=1)
    if "window" in m:
        changes["window"] = r.integer(m["window"], join(path, "window"), minimum=2)
    if "token_drop_ratio" in m:
        ratio = r.number(m["token_drop_ratio"], join(path, "token_drop_ratio"))
        if ratio >= 1:
            raise r.fail(join(path, "token_drop_ratio"), "a number between 0 and 1", ratio)
        changes["token_drop_ratio"] = ratio
    if "budgets" in m:
        bpath = join(path, "budgets")
        b = r.mapping(m["budgets"], bpath, {"steps", "tokens", "seconds"})
        budgets = base.budgets
        if "steps" in b:
            budgets = replace(budgets, steps=r.integer(b["steps"], join(bpath, "steps"), 1))
        if "tokens" in b:
            budgets = replace(budgets, tokens=r.integer(b["tokens"], join(bpath, "tokens"), 1))
        if "seconds" in b:
            budgets = replace(budgets, seconds=r.number(b["seconds"], join(bpath, "seconds")))
        changes["budgets"] = budgets
    return replace(base, **changes)


def _similarity(
    r: ConfigReader, raw: Any, path: str, base: Similarity, allowed: set[str]
) -> Similarity:
    if isinstance(raw, bool):  # `similarity: false`: the off switch
        return replace(base, enabled=raw)
    m = r.mapping(raw, path, allowed)
    changes: dict[str, Any] = {}
    for key in ("enabled", "compare_results", "result_items", "model_turns"):
        if key in m:
            changes[key] = r.boolean(m[key], join(path, key))
    if "min_calls" in m:
        changes["min_calls"] = r.integer(m["min_calls"], join(path, "min_calls"), minimum=2)
    for key in ("argument_similarity", "result_similarity", "seen_items"):
        if key in m:
            value = r.number(m[key], join(path, key))
            if value > 1:
                raise r.fail(join(path, key), "a number between 0 and 1", value)
            changes[key] = value
    if "arguments" in m:
        changes["arguments"] = r.strings(m["arguments"], join(path, "arguments"))
    return replace(base, **changes)


def _tool(
    r: ConfigReader, name: str, raw: Any, path: str, similarity: Similarity = Similarity()
) -> ToolContract:
    m = r.mapping(raw, path, _TOOL_KEYS)
    kw: dict[str, Any] = {"name": name}
    if "similarity" in m:
        kw["similarity"] = _similarity(
            r, m["similarity"], join(path, "similarity"), similarity, _TOOL_SIMILARITY_KEYS
        )
    if "identity" in m:
        kw["identity"] = r.strings(m["identity"], join(path, "identity"))
    if "defaults" in m:
        kw["defaults"] = dict(r.mapping(m["defaults"], join(path, "defaults"), None))
    if "normalize" in m:
        npath = join(path, "normalize")
        norm: dict[str, tuple[str, ...]] = {}
        for arg, ops in r.mapping(m["normalize"], npath, None).items():
            opstuple = r.strings(ops, join(npath, arg))
            for op in opstuple:
                if op not in NORMALIZE_OPS:
                    raise ConfigError(
                        f"{r.source}: {join(npath, arg)}: unknown normalization {op!r}; "
                        f"expected one of {', '.join(sorted(NORMALIZE_OPS))}"
                    )
            norm[arg] = opstuple
        kw["normalize"] = norm
    if "progress" in m:
        ppath = join(path, "progress")
        p = r.mapping(m["progress"], ppath, _PROGRESS_KEYS)
        for key in ("version_field", "state_field", "cursor_arg", "new_items_field"):
            if key in p:
                kw[key] = r.string(p[key], join(ppath, key))
        if "terminal_states" in p:
            if "state_field" not in p:
                raise ConfigError(
                    f"{r.source}: {ppath}.terminal_states: needs progress.state_field"
                )
            kw["terminal_states"] = frozenset(
                r.strings(p["terminal_states"], join(ppath, "terminal_states"))
            )
        if "cursor_arg" in p and "new_items_field" not in p:
            raise ConfigError(
                f"{r.source}: {ppath}: cursor_arg needs new_items_field "
                "(progress = a new cursor that returns new items)"
            )
    if "max_polls" in m:
        kw["max_polls"] = r.integer(m["max_polls"], join(path, "max_polls"), minimum=1)
    if "side_effect" in m:
        kw["side_effect"] = r.boolean(m["side_effect"], join(path, "side_effect"))
    if "idempotency_key_arg" in m:
        kw["idempotency_key_arg"] = r.string(
            m["idempotency_key_arg"], join(path, "idempotency_key_arg")
        )
    if "business_identity" in m:
        kw["business_identity"] = r.strings(m["business_identity"], join(path, "business_identity"))
    if "reconcile_tool" in m:
        kw["reconcile_tool"] = r.string(m["reconcile_tool"], join(path, "reconcile_tool"))
    for key in ("idempotency_key_arg", "business_identity", "reconcile_tool"):
        if key in kw and not kw.get("side_effect"):
            raise ConfigError(
                f"{r.source}: {join(path, key)}: only meaningful with side_effect: true"
            )
    if "guard" in m:
        kw["guard_mode"] = _guard_mode(r, m["guard"], join(path, "guard"))
    return ToolContract(**kw)


def _guard_mode(r: ConfigReader, raw: Any, path: str) -> str:
    """`guard: enforce` or `guard: {mode: enforce}`."""
    if isinstance(raw, str):
        mode, mpath = raw, path
    else:
        m = r.mapping(raw, path, {"mode"})
        if "mode" not in m:
            raise r.fail(join(path, "mode"), "one of " + ", ".join(GUARD_MODES), None)
        mode, mpath = m["mode"], join(path, "mode")
    if mode not in GUARD_MODES:
        raise r.fail(mpath, "one of " + ", ".join(GUARD_MODES), mode)
    return str(mode)


def _check_enforced_side_effects(
    source: str, policy_mode: str, tools: dict[str, ToolContract]
) -> None:
    """The seeds' rollout: side-effect tools are enforced only once their idempotency and
    reconciliation paths exist, i.e. their contract declares both."""
    for name, contract in tools.items():
        mode = contract.guard_mode or policy_mode
        if mode != "enforce" or not contract.side_effect:
            continue
        missing = [
            key
            for key, value in (
                ("idempotency_key_arg", contract.idempotency_key_arg),
                ("reconcile_tool", contract.reconcile_tool),
            )
            if value is None
        ]
        if missing:
            where = f"tools.{name}.guard" if contract.guard_mode else "guard.mode"
            raise ConfigError(
                f"{source}: {where}: the side-effect tool {name!r} can be enforced only when its "
                f"contract declares {' and '.join(missing)}; declare it, or set "
                f"tools.{name}.guard: observe"
            )


def policy_from_mapping(raw: Any, source: str = "<policy>") -> Policy:
    r = ConfigReader(source)
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
    if "prices" in m:
        kw["prices"] = read_prices(r, m["prices"])
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
    similarity = Similarity()
    if "similarity" in m:
        similarity = _similarity(r, m["similarity"], "similarity", similarity, _TOP_SIMILARITY_KEYS)
        kw["similarity"] = similarity
    tools: dict[str, ToolContract] = {}
    if "tools" in m:
        for name, value in r.mapping(m["tools"], "tools", None).items():
            tools[name] = _tool(r, name, value, f"tools.{name}", similarity)
    for name, contract in tools.items():
        if contract.reconcile_tool is not None and contract.reconcile_tool not in tools:
            raise ConfigError(
                f"{source}: tools.{name}.reconcile_tool: unknown tool {contract.reconcile_tool!r}; "
                "expected a tool declared under tools:"
            )
    kw["tools"] = tools
    if "guard" in m:
        g = r.mapping(
            m["guard"], "guard", {"mode", "holds_refresh_seconds", "side_effects_fail_closed"}
        )
        if "mode" in g:
            kw["guard_mode"] = _guard_mode(r, g["mode"], "guard.mode")
        if "holds_refresh_seconds" in g:
            seconds = r.number(g["holds_refresh_seconds"], "guard.holds_refresh_seconds")
            if seconds < 0.1:
                raise r.fail("guard.holds_refresh_seconds", "at least 0.1 seconds", seconds)
            kw["holds_refresh_seconds"] = seconds
        if "side_effects_fail_closed" in g:
            kw["side_effects_fail_closed"] = r.boolean(
                g["side_effects_fail_closed"], "guard.side_effects_fail_closed"
            )
    if "holds" in m:
        h = r.mapping(m["holds"], "holds", {"default_ttl", "max_ttl"})
        for key, name in (
            ("default_ttl", "hold_default_ttl_seconds"),
            ("max_ttl", "hold_max_ttl_seconds"),
        ):
            if key in h:
                kw[name] = parse_duration(h[key], f"{source}: holds.{key}")
        if kw.get("hold_default_ttl_seconds", 7200.0) > kw.get("hold_max_ttl_seconds", 86400.0):
            raise ConfigError(f"{source}: holds.default_ttl: longer than holds.max_ttl")
    _check_enforced_side_effects(source, kw.get("guard_mode", "observe"), tools)
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
        kw["exception_types"] = exc
        kw["message_patterns"] = tuple(
            (r.regex(pattern, "termination.message_patterns"), reason)
            for pattern, reason in pats.items()
        )
        kw["finish_reasons"] = fins
    if "transient_message_patterns" in m:
        patterns = []
        for pattern, code in r.mapping(
            m["transient_message_patterns"], "transient_message_patterns", None
        ).items():
            where = f"transient_message_patterns.{pattern}"
            patterns.append((r.regex(pattern, where), r.string(code, where).lower()))
        kw["transient_message_patterns"] = tuple(patterns)
        kw["transient_error_codes"] = kw.get(
            "transient_error_codes", frozenset(DEFAULT_TRANSIENT_CODES)
        ) | {c for _, c in patterns}
    conventions = kw.get("conventions")
    if conventions is not None or "profiles" in m or "termination" in m:
        kw["profiles"] = _profiles(
            r,
            m.get("profiles"),
            conventions or {},
            set(r.mapping(m.get("conventions"), "conventions", None)),
            Termination(
                kw.get("exception_types", dict(DEFAULT_EXCEPTION_TYPES)),
                kw.get("message_patterns", DEFAULT_MESSAGE_REGEXES),
                kw.get("finish_reasons", dict(DEFAULT_FINISH_REASONS)),
            ),
        )
    return Policy(**kw)


def _profiles(
    r: ConfigReader,
    user: Any,
    conventions: dict[str, tuple[str, ...]],
    overridden: set[str],
    base: Termination,
) -> tuple[Profile, ...]:
    builtin = copy.deepcopy(BUILTIN_PROFILES)
    for rule in builtin["generic"]["kinds"]:
        rule_id = rule.get("id")
        if rule_id in SUMMARY_RULE_IDS and rule_id in overridden:
            values = list(conventions[rule_id])
            if rule_id == "summary_operations":
                rule["match"] = {"field": {"operation": values}}
            else:
                rule["match"] = {"name_contains": values}
            if not values:  # an empty list turns the rule off
                rule["match"] = {"name": []}

    def check_reason(value: Any, path: str) -> str:
        reason = r.string(value, path)
        if reason not in TERMINATION_REASONS:
            raise r.fail(path, "one of " + ", ".join(TERMINATION_REASONS), reason)
        return reason

    return compile_profiles(
        builtin,
        r.mapping(user, "profiles", None) if user is not None else None,
        builtin_source=str(BUILTIN_PROFILES_FILE),
        source=r.source,
        check_reason=check_reason,
        base_termination=base,
        overrides={
            k: v for k, v in conventions.items() if k in overridden and k in RECOGNITION_FIELDS
        },
    )


_DEFAULT_PROFILES: tuple[Profile, ...] | None = None


def default_profiles() -> tuple[Profile, ...]:
    """The built-in profiles under the default termination tables (compiled once)."""
    global _DEFAULT_PROFILES
    if _DEFAULT_PROFILES is None:
        _DEFAULT_PROFILES = _profiles(
            ConfigReader(str(BUILTIN_PROFILES_FILE)),
            None,
            {},
            set(),
            Termination(
                dict(DEFAULT_EXCEPTION_TYPES),
                DEFAULT_MESSAGE_REGEXES,
                dict(DEFAULT_FINISH_REASONS),
            ),
        )
    return _DEFAULT_PROFILES


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
