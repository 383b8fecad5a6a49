"""The detect agent's checkpoint: state after outputs, offsets after state.

A batch's state changes are staged (pending in the driver's store) once its outputs are
acknowledged by the broker, and written to the tables (changelog and rocksdb) once per
flush interval (``LOOPWATCH_STATE_FLUSH_MS``) or when too many runs wait: a run touched by
several batches of an interval is written once (Kafka Streams' record cache, quix-streams'
``Checkpoint.commit``). The batches' records are acknowledged only after the write, so
offsets are never committed past state that is not in the changelog.

A rebalance (Publisher.generation) drops what is staged, unacknowledged: the records are
processed again from their committed offsets by the partition's next owner.
"""

from __future__ import annotations

import time
from typing import Any

from streams.worker.agents.driver import RunDriver
from streams.worker.kafka.delivery import Publisher
from streams.worker.kafka.skips import SkipGuard
from streams.worker.state.store import Tables


class StateWriteError(Exception):
    """A table write failed (a full disk, an I/O error): the batch's state is not (all)
    written, so the batch must not be acknowledged."""


def write_error(exc: Exception) -> StateWriteError:
    return StateWriteError(f"{type(exc).__name__}: {exc}"[:300])


class Checkpoint:
    def __init__(
        self,
        driver: RunDriver,
        tables: Tables,
        skips: SkipGuard,
        publisher: Publisher,
        *,
        flush_seconds: float = 0.0,
        flush_max_runs: int = 10_000,
    ) -> None:
        self.driver = driver
        self.tables = tables
        self.skips = skips
        self.publisher = publisher
        self.flush_seconds = flush_seconds  # 0: every batch
        self.flush_max_runs = flush_max_runs  # ... or when this many runs have staged writes
        self.failed: str | None = None  # a table write failed: nothing more is written
        # staged: written and acknowledged by the next flush
        self.staged: list[Any] = []  # events of the batches since the last flush
        self.staged_refetched: list[Any] = []  # records read back for them
        self.staged_events: dict[int, Any] = {}  # partition -> an event of it (table routing)
        self.staged_generation = 0
        self.last_flush = time.monotonic()

    def stage(
        self, events: list[Any], refetched: list[Any], routing: dict[int, Any], generation: int
    ) -> None:
        """A batch whose outputs are delivered: its state is written by the next flush."""
        self.staged += events
        self.staged_refetched += refetched
        self.staged_events.update(routing)
        self.staged_generation = generation

    def drop(self) -> None:
        """A batch failed or was abandoned before it was staged: its writes go too."""
        self.driver.discard_writes()
        self.staged, self.staged_refetched, self.staged_events = [], [], {}

    def due(self) -> bool:
        if not self.staged:
            return False
        return (
            time.monotonic() - self.last_flush >= self.flush_seconds
            or len(self.driver.store.pending_runs) >= self.flush_max_runs
        )

    def flush(self) -> list[Any]:
        """Write the staged state to the tables; returns the events now to acknowledge
        (none when a rebalance since they were staged has dropped them). Raises
        StateWriteError when a write fails."""
        events, refetched, routing = self.staged, self.staged_refetched, self.staged_events
        self.staged, self.staged_refetched, self.staged_events = [], [], {}
        self.last_flush = time.monotonic()
        if self.staged_generation != self.publisher.generation:
            self.driver.discard_writes()
            return []
        if self.failed is not None:
            return []
        tables = self.tables
        by_name = {
            "runs": tables.runs,
            "finished": tables.finished,
            "retained": tables.retained,
            "episodes": tables.episodes,
        }
        try:
            for table, partition, key, value in self.driver.take_writes():
                with tables.in_event(routing[partition]):
                    if value is None:
                        by_name[table].pop(key, None)
                    else:
                        by_name[table][key] = value
        except Exception as exc:  # rocksdb: "IO error: No space left on device: ..."
            self.driver.discard_writes()
            raise write_error(exc) from exc
        self.skips.ack_refetched(refetched)
        return events
