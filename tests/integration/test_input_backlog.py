"""A run whose spans wait in one input partition's backlog while its root is alone on
another (unkeyed input, the kafkaexporter's default): the worker must not finalize the run
from its root alone. The input clock (streams/worker/kafka/input_clock.py) holds run deadlines until
the consumer group has processed every input record that existed meanwhile.

Before the input clock the worker finalized the run `finalize_grace_seconds` after its root
arrived: outcome `complete` with 1 step and no event, where the replay has 9 steps and an
identical_repetition event.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import Producer

from tests.integration.worker_support import Oracle, rooted_corpus, values
from tests.otlp_build import encode_request
from tests.spankit import Run
from tests.support.kafka import bootstrap, create_topics, require_broker
from tests.support.worker_proc import WorkerProc, write_policy

pytestmark = pytest.mark.kafka

BACKLOG_SPANS = 40_000  # several seconds of work for one worker, far above the grace


def target_run() -> Run:
    run = Run(trace=4242)
    for _ in range(8):
        run.tool("lookup_order", {"order_id": "B7"}, {"status": "pending"})
    run.root()
    return run


def test_run_waiting_in_the_input_backlog_is_not_finalized_early(tmp_path: Path) -> None:
    require_broker()
    backlog = rooted_corpus(BACKLOG_SPANS, seed=77)
    run = target_run()
    body = encode_request(run.spans[:-1])  # the 8 tool calls, behind the backlog
    root = encode_request(run.spans[-1:])  # alone on the other partition
    want = Oracle.of([backlog, [body, root]])
    assert any(e["run_id"] == run.trace_id for e in want.events)

    policy = write_policy(
        tmp_path / "policy.yaml", finalize_grace_seconds=1, allowed_lateness_seconds=60
    )
    worker = WorkerProc(tmp_path, policy, LOOPWATCH_INPUT_CLOCK="true")
    try:
        create_topics([worker.topics["input"]], 2)
        producer = Producer({"bootstrap.servers": bootstrap(), "log_level": 0, "linger.ms": 5})
        for message in [*backlog, body]:
            producer.produce(worker.topics["input"], value=message, partition=0)
        producer.produce(worker.topics["input"], value=root, partition=1)
        assert producer.flush(30) == 0
        total = len(backlog) + 2

        worker.start()
        worker.wait_ready()
        worker.wait_taken(total, timeout=180)
        summaries = values(
            worker.read(
                "runs",
                until=lambda recs: len({v["run_id"] for v in values(recs)}) >= len(want.runs),
                timeout=120,
            )
        )
        events = values(worker.read("events", settle=2.0, timeout=30))
    finally:
        worker.cleanup()

    mine = [s for s in summaries if s["run_id"] == run.trace_id]
    assert mine and {s["steps"] for s in mine} == {want.summaries[run.trace_id]["steps"]}, (
        f"finalized before its spans arrived: {mine}"
    )
    problems, _ = want.differences(events, summaries)
    assert not problems, "\n".join(problems)
