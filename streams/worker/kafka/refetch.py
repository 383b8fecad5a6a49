"""Records the stream skipped, read again from the broker.

Around a rebalance faust's stream can skip a record: after revocation and the seek back
to the committed offsets, the ingest agent was seen receiving offsets 17, 18, 20 of a
partition, never 19, and 19 was then committed with the records around it (its spans
were lost). Both agents therefore track the last offset they processed per topic
partition (ingest: the input; detect: the internal steps topic, and the input when it is
keyed by run); a forward jump is read back from the broker with a consumer outside the
group and processed before the record that revealed it (offsets of transaction markers
come back empty, which is fine).

The first record of a partition after an assignment is compared with the committed
offset faust's consumer sought to: faust's own head check (`Consumer._new_offset`) lets
exactly one missing record at the head through, so a skip of the first record would be
committed silently (the likely cause of a rebalance test run that lost half a run's
spans). A partition without a committed offset yet cannot be checked.

Once processed, the read-back offsets are acknowledged to faust's consumer like streamed
ones: faust commits only up to the first offset it has not seen acknowledged, so without
that the partition's committed offset stayed at the skip until the next restart (and,
with the input clock, every run's deadlines with it).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from faust.types import TP, Message


class OffsetGaps:
    """The last processed offset per topic partition; reports forward jumps."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], int] = {}

    def observe(
        self, topic: str, partition: int, offset: int, committed: int | None = None
    ) -> tuple[int, int] | None:
        """Record `offset` as processed; (first, end) of the skipped offsets, if any.
        `committed` (the next offset the group would read) counts for the first record of a
        partition only. A backward move (redelivery after a seek) is normal and resets."""
        tp = (topic, partition)
        last = self._last.get(tp)
        self._last[tp] = offset
        if last is None:
            if committed is not None and offset > committed:
                return committed, offset
            return None
        if offset > last + 1:
            return last + 1, offset
        return None

    def forget(self) -> None:
        """After a rebalance the next offset of a partition may be anything."""
        self._last.clear()


@dataclass(slots=True)
class RefetchedEvent:
    """What the agents read of a faust event: its message (a faust Message, so that the
    consumer can acknowledge its offset like a streamed one)."""

    message: Message


class Refetcher:
    """Reads offset ranges of one topic (blocking: run it in an executor)."""

    def __init__(self, bootstrap: str, topic: str, timeout: float = 10.0) -> None:
        self.topic = topic
        self.timeout = timeout
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                # never subscribes and never commits: outside the worker's group
                "group.id": f"loopwatch-refetch-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "log_level": 0,
            }
        )

    def read(self, partition: int, first: int, end: int) -> list[RefetchedEvent]:
        """Records with first <= offset < end; raises KafkaException on broker errors."""
        self._consumer.assign([TopicPartition(self.topic, partition, first)])
        out: list[RefetchedEvent] = []
        deadline = time.monotonic() + self.timeout
        try:
            while time.monotonic() < deadline:
                msg: Any = self._consumer.poll(0.5)
                if msg is None:
                    continue
                if msg.error():
                    raise KafkaException(msg.error())
                if msg.offset() >= end:
                    break
                kind, ts_ms = msg.timestamp()
                message = Message(
                    self.topic,
                    partition,
                    msg.offset(),
                    ts_ms / 1000.0 if ts_ms > 0 else 0.0,
                    kind,
                    msg.headers(),
                    msg.key(),
                    msg.value(),
                    None,
                    tp=TP(self.topic, partition),
                )
                out.append(RefetchedEvent(message))
                if msg.offset() >= end - 1:
                    break
        finally:
            self._consumer.unassign()
        return out
