"""How far the consumer group has worked through its input: the input clock.

Unkeyed input spreads one trace's spans over several input partitions. A run's wall-clock
deadlines (release after lateness, finalization after grace or idle time) must not pass
while spans of the run may still wait in another partition's backlog, possibly on another
worker. The input clock is the latest wall time T such that every record that was in the
input topic at T has been processed by the group (its offsets are committed). Deadlines
are then compared with min(wall clock, input clock): in steady state that trails the wall
clock by the commit interval; after downtime it holds runs until the backlog is drained.

`InputClock` is the bookkeeping (pure, unit tested); `KafkaInputProbe` reads end offsets
and the group's committed offsets with a confluent-kafka AdminClient (blocking: run it in
an executor).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from collections.abc import Mapping

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

log = logging.getLogger("loopwatch.worker")

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
    """End offsets of the input topic and the group's committed offsets, read with an
    AdminClient: it needs no group id of its own and can be rebuilt after an error."""

    def __init__(self, bootstrap: str, group: str, topic: str, timeout: float = 5.0) -> None:
        self.topic = topic
        self.bootstrap = bootstrap
        self.group = group
        self.timeout = timeout
        self._admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})

    def read(self) -> tuple[dict[int, int], dict[int, int]] | None:
        """(end offsets, committed offsets) by partition; None when the broker cannot say."""
        try:
            md = self._admin.list_topics(self.topic, timeout=self.timeout)
            tps = [TopicPartition(self.topic, p) for p in sorted(md.topics[self.topic].partitions)]
            ends = self._offsets(tps, OffsetSpec.latest())  # type: ignore[no-untyped-call]
            starts = self._offsets(tps, OffsetSpec.earliest())  # type: ignore[no-untyped-call]
            request = [ConsumerGroupTopicPartitions(self.group, tps)]
            future = self._admin.list_consumer_group_offsets(request, request_timeout=self.timeout)[
                self.group
            ]
            committed: dict[int, int] = {}
            for tp in future.result(timeout=self.timeout).topic_partitions:
                # No commit yet: the group starts from the earliest record (reset policy).
                committed[tp.partition] = tp.offset if tp.offset >= 0 else starts[tp.partition]
            return ends, committed
        except (KafkaException, KeyError, TimeoutError, concurrent.futures.TimeoutError) as exc:
            log.warning(
                "input clock: offsets of %s unavailable: %s", self.topic, exc or type(exc).__name__
            )
            # After a broker restart this client kept timing out: start afresh next time.
            self._admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
            return None

    def _offsets(self, tps: list[TopicPartition], spec: OffsetSpec) -> dict[int, int]:
        futures = self._admin.list_offsets({tp: spec for tp in tps}, request_timeout=self.timeout)
        return {tp.partition: f.result(timeout=self.timeout).offset for tp, f in futures.items()}
