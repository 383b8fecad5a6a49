"""The detect agent's checkpoint, the one place that writes the worker's tables: counts
after outputs, state after counts, offsets after state.

A batch's outputs are delivered first (publish.py). Its table writes, run states, finished
markers, retained runs, episodes and its counts (counting.py), wait in one buffer (the
driver's store, `Writes`) and are written once per flush interval
(``LOOPWATCH_STATE_FLUSH_MS``) or when too many runs wait: a run touched by several
batches of an interval is written once (Kafka Streams' record cache, quix-streams'
``Checkpoint.commit``). A flush writes in this order, waiting for the producer after each:

1. the counts and version sightings (each added once: a redo's ids are refused), in bulk
   (`Tables.write_counts`), their changelog records delivered before it returns;
2. the run states and the rest, whose fired markers stop their outputs from coming again
   (`Tables.write`: in bulk, its changelog records delivered before it returns);
3. then the batches' records are acknowledged, so offsets are never committed past state
   that is not in the changelog.

A crash after 1 and before 2 makes the batches be processed again with their counts
already written: the same ids, not added twice. A crash after 2 redoes records whose
outputs do not come again. Counting after the states instead would lose the counts of a
crash between the two.

A rebalance (Publisher.generation) drops what is staged, unacknowledged: the records are
processed again from their committed offsets by the partition's next owner. Nothing read
before a rebalance is acknowledged once it has begun (Publisher.may_acknowledge): faust
has forgotten the partition's committed offset by then and would commit past the dropped
records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from streams.worker.agents.counting import Counting
from streams.worker.agents.parts import Parts

log = logging.getLogger(__name__)


class StateWriteError(Exception):
    """A table write failed (a full disk, an I/O error): the batch's state is not (all)
    written, so the batch must not be acknowledged."""


def write_error(exc: Exception) -> StateWriteError:
    return StateWriteError(f"{type(exc).__name__}: {exc}"[:300])


async def nothing_to_flush() -> None:
    return None


class Checkpoint:
    def __init__(
        self,
        parts: Parts,
        counting: Counting,
        *,
        flush_producer: Callable[[], Awaitable[None]] = nothing_to_flush,
        flush_seconds: float = 0.0,
        flush_max_runs: int = 10_000,
    ) -> None:
        self.driver = parts.driver
        self.tables = parts.tables
        self.counting = counting
        self.skips = parts.skips
        self.publisher = parts.publisher
        self.flush_producer = flush_producer  # until every table write sent is in its log
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
        """A batch whose outputs are delivered: its writes are made by the next flush."""
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
            or self.driver.store.writes.staged("runs") >= self.flush_max_runs
        )

    def drop_if_stale(self) -> bool:
        """Staged before a rebalance: dropped, unacknowledged. True if it was."""
        if not self.staged or self.staged_generation == self.publisher.generation:
            return False
        self.drop()
        return True

    async def flush(self) -> list[Any]:
        """Make the staged writes, in the order above; returns the events now to
        acknowledge (none when a rebalance since they were staged has dropped them).
        Raises StateWriteError when a write fails."""
        events, refetched, routing = self.staged, self.staged_refetched, self.staged_events
        self.staged, self.staged_refetched, self.staged_events = [], [], {}
        self.last_flush = time.monotonic()
        generation = self.staged_generation
        if generation != self.publisher.generation or self.failed is not None:
            self.driver.discard_writes()
            return []
        writes = self.driver.take_writes()
        # (the last flush's states are in the log: a crash from here on redoes only the
        # batches below, whose ids the counts then refuse)
        try:
            await self.counting.write(writes, routing)
        except Exception as exc:  # rocksdb: "IO error: No space left on device: ..."
            self.driver.discard_writes()
            raise write_error(exc) from exc
        if not await self.producer_flushed(generation):
            return []  # counts written while owned: a redo's ids are refused
        try:
            await self.tables.write(writes.by_partition(), routing)
        except Exception as exc:  # rocksdb's I/O errors, the producer's failures
            self.driver.discard_writes()
            if self.publisher.stopping():
                log.warning("checkpoint: table writes at a stop failed (%s): redone", exc)
                return []
            raise write_error(exc) from exc
        if generation != self.publisher.generation or not self.acknowledgeable(events):
            return []  # revoked meanwhile: the new owner redoes them (their state is written)
        self.skips.ack_refetched(refetched)
        return events

    def acknowledgeable(self, events: list[Any]) -> bool:
        """Read in the current assignment with no rebalance under way (all of them or
        none: a rebalance drops what was staged before it). faust's acks go out
        without a pause after this, so no rebalance can begin in between."""
        return all(self.publisher.may_acknowledge(event.message) for event in events)

    async def producer_flushed(self, generation: int) -> bool:
        """Wait until every table write sent so far is in its changelog. False (and the
        staged writes dropped, the records left unacknowledged) when the partitions were
        revoked meanwhile or the producer cannot flush (it is stopping): not a table
        write failure, so the worker does not halt for it."""
        try:
            await self.flush_producer()
        except Exception as exc:  # faust: "Cannot flush: Producer not Running" at a stop
            log.warning("checkpoint: the producer did not flush (%s): the batches are redone", exc)
            self.driver.discard_writes()
            return False
        if generation != self.publisher.generation:
            self.driver.discard_writes()
            return False
        return True
