"""In-memory schedules of the run loop (streams/runloop/loop.py); the worker rebuilds them from its
tables on every partition assignment:
`DeadlineIndex` (when each live run is next due: release after lateness, finalization
after grace or idle time, eviction past LOOPWATCH_MAX_ACTIVE_RUNS). Finished-run markers
have no index in memory: a sweep expires them from the table (streams/worker/state/store.py
`sweep_finished`)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(slots=True)
class Deadline:
    partition: int
    seen_ns: int
    release_at: int | None  # buffered steps become ready (run clock passed the lateness)
    finalize_at: int  # root ended + grace, or idle timeout
    evict: bool = False

    @property
    def due(self) -> int:
        if self.evict:
            return 0
        if self.release_at is not None and self.release_at < self.finalize_at:
            return self.release_at
        return self.finalize_at


class DeadlineIndex:
    """In-memory wall-clock schedule of the live runs of this worker, per partition.

    Rebuilt from the `runs` table headers on partition assignment; lazy-deletion heaps.
    """

    def __init__(self) -> None:
        self.entries: dict[str, Deadline] = {}
        self._heaps: dict[int, list[tuple[int, str]]] = {}
        self.evicting = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self.entries

    def get(self, run_id: str) -> Deadline | None:
        return self.entries.get(run_id)

    def set(self, run_id: str, deadline: Deadline) -> None:
        old = self.entries.get(run_id)
        if old is not None and old.evict:
            deadline.evict = True  # stays marked until the eviction happens
        self.entries[run_id] = deadline
        heapq.heappush(self._heaps.setdefault(deadline.partition, []), (deadline.due, run_id))

    def remove(self, run_id: str) -> None:
        old = self.entries.pop(run_id, None)
        if old is not None and old.evict:
            self.evicting -= 1

    def clear(self) -> None:
        self.entries.clear()
        self._heaps.clear()
        self.evicting = 0

    def _top(self, partition: int) -> tuple[int, str] | None:
        heap = self._heaps.get(partition)
        while heap:
            due, run_id = heap[0]
            entry = self.entries.get(run_id)
            if entry is not None and entry.partition == partition and entry.due == due:
                return heap[0]
            heapq.heappop(heap)
        return None

    def next_due(self, partition: int) -> int | None:
        top = self._top(partition)
        return None if top is None else top[0]

    def partitions(self) -> list[int]:
        return list(self._heaps)

    def scheduled(self) -> int:
        """Entries in the heaps, stale ones included (what the schedule holds in memory)."""
        return sum(len(heap) for heap in self._heaps.values())

    def pop_due(self, partition: int, now_ns: int, limit: int | None = None) -> list[str]:
        """Run ids of `partition` whose deadline passed, the earliest `limit` of them
        (removed from the heap, kept in `entries`: the caller finalizes, reschedules or
        removes each one). A run is in the heap once per `set`, so twice at the same time
        when a reschedule kept its time (a second arrival keeps the first one's release):
        it is returned once."""
        out: list[str] = []
        taken: set[str] = set()
        while limit is None or len(out) < limit:
            top = self._top(partition)
            if top is None or top[0] > now_ns:
                return out
            heapq.heappop(self._heaps[partition])
            if top[1] not in taken:
                taken.add(top[1])
                out.append(top[1])
        return out

    def mark_evictions(self, max_active: int, now_ns: int) -> int:
        """Mark the oldest idle runs beyond `max_active` for eviction; returns how many."""
        excess = len(self.entries) - self.evicting - max_active
        if excess <= 0:
            return 0
        candidates = heapq.nsmallest(
            excess,
            ((d.seen_ns, run_id) for run_id, d in self.entries.items() if not d.evict),
        )
        for _seen, run_id in candidates:
            entry = self.entries[run_id]
            entry.evict = True
            self.evicting += 1
            heapq.heappush(self._heaps.setdefault(entry.partition, []), (0, run_id))
        return len(candidates)
