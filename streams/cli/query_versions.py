"""`loopwatch query versions` and `loopwatch query compare`: which version replaced which,
and whether a version loops more than the one before (GET /versions, GET /compare).

    loopwatch query versions [--service S] [--agent A] [--since 7d]
    loopwatch query compare --prompt-version V [--baseline W] [--since 24h]
    loopwatch query compare --tool T --tool-version TV [--baseline W] [--since 24h]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from detectors.compare import BETTER, OVERALL, SAME, TOO_FEW, WORSE
from detectors.errors import LoopwatchError
from streams.cli.comparison import comparison_blocks
from streams.cli.render import Block, covered, table, utc, write
from streams.worker.api.versions import DEFAULT_COMPARE_SINCE, DEFAULT_VERSIONS_SINCE

VERSION_COLUMNS = (
    "kind",
    "service",
    "agent",
    "tool",
    "version",
    "replaced",
    "first seen",
    "last seen",
    "runs",
)


def default_since(what: str) -> str:
    return DEFAULT_VERSIONS_SINCE if what == "versions" else DEFAULT_COMPARE_SINCE


def request(
    what: str, args: argparse.Namespace, since: str, where: dict[str, str]
) -> tuple[str, dict[str, str]]:
    """The path and parameters of `query versions` / `query compare`; LoopwatchError for a
    combination the API would refuse."""
    if what == "versions":
        extra = sorted(set(where) - {"service_name", "agent_name"})
        if extra:
            raise LoopwatchError("`loopwatch query versions` filters by --service and --agent only")
        if args.baseline is not None:
            raise LoopwatchError("--baseline is for `loopwatch query compare`")
        return "/versions", {"since": since, **where}
    if "shape" in where:
        raise LoopwatchError("`loopwatch query compare` compares every shape: drop --shape")
    prompt = where.get("prompt_version")
    tool, tool_version = where.get("tool_name"), where.get("tool_version")
    if prompt is not None and (tool or tool_version):
        raise LoopwatchError(
            "compare one thing: --prompt-version V, or --tool T with --tool-version TV"
        )
    if prompt is None and not (tool and tool_version):
        raise LoopwatchError(
            "what to compare: --prompt-version V, or --tool T with --tool-version TV"
        )
    baseline = args.baseline.strip() if args.baseline is not None else None
    if baseline is not None and baseline in (prompt, tool_version):
        raise LoopwatchError(f"--baseline {baseline} is the candidate itself: nothing to compare")
    params = {"since": since, **where}
    if baseline:
        params["baseline"] = baseline
    if args.alpha is not None:
        params["alpha"] = repr(args.alpha)
    if args.min_runs is not None:
        params["min_runs"] = str(args.min_runs)
    return "/compare", params


def _utc(ns: Any) -> str:
    return utc(ns, "%Y-%m-%d %H:%M")


def render_versions(doc: Any, since: str) -> list[Block]:
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise LoopwatchError("unexpected answer from the on-call API for versions: no rows list")
    if not rows:
        return [f"no version finished a run in the last {since}"]
    cells = [
        [
            str(r.get("kind") or "-"),
            str(r.get("service_name") or "-"),
            str(r.get("agent_name") or "-"),
            str(r.get("tool_name") or "-"),
            str(r.get("version") or "-"),
            str(r.get("previous") or "(first)"),
            _utc(r.get("first_ns")),
            _utc(r.get("last_ns")),
            f"{int(r.get('runs') or 0):,}",
        ]
        for r in rows
    ]
    return [
        table(list(VERSION_COLUMNS), cells, {8}),
        f"{len(rows)} version{'s' if len(rows) != 1 else ''} seen in the last {since}; "
        "runs: finished since first seen; replaced: the version first seen just before",
    ]


def verdict_line(doc: dict[str, Any]) -> str:
    base, cand = doc["baseline"], doc["candidate"]
    overall = next((r for r in doc["rows"] if r["shape"] == OVERALL), None)
    if overall is None:
        return "verdict: nothing to compare"
    b, c = overall["baseline"], overall["candidate"]
    counts = (
        f"{c['looping']}/{c['runs']} looping runs against {b['looping']}/{b['runs']}, "
        f"p={overall['p_value']:.2g}"
    )
    verdict = overall["verdict"]
    worse_shapes = [r["shape"] for r in doc["rows"] if r["verdict"] == WORSE and r is not overall]
    if verdict == WORSE:
        text = f"WORSE: {cand['version']} loops more than {base['version']} ({counts})"
    elif verdict == BETTER:
        text = f"better: {cand['version']} loops less than {base['version']} ({counts})"
    elif verdict == SAME:
        text = f"no evidence of a difference ({counts})"
    elif verdict == TOO_FEW:
        needed = overall.get("runs_needed")
        text = f"not enough runs to tell ({counts}; a verdict needs {doc['min_runs']} a side"
        text += f", a difference this size about {needed:,})" if needed else ")"
    else:
        text = verdict
    if worse_shapes and verdict != WORSE:
        text += f"; worse in {', '.join(worse_shapes)}"
    if cand.get("duplicate_side_effects"):
        text += f"; {cand['duplicate_side_effects']} run(s) of {cand['version']} duplicated a side effect"
    return "verdict: " + text


def render_compare(doc: Any, since: str) -> list[Block]:
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("rows"), list)
        or not all(isinstance(doc.get(k), dict) for k in ("baseline", "candidate"))
    ):
        raise LoopwatchError(
            "unexpected answer from the on-call API for compare: no rows, baseline, candidate"
        )
    base, cand = doc["baseline"], doc["candidate"]
    what = (
        "prompt_version" if doc.get("kind") == "prompt" else f"{doc.get('tool_name')} tool_version"
    )
    how = "the version it replaced" if base.get("chosen") == "previous" else "--baseline"
    scope = ", ".join(
        f"{k.split('_')[0]} {doc[k]}" for k in ("service_name", "agent_name") if doc.get(k)
    )
    return [
        f"{what} {cand.get('version')} against {base.get('version')} ({how}), finished runs in the "
        f"last {covered(doc, since)}" + (f", {scope}" if scope else ""),
        "",
        *comparison_blocks(doc, str(base.get("version")), str(cand.get("version"))),
        verdict_line(doc),
    ]


def show(what: str, doc: Any, since: str) -> None:
    lines = render_versions(doc, since) if what == "versions" else render_compare(doc, since)
    write(lines, sys.stdout)
