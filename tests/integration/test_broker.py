"""The real local broker works for both client stacks loopwatch uses.

confluent-kafka: CLI produce, admin, benchmarks. aiokafka: faust's transport. Each test does a
keyed produce -> group consume -> commit round trip on its own fresh topic and checks keys,
values, headers, per-key ordering/partitioning and the committed group offsets.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka import TopicPartition as AioTopicPartition
from confluent_kafka import Consumer, Producer, TopicPartition

from tests.support.kafka import (
    bootstrap,
    create_topics,
    delete_topics,
    require_broker,
    unique_topic,
)

pytestmark = pytest.mark.kafka

PARTITIONS = 4
KEYS = [f"run-{i}" for i in range(6)]
N = 60
TIMEOUT = 30.0

Headers = list[tuple[str, bytes]]
Produced = tuple[bytes, bytes, Headers]  # key, value, headers
Consumed = tuple[int, bytes, bytes, Headers]  # partition, key, value, headers


def consumed(partition: int | None, key: object, value: object, headers: object) -> Consumed:
    assert isinstance(partition, int)
    assert isinstance(key, bytes) and isinstance(value, bytes), (key, value)
    assert isinstance(headers, list | tuple), headers
    hs = [(str(k), bytes(v)) for k, v in headers]
    return partition, key, value, hs


def expected_records() -> list[Produced]:
    records = []
    for i in range(N):
        key = KEYS[i % len(KEYS)].encode()
        value = f'{{"seq": {i}, "span": "{i:04x}"}}'.encode()
        headers = [("content-type", b"application/json"), ("seq", str(i).encode())]
        records.append((key, value, headers))
    return records


def check_round_trip(got: list[Consumed]) -> None:
    """got: (partition, key, value, headers) in consumption order."""
    want = expected_records()
    assert len(got) == len(want), f"consumed {len(got)} of {len(want)} records"
    assert sorted((k, v, tuple(h)) for _, k, v, h in got) == sorted(
        (k, v, tuple(h)) for k, v, h in want
    )
    # a key always lands on one partition, and its records arrive in produce order
    by_key: dict[bytes, list[tuple[int, int]]] = {}
    for partition, key, _value, headers in got:
        by_key.setdefault(key, []).append((partition, int(dict(headers)["seq"])))
    for key, seen in by_key.items():
        assert len({p for p, _ in seen}) == 1, f"key {key!r} spread over partitions {seen}"
        seqs = [s for _, s in seen]
        assert seqs == sorted(seqs), f"key {key!r} out of order: {seqs}"
    # six keys over four partitions: the records really are spread out
    assert len({p for p, *_ in got}) > 1


@pytest.fixture(scope="module")
def broker() -> str:
    require_broker()
    return bootstrap()


@pytest.fixture
def topic(broker: str) -> Iterator[str]:
    name = unique_topic("it-broker")
    create_topics([name], PARTITIONS)
    yield name
    delete_topics([name])


def test_confluent_round_trip(broker: str, topic: str) -> None:
    producer = Producer({"bootstrap.servers": broker, "enable.idempotence": True, "linger.ms": 5})
    for key, value, headers in expected_records():
        producer.produce(topic, key=key, value=value, headers=list(headers))
    assert producer.flush(TIMEOUT) == 0, "records left unsent"

    group = unique_topic("it-group")
    consumer = Consumer(
        {
            "bootstrap.servers": broker,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    got: list[Consumed] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + TIMEOUT
        while len(got) < N and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            got.append(consumed(msg.partition(), msg.key(), msg.value(), msg.headers() or []))
        consumer.commit(asynchronous=False)
        committed = consumer.committed(
            [TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10
        )
    finally:
        consumer.close()

    check_round_trip(got)
    assert sum(max(tp.offset, 0) for tp in committed) == N, committed


async def test_aiokafka_round_trip(broker: str, topic: str) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=broker, enable_idempotence=True)
    await producer.start()
    try:
        batch = [
            await producer.send(topic, key=key, value=value, headers=headers)
            for key, value, headers in expected_records()
        ]
        await producer.flush()
        for fut in batch:
            await fut  # raises if the broker refused a record
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=broker,
        group_id=unique_topic("it-group"),
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    got: list[Consumed] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(got) < N and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for tp, msgs in batches.items():
                got.extend(consumed(tp.partition, m.key, m.value, m.headers) for m in msgs)
        await consumer.commit()
        committed = [
            await consumer.committed(AioTopicPartition(topic, p)) for p in range(PARTITIONS)
        ]
    finally:
        await consumer.stop()

    check_round_trip(got)
    assert sum(c or 0 for c in committed) == N, committed
