"""The on-call API's answers, computed without faust: query parameters, the windowed count
tables' sums, the /runs/{run_id} view of a run's state, the bearer token check. The faust views
that serve them: streams/worker/api/views.py."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from alerts.trace_links import TraceLinks
from detectors.model import NS
from detectors.recovery import event_id
from detectors.state import WIN_ACTION, WIN_CODE, WIN_OUTCOME, WIN_POS, WIN_SPAN, WIN_TOOL
from streams.worker.api import params as api_params
from streams.worker.api.params import DEFAULT_LOOP_BY, DEFAULT_SINCE, LOOP_LABELS
from streams.worker.state import episodes, retained
from streams.worker.state.retained import Retention
from streams.worker.state.store import decode_envelope
from streams.worker.state.window_keys import iter_window_counts


class BadRequest(ValueError):
    """A malformed query parameter (HTTP 400)."""


class PeerError(RuntimeError):
    """Another worker did not answer its share of an aggregate (HTTP 503)."""


def parse_since(text: str | None) -> tuple[str, int]:
    """`since=` (streams/worker/api/params.py; default 1h) -> (its text, seconds). The windowed
    counters keep 24 h, so a longer window covers what is kept."""
    since = text if text is not None else DEFAULT_SINCE
    return api_params.checked(api_params.parse_since, since, "since", BadRequest)


def window(since: str, seconds: int, kept_seconds: int) -> tuple[dict[str, str], int]:
    """What an answer covers: the window asked for, or what the counters keep when that is
    shorter (said in the answer, never silently less) -> (its fields, seconds to sum)."""
    covers = min(seconds, kept_seconds)
    fields = {
        "since": since,
        "covers": since if covers == seconds else api_params.duration_text(covers),
        "kept": api_params.duration_text(kept_seconds),
    }
    return fields, covers


def parse_by(text: str | None) -> list[str]:
    """`by=` (streams/worker/api/params.py; default every label of /loops)."""
    if text is None:
        return list(DEFAULT_LOOP_BY)
    return api_params.checked(api_params.parse_by, text, "by", BadRequest)


def parse_filters(query: Mapping[str, str]) -> dict[str, str]:
    """The label filters of GET /loops (`shape=`, `prompt_version=`, `tool_name=`,
    `tool_version=`)."""
    return {
        label: api_params.checked(api_params.filter_of(label), query[label], label, BadRequest)
        for label in LOOP_LABELS
        if label in query
    }


def label_matches(value: Any, want: str) -> bool:
    """A label filter: the value as given, `unknown` for none (as the metrics spell it)."""
    return (value if value is not None else "unknown") == want


def sum_windows(
    items: Iterable[tuple[Any, Any]],
    names: tuple[str, ...],
    by: list[str],
    since_seconds: int,
    now: float,
    value_name: str,
    where: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Counts of the windows that ended within `since_seconds`, grouped by `by`; `where`:
    only the counts whose labels have these values (`unknown` matches none)."""
    cutoff = now - since_seconds
    totals: dict[tuple[Any, ...], int] = {}
    positions = [names.index(label) for label in by]
    tests = [(names.index(label), want) for label, want in (where or {}).items()]
    for labels, end, count in iter_window_counts(items):
        if len(labels) == 3 and names == LOOP_LABELS:
            # written before tool, service and agent were labels (a day of counts at most)
            labels = [labels[0], labels[1], None, labels[2], None, None]
        if end < cutoff or len(labels) != len(names):
            continue
        if not all(label_matches(labels[i], want) for i, want in tests):
            continue
        group = tuple(labels[i] for i in positions)
        totals[group] = totals.get(group, 0) + count
    rows = [{**dict(zip(by, group, strict=True)), value_name: n} for group, n in totals.items()]
    rows.sort(key=lambda r: (-r[value_name], json.dumps([r[b] for b in by])))
    return rows


def merge_rows(
    rows: Iterable[dict[str, Any]], by: list[str], value_name: str
) -> list[dict[str, Any]]:
    """Rows of several workers: counts and distinct runs add up (a run lives in one
    partition), first seen is the earliest, last seen the latest."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        group = tuple(row.get(b) for b in by)
        into = merged.setdefault(group, {**dict(zip(by, group, strict=True)), value_name: 0})
        into[value_name] += int(row.get(value_name, 0))
        if "looping_runs" in row:
            into["looping_runs"] = into.get("looping_runs", 0) + int(row["looping_runs"])
            for name, pick in (("first_ns", min), ("last_ns", max)):
                if row.get(name):
                    into[name] = pick(into[name], row[name]) if into.get(name) else row[name]
    out = list(merged.values())
    out.sort(key=lambda r: (-r[value_name], json.dumps([r[b] for b in by])))
    return out


def episodes_since(
    episodes_table: Any,
    partition: int,
    newest: Callable[[Any, int], Iterable[tuple[bytes, bytes]]],
    cutoff_ns: int,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """A partition's episodes listed at or after `cutoff_ns`, newest first, with the time
    each was listed."""
    for key, raw in newest(episodes_table, partition):
        at = episodes.key_ns(key)
        if at < cutoff_ns:
            return
        yield at, episodes.decode(raw)


def episode_matches(episode: Mapping[str, Any], where: Mapping[str, str]) -> bool:
    return all(label_matches(episode.get(label), want) for label, want in where.items())


EPISODE_SCAN_CAP = 200_000  # episodes read for one /loops answer's runs and first/last seen


def add_spread(
    rows: list[dict[str, Any]],
    by: list[str],
    partitions: Iterable[int],
    episodes_table: Any,
    newest: Callable[[Any, int], Iterable[tuple[bytes, bytes]]],
    cutoff_ns: int,
    where: Mapping[str, str],
    cap: int = EPISODE_SCAN_CAP,
) -> bool:
    """Add to each row how many distinct runs its episodes came from and when the first
    and the last were listed (one run stuck, or a loop spreading: runbook step 3), from
    the episodes since `cutoff_ns`. Returns False when the cap cut the scan short."""
    spread: dict[tuple[Any, ...], dict[str, Any]] = {}
    scanned = 0
    for partition in sorted(partitions):
        for at, episode in episodes_since(episodes_table, partition, newest, cutoff_ns):
            scanned += 1
            if scanned > cap:
                break
            if not episode_matches(episode, where):
                continue
            group = tuple(episode.get(b) for b in by)
            s = spread.setdefault(group, {"runs": set(), "first_ns": at, "last_ns": at})
            s["runs"].add(episode.get("run_id"))
            s["first_ns"], s["last_ns"] = min(s["first_ns"], at), max(s["last_ns"], at)
    for row in rows:
        found = spread.get(tuple(row.get(b) for b in by))
        row["looping_runs"] = len(found["runs"]) if found else 0
        if found:
            row["first_ns"], row["last_ns"] = found["first_ns"], found["last_ns"]
    return scanned <= cap


def fired(run_id: str, state: Any) -> list[dict[str, Any]]:
    """The episodes a run's state says fired ("shape|key" markers), with their event ids."""
    found = []
    for marker in state.fired:
        shape, _, key = marker.partition("|")
        found.append({"shape": shape, "episode": key, "event_id": event_id(run_id, shape, key)})
    return found


def run_view(
    run_id: str, raw: bytes | None, finished: bool, links: TraceLinks | None = None
) -> dict[str, Any]:
    """GET /runs/{run_id}: bounded state, digests only; `trace_url` with LOOPWATCH_TRACE_URL."""
    if raw is None:
        return {
            "run_id": run_id,
            "found": False,
            "finished": finished,
            "state": None,
            "steps": [],
            "findings": [],
        }
    env, state = decode_envelope(raw)
    findings = fired(run_id, state)
    doc: dict[str, Any] = {
        "run_id": run_id,
        "found": True,
        "finished": finished,
        "state": {
            "steps": state.position,
            "tool_calls": state.tool_calls,
            "spans": state.spans,
            "duplicate_spans": state.duplicate_spans,
            "late_spans": state.late_spans,
            "pending": len(state.pending),
            "shapes": list(state.shapes),
            "prompt_version": state.prompt_version,
            "agent_name": state.agent_name,
            "termination": state.termination,
            "root_seen": state.root_seen,
            "last_span_arrived_at": round(env.seen_ns / NS, 3),
        },
        "steps": [
            {
                "position": entry[WIN_POS],
                "span_id": entry[WIN_SPAN],
                "tool_name": entry[WIN_TOOL],
                "action_fp": entry[WIN_ACTION],
                "outcome_digest": entry[WIN_OUTCOME],
                "error_code": entry[WIN_CODE],
            }
            for entry in state.window
        ],
        "findings": findings,
    }
    if links is not None:
        doc["trace_url"] = links.url(state.trace_id, None, run_id)
    return doc


def retained_view(
    run_id: str, raw: bytes, retention: Retention, links: TraceLinks | None = None
) -> dict[str, Any]:
    """GET /runs/{run_id} for a finished run kept in the retained table."""
    doc = retained.view(run_id, raw, retention)
    summary = doc.get("summary") or {}
    if links is not None and "trace_url" not in summary:
        doc["trace_url"] = links.url(summary.get("trace_id"), None, run_id)
    elif summary.get("trace_url"):
        doc["trace_url"] = summary["trace_url"]
    return doc


MIN_PREFIX = 8  # hex characters: what every table prints of a run id
MAX_MATCHES = 20
_HEX = frozenset("0123456789abcdef")


def parse_prefix(text: str | None) -> str:
    """`run=` of GET /find: at least MIN_PREFIX lowercase hex characters."""
    value = (text or "").strip().lower()
    if len(value) < MIN_PREFIX or len(value) > 64 or not set(value) <= _HEX:
        raise BadRequest(f"run {text!r}: expected {MIN_PREFIX} to 64 hex characters of a run id")
    return value


def find_runs(
    prefix: str,
    partitions: Iterable[int],
    runs: Any,
    retained_table: Any,
    scan: Callable[[Any, int, bytes, int], list[tuple[bytes, bytes]]],
) -> list[dict[str, Any]]:
    """The runs of these partitions whose id starts with `prefix`: in flight (the runs
    table) or finished and kept (the retained table), at most MAX_MATCHES."""
    key = prefix.encode()
    found: dict[str, dict[str, Any]] = {}
    for partition in sorted(partitions):
        for k, _raw in scan(runs, partition, key, MAX_MATCHES):
            found.setdefault(k.decode("utf-8", "replace"), {"status": "in progress"})
        if retained_table is None:
            continue
        for k, raw in scan(retained_table, partition, key, MAX_MATCHES):
            run_id = k.decode("utf-8", "replace")
            done = retained.finished(raw)
            if done is not None and run_id not in found:
                finished_ns, summary = done
                found[run_id] = {
                    "status": "finished",
                    "finished_at_ns": finished_ns,
                    "outcome": summary.get("outcome"),
                    "shapes": summary.get("shapes", []),
                }
    return [{"run_id": r, **found[r]} for r in sorted(found)][:MAX_MATCHES]


MAX_EPISODES = 50


def parse_limit(text: str | None) -> int:
    """`limit=` of GET /episodes: 1 to MAX_EPISODES (default 20)."""
    if text is None:
        return 20
    value = text.strip()
    if not value.isdigit() or not 1 <= int(value) <= MAX_EPISODES:
        raise BadRequest(f"limit {text!r}: expected a whole number from 1 to {MAX_EPISODES}")
    return int(value)


def recent_episodes(
    partitions: Iterable[int],
    episodes_table: Any,
    retained_table: Any,
    newest: Callable[[Any, int], Iterable[tuple[bytes, bytes]]],
    cutoff_ns: int,
    where: Mapping[str, str],
    limit: int = MAX_EPISODES,
) -> list[dict[str, Any]]:
    """The latest loop episodes of these partitions detected at or after `cutoff_ns` that
    match the label filters, newest first, at most `limit`; a finished run's episodes say
    how it ended (from its retained summary)."""
    rows: list[dict[str, Any]] = []
    for partition in sorted(partitions):
        taken = 0
        for at, episode in episodes_since(episodes_table, partition, newest, cutoff_ns):
            if not episode_matches(episode, where):
                continue
            rows.append({"detected_ns": at, **episode})
            taken += 1
            if taken >= limit:
                break
    rows = merge_episodes([rows], limit)
    for row in rows:
        row["run_status"] = "in progress"
        kept = (
            retained_table.get(str(row.get("run_id", "")).encode())
            if retained_table is not None
            else None
        )
        done = retained.finished(kept) if kept is not None else None
        if done is not None:
            summary = done[1]
            row["run_status"] = "finished"
            row["outcome"] = summary.get("outcome")
            row["termination_reason"] = summary.get("termination_reason")
    return rows


def merge_episodes(
    lists: Iterable[list[dict[str, Any]]], limit: int = MAX_EPISODES
) -> list[dict[str, Any]]:
    """Newest first, one row per event id, at most `limit`."""
    by_id: dict[str, dict[str, Any]] = {}
    for rows in lists:
        for row in rows:
            if isinstance(row, dict):
                by_id.setdefault(str(row.get("event_id")), row)
    ordered = sorted(
        by_id.values(), key=lambda r: (-int(r.get("detected_ns") or 0), str(r.get("event_id")))
    )
    return ordered[:limit]


def merge_matches(docs: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    by_id: dict[str, dict[str, Any]] = {}
    for matches in docs:
        for match in matches:
            if isinstance(match, dict) and isinstance(match.get("run_id"), str):
                by_id.setdefault(match["run_id"], match)
    return [by_id[r] for r in sorted(by_id)][:MAX_MATCHES]


def check_bearer(header: str | None, token: str | None) -> bool:
    if not token:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())
