"""faust's rocksdb table store under one memory budget for the whole process.

faust opens one rocksdb instance per table partition (4 tables x 4 partitions = 16 by
default), each with its own block cache and memtables, and keeps index and filter blocks
outside any cache. Worker RSS then grew with the data towards the sum of 16 caps (+17.5%
between 100k and 1M finished runs). Here every instance shares one block cache; memtables
are charged to that cache through one WriteBufferManager, and index and filter blocks
live in it too, so rocksdb's memory is bounded by one number
(``LOOPWATCH_ROCKSDB_MEMORY_MB``) however many partitions a worker owns.

The store is registered with faust under the URL scheme ``bounded-rocksdb://``; the
worker selects it when the configured store is ``rocksdb://``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import rocksdict
from faust import stores
from faust.stores import rocksdb as faust_rocksdb

SCHEME = "bounded-rocksdb"
MIB = 1024 * 1024


class SharedMemory:
    """The block cache and write buffer manager every table partition shares."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.cache = rocksdict.Cache(total_bytes)
        # Memtables may take half of the budget; they are charged to the cache, so the
        # cache (reads, index and filter blocks) and memtables together stay within it.
        self.write_buffers = rocksdict.WriteBufferManager.new_write_buffer_manager_with_cache(
            total_bytes // 2, False, self.cache
        )

    def usage_bytes(self) -> int:
        return int(self.cache.get_usage())


_shared: SharedMemory | None = None


def shared_memory(total_bytes: int) -> SharedMemory:
    """The process's one budget; the first call fixes its size."""
    global _shared
    if _shared is None:
        _shared = SharedMemory(total_bytes)
    return _shared


class BoundedOptions(faust_rocksdb.RocksDBOptions):
    """faust's options with the shared cache and write buffer manager."""

    def __init__(self, *, memory: SharedMemory, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.memory = memory

    def as_options(self) -> Any:
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_max_open_files(self.max_open_files or -1)
        options.set_write_buffer_size(self.write_buffer_size)
        options.set_max_write_buffer_number(self.max_write_buffer_number)
        options.set_target_file_size_base(self.target_file_size_base)
        options.set_write_buffer_manager(self.memory.write_buffers)
        table = rocksdict.BlockBasedOptions()
        table.set_bloom_filter(self.bloom_filter_size, True)
        table.set_block_cache(self.memory.cache)
        table.set_cache_index_and_filter_blocks(True)
        # L0 index/filter blocks are read on every lookup: keep them from being evicted.
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        table.set_index_type(rocksdict.BlockBasedIndexType.binary_search())
        options.set_block_based_table_factory(table)
        return options

    def open(self, path: Path, *, read_only: bool = False) -> Any:
        options = self.as_options()
        options.set_db_paths([rocksdict.DBPath(str(path), self.target_file_size_base)])
        access = (
            rocksdict.AccessType.read_write()
            if self.ttl is None
            else rocksdict.AccessType.with_ttl(self.ttl)
        )
        db = rocksdict.Rdict(str(path), options=options, access_type=access)
        db.set_read_options(rocksdict.ReadOptions())
        return db


class BoundedStore(faust_rocksdb.Store):
    """faust's rocksdb Store (rocksdict driver) opening partitions with BoundedOptions.
    Table options carry ``memory_bytes``: the process-wide budget."""

    def __init__(self, url: Any, app: Any, table: Any, **kwargs: Any) -> None:
        options = dict(kwargs.pop("options", None) or {})
        memory_bytes = int(options.pop("memory_bytes"))
        options["driver"] = "rocksdict"
        super().__init__(url, app, table, options=options, **kwargs)
        self.rocksdb_options = BoundedOptions(
            memory=shared_memory(memory_bytes), **dict(self.options or {}), use_rocksdict=True
        )


def memory_report() -> dict[str, float] | None:
    """The shared budget and its use, in MiB (None before a rocksdb table was opened)."""
    if _shared is None:
        return None
    return {
        "budget_mib": round(_shared.total_bytes / MIB, 1),
        "used_mib": round(_shared.usage_bytes() / MIB, 1),
    }


def register() -> str:
    """Make ``bounded-rocksdb://`` known to faust; returns the store URL."""
    stores.STORES.aliases.setdefault(SCHEME, f"{__name__}:BoundedStore")
    return f"{SCHEME}://"
