"""`loopwatch query`: a small client for the worker's on-call HTTP API (stdlib only).

    loopwatch query loops [--by shape,prompt_version,tool_version] [--since 1h]  GET /loops
    loopwatch query runs  [--since 1h]                                            GET /runs
    loopwatch query run RUN_ID                                                    GET /runs/ID
    loopwatch query versions [--service S] [--since 7d]                           GET /versions
    loopwatch query compare --prompt-version V [--baseline W] [--since 24h]       GET /compare
    loopwatch query holds [--since 24h]                               GET /holds, /hold-counts

The API is at --url, else $LOOPWATCH_API, else http://127.0.0.1:6066; a bearer token is sent
when $LOOPWATCH_API_TOKEN is set. Answers are rendered as aligned tables (largest count
first) or, with --json, printed as the server sent them. Arguments are checked before any
request; every failure is one LoopwatchError line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from detectors.errors import LoopwatchError
from streams.cli import query_holds, query_versions
from streams.cli.client import DEFAULT_API, ApiClient, base_url
from streams.cli.render import Block, covered, table, utc, write
from streams.worker.api import params as api_params

__all__ = [
    "DEFAULT_API",
    "ApiClient",
    "cmd_query",
    "parse_by",
    "parse_since",
    "render_loops",
    "render_run",
    "render_runs",
]

DIGEST_CHARS = 12  # fingerprints/digests are shortened in tables (--json has them whole)
MAX_CELL = 60

STEP_COLUMNS = ("position", "span_id", "tool_name", "action_fp", "outcome_digest", "error_code")
FINDING_COLUMNS = (
    "shape",
    "severity",
    "tool_name",
    "count",
    "first_sequence",
    "last_sequence",
    "trigger_span_id",
    "recommended_action",
)


# ---------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------


def parse_since(text: str) -> str:
    """`--since` (streams/worker/api/params.py: the API's rule) -> its canonical text."""
    return api_params.checked(api_params.parse_since, text, "--since", LoopwatchError)[0]


def parse_by(text: str) -> list[str]:
    """`--by` (streams/worker/api/params.py: the API's rule) -> the labels."""
    return api_params.checked(api_params.parse_by, text, "--by", LoopwatchError)


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3g}"
    if isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    text = " ".join(text.split())  # no control characters or line breaks in a table
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def _digest(value: Any) -> str:
    if isinstance(value, str) and len(value) > DIGEST_CHARS + 1:
        return value[:DIGEST_CHARS] + "…"
    return _cell(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _rows(doc: Any, what: str) -> list[dict[str, Any]]:
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise LoopwatchError(f"unexpected answer from the on-call API for {what}: no rows list")
    return rows


FILTER_FLAGS = {
    "shape": "--shape",
    "prompt_version": "--prompt-version",
    "tool_name": "--tool",
    "tool_version": "--tool-version",
    "service_name": "--service",
    "agent_name": "--agent",
}


def parse_where(args: argparse.Namespace) -> dict[str, str]:
    """The label filters given (`--shape`, `--prompt-version`, `--tool`, `--tool-version`)."""
    given = {label: getattr(args, f"where_{label}", None) for label in FILTER_FLAGS}
    return {
        label: api_params.checked(
            api_params.filter_of(label), value, FILTER_FLAGS[label], LoopwatchError
        )
        for label, value in given.items()
        if value is not None
    }


def render_loops(
    doc: Any, by: Sequence[str], since: str, where: Mapping[str, str] | None = None
) -> list[Block]:
    """GET /loops answer -> table lines, groups with most events first."""
    rows = _rows(doc, "loops")
    labels = doc.get("by") if isinstance(doc.get("by"), list) else list(by)
    since = covered(doc, since, where)
    if not rows:
        return [f"no loop events in the last {since}"]
    ordered = sorted(
        rows,
        key=lambda r: (-_count(r.get("events")), [_cell(r.get(label)) for label in labels]),
    )
    spread = any("looping_runs" in r for r in rows)  # runs, first and last seen
    cells = []
    for r in ordered:
        row = [_cell(r.get(label)) for label in labels] + [_cell(r.get("events"))]
        if spread:
            row += [
                _cell(r.get("looping_runs")),
                utc(r.get("first_ns")),
                utc(r.get("last_ns")),
            ]
        cells.append(row)
    total = sum(_count(r.get("events")) for r in rows)
    headers = [*labels, "events"] + (["runs", "first_seen", "last_seen"] if spread else [])
    right = {len(labels)} | ({len(labels) + 1} if spread else set())
    footer = f"{total:,} loop event{'s' if total != 1 else ''} in the last {since}"
    if doc.get("runs_partial"):
        footer += " (runs and first/last seen from the latest episodes only)"
    return [table(headers, cells, right), footer]


EPISODE_COLUMNS = (
    "detected",
    "run",
    "shape",
    "tool",
    "count",
    "wasted_steps",
    "wasted_tokens",
    "run_status",
    "trace",
)


def unique_prefix(ids: Sequence[str], least: int = 12) -> int:
    """How many leading characters keep these ids apart (at least `least`)."""
    distinct = set(ids)
    for n in range(least, max((len(i) for i in distinct), default=least) + 1):
        if len({i[:n] for i in distinct}) == len(distinct):
            return n
    return max((len(i) for i in distinct), default=least)


def render_episodes(doc: Any, since: str, where: Mapping[str, str]) -> list[Block]:
    """GET /episodes answer -> the runs behind the slice, newest first."""
    rows = _rows(doc, "episodes")
    window = covered(doc, since, where)
    if not rows:
        return [f"no loop episodes in the last {window}"]
    width = unique_prefix([str(r.get("run_id", "")) for r in rows])
    cells = []
    for r in rows:
        status = r.get("run_status") or "-"
        if status == "finished":
            status = f"{r.get('outcome') or '-'}/{r.get('termination_reason') or '-'}"
        tool = r.get("tool_name") or "-"
        if r.get("tool_version"):
            tool += f"@{r['tool_version']}"
        cells.append(
            [
                utc(r.get("detected_ns")),
                str(r.get("run_id", "-"))[:width],
                _cell(r.get("shape")),
                tool,
                _cell(r.get("count")),
                _cell(r.get("wasted_steps")),
                _cell(r.get("wasted_tokens")),
                status,
                " ".join(str(r.get("trace_url") or r.get("trace_id") or "-").split()),
            ]
        )
    runs = len({r.get("run_id") for r in rows})
    return [
        table(list(EPISODE_COLUMNS), cells, {4, 5, 6}),
        f"{len(rows)} latest loop episode{'s' if len(rows) != 1 else ''} of {runs} "
        f"run{'s' if runs != 1 else ''} in the last {window}; `loopwatch query run RUN` "
        "shows one",
    ]


RUN_COLUMNS = ("prompt_version", "outcome", "termination_reason")


def render_runs(doc: Any, since: str) -> list[Block]:
    """GET /runs answer -> table lines, most runs first."""
    rows = _rows(doc, "runs")
    since = covered(doc, since)
    if not rows:
        return [f"no finished runs in the last {since}"]
    ordered = sorted(
        rows, key=lambda r: (-_count(r.get("runs")), [_cell(r.get(c)) for c in RUN_COLUMNS])
    )
    cells = [[_cell(r.get(c)) for c in RUN_COLUMNS] + [_cell(r.get("runs"))] for r in ordered]
    total = sum(_count(r.get("runs")) for r in rows)
    return [
        table([*RUN_COLUMNS, "runs"], cells, {len(RUN_COLUMNS)}),
        f"{total:,} run{'s' if total != 1 else ''} finished in the last {since}",
    ]


def _columns(items: list[dict[str, Any]], preferred: Sequence[str]) -> list[str]:
    present = [c for c in preferred if any(c in item for item in items)]
    if present:
        return present
    seen: dict[str, None] = {}
    for item in items:
        for key, value in item.items():
            if not isinstance(value, dict | list):
                seen.setdefault(key, None)
    return list(seen)


def _item_table(items: list[dict[str, Any]], columns: Sequence[str]) -> Block:
    digests = {"action_fp", "outcome_digest", "fingerprint"}
    cells = [[(_digest if c in digests else _cell)(item.get(c)) for c in columns] for item in items]
    right = {i for i, c in enumerate(columns) if any(_is_number(item.get(c)) for item in items)}
    return table(list(columns), cells, right, indent=2)


SUMMARY_FIELDS = (
    "outcome",
    "termination_reason",
    "termination_evidence",
    "prompt_version",
    "agent_name",
    "service_name",
    "shapes",
    "steps",
    "tool_calls",
    "distinct_actions",
    "tokens",
    "duplicate_spans",
    "late_spans",
)
EVENT_COLUMNS = (
    "detected_at",
    "shape",
    "severity",
    "tool_name",
    "count",
    "wasted_steps",
    "wasted_tokens",
    "recommended_action",
    "trigger_span_id",
)
TIMELINE_COLUMNS = (
    "position",
    "span_id",
    "tool_name",
    "action_fp",
    "outcome_digest",
    "error_code",
)


def render_finished_run(doc: dict[str, Any]) -> list[Block]:
    """A finished run kept by the worker: its summary, its loop events, its last tool steps."""
    lines: list[Block] = [
        f"run       {_cell(doc.get('run_id'))}",
        "status    finished" + _kept_until(doc.get("kept_until_ns")),
    ]
    if doc.get("trace_url"):
        lines.append("trace     " + " ".join(str(doc["trace_url"]).split()))
    summary = doc.get("summary")
    if isinstance(summary, dict):
        present = [k for k in SUMMARY_FIELDS if summary.get(k) not in (None, "", [])]
        lines.append("summary")
        width = max((len(k) for k in present), default=0)
        lines += [f"  {k:<{width}}  {_cell(summary[k])}" for k in present]
    events = [e for e in doc.get("events") or [] if isinstance(e, dict)]
    lines.append(f"loop events ({len(events)})")
    if events:
        lines.append(_item_table(events, _columns(events, EVENT_COLUMNS)))
    steps = [s for s in doc.get("timeline") or [] if isinstance(s, dict)]
    if steps:
        steps.sort(key=lambda s: _count(s.get("position")))
        lines.append(f"last tool steps ({len(steps)})")
        lines.append(_item_table(steps, TIMELINE_COLUMNS))
    lines += render_side_effects(doc)
    return lines


SIDE_EFFECT_COLUMNS = (
    "at",
    "tool",
    "business",
    "idempotency_key",
    "outcome",
    "reconciled",
    "committed_before_first_loop",
    "span_id",
)


def render_side_effects(doc: dict[str, Any]) -> list[Block]:
    """The run's side-effect calls: did a refund already go out, before the loop?"""
    calls = [c for c in doc.get("side_effects") or [] if isinstance(c, dict)]
    if not calls:
        return []
    rows = [{**c, "at": utc(c.get("end_ns"), "%H:%M:%S")} for c in calls]
    committed = sum(1 for c in calls if c.get("committed_before_first_loop"))
    head = f"side effects ({len(calls)})"
    if committed:
        head += f": {committed} committed before the first loop event"
    return [head, _item_table(rows, SIDE_EFFECT_COLUMNS)]


def _kept_until(ns: Any) -> str:
    when = utc(ns, "%Y-%m-%d %H:%M UTC")
    return "" if when == "-" else f" (kept until {when})"


def not_found(run_id: str, doc: Any) -> LoopwatchError:
    retention = doc.get("retention") if isinstance(doc, dict) else None
    if isinstance(retention, dict):
        looping = _hours(retention.get("looping_hours"))
        clean = _hours(retention.get("clean_hours"))
        return LoopwatchError(
            f"run {run_id} not found: not in flight, and not among the runs finished in the "
            f"last {looping} (runs without loops: {clean}; LOOPWATCH_RUN_RETENTION_HOURS)"
        )
    return LoopwatchError(f"run {run_id} not found (finished runs are in loop_runs)")


_HEX_PREFIX = re.compile(r"[0-9a-f]{8,64}").fullmatch


def resolve_prefix(client: ApiClient, prefix: str, miss: dict[str, Any]) -> str:
    """The one run whose id starts with `prefix` (GET /find, every worker); not found or
    ambiguous: one LoopwatchError listing the candidates."""
    try:
        _status, _body, doc = client.get("/find", {"run": prefix})
    except urllib.error.HTTPError as exc:
        raise client.http_error(exc, "/find") from None
    matches = [m for m in (doc or {}).get("matches", []) if isinstance(m, dict)]
    if not matches:
        raise not_found(prefix, doc if isinstance(doc, dict) and "retention" in doc else miss)
    if len(matches) == 1:
        return str(matches[0]["run_id"])
    listed = "; ".join(
        f"{m['run_id']} ({m.get('status', '?')}"
        + (f", {', '.join(m['shapes'])}" if m.get("shapes") else "")
        + ")"
        for m in matches[:10]
    )
    more = f" and {len(matches) - 10} more" if len(matches) > 10 else ""
    raise LoopwatchError(
        f"{len(matches)} runs start with {prefix}: {listed}{more}; give more characters"
    )


def _hours(value: Any) -> str:
    if not isinstance(value, int | float):
        return "?"
    return f"{value / 24:g}d" if value >= 48 and value % 24 == 0 else f"{value:g}h"


def render_run(doc: Any) -> list[Block]:
    """GET /runs/ID answer -> a header block, the run state, its steps and its findings."""
    if not isinstance(doc, dict):
        raise LoopwatchError("unexpected answer from the on-call API for a run: not an object")
    if "summary" in doc:
        return render_finished_run(doc)
    finished = doc.get("finished")
    lines: list[Block] = [
        f"run       {_cell(doc.get('run_id'))}",
        f"status    {'finished' if finished else 'in progress'}",
    ]
    if doc.get("trace_url"):
        lines.append("trace     " + " ".join(str(doc["trace_url"]).split()))  # whole: a link
    state = doc.get("state")
    if isinstance(state, dict) and state:
        lines.append("state")
        width = max(len(str(k)) for k in state)
        for key in sorted(state, key=str):
            lines.append(f"  {str(key):<{width}}  {_cell(state[key])}")
    steps = [s for s in doc.get("steps") or [] if isinstance(s, dict)]
    steps.sort(key=lambda s: _count(s.get("position")))
    lines.append(f"steps ({len(steps)})")
    if steps:
        lines.append(_item_table(steps, STEP_COLUMNS))
    findings = [f for f in doc.get("findings") or [] if isinstance(f, dict)]
    lines.append(f"findings ({len(findings)})")
    if findings:
        lines.append(_item_table(findings, _columns(findings, FINDING_COLUMNS)))
    lines += render_side_effects(doc)
    return lines


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------


def _print_json(body: bytes) -> None:
    text = body.decode("utf-8", "replace").strip()
    sys.stdout.write(text + "\n")


def cmd_query(args: argparse.Namespace) -> int:
    what = args.what
    run_id = args.run_id
    if what == "run":
        if not run_id or not run_id.strip():
            raise LoopwatchError("`loopwatch query run` needs a RUN_ID")
    elif run_id is not None:
        raise LoopwatchError(f"`loopwatch query {what}` takes no RUN_ID (did you mean `run`?)")
    comparing = what in ("versions", "compare")
    since_text = args.since
    if since_text is None:
        since_text = (
            query_versions.default_since(what)
            if comparing
            else query_holds.DEFAULT_SINCE
            if what == "holds"
            else "1h"
        )
    since = parse_since(since_text) if what != "run" else ""
    by = parse_by(args.by) if what == "loops" else []
    where = parse_where(args)
    if where and what not in ("loops", "versions", "compare"):
        raise LoopwatchError(f"`loopwatch query {what}` takes no label filter (they are for loops)")
    if not comparing and (
        getattr(args, "baseline", None) is not None
        or getattr(args, "alpha", None) is not None
        or getattr(args, "min_runs", None) is not None
    ):
        raise LoopwatchError("--baseline, --alpha and --min-runs are for `loopwatch query compare`")
    episodes = bool(getattr(args, "runs", False))
    if episodes and what != "loops":
        raise LoopwatchError("--runs lists the runs behind a slice of `loopwatch query loops`")
    limit = int(getattr(args, "limit", 20) or 20)
    timeout = float(getattr(args, "timeout", None) or 10.0)
    if timeout <= 0:
        raise LoopwatchError("--timeout must be positive")
    client = ApiClient(base_url(args.url), os.environ.get("LOOPWATCH_API_TOKEN"), timeout)
    if what == "holds":
        seconds = api_params.parse_since(since)[1]
        try:
            return query_holds.show(client, since, seconds, bool(args.json), time.time_ns())
        except urllib.error.HTTPError as exc:
            raise client.http_error(exc, "/hold-counts") from None

    params: dict[str, str]
    if comparing:
        path, params = query_versions.request(what, args, since, where)
    elif what == "run":
        path = "/runs/" + urllib.parse.quote(run_id, safe="")
        params = {}
    elif what == "loops" and episodes:
        path, params = "/episodes", {"since": since, "limit": str(limit), **where}
    elif what == "loops":
        path, params = "/loops", {"by": ",".join(by), "since": since, **where}
    else:
        path, params = "/runs", {"since": since}
    try:
        _status, body, doc = client.get(path, params)
    except urllib.error.HTTPError as exc:
        if what == "run" and exc.code == 404:
            exc.close()
            raise LoopwatchError(
                f"run {run_id} not found (finished runs are in loop_runs)"
            ) from None
        raise client.http_error(exc, path) from None
    if what == "run" and isinstance(doc, dict) and doc.get("found") is False:
        # not an id: a prefix as the tables print it (at least 8 hex characters)?
        if not _HEX_PREFIX(run_id.strip().lower()):
            raise not_found(run_id, doc)
        run_id = resolve_prefix(client, run_id.strip().lower(), doc)
        path = "/runs/" + urllib.parse.quote(run_id, safe="")
        _status, body, doc = client.get(path, {})
        if isinstance(doc, dict) and doc.get("found") is False:  # gone in between
            raise not_found(run_id, doc)

    if args.json:
        _print_json(body)
        return 0
    if comparing:
        query_versions.show(what, doc, since)
        return 0
    if what == "loops" and episodes:
        lines = render_episodes(doc, since, where)
    elif what == "loops":
        lines = render_loops(doc, by, since, where)
    elif what == "runs":
        lines = render_runs(doc, since)
    else:
        lines = render_run(doc)
    write(lines, sys.stdout)
    return 0
