"""A send the broker refuses, through `loopwatch worker` on the real broker.

The internal steps topic is created beforehand with a small ``max.message.bytes``: the
steps of one large input record exceed it, and the broker answers MESSAGE_TOO_LARGE for
the delivery. The worker must dead-letter that record (reason ``publish_error``), count
the failed delivery, acknowledge the record so that its partition's commits move on, and
keep processing the records after it. Before, the record stayed unacknowledged and held
its partition's committed offset until a restart.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.integration.worker_support import WorkerProc, headers_of, write_policy
from tests.kafka_support import bootstrap, create_topics, require_broker
from tests.otlp_build import encode_request
from tests.spankit import Run

pytestmark = pytest.mark.kafka

STEPS_MAX_BYTES = 8000


def committed_offset(group: str, topic: str, partition: int) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap(), "group.id": group, "log_level": 0})
    try:
        (tp,) = consumer.committed([TopicPartition(topic, partition)], timeout=10)
        return int(tp.offset)
    finally:
        consumer.close()


def test_steps_refused_as_too_large_are_dead_lettered_and_commits_move_on(
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
    for i in range(100):  # one run: its steps go in one message, far over the limit
        big.tool("lookup_order", {"order_id": f"B{i}"}, {"status": "shipped", "version": i})
    big.root()
    small = Run(trace=32)
    for _ in range(3):
        small.tool("lookup_order", {"order_id": "A1"}, {"status": "pending"})
    small.root()
    try:
        worker.start()
        worker.wait_ready()
        ((_, big_offset),) = worker.produce([(None, encode_request(big.spans))])
        dead = worker.read("dead", until=lambda records: len(records) >= 1, timeout=60)
        assert len(dead) == 1, worker.log_tail()
        headers = headers_of(dead[0])
        assert headers["reason"] == "publish_error", headers
        assert headers["error"] == "MessageSizeTooLargeError", headers
        assert headers["source_offset"] == str(big_offset)
        assert worker.metric('loopwatch_publish_retries_total{stage="ingest"}') >= 1
        assert worker.metric('loopwatch_dead_letters_total{reason="publish_error"}') == 1

        # The partition moves on: the next record is processed and both are committed.
        ((_, small_offset),) = worker.produce([(None, encode_request(small.spans))])
        events = worker.read(
            "events",
            until=lambda records: any(
                json.loads(r.value())["trace_id"] == small.trace_id for r in records
            ),
            timeout=60,
        )
        shapes = {json.loads(r.value())["shape"] for r in events}
        assert shapes == {"identical_repetition"}, worker.log_tail()
        deadline = time.monotonic() + 30
        while committed_offset(worker.app_id, worker.topics["input"], 0) < small_offset + 1:
            assert time.monotonic() < deadline, "the input partition's commits did not move on"
            time.sleep(0.5)
        assert worker.alive()
        assert not worker.crash_lines(), worker.log_tail()
    finally:
        worker.cleanup()
