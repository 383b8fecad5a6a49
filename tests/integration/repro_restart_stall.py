"""Reproduction, run by hand (not collected: the file name does not start with test_):
the worker stops consuming an input partition after a restart about 1 run in 3.

    .venv/bin/python -m pytest tests/integration/repro_restart_stall.py   # broker running

Rocksdb tables; the corpus in three parts, one per run; before the second run the data
dir is deleted, before the third every table partition's rocksdb CURRENT file is
overwritten. The tables are rebuilt from the changelogs (the damaged partitions are moved
aside), but after a restart the consumer sometimes stops delivering one input partition:
committed offsets {0: 9, 1: 14, 2: 16, 3: 2} against end offsets {0: 9, 1: 18, 2: 16,
3: 2}, 242 run summaries and 9 events missing. The log ends at "Worker ready" with no
error; /healthz reports it ("nothing processed for 115 s with a consumer lag of 5
records"). Seen 3 times in about 10 runs with the faults work, and 1 in 4 plain restarts
without it: a restart problem this scenario exposes, cause not found yet. Until it is
fixed the scenario is not in CI (a known-red test would hide every other regression).
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

from tests.integration.test_chaos import check_against_replay, collect
from tests.integration.test_faults import (  # noqa: F401 - the module fixture `expected`
    PARTITIONS,
    RESULT_TIMEOUT,
    create_topics,
    expected,  # noqa: F811
    fault_worker,
    split,
)
from tests.integration.worker_support import Oracle


def damage(data_dir: Path) -> int:
    n = 0
    for current in data_dir.glob("*/v*/tables/*.db/CURRENT"):
        current.write_bytes(b"garbage, not a manifest name\n")
        n += 1
    return n


def test_state_dir_deleted_or_damaged(expected: Oracle, tmp_path: Path) -> None:  # noqa: F811
    worker = fault_worker(tmp_path / "state", LOOPWATCH_STORE="rocksdb://")
    data_dir = Path(worker.env["LOOPWATCH_DATA_DIR"])
    parts = split(expected.messages, 3)
    try:
        create_topics([worker.topics["input"]], PARTITIONS)
        taken = 0
        for i, part in enumerate(parts):
            if i == 1:
                shutil.rmtree(data_dir)
            elif i == 2:
                assert damage(data_dir) > 0, f"no table state under {data_dir}"
            worker.start()
            worker.wait_ready(120)
            worker.produce((None, m) for m in part)
            taken += len(part)
            worker.wait_taken(taken if i == 0 else len(part), 120)
            time.sleep(3.0)  # detect's batch and the commits
            if i < len(parts) - 1:
                assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()
        got = collect(worker, expected, RESULT_TIMEOUT)
        check_against_replay(got, expected, "state-dir", worker)
        text = worker.log_path.read_text(errors="replace")
        assert "is damaged" in text and "moved aside" in text, worker.log_tail()
        assert worker.stop(signal.SIGTERM) == 0, worker.log_tail()
    finally:
        worker.cleanup()
