"""Records the stream skipped: faust's stream was seen skipping a record around rebalances
(offsets 17, 18, 20 delivered, 19 committed with them). `SkipGuard` tracks the last offset
processed per partition (streams/worker/kafka/refetch.py), reads a skipped range back from the broker,
and acknowledges what it read back to faust's consumer (it commits only up to the first
offset it has not seen acknowledged)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from streams.worker.faust_internals import committed_offsets
from streams.worker.kafka.refetch import OffsetGaps, Refetcher

log = logging.getLogger(__name__)


class SkipGuard:
    """`consumer()`: faust's consumer (acks; its ``_committed_offset`` mapping, a faust
    internal, for the first record after an assignment). `refetcher(topic)`: a reader of
    that topic's records by offset."""

    def __init__(
        self,
        consumer: Callable[[], Any],
        counters: dict[str, int],
        refetcher: Callable[[str], Any],
    ) -> None:
        self.consumer = consumer
        self.counters = counters
        self._make_refetcher = refetcher
        self.refetchers: dict[str, Any] = {}  # by topic
        self._gaps = OffsetGaps()
        self._head_check_off = False  # faust internals the head-skip check reads are missing

    @classmethod
    def for_broker(
        cls, bootstrap: str, consumer: Callable[[], Any], counters: dict[str, int]
    ) -> SkipGuard:
        return cls(consumer, counters, lambda topic: Refetcher(bootstrap, topic))

    def forget(self) -> None:
        """Partitions were revoked: positions start over at the next assignment."""
        self._gaps.forget()

    def skipped_before(self, message: Any) -> tuple[int, int] | None:
        """Offsets [first, end) of `message`'s partition the stream skipped before it. The
        first record after an assignment is checked against the committed offset faust's
        consumer sought to (a faust internal: no broker call on the hot path)."""
        offsets = committed_offsets(self.consumer())
        if offsets is None:
            offsets = {}
            if not self._head_check_off:
                self._head_check_off = True
                log.warning(
                    "faust's consumer has no _committed_offset mapping (a faust upgrade?): "
                    "a skip of a partition's first record after an assignment goes unseen"
                )
        committed = offsets.get(message.tp)
        return self._gaps.observe(
            message.topic,
            message.partition,
            message.offset,
            committed if isinstance(committed, int) else None,
        )

    async def read_back(self, message: Any) -> list[Any]:
        """The records the stream skipped before `message` (its partition's), read back from
        the broker as events, in offset order; none when nothing was skipped. Raises as
        `refetch` does."""
        skipped = self.skipped_before(message)
        return [] if skipped is None else await self.refetch(*skipped, message)

    async def refetch(self, first: int, end: int, revealed_by: Any) -> list[Any]:
        """Offsets [first, end) of the topic partition of `revealed_by`, read back from the
        broker. A failed read raises: the record that revealed the gap is then not
        acknowledged."""
        topic, partition = revealed_by.topic, revealed_by.partition
        refetcher = self.refetchers.get(topic)
        if refetcher is None:
            refetcher = self.refetchers[topic] = self._make_refetcher(topic)
        log.warning(
            "offsets %d..%d of %s/%d were skipped by the stream; reading them again",
            first,
            end - 1,
            topic,
            partition,
        )
        events = await asyncio.get_running_loop().run_in_executor(
            None, refetcher.read, partition, first, end
        )
        self.counters["refetched_records"] += len(events)
        return list(events)

    def ack_refetched(self, events: list[Any]) -> None:
        """Acknowledge read-back records to faust's consumer."""
        consumer = self.consumer()
        for event in events:
            consumer.ack(event.message)
