"""The windowed counts after crashes between counting and the offset commit (issue 40).

A worker (rocksdb tables, one data dir) is SIGKILLed, on every start but the last, inside a
checkpoint flush: once after a flush's counts are in the changelog and its run states are
not (the failpoint ``kill_at=counts:N``, tests/integration/failpoints/), once after both
(``states:N``), in either case before the batches' records are acknowledged. Each restart
processes those batches again from the committed offsets: the same events and summaries
come out again (at least once), and the counts must not take them twice. At the end the
on-call API's answers (`/loops`, `/runs`, `/versions`, `/compare`, what `loopwatch query
loops`, `query versions` and `query compare` print) must equal the distinct events and
finished runs of the input, as the replay computes them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_chaos import check_against_replay, collect
from tests.integration.test_faults import FAILPOINTS, fault_worker, split
from tests.integration.worker_support import LONG, Oracle, rooted_corpus
from tests.support.kafka import create_topics, require_broker
from tests.support.worker_proc import REPO, WorkerProc

pytestmark = pytest.mark.kafka

PARTITIONS = 4
# the failpoint of each start (None: the last, which runs to the end); `make chaos` (LONG):
# twice as many corpus parts, 7 kills
KILLS = (
    ("counts:1", "states:1", "counts:2", "states:2", "counts:1", "counts:3", "states:1", None)
    if LONG
    else ("counts:1", "states:1", "counts:2", None)
)
SPANS = 40_000 if LONG else 16_000


def total(doc: dict[str, Any], value: str) -> int:
    return sum(int(row[value]) for row in doc["rows"])


def answers(worker: WorkerProc) -> dict[str, Any]:
    status, loops = worker.api("/loops?by=shape&since=24h")
    assert status == 200, loops
    status, runs = worker.api("/runs?since=24h")
    assert status == 200, runs
    status, versions = worker.api("/versions?since=24h")
    assert status == 200, versions
    return {"loops": loops, "runs": runs, "versions": versions}


def test_counts_after_sigkill_between_counting_and_the_commit(tmp_path: Path) -> None:
    require_broker()
    want = Oracle.of([rooted_corpus(SPANS, seed=2031)])
    assert len(want.event_ids) >= 5 and len(want.runs) >= 200
    worker = fault_worker(
        tmp_path,
        LOOPWATCH_STORE="rocksdb://",
        LOOPWATCH_STATE_FLUSH_MS="200",
        PYTHONPATH=f"{FAILPOINTS}{os.pathsep}{REPO}",
    )
    parts = split(want.messages, len(KILLS))
    try:
        create_topics([worker.topics["input"]], PARTITIONS)
        for part, kill_at in zip(parts, KILLS, strict=True):
            worker.produce((None, m) for m in part)
            worker.env.pop("LOOPWATCH_FAILPOINT_KILL_AT", None)
            if kill_at is not None:
                worker.env["LOOPWATCH_FAILPOINT_KILL_AT"] = kill_at
            worker.start()
            if kill_at is None:
                break
            assert worker.proc is not None
            try:
                code = worker.proc.wait(120)
            except subprocess.TimeoutExpired:
                _status, health = worker.api("/healthz")
                raise AssertionError(f"not killed at {kill_at}: {health}") from None
            assert code == -signal.SIGKILL, worker.log_tail()
        worker.wait_ready(120)
        got = collect(worker, want, 180)
        check_against_replay(got, want, "crash-counts", worker)
        time.sleep(2.0)  # the last flush of counts
        text = worker.log_path.read_text(errors="replace")
        kills = text.count("failpoint kill_at: SIGKILL")
        assert kills == len(KILLS) - 1, worker.log_tail()
        redone = sum(n - 1 for n in got.event_copies.values() if n > 1) + sum(
            n - 1 for n in got.summary_copies.values() if n > 1
        )
        print(f"\n{kills} kills; outputs published again after them: {redone}")
        assert redone > 0, "no batch was redone: the test did not test the counts' guard"

        got_answers = answers(worker)
        assert total(got_answers["loops"], "events") == len(want.event_ids), got_answers["loops"]
        by_shape = Counter(e["shape"] for e in want.events)
        assert {r["shape"]: r["events"] for r in got_answers["loops"]["rows"]} == by_shape
        assert total(got_answers["runs"], "runs") == len(want.runs), got_answers["runs"]
        by_version = Counter(s["prompt_version"] for s in want.summaries.values())
        prompt_rows = [r for r in got_answers["versions"]["rows"] if r["kind"] == "prompt"]
        assert {r["version"]: r["runs"] for r in prompt_rows} == by_version

        status, compare = worker.api(
            "/compare?prompt_version=support-v14&baseline=support-v12&since=24h"
        )
        assert status == 200, compare
        assert compare["baseline"]["runs"] == by_version["support-v12"], compare
        assert compare["candidate"]["runs"] == by_version["support-v14"], compare
        assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()
    finally:
        worker.cleanup()
