"""How far the consumer group has worked through its input: the input clock.

Unkeyed input spreads one trace's spans over several input partitions. A run's wall-clock
deadlines (release after lateness, finalization after grace or idle time) must not pass
while spans of the run may still wait in another partition's backlog, possibly on another
worker. The input clock is the latest wall time T such that every record that was in the
input topic at T has been processed by the group (its offsets are committed). Deadlines
are then compared with min(wall clock, input clock): in steady state that trails the wall
clock by one probe period and the time the ingest agent takes to deliver what it read;
after downtime it holds runs until the backlog is drained.

A partition's progress is the largest of three promises: the group's committed offset (any
worker's work, known a commit and a probe later), this worker's own delivered offset
(ingest's steps delivered for every record before it, known at once), and the delivered
offsets other workers send in marks on the steps topic (known when detect reads the
mark). The last two keep the clock within a fraction of a second of the wall clock: waiting for the commit and
the next probe cost 1-1.5 s a release (docs/PERFORMANCE.md "Where unkeyed detection latency
goes"). Delivered offsets are only taken as a contiguous extension of what is already
promised, so a record whose steps were never delivered (a failed acknowledgement) holds the
partition until the group's commits pass it, as before.

`InputClock` is the bookkeeping (pure, unit tested); `KafkaInputProbe` reads end offsets
and the group's committed offsets with a confluent-kafka consumer that never joins the
group (blocking: run it in an executor).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping

from confluent_kafka import Consumer, KafkaException, TopicPartition

log = logging.getLogger(__name__)

MAX_SNAPSHOTS = 3600  # one per tick: an hour of backlog at 1 s ticks
# ListOffsets' timestamps for a partition's end and start (the Kafka protocol's -1 and -2)
LATEST, EARLIEST = -1, -2


class InputClock:
    """Snapshots of the input's end offsets, released once every partition's progress (the
    group's commits, this worker's deliveries or other workers' marks) passes them."""

    def __init__(self, start_ns: int) -> None:
        self.now_ns = start_ns  # nothing before the worker started is promised
        self._snapshots: deque[tuple[int, dict[int, int]]] = deque()
        self._committed: dict[int, int] = {}  # the group's, as of the last probe
        self._delivered: dict[int, int] = {}  # this worker's ingest, as of its last ack
        self._marked: dict[int, int] = {}  # other workers' ingest, as their marks say

    def observe(self, at_ns: int, ends: Mapping[int, int], committed: Mapping[int, int]) -> int:
        """Record the end offsets seen at `at_ns` and the group's committed offsets (same
        moment or later), and advance the clock past every snapshot the progress has
        reached. Returns the clock."""
        self._snapshots.append((at_ns, dict(ends)))
        if len(self._snapshots) > MAX_SNAPSHOTS:
            self._snapshots.popleft()  # coarser, never wrong: the clock just waits longer
        for p, offset in committed.items():
            self._committed[p] = max(offset, self._committed.get(p, offset))
        self._release()
        return self.now_ns

    def delivered(self, partition: int, first: int, end: int) -> bool:
        """This worker delivered the steps of records `first` .. `end` - 1 of `partition`.
        Taken only when `first` is within what is already promised (no gap before it).
        Returns whether the clock advanced."""
        if first > self._progress(partition):
            return False
        if end <= self._delivered.get(partition, 0):
            return False
        self._delivered[partition] = end
        return self._release()

    def marked(self, delivered: Mapping[int, int]) -> bool:
        """Another worker's mark: its ingest delivered the steps of every record below
        these offsets (a prefix it vouches for, before it sent the mark). Returns whether
        the clock advanced."""
        for p, end in delivered.items():
            if end > self._marked.get(p, 0):
                self._marked[p] = end
        return self._release()

    def own_deliveries(self) -> dict[int, int]:
        """This worker's delivered offsets, for its marks."""
        return dict(self._delivered)

    def _progress(self, partition: int) -> int:
        return max(
            self._committed.get(partition, 0),
            self._delivered.get(partition, 0),
            self._marked.get(partition, 0),
        )

    def _release(self) -> bool:
        """Drop the snapshots every partition's progress has passed, the clock to the last
        of them. Returns whether the clock advanced."""
        before = self.now_ns
        while self._snapshots:
            at, snapshot = self._snapshots[0]
            if any(self._progress(p) < end for p, end in snapshot.items()):
                break
            self._snapshots.popleft()
            self.now_ns = max(self.now_ns, at)
        return self.now_ns > before

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
    rebuilt: after a broker restart an old client kept timing out.

    A read is two requests whatever the partition count: the end offsets of every
    partition in one ListOffsets (`offsets_for_times` with the protocol's "latest"
    timestamp, one request per leader) and the committed ones in one OffsetFetch; a
    partition the group never committed adds its log start (one more ListOffsets). It was
    one request per partition plus the topic's metadata, ten times a second: 34 round
    trips a read at 32 partitions. The partition list is read again every
    `metadata_seconds` and after an error (a partition added since waits that long to be
    held for)."""

    def __init__(
        self,
        bootstrap: str,
        group: str,
        topic: str,
        timeout: float = 5.0,
        metadata_seconds: float = 10.0,
    ) -> None:
        self.topic = topic
        self.bootstrap = bootstrap
        self.group = group
        self.timeout = timeout
        self.metadata_seconds = metadata_seconds
        self._consumer: Consumer | None = None
        self._partitions: list[int] = []
        self._partitions_at = 0.0  # monotonic time of the last metadata read
        self.requests = 0  # broker requests sent (tests: a read's cost)

    def _client(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(
                {
                    "bootstrap.servers": self.bootstrap,
                    "group.id": self.group,
                    "enable.auto.commit": False,
                    # ends are high watermarks: faust's consumer (at least once) reads
                    # uncommitted records. Under read_committed, librdkafka's default, the
                    # answer is the last stable offset (get_watermark_offsets' too, which
                    # this probe used before), short of an open transaction's records
                    "isolation.level": "read_uncommitted",
                    "log_level": 0,
                }
            )
            self._partitions = []
        return self._consumer

    def _partition_list(self, consumer: Consumer) -> list[int]:
        now = time.monotonic()
        if self._partitions and now - self._partitions_at < self.metadata_seconds:
            return self._partitions
        self.requests += 1
        md = consumer.list_topics(self.topic, timeout=self.timeout)
        topic = md.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            raise KafkaException(topic.error if topic is not None else "topic not found")
        self._partitions, self._partitions_at = sorted(topic.partitions), now
        return self._partitions

    def _log_offsets(self, consumer: Consumer, partitions: list[int], which: int) -> dict[int, int]:
        """The end (`which` LATEST) or start (EARLIEST) offset of each partition."""
        self.requests += 1
        asked = [TopicPartition(self.topic, p, which) for p in partitions]
        out: dict[int, int] = {}
        for tp in consumer.offsets_for_times(asked, timeout=self.timeout):
            if tp.error is not None:
                raise KafkaException(tp.error)
            if tp.offset < 0:
                raise KafkaException(f"no offset for {self.topic}/{tp.partition}")
            out[tp.partition] = tp.offset
        if len(out) != len(partitions):
            raise KafkaException(f"offsets of {len(out)} of {len(partitions)} partitions")
        return out

    def read(self) -> tuple[dict[int, int], dict[int, int]] | None:
        """(end offsets, committed offsets) by partition; None when the broker cannot say.
        The ends are read first: committed offsets read after them can only be later."""
        try:
            consumer = self._client()
            partitions = self._partition_list(consumer)
            ends = self._log_offsets(consumer, partitions, LATEST)
            self.requests += 1
            committed: dict[int, int] = {}
            never: list[int] = []
            asked = [TopicPartition(self.topic, p) for p in partitions]
            for tp in consumer.committed(asked, timeout=self.timeout):
                if tp.error is not None:
                    raise KafkaException(tp.error)
                if tp.offset >= 0:
                    committed[tp.partition] = tp.offset
                else:
                    never.append(tp.partition)
            if never:  # no commit yet: the group starts from the earliest record
                committed.update(self._log_offsets(consumer, never, EARLIEST))
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
