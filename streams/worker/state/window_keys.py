"""Keys and values of the windowed count tables (``loop_counts``, ``run_counts``,
``version_counts``, ``hold_counts``): written by the detect agent's checkpoint
(streams/worker/agents/counting.py stages, streams/worker/agents/checkpoint.py writes), read
back and summed by the on-call API (streams/worker/api/answers.py). One module for both
directions of the format.

A value is ``[n, [id, ...]]``: the count, and the ids of what the record's last write added
(`contribution_id` of an event id, a run id, a held call). A batch redone after a crash
(its counts written, its run states not: the states' fired markers did not stop its
outputs) brings the same ids again, and they are not added twice (`added_once`). A plain
integer is a record written before the ids were kept.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Container, Iterable, Iterator, Mapping
from typing import Any


def aggregate_key(labels: Iterable[Any], partition: int) -> str:
    """Windowed count table key: the labels plus the partition (each partition keeps its own
    counter: a key updated from two partitions would otherwise collide in the store)."""
    return json.dumps([*labels, partition], separators=(",", ":"))


def iter_window_counts(items: Iterable[tuple[Any, Any]]) -> Iterator[tuple[list[Any], float, int]]:
    """Raw windowed-table items -> (labels, window end, count). Keys are
    (key, (start, end)) tuples (memory store) or their JSON lists (rocksdb)."""
    for key, value in items:
        try:
            label_key, window = key
            _start, end = window
            labels = json.loads(label_key)[:-1]
            count, _ids = decode_count(value)
        except (TypeError, ValueError):
            continue
        yield labels, float(end), count


def contribution_id(*parts: str) -> int:
    """A 48-bit id of one counted thing (collisions among the few hundred ids of one
    record's write: about 1e-10)."""
    digest = hashlib.blake2b("\x1f".join(parts).encode("utf-8"), digest_size=6).digest()
    return int.from_bytes(digest, "big")


def decode_count(value: Any) -> tuple[int, list[int]]:
    """A stored count -> (n, ids of its last write). Raises ValueError or TypeError for a
    value this version cannot read."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, []  # written before the ids were kept (or the table's default, 0)
    n, ids = value
    if type(n) is not int or not all(type(i) is int for i in ids):
        raise ValueError(f"not a count record: {value!r}")
    return n, list(ids)


def added_once(value: Any, adds: Mapping[int, int], done: Container[int] = ()) -> list[Any]:
    """The stored count `value` with `adds` ({contribution id: n}) added, except the ids its
    last write already added and those in `done` (added before a crash, per `last_ids`).
    The record keeps the ids of all of `adds`: a redo of this write adds nothing again. An
    unreadable value starts again from 0."""
    try:
        n, last = decode_count(value)
    except (TypeError, ValueError):
        n, last = 0, []
    last_write = set(last)
    fresh = (k for cid, k in adds.items() if cid not in last_write and cid not in done)
    return [n + sum(fresh), sorted(adds)]


def last_ids(items: Iterable[tuple[Any, Any]], partitions: set[int]) -> dict[int, set[int]]:
    """Per partition of `partitions`, the ids of the latest window's record of each of its
    label keys: what was counted by the last write of each before a crash or a rebalance
    (the ids a redone batch may bring again, whatever window it lands in now). One pass;
    a label key is parsed once, and only each label's latest record is decoded."""
    latest: dict[str, tuple[float, int, Any]] = {}  # label key -> (window end, partition, value)
    for key, value in items:
        try:
            label_key, window = key if isinstance(key, (list, tuple)) else (key, (0, 0))
            end = float(window[1])
            have = latest.get(label_key)
            if have is not None and end < have[0]:
                continue
            partition = have[1] if have is not None else json.loads(label_key)[-1]
        except (TypeError, ValueError, IndexError):
            continue
        if type(partition) is not int:
            continue  # not a key aggregate_key wrote
        latest[label_key] = (end, partition, value)
    out: dict[int, set[int]] = {p: set() for p in partitions}
    for _end, partition, value in latest.values():
        if partition in out:
            try:
                out[partition].update(decode_count(value)[1])
            except (TypeError, ValueError):
                continue
    return out
