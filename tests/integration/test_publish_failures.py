"""A send the broker refuses, through `loopwatch worker` on the real broker.

The internal steps topic is created beforehand with a small ``max.message.bytes`` (an
operator's mistake): the steps of one large input record exceed it, and the broker answers
MESSAGE_TOO_LARGE for the delivery, which the producer does not retry. The worker must
count the failed delivery (the metric LoopwatchPublishRetrying alerts on), keep sending it
with backoff, and once the limit is raised deliver it, process it and the records after it,
and commit past them, without a restart and without a dead letter. Before, the record
stayed unacknowledged and held its partition's committed offset until a restart.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

from tests.otlp_build import encode_request
from tests.spankit import Run
from tests.support.kafka import admin_client, bootstrap, create_topics, require_broker
from tests.support.worker_proc import WorkerProc, write_policy

pytestmark = pytest.mark.kafka

STEPS_MAX_BYTES = 3000  # the big run's steps take about 5.6 kB, the small run's 0.8 kB


def committed_offset(group: str, topic: str, partition: int) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap(), "group.id": group, "log_level": 0})
    try:
        (tp,) = consumer.committed([TopicPartition(topic, partition)], timeout=10)
        return int(tp.offset)
    finally:
        consumer.close()


def raise_message_limit(topic: str, limit: int) -> None:
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry(
                "max.message.bytes", str(limit), incremental_operation=AlterConfigOpType.SET
            )
        ],
    )
    admin = admin_client()  # kept alive until the answer: a dropped client aborts it
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(30)


def events_of(worker: WorkerProc, run: Run) -> list[str]:
    events = worker.read(
        "events",
        until=lambda records: any(
            json.loads(r.value())["trace_id"] == run.trace_id for r in records
        ),
        timeout=60,
    )
    return [
        json.loads(r.value())["shape"]
        for r in events
        if json.loads(r.value())["trace_id"] == run.trace_id
    ]


def test_steps_refused_as_too_large_are_sent_again_until_the_limit_is_raised(
    tmp_path: Path,
) -> None:
    require_broker()
    policy = write_policy(
        tmp_path / "policy.yaml", allowed_lateness_seconds=1, finalize_grace_seconds=2
    )
    worker = WorkerProc(tmp_path, policy)
    create_topics([worker.topics["input"]], 1)
    create_topics([worker.topics["steps"]], 4, config={"max.message.bytes": str(STEPS_MAX_BYTES)})

    big = Run(trace=31)
    for _ in range(30):  # one run, looping: its steps go in one message, over the limit
        big.tool("lookup_order", {"order_id": "B1"}, {"status": "shipped"})
    big.root()
    small = Run(trace=32)
    for _ in range(3):
        small.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    small.root()
    try:
        worker.start()
        worker.wait_ready()
        worker.produce([(None, encode_request(big.spans)), (None, encode_request(small.spans))])
        deadline = time.monotonic() + 30
        while worker.metric('loopwatch_publish_retries_total{stage="ingest"}') < 2:
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.5)
        assert committed_offset(worker.app_id, worker.topics["input"], 0) < 1  # held

        raise_message_limit(worker.topics["steps"], 1_000_000)  # the operator's fix
        assert events_of(worker, big) == ["identical_repetition"], worker.log_tail()
        assert events_of(worker, small) == ["identical_repetition"], worker.log_tail()
        deadline = time.monotonic() + 30
        while committed_offset(worker.app_id, worker.topics["input"], 0) < 2:
            assert time.monotonic() < deadline, "the input partition's commits did not move on"
            time.sleep(0.5)
        assert worker.read("dead", timeout=2) == []
        assert worker.alive()
        assert not worker.crash_lines(), worker.log_tail()
    finally:
        worker.cleanup()
