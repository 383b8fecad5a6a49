"""Holds: containment the on-call places (`loopwatch hold add`), enforced by the in-process
guard. Pure: what a hold is, which calls it matches, when it is active. The worker keeps
them (a compacted topic of their own); the guard fetches the active ones in the background
and matches each proposed call in memory.

A hold's scope is any of `service`, `agent`, `prompt_version`, `tool` (with `tool_version`)
or `side_effects` (every tool whose contract says `side_effect: true`), or `run` (one run: a
run hold stops it). Every field given must equal the call's; a scope with none is refused
(a hold must not match everything). A hold always expires (`ttl`, at most the policy's
maximum); a released hold stays in the record with who released it and when.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from .errors import ConfigError
from .model import Step, denials

SCOPE_FIELDS = ("service", "agent", "prompt_version", "tool", "tool_version", "side_effects", "run")
MAX_TEXT = 512  # reason, by, scope values
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


class HoldError(ConfigError):
    """A hold that cannot be placed or released as asked (one line, exit 2)."""


@dataclass(frozen=True, slots=True)
class Scope:
    service: str | None = None
    agent: str | None = None
    prompt_version: str | None = None
    tool: str | None = None
    tool_version: str | None = None
    side_effects: bool = False
    run: str | None = None

    def describe(self) -> str:
        """What the hold matches, in words."""
        parts = []
        if self.run is not None:
            parts.append(f"every call of run {self.run}")
        elif self.side_effects:
            parts.append("every side-effect tool call")
        elif self.tool is not None:
            version = f" version {self.tool_version}" if self.tool_version else ""
            parts.append(f"calls of tool {self.tool}{version}")
        else:
            parts.append("every tool call")
        for name in ("service", "agent", "prompt_version"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name.replace('_', ' ')} {value}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Hold:
    id: str
    scope: Scope
    reason: str
    by: str
    created_ns: int
    expires_ns: int
    released_ns: int | None = None
    released_by: str | None = None

    @property
    def scope_is_run(self) -> bool:
        return self.scope.run is not None

    def active(self, now_ns: int) -> bool:
        return self.released_ns is None and now_ns < self.expires_ns

    def status(self, now_ns: int) -> str:
        if self.released_ns is not None:
            return "released"
        return "active" if now_ns < self.expires_ns else "expired"

    def to_doc(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["scope"] = {k: v for k, v in asdict(self.scope).items() if v not in (None, False)}
        return doc


def parse_duration(text: str, what: str) -> float:
    """'90s', '15m', '2h', '1d' or seconds as a number."""
    found = _DURATION.match(str(text))
    if not found or float(found.group(1)) <= 0:
        raise HoldError(f"{what}: expected a duration like 30m, 2h or 1d, got {text!r}")
    return float(found.group(1)) * _UNIT[found.group(2)]


def scope_from(doc: Any) -> Scope:
    """A scope from a JSON object; a clear HoldError for anything else."""
    if not isinstance(doc, dict):
        raise HoldError("scope: expected an object with any of " + ", ".join(SCOPE_FIELDS))
    unknown = sorted(set(doc) - set(SCOPE_FIELDS))
    if unknown:
        raise HoldError(
            f"scope: unknown field {unknown[0]!r}; expected any of " + ", ".join(SCOPE_FIELDS)
        )
    values: dict[str, Any] = {}
    for name in SCOPE_FIELDS:
        value = doc.get(name)
        if value is None or value == "":
            continue
        if name == "side_effects":
            if not isinstance(value, bool):
                raise HoldError("scope.side_effects: expected true or false")
            values[name] = value
            continue
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise HoldError(f"scope.{name}: expected a string of at most {MAX_TEXT} characters")
        values[name] = value
    scope = Scope(**values)
    if scope.tool_version is not None and scope.tool is None:
        raise HoldError("scope.tool_version: needs scope.tool")
    if scope.side_effects and scope.tool is not None:
        raise HoldError("scope.side_effects: holds every side-effect tool already; drop scope.tool")
    if scope == Scope():
        raise HoldError(
            "scope: a hold needs at least one of "
            + ", ".join(SCOPE_FIELDS)
            + " (a hold that matches every call is refused)"
        )
    return scope


def hold_from(doc: Any) -> Hold:
    """A hold as the worker stores and serves it (Hold.to_doc)."""
    if not isinstance(doc, dict):
        raise HoldError("hold: expected an object")
    try:
        return Hold(
            id=str(doc["id"]),
            scope=scope_from(doc.get("scope", {})),
            reason=str(doc.get("reason", "")),
            by=str(doc.get("by", "")),
            created_ns=int(doc["created_ns"]),
            expires_ns=int(doc["expires_ns"]),
            released_ns=int(doc["released_ns"]) if doc.get("released_ns") is not None else None,
            released_by=str(doc["released_by"]) if doc.get("released_by") is not None else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise HoldError(f"hold: missing or bad field ({exc})") from None


class Call(NamedTuple):
    """What a hold is matched against: one tool call and the labels of its run."""

    run_id: str
    tool: str
    tool_version: str | None
    service: str | None
    agent: str | None
    prompt_version: str | None
    side_effect: bool  # the tool's contract says side_effect: true


def matches(hold: Hold, call: Call) -> bool:
    """Whether a call falls under the hold (every field of its scope equal)."""
    s = hold.scope
    return (
        (s.run is None or s.run == call.run_id)
        and (s.tool is None or s.tool == call.tool)
        and (s.tool_version is None or s.tool_version == call.tool_version)
        and (not s.side_effects or call.side_effect)
        and (s.service is None or s.service == call.service)
        and (s.agent is None or s.agent == call.agent)
        and (s.prompt_version is None or s.prompt_version == call.prompt_version)
    )


class HoldIndex:
    """Holds filed under the first of their scope's run, tool, prompt version, service or
    agent (side-effect holds that name none of them: a list of their own), so that a call
    is matched against the holds that can name it, not all of them (the guard on every
    decision, the worker on every tool span: 1,000 active holds in `make bench`)."""

    KEYS = ("run", "tool", "prompt_version", "service", "agent")

    def __init__(self, holds: Iterable[Hold]) -> None:
        self.filed: tuple[dict[str, list[Hold]], ...] = tuple({} for _ in self.KEYS)
        self.side: list[Hold] = []
        self.size = 0
        for hold in holds:
            self.size += 1
            for at, key in enumerate(self.KEYS):
                value = getattr(hold.scope, key)
                if value is not None:
                    self.filed[at].setdefault(value, []).append(hold)
                    break
            else:
                self.side.append(hold)  # side_effects alone

    def find(self, call: Call, when: Callable[[Hold], bool] = lambda hold: True) -> Hold | None:
        """The first hold that matches the call and passes `when` (active, say)."""
        values = (call.run_id, call.tool, call.prompt_version, call.service, call.agent)
        groups = [self.filed[at].get(v, ()) for at, v in enumerate(values) if v is not None]
        if call.side_effect:
            groups.append(self.side)
        for group in groups:
            for hold in group:
                if when(hold) and matches(hold, call):
                    return hold
        return None


# ---------------------------------------------------------------- what the holds did
# Per hold: the calls it denied (the guard's decision names it), the calls that ran under it
# with no guard decision (a hold nothing enforced), the runs it touched. Counted once per
# delivered span (after the run's dedup) by the run loop, summed by the worker.

MAX_RUN_HOLDS = 8  # holds a run remembers being counted under; past it a run counts again
# what is counted per hold: calls it denied, calls that ran under it undecided, runs touched
DENIED, EXECUTED, RUNS = "denied", "executed", "runs"
HOLD_MEASURES = (DENIED, EXECUTED, RUNS)


class HeldCall(NamedTuple):
    """A tool call a hold decided on or should have: what `loopwatch query holds` counts."""

    hold_id: str
    tool: str | None
    prompt_version: str | None
    denied: bool  # False: it ran under the hold, no guard decision on it
    first_in_run: bool  # the run's first call under this hold (runs affected)
    call_id: str = ""  # run, span and position in the span: what the worker counts once


def account(counted: list[str], step: Step, ran_under: str | None) -> list[HeldCall]:
    """The held calls of one fresh step: its denials that name a hold, and `ran_under`, the
    hold its tool call ran under undecided (the worker's hold book says; None: none).
    `counted`: the holds the run was already counted under (its state's; updated)."""
    found: list[HeldCall] = []

    def note(hold_id: str, tool: str | None, denied: bool) -> None:
        first = hold_id not in counted
        if first:
            counted.append(hold_id)
            del counted[:-MAX_RUN_HOLDS]
        call_id = f"{step.run_id}\x1f{step.span_id}\x1f{len(found)}"
        found.append(HeldCall(hold_id, tool, step.prompt_version, denied, first, call_id))

    for denial in denials(step):
        if denial.hold_id is not None:
            note(denial.hold_id, None, True)  # the denied call's tool is not on this span
    if ran_under is not None:
        note(ran_under, step.name, False)
    return found
