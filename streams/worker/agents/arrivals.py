"""Unkeyed arrivals held until the input clock has passed them (issue 39).

On unkeyed input a run's steps are released only once the input clock vouches for their
arrival (streams/runloop/loop.py `RunLoop.apply`): applied at once, they wait in the run's
state for the tick whose clock passes them, and the run is loaded, released and written a
second time. In an unkeyed live round that was one state write in two, and the steps
waiting in the state were more than half of what every write encoded.

So detect holds a run's arrivals here, in memory and unacknowledged (a record is
acknowledged only after the flush that wrote its applied state: a crash redoes it), until a
message or tick of the partition brings an input clock at or past the run's first held
arrival. Every message of a partition carries the clock it was sent at, and whatever was
forwarded before that clock is ahead of it on the partition, so any of them vouches for the
partition's earlier arrivals, not only the run's own. Then every held arrival of the run is
applied, in order and each at its own arrival time, and released by that clock: what the
tick would have found in the state and released, with one load and one write. (All of
them, not only those the clock passed: a later arrival may carry a span that ended earlier,
which the release must not overtake.)

A run whose first held arrival waits longer than `hold_ns` (the input clock is behind: a
backlog, a stalled input partition), or once more than `max_steps` are held, is applied the
same way with the clock there is: its steps not vouched for wait in its state, as they did
before holds, with their arrival times. So is a run a tick is about to release or finalize:
its deadlines count from its last arrival, held or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streams.worker.agents.messages import PackedSteps

__all__ = ["Arrival", "Arrivals"]


@dataclass(slots=True)
class Arrival:
    at_ns: int  # wall clock when detect read it: what the input clock must pass
    run_id: str
    steps: PackedSteps  # (not Step objects: a quarter of the memory)
    sent_clock: int  # the input clock it was sent at
    token: Any  # what the caller acknowledges once it is applied (its record)


class Arrivals:
    """Per partition, the runs with held arrivals, in the order of their first one (a run
    applied and held again goes to the back: the order stays by first held arrival), and
    the latest input clock read on the partition."""

    def __init__(self, hold_ns: int, max_steps: int) -> None:
        self.hold_ns = hold_ns
        self.max_steps = max_steps
        self.queues: dict[int, dict[str, list[Arrival]]] = {}
        self.clocks: dict[int, int] = {}  # partition -> latest input clock read on it
        self.steps = 0  # steps held, every partition

    def __len__(self) -> int:
        return sum(len(held) for runs in self.queues.values() for held in runs.values())

    def saw(self, partition: int, clock_ns: int) -> None:
        """A message or tick of the partition sent at this input clock."""
        if clock_ns > self.clocks.get(partition, -1):
            self.clocks[partition] = clock_ns

    def hold(self, partition: int, arrival: Arrival) -> None:
        self.queues.setdefault(partition, {}).setdefault(arrival.run_id, []).append(arrival)
        self.steps += len(arrival.steps)

    def take(
        self, partition: int, wall_ns: int, must: Callable[[str], bool] | None = None
    ) -> list[list[Arrival]]:
        """The held arrivals of each run to apply now, oldest run first: its first one
        passed by the partition's latest clock or held too long, or more held than the
        bound, or `must(run_id)` (a tick is about to release or finalize the run: its
        arrivals go in first, as they would have on arrival)."""
        runs = self.queues.get(partition)
        if not runs:
            return []
        limit = max(self.clocks.get(partition, -1), wall_ns - self.hold_ns)
        out = []
        for run_id, held in runs.items():
            if held[0].at_ns > limit and self.steps <= self.max_steps:
                if must is None:
                    break  # the runs after it were first held later
                if not must(run_id):
                    continue
            out.append(held)
            self.steps -= sum(len(a.steps) for a in held)
        for held in out:
            del runs[held[0].run_id]
        if not runs:
            del self.queues[partition]
        return out

    def due(self, clock_ns: int, wall_ns: int) -> set[int]:
        """Partitions with held arrivals a tick sent now at `clock_ns` would apply."""
        if self.steps > self.max_steps:
            return set(self.queues)
        limit = max(clock_ns, wall_ns - self.hold_ns)
        return {p for p, runs in self.queues.items() if next(iter(runs.values()))[0].at_ns <= limit}

    def clear(self) -> None:
        """Drop everything held, unacknowledged (a rebalance: the records are processed
        again by the partitions' next owner)."""
        self.queues.clear()
        self.clocks.clear()
        self.steps = 0
