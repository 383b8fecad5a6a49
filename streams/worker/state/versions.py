"""The `versions` table's format: which version replaced which (detectors/versions.py).

Key: the slice's labels plus the partition, as the windowed count tables spell them
(streams/worker/state/window_keys.py), as bytes; each partition keeps its own record, so
two partitions never write one key. Value: the JSON list [first_ns, last_ns, runs, ids], the
ids (streams/worker/state/window_keys.py `contribution_id` of run ids) those of the runs its
last write added, so that a batch redone after a crash does not count its runs twice
(records written before the ids were kept have 3 items).
The table stays small (one record per version, service, agent, tool and partition);
it is compacted, never windowed, so a version's first sighting outlives the 24 h counts.
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterable, Mapping
from typing import Any

from detectors.versions import History, Seen, Slice
from streams.worker.state.window_keys import aggregate_key


def version_key(key: Slice, partition: int) -> bytes:
    return aggregate_key(key.labels(), partition).encode("utf-8")


def encode_seen(seen: Seen, ids: Iterable[int] = ()) -> bytes:
    return json.dumps([*seen.to_list(), sorted(ids)], separators=(",", ":")).encode("ascii")


def decode_record(raw: Any) -> tuple[Seen, list[int]] | None:
    """A record and the ids of its last write, or None for a value this version cannot read
    (skipped, not fatal)."""
    try:
        values = json.loads(bytes(raw))
        ids = values[3] if len(values) == 4 else []
        if not all(type(i) is int for i in ids):
            return None
        return Seen.from_list(values[:3]), ids
    except (TypeError, ValueError, IndexError):
        return None


def decode_seen(raw: Any) -> Seen | None:
    record = decode_record(raw)
    return None if record is None else record[0]


def parse_key(raw: Any) -> Slice | None:
    try:
        labels = json.loads(bytes(raw))[:-1]
        return Slice.of(labels)
    except (TypeError, ValueError):
        return None


def merged(old: Any, sightings: Mapping[int, Seen], done: Container[int] = ()) -> bytes:
    """The stored record `old` (bytes or None) with `sightings` ({run's contribution id: its
    sighting}) added, except those its last write added and those in `done` (added before
    a crash). The record keeps the ids of all of `sightings`: a redo of this write adds
    nothing again."""
    record = decode_record(old) if old is not None else None
    have, last = record if record is not None else (None, [])
    last_write = set(last)
    for cid, seen in sightings.items():
        counted = cid in last_write or cid in done
        if have is None:
            have = Seen(seen.first_ns, seen.last_ns, 0 if counted else seen.runs)
        elif not counted:
            have.merge(seen)
    if have is None:
        raise ValueError("no sighting to record")
    return encode_seen(have, sightings)


def last_ids(items: Iterable[tuple[Any, Any]], partitions: set[int]) -> dict[int, set[int]]:
    """Per partition of `partitions`, the ids of its records' last writes (see
    window_keys.last_ids)."""
    out: dict[int, set[int]] = {p: set() for p in partitions}
    for raw_key, raw_value in items:
        try:
            partition = json.loads(bytes(raw_key))[-1]
        except (TypeError, ValueError, IndexError):
            continue
        if type(partition) is not int:
            continue  # not a key version_key wrote
        if partition in out and (record := decode_record(raw_value)) is not None:
            out[partition].update(record[1])
    return out


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
