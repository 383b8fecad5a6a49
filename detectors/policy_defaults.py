"""The policy's defaults (docs/CONTRACTS.md §4): the error codes taken as transient, as
missing data or as ambiguous, the termination reasons and the tables that map exception
types, status messages and finish reasons to them, and the built-in recognition profiles
(detectors/profiles.yaml) with the conventions derived from them. Data only: the policy
file overrides them (detectors/policy.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

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
    "overloaded",
    "529",
    "connection_error",
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

# Span recognition: the built-in profiles (detectors/profiles.yaml, format in
# detectors/recognition.py). `conventions:` (the older form) overrides the key lists of the
# `generic` profile, names the resource keys, and sets the summary rules' values.
BUILTIN_PROFILES_FILE = Path(__file__).with_name("profiles.yaml")
BUILTIN_PROFILES: dict[str, Any] = yaml.safe_load(BUILTIN_PROFILES_FILE.read_text("utf-8"))[
    "profiles"
]
RESOURCE_CONVENTIONS: dict[str, tuple[str, ...]] = {
    "resource_prompt_version": ("prompt.version",),
    "resource_tool_version": ("tool.version",),
}
SUMMARY_RULE_IDS = {
    "summary_operations": "field",  # the operation values of a summarization span
    "summary_name_markers": "name_contains",  # span-name fragments that mean one
}


def _generic_keys() -> dict[str, tuple[str, ...]]:
    fields = BUILTIN_PROFILES["generic"]["fields"]
    return {f: tuple(k for k in v if isinstance(k, str)) for f, v in fields.items()}


def _summary_values() -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for rule in BUILTIN_PROFILES["generic"]["kinds"]:
        if rule.get("id") == "summary_operations":
            out["summary_operations"] = tuple(rule["match"]["field"]["operation"])
        elif rule.get("id") == "summary_name_markers":
            out["summary_name_markers"] = tuple(rule["match"]["name_contains"])
    return out


DEFAULT_CONVENTIONS: dict[str, tuple[str, ...]] = {
    **_generic_keys(),
    **RESOURCE_CONVENTIONS,
    **_summary_values(),
}

# Transient causes found in exception and status messages when the error's code itself
# is not transient (a tool raising RuntimeError("... 503 Service Unavailable")): regex ->
# the transient code it means. Matched, never copied. Order matters (504 before timeout).
DEFAULT_TRANSIENT_MESSAGE_PATTERNS: dict[str, str] = {
    r"(?i)\b429\b|too many requests|rate[ _-]?limit|resource[ _]exhausted|quota exceeded": "429",
    r"(?i)\b504\b|gateway time-?out": "504",
    r"(?i)\b503\b|service unavailable|temporarily unavailable": "503",
    r"(?i)\b502\b|bad gateway": "502",
    r"(?i)\b529\b|overloaded": "overloaded",
    r"(?i)timed out|time-?out|deadline exceeded": "timeout",
    r"(?i)connection (reset|refused|aborted)|econnreset|econnrefused": "connection_error",
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
DEFAULT_MESSAGE_REGEXES = tuple((re.compile(p), r) for p, r in DEFAULT_MESSAGE_PATTERNS.items())
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
