"""A second worker joins while the first works through a backlog (the bench's two-worker
rounds lost events now and then): every event of the replay comes out.

The first worker stages its state for a long flush interval (what it has staged when the
rebalance begins is dropped, to be redone) and, by the ``hold_across_rebalance``
failpoint (tests/integration/failpoints/), hands its detect agent a batch it read before
the rebalance once the partitions are assigned again, flushes it and lets faust commit
before its end-of-recovery seek. Processed and acknowledged, that batch let faust, which
forgets a partition's committed offset as a revocation begins, commit past the dropped
records: their runs were never seen by either worker. Its steps partitions have no
committed offset yet when the second worker joins: their records fetched during the
rebalance must be read again too (faust_internals.install_uncommitted_seek_fix)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.integration.test_chaos import chaos_policy, check_against_replay, collect
from tests.integration.worker_support import Oracle, rooted_corpus
from tests.support.kafka import create_topics, require_broker
from tests.support.worker_proc import REPO, WorkerProc

pytestmark = pytest.mark.kafka

FAILPOINTS = Path(__file__).resolve().parent / "failpoints"
SPANS = 30_000


def test_a_worker_joining_during_a_backlog_loses_nothing(tmp_path: Path) -> None:
    require_broker()
    want = Oracle.of([rooted_corpus(SPANS, seed=39)])
    assert len(want.event_ids) >= 5, "the corpus must loop a little"
    (tmp_path / "w0").mkdir()
    first = WorkerProc(
        tmp_path / "w0",
        chaos_policy(tmp_path / "w0"),
        LOOPWATCH_STORE="rocksdb://",
        LOOPWATCH_STATE_FLUSH_MS="60000",
        LOOPWATCH_FAILPOINT_HOLD_ACROSS_REBALANCE="4",
        PYTHONPATH=f"{FAILPOINTS}{os.pathsep}{REPO}",
    )
    second = first.sibling(tmp_path / "w1")
    second.env["LOOPWATCH_FAILPOINT_HOLD_ACROSS_REBALANCE"] = ""  # the first one's only
    second.workdir.mkdir()
    workers = [first, second]
    try:
        create_topics([first.topics["input"]], 4)
        first.produce([(None, m) for m in want.messages])  # the backlog, unkeyed
        first.start()
        first.wait_ready(120)
        deadline = time.monotonic() + 60
        while "batch 4 held" not in first.log_tail(200):
            assert time.monotonic() < deadline, first.log_tail(40)
            time.sleep(0.1)
        second.start()
        second.wait_ready(120)
        got = collect(first, want, 180)
        check_against_replay(got, want, "second worker joins", first)
        assert "handed over" in first.log_tail(400), "the rebalance never came"
    finally:
        for worker in workers:
            worker.cleanup()
