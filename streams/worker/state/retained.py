"""Finished runs kept for the on-call: the `retained` table (run id -> record), so that
`loopwatch query run ID` answers for a run minutes or days after it finished, after
restarts and rebalances too (the table has a changelog like the others).

A record is written when a run's loop fires (its events so far) and when the run finishes
(its summary, and for a run that looped the last tool steps the detectors kept: the step
timeline). A clean run keeps its summary only, and for a shorter time: at a million runs a
day, summaries of clean runs are most of the bytes.

Value: a fixed 19-byte header, then zlib-compressed JSON::

    b"R" | expires_ns (8 bytes, big-endian) | finished_ns (8, 0 while in flight) | partition (2)

The sweep (`TableStore.sweep_retained`) reads the header only. Only digests, names, codes,
ids and counts are in a record: what the events and summaries already carry.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from detectors.state import (
    WIN_ACTION,
    WIN_CALL,
    WIN_CODE,
    WIN_END,
    WIN_OUTCOME,
    WIN_POS,
    WIN_SPAN,
    WIN_START,
    WIN_TOOL,
    RunState,
)

NS = 1_000_000_000
_HEAD = struct.Struct(">cqqH")
MAGIC = b"R"
MAX_EVENTS = 64  # events kept per run (the first ones: where the loop began)
FP_CHARS = 12  # fingerprint prefixes in the timeline

EVENT_FIELDS = (
    "event_id",
    "shape",
    "severity",
    "detector",
    "tool_name",
    "tool_version",
    "count",
    "first_sequence",
    "last_sequence",
    "trigger_span_id",
    "recommended_action",
    "wasted_steps",
    "wasted_tokens",
    "detected_at",
    "trace_id",
    "trace_url",
)


@dataclass(frozen=True, slots=True)
class Retention:
    """How long finished runs are kept: runs that looped, and clean runs (0: not kept)."""

    looping_ns: int
    clean_ns: int

    @classmethod
    def hours(cls, looping: float, clean: float) -> Retention:
        return cls(int(looping * 3600 * NS), int(clean * 3600 * NS))

    @property
    def longest_ns(self) -> int:
        return max(self.looping_ns, self.clean_ns)


def encode(body: dict[str, Any], partition: int, expires_ns: int, finished_ns: int) -> bytes:
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return _HEAD.pack(MAGIC, expires_ns, finished_ns, partition) + zlib.compress(data, 6)


def header(raw: bytes) -> tuple[int, int, int]:
    """(expires_ns, finished_ns, partition); ValueError for a value that is not a record."""
    if len(raw) < _HEAD.size or raw[:1] != MAGIC:
        raise ValueError("not a retained-run record")
    _magic, expires_ns, finished_ns, partition = _HEAD.unpack_from(raw)
    return expires_ns, finished_ns, partition


def decode(raw: bytes) -> dict[str, Any]:
    header(raw)
    body: dict[str, Any] = json.loads(zlib.decompress(bytes(raw)[_HEAD.size :]))
    return body


def compact_event(event: dict[str, Any]) -> dict[str, Any]:
    return {k: event[k] for k in EVENT_FIELDS if event.get(k) is not None}


def add_events(body: dict[str, Any], events: list[dict[str, Any]]) -> None:
    kept = body.setdefault("events", [])
    ids = {e.get("event_id") for e in kept}
    for event in events:
        if event["event_id"] not in ids and len(kept) < MAX_EVENTS:
            kept.append(compact_event(event))
            ids.add(event["event_id"])


def timeline(state: RunState) -> list[dict[str, Any]]:
    """The last tool steps the detectors kept (the policy's window), oldest first."""
    steps = []
    for entry in state.window:
        steps.append(
            {
                "position": entry[WIN_POS],
                "span_id": entry[WIN_SPAN],
                "tool_name": entry[WIN_TOOL],
                "action_fp": (entry[WIN_ACTION] or "")[:FP_CHARS] or None,
                "outcome_digest": (entry[WIN_OUTCOME] or "")[:FP_CHARS] or None,
                "error_code": entry[WIN_CODE],
                "call_id": entry[WIN_CALL],
                "start_ns": entry[WIN_START],
                "end_ns": entry[WIN_END],
            }
        )
    return steps


def finish(body: dict[str, Any], summary: dict[str, Any], state: RunState | None) -> dict[str, Any]:
    """The record of a finished run: its summary (without the per-event metric list the
    drivers count from), and for a run that looped its timeline."""
    body["summary"] = {k: v for k, v in summary.items() if k != "deferred_events"}
    if summary.get("shapes") and state is not None:
        body["timeline"] = timeline(state)
    return body


def view(run_id: str, raw: bytes, retention: Retention) -> dict[str, Any]:
    """GET /runs/{run_id} for a run that finished: what was kept of it."""
    expires_ns, finished_ns, _partition = header(raw)
    body = decode(raw)
    return {
        "run_id": run_id,
        "found": True,
        "finished": True,
        "finished_at_ns": finished_ns,
        "kept_until_ns": expires_ns,
        "summary": body.get("summary"),
        "events": body.get("events", []),
        "timeline": body.get("timeline", []),
        "retention": retention_doc(retention),
    }


def retention_doc(retention: Retention) -> dict[str, float]:
    return {
        "looping_hours": retention.looping_ns / 3600 / NS,
        "clean_hours": retention.clean_ns / 3600 / NS,
    }
