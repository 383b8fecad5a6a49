"""The answers of GET /versions (which version replaced which) and GET /compare (a version's
loop rate against its baseline's), computed without faust. The faust views that serve them:
streams/worker/api/views.py; the rules: detectors/versions.py and detectors/compare.py.

Each worker holds the records of its partitions. A worker's own share (`scope=local`) is
its raw material: the versions table's rows and the windowed measures of every slice. The
worker that was asked merges every share and answers: a predecessor is only known once
every partition's first sightings are merged, and a p-value only from the summed counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from detectors import compare as comparing
from detectors.versions import PROMPT, TOOL, History, Slice, side_of
from streams.worker.api import params as api_params
from streams.worker.api.answers import BadRequest, label_matches, sum_windows
from streams.worker.state.versions import history_from_rows, history_of

COUNT_LABELS = ("kind", "service_name", "agent_name", "tool_name", "version", "measure")
DEFAULT_VERSIONS_SINCE = "7d"
DEFAULT_COMPARE_SINCE = "24h"


class NotFound(LookupError):
    """Nothing to answer with: an unknown version, no baseline, no runs (HTTP 404)."""


@dataclass(frozen=True, slots=True)
class CompareAsk:
    kind: str
    tool: str  # "" for a prompt
    version: str
    baseline: str | None
    service: str | None
    agent: str | None
    alpha: float
    min_runs: int

    @property
    def what(self) -> str:
        """The candidate as the on-call names it."""
        if self.kind == PROMPT:
            return f"prompt_version {self.version}"
        return f"{self.tool} tool_version {self.version}"

    def matches(self, key: Slice) -> bool:
        return (
            key.kind == self.kind
            and key.tool == self.tool
            # `unknown` is how the metrics and alerts spell "none"
            and (self.service is None or label_matches(key.service, self.service))
            and (self.agent is None or label_matches(key.agent, self.agent))
        )


def _value(query: Mapping[str, str], name: str) -> str | None:
    if name not in query:
        return None
    return api_params.checked(api_params.filter_of(name), query[name], name, BadRequest)


def parse_compare(query: Mapping[str, str]) -> CompareAsk:
    """`prompt_version=V`, or `tool_name=T&tool_version=TV`; `baseline=W`, `service_name=`,
    `agent_name=`, `alpha=` (0.05), `min_runs=` (30)."""
    prompt = _value(query, "prompt_version")
    tool, tool_version = _value(query, "tool_name"), _value(query, "tool_version")
    if prompt is not None and (tool is not None or tool_version is not None):
        raise BadRequest("compare one thing: prompt_version, or tool_name with tool_version")
    if prompt is not None:
        kind, name, version = PROMPT, "", prompt
    elif tool is not None and tool_version is not None:
        kind, name, version = TOOL, tool, tool_version
    else:
        raise BadRequest("what to compare: prompt_version=V, or tool_name=T and tool_version=TV")
    baseline = _value(query, "baseline")
    if baseline == version:
        raise BadRequest(f"baseline {baseline!r} is the candidate itself: nothing to compare")
    try:
        alpha = float(query.get("alpha", "0.05"))
        min_runs = int(query.get("min_runs", "30"))
    except ValueError:
        raise BadRequest("alpha: a number in (0, 1); min_runs: a whole number") from None
    if not (0 < alpha < 1) or math.isnan(alpha):
        raise BadRequest(f"alpha {alpha:g}: expected a number in (0, 1), e.g. 0.05")
    if min_runs < 1:
        raise BadRequest(f"min_runs {min_runs}: expected at least 1")
    return CompareAsk(
        kind,
        name,
        version,
        baseline,
        _value(query, "service_name"),
        _value(query, "agent_name"),
        alpha,
        min_runs,
    )


def local_share(
    version_items: Iterable[tuple[Any, Any]],
    count_items: Iterable[tuple[Any, Any]],
    seconds: int,
    now: float,
) -> dict[str, Any]:
    """This worker's raw material: its versions rows and its slices' measures."""
    rows = history_of(version_items).rows()
    counts = sum_windows(count_items, COUNT_LABELS, list(COUNT_LABELS), seconds, now, "n")
    return {"versions": rows, "counts": counts}


def merged_history(shares: Iterable[Mapping[str, Any]]) -> History:
    history = History()
    for share in shares:
        for key, seen in history_from_rows(share.get("versions", ())).seen.items():
            history.add(key, seen)
    return history


def versions_rows(
    history: History,
    cutoff_ns: int,
    service: str | None = None,
    agent: str | None = None,
) -> list[dict[str, Any]]:
    """The versions seen since `cutoff_ns`, with their predecessors (which may be older)."""
    return [
        row
        for row in history.rows()
        if row["last_ns"] >= cutoff_ns
        and (service is None or label_matches(row["service_name"], service))
        and (agent is None or label_matches(row["agent_name"], agent))
    ]


def _measures(shares: Iterable[Mapping[str, Any]], keys: set[Slice]) -> dict[str, int]:
    wanted = {tuple(key.labels()) for key in keys}
    total: dict[str, int] = {}
    for share in shares:
        for row in share.get("counts", ()):
            labels = (
                row.get("kind"),
                row.get("service_name"),
                row.get("agent_name"),
                row.get("tool_name"),
                row.get("version"),
            )
            if labels in wanted:
                measure = str(row.get("measure"))
                total[measure] = total.get(measure, 0) + int(row.get("n", 0))
    return total


def _groups(candidates: list[Slice]) -> str:
    names = sorted({f"{k.service or 'unknown'}/{k.agent or 'unknown'}" for k in candidates})
    return ", ".join(names)


def answer_compare(
    ask: CompareAsk, shares: list[Mapping[str, Any]], covered: Mapping[str, str]
) -> dict[str, Any]:
    """The comparison of `ask` from every worker's share. NotFound / BadRequest when there
    is nothing to compare."""
    history = merged_history(shares)
    candidates = [k for k in history.seen if ask.matches(k) and k.version == ask.version]
    if not candidates:
        raise NotFound(
            f"no finished run of {ask.what} is known"
            + (f" in service {ask.service}" if ask.service else "")
            + ": `loopwatch query versions` lists the versions seen"
        )
    if ask.baseline is not None:
        base_name = ask.baseline
        chosen = "given"
    else:
        previous = {p.version for c in candidates if (p := history.previous(c)) is not None}
        if not previous:
            raise NotFound(
                f"{ask.what} is the first version seen in {_groups(candidates)}: "
                "nothing it replaced; name one with --baseline"
            )
        if len(previous) > 1:
            raise BadRequest(
                f"{ask.what} replaced different versions ({', '.join(sorted(previous))}) in "
                f"{_groups(candidates)}: choose with --baseline, or --service / --agent"
            )
        (base_name,) = previous
        chosen = "previous"
    # like with like: the service/agent/tool groups both versions ran in
    baselines = [
        k
        for k in history.seen
        if k.version == base_name and any(k.group == c.group for c in candidates)
    ]
    if not baselines:
        raise NotFound(
            f"no finished run of {base_name} is known beside {ask.what} ({_groups(candidates)})"
        )
    shared = {k.group for k in baselines}
    candidates = [c for c in candidates if c.group in shared]
    base_side = side_of(_measures(shares, set(baselines)))
    cand_side = side_of(_measures(shares, set(candidates)))
    window = covered.get("covers", "")
    for name, side in ((base_name, base_side), (ask.version, cand_side)):
        if side.runs == 0:
            raise NotFound(
                f"no finished run of {name} in the last {window} (the counts keep "
                f"{covered.get('kept', '')}): nothing to compare"
            )
    rows = comparing.compare(base_side, cand_side, alpha=ask.alpha, min_runs=ask.min_runs)
    doc = comparing.document(rows, base_side, cand_side, alpha=ask.alpha, min_runs=ask.min_runs)
    doc["baseline"].update(version=base_name, chosen=chosen)
    doc["candidate"].update(version=ask.version)
    first = {k: history.seen[k].first_ns for k in (*baselines, *candidates)}
    doc["baseline"]["first_ns"] = min(first[k] for k in baselines)
    doc["candidate"]["first_ns"] = min(first[k] for k in candidates)
    return {
        "kind": ask.kind,
        "tool_name": ask.tool or None,
        "service_name": ask.service,
        "agent_name": ask.agent,
        **covered,
        **doc,
    }


__all__ = [
    "COUNT_LABELS",
    "DEFAULT_COMPARE_SINCE",
    "DEFAULT_VERSIONS_SINCE",
    "PROMPT",
    "TOOL",
    "CompareAsk",
    "NotFound",
    "answer_compare",
    "local_share",
    "merged_history",
    "parse_compare",
    "versions_rows",
]
