"""Loop episodes by time: the `episodes` table, so that on-call can list the runs behind an
alert's slice (`loopwatch query loops --shape S --prompt-version V --runs`).

One record per `loop_detected` event, in the partition of its run. The key starts with the
time the worker emitted the event (wall clock, as the loop counters and the alerts count),
so a partition's records are in time order: the newest episodes of a window are read
backwards from the end and the expired ones are deleted from the start, neither reading
more than it keeps or deletes.

Key: ``b"%020d:" % listed_ns + event_id``. Value: the event's labels, ids and counts as
JSON (what the event carries; no content).
"""

from __future__ import annotations

import json
from typing import Any

FIELDS = (
    "run_id",
    "trace_id",
    "shape",
    "severity",
    "prompt_version",
    "tool_name",
    "tool_version",
    "service_name",
    "agent_name",
    "count",
    "wasted_steps",
    "wasted_tokens",
    "detected_at",
    "recommended_action",
    "trace_url",
    "event_id",
)


def key(event: dict[str, Any], listed_ns: int) -> bytes:
    return b"%020d:" % listed_ns + str(event["event_id"]).encode()


def key_ns(raw_key: bytes) -> int:
    """The detection time a key starts with (0 for a key that is not an episode's)."""
    head = bytes(raw_key)[:20]
    return int(head) if head.isdigit() else 0


def encode(event: dict[str, Any]) -> bytes:
    doc = {k: event.get(k) for k in FIELDS if event.get(k) is not None}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def decode(raw: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(raw)
    return doc
