"""The rocksdb store's one memory budget (streams/store.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from detectors.errors import ConfigError
from streams.settings import WorkerSettings
from streams.store import MIB, BoundedOptions, SharedMemory


def _options(memory: SharedMemory) -> BoundedOptions:
    return BoundedOptions(
        memory=memory,
        write_buffer_size=1 * MIB,
        max_write_buffer_number=2,
        target_file_size_base=2 * MIB,
    )


def test_many_partitions_share_one_budget(tmp_path: Path) -> None:
    """Eight partitions, 40 MiB written and read back: rocksdb's cache, memtables and
    index/filter blocks stay within the one 8 MiB budget, and nothing is lost."""
    memory = SharedMemory(8 * MIB)
    options = _options(memory)
    dbs = [options.open(tmp_path / f"p{i}") for i in range(8)]
    value = os.urandom(1000)
    peak = 0
    try:
        for n in range(5_000):
            for i, db in enumerate(dbs):
                db[f"run-{n}".encode()] = value[:-1] + bytes([i])
            peak = max(peak, memory.usage_bytes())
        memtables = sum(db.property_int_value("rocksdb.cur-size-all-mem-tables") for db in dbs)
        assert memtables > MIB
        # nothing was read yet: the cache's use is mostly the memtables charged to it
        assert memory.usage_bytes() >= memtables // 2
        for n in range(0, 5_000, 7):
            for i, db in enumerate(dbs):
                assert db[f"run-{n}".encode()] == value[:-1] + bytes([i])
            peak = max(peak, memory.usage_bytes())
    finally:
        for db in dbs:
            db.close()
    # A soft limit: flushes are asynchronous, so use may briefly exceed the budget.
    assert peak <= 8 * MIB * 1.25, peak / MIB


def test_settings_give_the_budget_and_reject_the_replaced_variable() -> None:
    s = WorkerSettings.from_env({"LOOPWATCH_ROCKSDB_MEMORY_MB": "128"})
    assert s.rocksdb_options()["memory_bytes"] == 128 * MIB
    with pytest.raises(ConfigError, match="LOOPWATCH_ROCKSDB_MEMORY_MB"):
        WorkerSettings.from_env({"LOOPWATCH_ROCKSDB_BLOCK_CACHE_MB": "8"})
    with pytest.raises(ConfigError, match="LOOPWATCH_ROCKSDB_MEMORY_MB"):
        WorkerSettings.from_env({"LOOPWATCH_ROCKSDB_MEMORY_MB": "2"})
