"""Which version replaced which, and what each version's finished runs did. Pure: no I/O.

A *slice* is one version of one thing a service runs: its prompt (`kind` "prompt",
`tool` "") or one tool (`kind` "tool"), per service and agent. A finished run counts on
its prompt_version's slice and on the slice of each [tool, version] it called, so a tool
version's side holds the runs that called it (whatever they looped on).

History: the versions of a (kind, service, agent, tool) in the order they were first seen
(the start of the first finished run that carried them). A version's *predecessor* is the
one first seen just before it: the version it replaced, or for a canary the version it
runs beside. Two versions first seen in the same nanosecond are ordered by name.

Measures: what the worker counts per slice and time window, summed by `side_of` into a
detectors.compare.Side: finished runs, looping runs, runs per shape, wasted steps and
tokens (duplicate side effects are the runs with the `duplicate_side_effect` shape).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .compare import Side

PROMPT, TOOL = "prompt", "tool"
KINDS = (PROMPT, TOOL)
RUNS, LOOPING, WASTED_STEPS, WASTED_TOKENS = "runs", "looping", "wasted_steps", "wasted_tokens"
PRICED_RUNS, WASTED_MICROS = "priced_runs", "wasted_cost_micros"  # money: where models are priced
SHAPE_PREFIX = "shape:"


@dataclass(frozen=True, slots=True, order=True)
class Slice:
    kind: str  # PROMPT or TOOL
    service: str | None
    agent: str | None
    tool: str  # "" for a prompt
    version: str

    @property
    def group(self) -> tuple[str, str | None, str | None, str]:
        """What the versions replace each other within."""
        return self.kind, self.service, self.agent, self.tool

    def labels(self) -> list[Any]:
        return [self.kind, self.service, self.agent, self.tool, self.version]

    @classmethod
    def of(cls, labels: Iterable[Any]) -> Slice:
        kind, service, agent, tool, version = labels
        if kind not in KINDS or not isinstance(version, str) or not isinstance(tool, str):
            raise ValueError(f"not a version slice: {labels!r}")
        return cls(kind, service, agent, tool, version)


def slices_of(summary: Mapping[str, Any]) -> list[Slice]:
    """The slices a finished run counts on (none without versions)."""
    service, agent = summary.get("service_name"), summary.get("agent_name")
    out = []
    prompt_version = summary.get("prompt_version")
    if isinstance(prompt_version, str) and prompt_version:
        out.append(Slice(PROMPT, service, agent, "", prompt_version))
    for pair in summary.get("tool_versions") or ():
        tool, version = pair
        if isinstance(tool, str) and isinstance(version, str) and version:
            out.append(Slice(TOOL, service, agent, tool, version))
    return list(dict.fromkeys(out))


def run_measures(summary: Mapping[str, Any]) -> dict[str, int]:
    """One finished run's contribution to each of its slices (zeros left out)."""
    shapes = sorted(set(summary.get("shapes") or ()))
    out = {RUNS: 1}
    if shapes:
        out[LOOPING] = 1
    for shape in shapes:
        out[SHAPE_PREFIX + shape] = 1
    for name in (WASTED_STEPS, WASTED_TOKENS):
        value = summary.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[name] = value
    money = summary.get("wasted_cost")
    if isinstance(money, (int, float)) and not isinstance(money, bool):
        out[PRICED_RUNS] = 1
        if money > 0:
            out[WASTED_MICROS] = round(money * 1_000_000)
    return out


def side_of(measures: Mapping[str, int]) -> Side:
    """A slice's summed measures as one side of a comparison."""
    side = Side(
        runs=int(measures.get(RUNS, 0)),
        looping=int(measures.get(LOOPING, 0)),
        wasted_steps=int(measures.get(WASTED_STEPS, 0)),
        wasted_tokens=int(measures.get(WASTED_TOKENS, 0)),
    )
    for name, n in measures.items():
        if name.startswith(SHAPE_PREFIX) and n:
            side.by_shape[name[len(SHAPE_PREFIX) :]] = int(n)
    side.duplicate_side_effects = side.by_shape.get("duplicate_side_effect", 0)
    if measures.get(PRICED_RUNS):
        side.wasted_cost = int(measures.get(WASTED_MICROS, 0)) / 1_000_000
    return side


@dataclass(slots=True)
class Seen:
    """A slice's all-time record: first and last seen (run start / end, ns), finished runs."""

    first_ns: int
    last_ns: int
    runs: int

    def merge(self, other: Seen) -> None:
        self.first_ns = min(self.first_ns, other.first_ns)
        self.last_ns = max(self.last_ns, other.last_ns)
        self.runs += other.runs

    def to_list(self) -> list[int]:
        return [self.first_ns, self.last_ns, self.runs]

    @classmethod
    def from_list(cls, values: Any) -> Seen:
        first, last, runs = values
        if not all(type(v) is int for v in (first, last, runs)):
            raise ValueError(f"not a version record: {values!r}")
        return cls(first, last, runs)


def seen_of(summary: Mapping[str, Any]) -> Seen:
    """One finished run's record: its start and end (event time), one run."""
    start = summary.get("start_time_unix_nano")
    end = summary.get("end_time_unix_nano")
    start = start if type(start) is int else 0
    return Seen(start, end if type(end) is int and end >= start else start, 1)


class History:
    """Every slice's record, merged (from partitions and workers); the order of versions."""

    def __init__(self) -> None:
        self.seen: dict[Slice, Seen] = {}

    def add(self, key: Slice, seen: Seen) -> None:
        have = self.seen.get(key)
        if have is None:
            self.seen[key] = Seen(seen.first_ns, seen.last_ns, seen.runs)
        else:
            have.merge(seen)

    def ordered(self, group: tuple[str, str | None, str | None, str]) -> list[Slice]:
        """A group's versions, oldest first."""
        keys = [k for k in self.seen if k.group == group]
        return sorted(keys, key=lambda k: (self.seen[k].first_ns, k.version))

    def previous(self, key: Slice) -> Slice | None:
        """The version first seen just before `key` in its group (None: it was the first)."""
        order = self.ordered(key.group)
        at = order.index(key) if key in order else -1
        return order[at - 1] if at > 0 else None

    def rows(self, latest: int | None = None) -> list[dict[str, Any]]:
        """Every slice with its record and predecessor: by group, oldest version first;
        `latest`: only each group's newest versions."""
        out = []
        for group in sorted({k.group for k in self.seen}, key=_group_order):
            before: Slice | None = None
            order = self.ordered(group)
            first = 0 if latest is None else max(0, len(order) - latest)
            for at, key in enumerate(order):
                if at < first:
                    before = key
                    continue
                seen = self.seen[key]
                out.append(
                    {
                        **slice_doc(key),
                        "first_ns": seen.first_ns,
                        "last_ns": seen.last_ns,
                        "runs": seen.runs,
                        "previous": before.version if before is not None else None,
                        "previous_first_ns": self.seen[before].first_ns if before else None,
                    }
                )
                before = key
        return out


def slice_doc(key: Slice) -> dict[str, Any]:
    return {
        "kind": key.kind,
        "service_name": key.service,
        "agent_name": key.agent,
        "tool_name": key.tool or None,
        "version": key.version,
    }


def _group_order(group: tuple[str, str | None, str | None, str]) -> tuple[str, ...]:
    kind, service, agent, tool = group
    return kind, service or "", agent or "", tool
