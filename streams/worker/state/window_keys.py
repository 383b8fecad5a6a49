"""Keys of the windowed count tables (``loop_counts``, ``run_counts``): written by the detect
agent's counting (streams/worker/agents/counting.py), read back and summed by the on-call
API (streams/worker/api/answers.py). One module for both directions of the format."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
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
            count = int(value)
        except (TypeError, ValueError):
            continue
        yield labels, float(end), count
