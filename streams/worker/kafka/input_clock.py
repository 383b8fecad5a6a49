"""How far the consumer group has worked through its input: the input clock.

Unkeyed input spreads one trace's spans over several input partitions. A run's wall-clock
deadlines (release after lateness, finalization after grace or idle time) must not pass
while spans of the run may still wait in another partition's backlog, possibly on another
worker. The input clock is the latest wall time T such that every record that was in the
input topic at T has been processed by the group (its offsets are committed). Deadlines
are then compared with min(wall clock, input clock): in steady state that trails the wall
clock by the commit interval; after downtime it holds runs until the backlog is drained.

`InputClock` is the bookkeeping (pure, unit tested); `KafkaInputProbe` reads end offsets
and the group's committed offsets with a confluent-kafka consumer that never joins the
group (blocking: run it in an executor).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Mapping

from confluent_kafka import Consumer, KafkaException, TopicPartition

log = logging.getLogger(__name__)

MAX_SNAPSHOTS = 3600  # one per tick: an hour of backlog at 1 s ticks


class InputClock:
    """Snapshots of the input's end offsets, released once the group's commits pass them."""

    def __init__(self, start_ns: int) -> None:
        self.now_ns = start_ns  # nothing before the worker started is promised
        self._snapshots: deque[tuple[int, dict[int, int]]] = deque()

    def observe(self, at_ns: int, ends: Mapping[int, int], committed: Mapping[int, int]) -> int:
        """Record the end offsets seen at `at_ns` and advance the clock past every snapshot
        the committed offsets (same moment or later) have reached. Returns the clock."""
        self._snapshots.append((at_ns, dict(ends)))
        if len(self._snapshots) > MAX_SNAPSHOTS:
            self._snapshots.popleft()  # coarser, never wrong: the clock just waits longer
        while self._snapshots:
            at, snapshot = self._snapshots[0]
            if any(committed.get(p, 0) < end for p, end in snapshot.items()):
                break
            self._snapshots.popleft()
            self.now_ns = max(self.now_ns, at)
        return self.now_ns

    @property
    def behind(self) -> int:
        """Snapshots still waiting for the group (0 when caught up)."""
        return len(self._snapshots)


class KafkaInputProbe:
    """End offsets of the input topic and the group's committed offsets.

    A plain consumer with the group's id that never subscribes: it does not join the group
    (no rebalance), it only asks the coordinator for committed offsets (OffsetFetch). Not
    an AdminClient: librdkafka's admin coordinator requests crash the process (SIGSEGV)
    when the connection drops mid-request, which a broker restart made happen here
    (librdkafka PR #5397). After an error the consumer is closed, on this thread, and
    rebuilt: after a broker restart an old client kept timing out."""

    def __init__(self, bootstrap: str, group: str, topic: str, timeout: float = 5.0) -> None:
        self.topic = topic
        self.bootstrap = bootstrap
        self.group = group
        self.timeout = timeout
        self._consumer: Consumer | None = None

    def _client(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(
                {
                    "bootstrap.servers": self.bootstrap,
                    "group.id": self.group,
                    "enable.auto.commit": False,
                    "log_level": 0,
                }
            )
        return self._consumer

    def read(self) -> tuple[dict[int, int], dict[int, int]] | None:
        """(end offsets, committed offsets) by partition; None when the broker cannot say."""
        try:
            consumer = self._client()
            md = consumer.list_topics(self.topic, timeout=self.timeout)
            topic = md.topics.get(self.topic)
            if topic is None or topic.error is not None:
                raise KafkaException(topic.error if topic is not None else "topic not found")
            ends: dict[int, int] = {}
            starts: dict[int, int] = {}
            for p in sorted(topic.partitions):
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(self.topic, p), timeout=self.timeout
                )
                starts[p], ends[p] = low, high
            committed: dict[int, int] = {}
            tps = [TopicPartition(self.topic, p) for p in ends]
            for tp in consumer.committed(tps, timeout=self.timeout):
                if tp.error is not None:
                    raise KafkaException(tp.error)
                # No commit yet: the group starts from the earliest record (reset policy).
                committed[tp.partition] = tp.offset if tp.offset >= 0 else starts[tp.partition]
            return ends, committed
        except (KafkaException, RuntimeError) as exc:
            log.warning(
                "input clock: offsets of %s unavailable: %s", self.topic, exc or type(exc).__name__
            )
            self.close()
            return None

    def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(KafkaException, RuntimeError):
                consumer.close()
