"""`loopwatch query holds`: per on-call hold, the calls it denied, the runs it touched and
the calls that still ran under it with no guard decision (an agent without the guard, or
one in observe mode): whether a hold contains anything. The holds come from GET /holds
(every worker has them all), the counts from GET /hold-counts (summed over the workers).

    loopwatch query holds [--since 24h] [--json]
"""

from __future__ import annotations

import json
import sys
from typing import Any

from detectors.holds import DENIED, EXECUTED, HOLD_MEASURES, RUNS
from detectors.model import NS
from streams.cli.render import Block, table, utc, write

DEFAULT_SINCE = "24h"  # the counters keep a day (the policy's default longest hold)
COLUMNS = ("hold", "status", "matches", "denied", "runs", "still ran", "placed by", "expires")


def fetch(client: Any, since: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(every hold the workers know, released and expired too; the counts answer)."""
    _s, _b, listing = client.get("/holds", {"all": "1"})
    _s, _b, counts = client.get("/hold-counts", {"since": since})
    holds = listing.get("holds", []) if isinstance(listing, dict) else []
    return [h for h in holds if isinstance(h, dict)], counts if isinstance(counts, dict) else {}


def report(
    holds: list[dict[str, Any]], counts: dict[str, Any], since_ns: int
) -> list[dict[str, Any]]:
    """One row per hold that is active, ended after `since_ns` or has counts; counts of a
    hold id the workers no longer know (pruned, or named by a span alone) get a row too."""
    by_hold: dict[str, dict[str, int]] = {}
    for row in counts.get("rows", []):
        if isinstance(row, dict) and row.get("measure") in HOLD_MEASURES:
            into = by_hold.setdefault(str(row.get("hold_id")), {})
            into[row["measure"]] = into.get(row["measure"], 0) + int(row.get("calls", 0))
    rows = []
    known = set()
    for h in holds:
        hold_id = str(h.get("id"))
        known.add(hold_id)
        n = by_hold.get(hold_id, {})
        ended = min(h.get("released_ns") or h.get("expires_ns") or 0, h.get("expires_ns") or 0)
        if h.get("status") != "active" and not n and ended < since_ns:
            continue
        rows.append(_row(h, n))
    for hold_id, n in by_hold.items():
        if hold_id not in known:
            rows.append(_row({"id": hold_id, "status": "unknown"}, n))
    rows.sort(key=lambda r: (r["status"] != "active", -r[EXECUTED], -r[DENIED], r["id"]))
    return rows


def _row(hold: dict[str, Any], n: dict[str, int]) -> dict[str, Any]:
    return {
        "id": hold.get("id"),
        "status": hold.get("status", "?"),
        "matches": hold.get("matches", ""),
        "reason": hold.get("reason"),
        "by": hold.get("by"),
        "expires_ns": hold.get("expires_ns"),
        "released_ns": hold.get("released_ns"),
        DENIED: n.get(DENIED, 0),
        RUNS: n.get(RUNS, 0),
        EXECUTED: n.get(EXECUTED, 0),
    }


def render(rows: list[dict[str, Any]], covers: str) -> list[Block]:
    if not rows:
        return [f"no holds active or ended in the last {covers} (loopwatch hold add)"]
    cells = [
        [
            str(r["id"]),
            str(r["status"]),
            str(r["matches"] or "-"),
            f"{r[DENIED]:,}",
            f"{r[RUNS]:,}",
            f"{r[EXECUTED]:,}",
            str(r.get("by") or "-"),
            utc(r.get("released_ns") or r.get("expires_ns")),
        ]
        for r in rows
    ]
    out: list[Block] = [
        table(list(COLUMNS), cells, {3, 4, 5}),
        f"counts of the last {covers}: calls denied by the guard, runs touched, calls that ran "
        "under the hold with no guard decision",
    ]
    leaking = [r for r in rows if r[EXECUTED] and r["status"] == "active"]
    for r in leaking:
        out.append(
            f"{r['id']}: {r[EXECUTED]:,} call{'s' if r[EXECUTED] != 1 else ''} still ran: "
            "an agent without the guard, or with guard mode observe (alert HoldNotEnforced)"
        )
    return out


def show(client: Any, since: str, since_seconds: int, as_json: bool, now_ns: int) -> int:
    holds, counts = fetch(client, since)
    rows = report(holds, counts, now_ns - since_seconds * NS)
    covers = counts.get("covers")
    if not isinstance(covers, str):
        covers = since
    if as_json:
        json.dump({"since": covers, "holds": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    write(render(rows, covers), sys.stdout)
    return 0
