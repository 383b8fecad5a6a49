"""Finished runs kept for the on-call: the `retained` table (run id -> record), so that
`loopwatch query run ID` answers for a run minutes or days after it finished, after
restarts and rebalances too (the table has a changelog like the others).

A record is written when a run's loop fires (its events so far), when it calls a tool the
policy marks `side_effect` or such a tool's `reconcile_tool` (the side-effect ledger: did
a refund already go out, with which idempotency key), and when the run finishes (its
summary, and for a run that looped the last tool steps the detectors kept: the step
timeline). A clean run keeps its summary and its ledger only, and for a shorter time: at a
million runs a day, summaries of clean runs are most of the bytes.

Value: a fixed 19-byte header, then zlib-compressed JSON::

    b"R" | expires_ns (8 bytes, big-endian) | finished_ns (8, 0 while in flight) | partition (2)

The sweep (`TableStore.sweep_retained`) reads the expiry index (below) and the header
only. Only digests, names, codes, ids and counts are in a record: what the events and
summaries already carry.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from detectors.model import NS, TOOL, Step
from detectors.policy import Policy
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

_HEAD = struct.Struct(">cqqH")
MAGIC = b"R"
MAX_EVENTS = 64  # events kept per run (the first ones: where the loop began)
MAX_LEDGER = 32  # side-effect and reconcile calls kept per run
FP_CHARS = 12  # fingerprint prefixes in the timeline

EVENT_FIELDS = (
    "event_id",
    "shape",
    "severity",
    "detector",
    "prompt_version",
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


def encode(body: dict[str, Any], partition: int, expires_ns: int, finished_ns: int) -> bytes:
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return _HEAD.pack(MAGIC, expires_ns, finished_ns, partition) + zlib.compress(data, 6)


def restamp(raw: bytes, partition: int, expires_ns: int, finished_ns: int) -> bytes:
    """Record `raw` with another header (the retention bench stamps the corpus' records
    with expiries of its own); ValueError if `raw` is not a record."""
    header(raw)
    return _HEAD.pack(MAGIC, expires_ns, finished_ns, partition) + raw[_HEAD.size :]


def header(raw: bytes) -> tuple[int, int, int]:
    """(expires_ns, finished_ns, partition); ValueError for a value that is not a record."""
    if len(raw) < _HEAD.size or raw[:1] != MAGIC:
        raise ValueError("not a retained-run record")
    _magic, expires_ns, finished_ns, partition = _HEAD.unpack_from(raw)
    return expires_ns, finished_ns, partition


# The table also holds an index of the records by expiry, so that the sweep reads what has
# expired and stops, instead of every record kept (a record is kept for a day or a week: at
# 100 runs finishing a second, 8.6 million records read a minute). An index key is
# INDEX + expires_ns (8 bytes, big-endian) + the record's key, its value the partition (2
# bytes); 0xff never occurs in UTF-8, so index keys sort after every run id, in expiry
# order. INDEXED + partition marks a partition whose records are all indexed (records
# written before the index are found by one pass over the partition, which indexes them).
INDEX = b"\xff"
INDEXED = b"\xfe" + b"expiry-index-v1:"
_PART = struct.Struct(">H")


def is_record_key(key: bytes) -> bool:
    return key[:1] not in (INDEX, INDEXED[:1])


def index_key(expires_ns: int, key: bytes) -> bytes:
    return INDEX + max(0, expires_ns).to_bytes(8, "big") + key


def index_entry(key: bytes, value: bytes) -> tuple[int, bytes, int]:
    """(expires_ns, the record's key, partition) of an index entry; ValueError if not one."""
    if key[:1] != INDEX or len(key) < 9 or len(value) != _PART.size:
        raise ValueError("not a retained-run index entry")
    return int.from_bytes(key[1:9], "big"), key[9:], _PART.unpack(value)[0]


def index_value(partition: int) -> bytes:
    return _PART.pack(partition)


def indexed_key(partition: int) -> bytes:
    return INDEXED + _PART.pack(partition)


def decode(raw: bytes) -> dict[str, Any]:
    header(raw)
    body: dict[str, Any] = json.loads(zlib.decompress(bytes(raw)[_HEAD.size :]))
    return body


def finished(raw: bytes) -> tuple[int, dict[str, Any]] | None:
    """(finished_ns, summary) of a finished run's record; None for a run still in flight
    or a value that is not a record."""
    try:
        _expires, finished_ns, _partition = header(raw)
    except ValueError:
        return None
    if not finished_ns:
        return None
    return finished_ns, decode(raw).get("summary") or {}


def compact_event(event: dict[str, Any]) -> dict[str, Any]:
    return {k: event[k] for k in EVENT_FIELDS if event.get(k) is not None}


def add_events(
    body: dict[str, Any], events: list[dict[str, Any]], at_ns: int
) -> list[dict[str, Any]]:
    """Keep the events not kept yet (`listed_ns`: when the worker emitted them, the time
    their episode is listed under); returns them. A redelivered event is kept once."""
    kept = body.setdefault("events", [])
    ids = {e.get("event_id") for e in kept}
    new = []
    for event in events:
        if event["event_id"] in ids:
            continue
        ids.add(event["event_id"])
        new.append(event)
        if len(kept) < MAX_EVENTS:
            kept.append({**compact_event(event), "listed_ns": at_ns})
    return new


def add_calls(body: dict[str, Any], calls: list[dict[str, Any]]) -> None:
    """Side-effect and reconcile calls (see `ledger_calls`), once per span."""
    kept = body.setdefault("ledger", [])
    spans = {c["span_id"] for c in kept}
    for call in calls:
        if call["span_id"] not in spans and len(kept) < MAX_LEDGER:
            kept.append(call)
            spans.add(call["span_id"])


def ledger_calls(steps: Iterable[Step], policy: Policy) -> list[dict[str, Any]]:
    """The calls of side-effect tools among `steps` (business identity and idempotency key
    digests, outcome) and the calls of their reconcile tools."""
    out = []
    for step in steps:
        if step.kind != TOOL:
            continue
        contract = policy.tools.get(step.name)
        if contract is not None and contract.side_effect:
            code = step.error_code
            if code is None and not step.status_error:
                outcome = "ok"
            elif code is not None and code in policy.ambiguous_error_codes:
                outcome = "ambiguous"
            else:
                outcome = "error"
            out.append(
                {
                    "tool": step.name,
                    "span_id": step.span_id,
                    "call_id": step.call_id,
                    "start_ns": step.start_ns,
                    "end_ns": step.end_ns,
                    "business": (step.business_fp or "")[:FP_CHARS] or None,
                    "key": (step.idempotency_fp or "")[:FP_CHARS] or None,
                    "outcome": outcome,
                    "error_code": code,
                    "reconcile_tool": contract.reconcile_tool,
                }
            )
        elif step.name in policy.reconcile_tools:
            out.append(
                {
                    "tool": step.name,
                    "span_id": step.span_id,
                    "end_ns": step.end_ns,
                    "reconcile": True,
                }
            )
    return out


def side_effects(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The side-effect calls of a run for on-call, in time order: was the idempotency key
    there, new or reused for the same business object; did a reconcile call follow; did
    it commit before the run's first loop fired (before the step that triggered its first
    event started: a refund that went out before the agent looped)."""
    calls = sorted(body.get("ledger", []), key=lambda c: (c.get("end_ns") or 0, c["span_id"]))
    first_loop = first_trigger_ns(body)
    seen_keys: dict[str | None, set[str]] = {}
    out = []
    for i, call in enumerate(calls):
        if call.get("reconcile"):
            continue
        key = call.get("key")
        keys = seen_keys.setdefault(call.get("business"), set())
        status = "missing" if key is None else ("reused" if key in keys else "new")
        if key is not None:
            keys.add(key)
        later = calls[i + 1 :]
        reconciled = call.get("reconcile_tool") is not None and any(
            c.get("reconcile") and c["tool"] == call["reconcile_tool"] for c in later
        )
        end = call.get("end_ns") or 0
        out.append(
            {
                "tool": call["tool"],
                "span_id": call["span_id"],
                "end_ns": end,
                "business": call.get("business"),
                "idempotency_key": status,
                "outcome": call.get("outcome"),
                "error_code": call.get("error_code"),
                "reconciled": reconciled,
                "committed_before_first_loop": call.get("outcome") == "ok"
                and first_loop is not None
                and end <= first_loop,
            }
        )
    return out


def first_trigger_ns(body: dict[str, Any]) -> int | None:
    """When the step that fired the run's first loop event started (from the ledger or
    the timeline; else the event's detection time, the trigger's end)."""
    starts = {c["span_id"]: c.get("start_ns") for c in body.get("ledger", [])}
    starts.update({s["span_id"]: s.get("start_ns") for s in body.get("timeline", [])})
    times = []
    for event in body.get("events", []):
        start = starts.get(event.get("trigger_span_id"))
        times.append(
            start if isinstance(start, int) and start > 0 else _ns(event.get("detected_at"))
        )
    return min(times, default=None)


def _ns(iso: Any) -> int:
    if not isinstance(iso, str):
        return 0
    try:
        return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * NS)
    except ValueError:
        return 0


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
        "side_effects": side_effects(body),
        "retention": retention_doc(retention),
    }


def retention_doc(retention: Retention) -> dict[str, float]:
    return {
        "looping_hours": retention.looping_ns / 3600 / NS,
        "clean_hours": retention.clean_ns / 3600 / NS,
    }
