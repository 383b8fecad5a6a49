"""The `versions` table's format: which version replaced which (detectors/versions.py).

Key: the slice's labels plus the partition, as the windowed count tables spell them
(streams/worker/state/window_keys.py), as bytes; each partition keeps its own record, so
two partitions never write one key. Value: the JSON list [first_ns, last_ns, runs].
The table stays small (one record per version, service, agent, tool and partition);
it is compacted, never windowed, so a version's first sighting outlives the 24 h counts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from detectors.versions import History, Seen, Slice
from streams.worker.state.window_keys import aggregate_key


def version_key(key: Slice, partition: int) -> bytes:
    return aggregate_key(key.labels(), partition).encode("utf-8")


def encode_seen(seen: Seen) -> bytes:
    return json.dumps(seen.to_list(), separators=(",", ":")).encode("ascii")


def decode_seen(raw: Any) -> Seen | None:
    """A record, or None for a value this version cannot read (skipped, not fatal)."""
    try:
        return Seen.from_list(json.loads(bytes(raw)))
    except (TypeError, ValueError):
        return None


def parse_key(raw: Any) -> Slice | None:
    try:
        labels = json.loads(bytes(raw))[:-1]
        return Slice.of(labels)
    except (TypeError, ValueError):
        return None


def merged(old: Any, seen: Seen) -> bytes:
    """The stored record `old` (bytes or None) with `seen` added."""
    have = decode_seen(old) if old is not None else None
    if have is None:
        return encode_seen(seen)
    have.merge(seen)
    return encode_seen(have)


def history_of(items: Iterable[tuple[Any, Any]], into: History | None = None) -> History:
    """The table's (key, value) items as one History (unreadable records skipped)."""
    history = into if into is not None else History()
    for raw_key, raw_value in items:
        key = parse_key(raw_key)
        seen = decode_seen(raw_value)
        if key is not None and seen is not None:
            history.add(key, seen)
    return history


def history_from_rows(rows: Iterable[dict[str, Any]]) -> History:
    """History from other workers' /versions rows (scope=local)."""
    history = History()
    for row in rows:
        try:
            key = Slice.of(
                [
                    row["kind"],
                    row.get("service_name"),
                    row.get("agent_name"),
                    row.get("tool_name") or "",
                    row["version"],
                ]
            )
            seen = Seen.from_list([row["first_ns"], row["last_ns"], row["runs"]])
        except (KeyError, TypeError, ValueError):
            continue
        history.add(key, seen)
    return history
