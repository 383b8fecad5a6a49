"""`loopwatch query holds` (streams/cli/query_holds.py): the holds joined with their counts
(GET /holds, GET /hold-counts): which rows are shown, how they are ordered, and the line
that says a hold is not contained."""

from __future__ import annotations

import sys
from typing import Any

from streams.cli.query_holds import render, report
from streams.cli.render import write

NS = 10**9
NOW = 1_800_000_000 * NS


def hold(hold_id: str, status: str, ended_ns: int, **more: Any) -> dict[str, Any]:
    return {
        "id": hold_id,
        "status": status,
        "matches": f"matches of {hold_id}",
        "by": "oncall",
        "expires_ns": ended_ns,
        **more,
    }


def counts(*rows: tuple[str, str, int]) -> dict[str, Any]:
    return {"rows": [{"hold_id": h, "measure": m, "calls": n} for h, m, n in rows]}


def test_rows_are_the_active_holds_the_recent_ones_and_any_with_counts() -> None:
    holds = [
        hold("hold-active", "active", NOW + 3600 * NS),
        hold("hold-old", "expired", NOW - 48 * 3600 * NS),  # ended before the window
        hold("hold-recent", "released", NOW + 3600 * NS, released_ns=NOW - 60 * NS),
        hold("hold-old-counted", "expired", NOW - 48 * 3600 * NS),
    ]
    answer = counts(
        ("hold-active", "denied", 3),
        ("hold-active", "runs", 2),
        ("hold-old-counted", "executed", 1),
        ("hold-gone", "denied", 4),
        ("hold-active", "bogus", 9),  # an unknown measure is not shown
    )
    rows = report(holds, answer, NOW - 24 * 3600 * NS)
    assert [r["id"] for r in rows] == [
        "hold-active",
        "hold-old-counted",
        "hold-gone",
        "hold-recent",
    ]
    active = rows[0]
    assert (active["denied"], active["runs"], active["executed"]) == (3, 2, 0)
    assert rows[2]["status"] == "unknown"


def test_the_table_says_which_active_hold_leaks(capsys: Any) -> None:
    holds = [hold("hold-a", "active", NOW + NS), hold("hold-b", "active", NOW + NS)]
    rows = report(holds, counts(("hold-b", "executed", 2), ("hold-b", "runs", 1)), NOW)
    write(render(rows, "24h"), sys.stdout)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["hold", "status", "matches"]
    assert lines[2].startswith("hold-b") and lines[3].startswith("hold-a")  # leaking first
    assert "hold-b: 2 calls still ran" in out and "hold-a:" not in out
    assert render([], "24h") == ["no holds active or ended in the last 24h (loopwatch hold add)"]
