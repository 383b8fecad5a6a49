"""The input clock's probe (streams/worker/kafka/input_clock.py `KafkaInputProbe`) against the
real broker: every partition's end offset, the group's committed offsets, and the log start
of a partition the group never committed (records deleted at its head included), in a
fixed number of requests whatever the partition count; a partition added to the topic is
read after the metadata interval."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import NewPartitions  # type: ignore[attr-defined]

from streams.worker.kafka.input_clock import KafkaInputProbe
from tests.support.kafka import admin_client, bootstrap, create_topics, require_broker, unique_topic
from tests.support.worker_proc import reader

pytestmark = pytest.mark.kafka


def produce(topic: str, counts: dict[int, int]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap(), "log_level": 0})
    for partition, n in counts.items():
        for i in range(n):
            producer.produce(topic, value=b"%d" % i, partition=partition)
    assert producer.flush(30) == 0


def watermarks(topic: str, partitions: range) -> dict[int, tuple[int, int]]:
    """(low, high) watermarks, as a consumer that reads what faust's does (uncommitted)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap(),
            "group.id": "lw-watermarks",
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            for p in partitions
        }
    finally:
        consumer.close()


def commit(group: str, topic: str, offsets: dict[int, int]) -> None:
    """Commit as the group would, without joining it."""
    consumer = reader(group)
    try:
        tps = [TopicPartition(topic, p, o) for p, o in offsets.items()]
        consumer.commit(offsets=tps, asynchronous=False)
    finally:
        consumer.close()


def fresh_input(records: dict[int, int]) -> tuple[str, str]:
    """A new input topic with these records per partition, and a new group's id."""
    require_broker()
    topic, group = unique_topic("lw-probe"), f"lw-probe-{uuid.uuid4().hex[:8]}"
    create_topics([topic], len(records))
    produce(topic, records)
    return topic, group


def test_the_probe_reads_every_end_and_the_groups_progress_in_a_fixed_number_of_requests() -> None:
    topic, group = fresh_input({p: 3 * p + 1 for p in range(6)})
    # a head deleted by retention: the group, which never committed there, starts after it
    admin = admin_client()  # (kept: its futures fail once it is collected)
    for future in admin.delete_records([TopicPartition(topic, 5, 4)]).values():
        future.result(30)
    commit(group, topic, {0: 1, 2: 5})
    probe = KafkaInputProbe(bootstrap(), group, topic)
    try:
        read = probe.read()
        assert read is not None
        ends, committed = read
        marks = watermarks(topic, range(6))
        assert (
            ends == {p: high for p, (_, high) in marks.items()} == {p: 3 * p + 1 for p in range(6)}
        )
        assert committed == {0: 1, 1: 0, 2: 5, 3: 0, 4: 0, 5: 4}
        assert probe.requests == 4  # metadata, ends, commits, starts of the uncommitted

        commit(group, topic, {p: 3 * p + 1 for p in range(6)})
        before = probe.requests
        assert probe.read() == ({p: 3 * p + 1 for p in range(6)},) * 2
        assert probe.requests - before == 2  # ends and commits: not one per partition
    finally:
        probe.close()


def test_a_partition_added_to_the_input_is_read_after_the_metadata_interval() -> None:
    topic, group = fresh_input({0: 2, 1: 3})
    probe = KafkaInputProbe(bootstrap(), group, topic, metadata_seconds=1.0)
    try:
        assert probe.read() == ({0: 2, 1: 3}, {0: 0, 1: 0})
        admin = admin_client()
        for future in admin.create_partitions([NewPartitions(topic, 3)]).values():
            future.result(30)
        deadline = time.monotonic() + 30
        while True:  # the producer's metadata learns of the partition on its own time
            try:
                produce(topic, {2: 4})
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        time.sleep(1.1)
        assert probe.read() == ({0: 2, 1: 3, 2: 4}, {0: 0, 1: 0, 2: 0})
    finally:
        probe.close()


def test_the_ends_include_the_records_of_an_open_transaction() -> None:
    """An end is the high watermark: faust's consumer (at least once) reads uncommitted
    records, so a record of a transaction still open is input the snapshot must wait for.
    librdkafka's default (read_committed) answers the last stable offset, short of it: the
    probe's `get_watermark_offsets` did that before its ends were read in one request."""
    topic, group = fresh_input({0: 2, 1: 1})
    producer = Producer(
        {"bootstrap.servers": bootstrap(), "transactional.id": f"lw-{group}", "log_level": 0}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    for _ in range(3):
        producer.produce(topic, value=b"open", partition=0)
    assert producer.flush(30) == 0
    probe = KafkaInputProbe(bootstrap(), group, topic)
    try:
        read = probe.read()
        assert read is not None
        assert read[0] == {0: 5, 1: 1} == {p: w[1] for p, w in watermarks(topic, range(2)).items()}
    finally:
        probe.close()
        producer.abort_transaction(30)
