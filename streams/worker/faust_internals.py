"""Every use of faust's (and, through it, aiokafka's) private internals, and the three
patches, in one place. faust-streaming is pinned to >=0.15.2,<0.16 (pyproject.toml);
tests/unit/worker/test_faust_internals.py has a test for each behaviour relied on here, so an
upgrade that changes one fails a test that names it, not the worker in production.

| what | why there is no public way | |
|---|---|---|
| `install_recovery_fix` | the end-of-recovery race below (faust-streaming #216 fixed it for apps without tables in #217; #253, which stopped fetching on suspend, was reverted in #256) | patch |
| `install_uncommitted_seek_fix` | the seek below: aiokafka's `seek_to_committed` moves only partitions with a committed offset above 0 | patch |
| `install_fetch_wait` | faust builds its worker consumer with `fetch_max_wait_ms=1500` and aiokafka's `fetch_min_bytes` of 1, and has no setting for either: live traffic is fetched a record or two at a time | patch |
| `in_event` | `faust.streams._current_event`: a table write goes to the current event's partition, and batched processing (`take_events`) handles several partitions per batch | ContextVar |
| `table_databases` | `table.data._dbs`: rocksdb's memory properties per partition, for /healthz | read |
| `share_store_memory` | `table.data.rocksdb_options`: faust's `RocksDBOptions.as_options()` gives every partition of every table a block cache of its own and no write buffer manager; replaced by one built on a shared cache and manager | replace |
| `partition_read` | `table.data._db_for_partition(p).get(key)`: a run's state, marker or record, read from the partition it is in. faust reads a key in the current event's partition; outside an event (the detect agent's reads are), it looks the key up in its key index, and for a key not there (every new run) in every partition's database in turn. Through the Table's layers a read took 6-12 µs, 1 µs here | read |
| `partition_items` | `table.data._dbs[p].items(from_key=...)`: one partition's records in key order, read as iterated, for the sweeps | read |
| `newest_first` | `items(backwards=True)` on the same database: the latest loop episodes of a window, read from the end | read |
| `prefix_items` | the same seek: the runs whose ids start with what on-call pasted (`query run 773fd730`) | read |
| `consumer_if_started` | `app._consumer`: `app.consumer` would create a consumer | read |
| `committed_offsets` | `Consumer._committed_offset`: the offsets faust sought to, without a broker call on the hot path | read |
| `read_offsets` | `Consumer._read_offset`: the last offset faust handed to a stream, per partition | read |
| `read_in_assignment` | `app.rebalancing` and `app.consumer_generation_id` are public attributes, but what the worker relies on is when faust sets them: `rebalancing` before the consumer forgets its acks and committed offsets at a revocation, cleared only after the seek that ends recovery; a message's `generation_id` the group generation it was fetched in | read |
| `ChangelogWriter` | `table.data._db_for_partition(p)`: a flush's rows of one table partition in one rocksdb write batch, their changelog records through `Producer.send` (faust's Table sends each through its producer buffer, one at a time, and every stream waits while that buffer holds more than 100); the memory store's keys are faust's decoded ones (`store._decode_key`, `table._to_key`) | write |
| `windowed_rows`, `windowed_read` | a windowed table's key in the window of a time, encoded as its store and changelog hold it (`store._encode_key`), and registered for faust's expiry of old windows (`table._maybe_set_key_ttl`, what a write through the table does); read back from the partition's store. Through the Table a count write and read took 130-200 µs, and each write a place in faust's producer buffer: a flush of 300 stalled detection for 60 ms | write |

The recovery race (faust-streaming 0.15.3) loses input records after a restart or a
rebalance, and stalls their partition until the next record arrives on it.

At the end of table recovery faust's ``Recovery.on_recovery_completed`` resumes the
stream partitions, seeks them to their committed offsets (``perform_seek``), then calls
``app.flow_control.resume()``, which clears every stream queue. But when the tables
needed restoring (a restart with an empty, deleted or damaged data dir, a memory store,
or any rebalance of a running worker) the fetcher is already running and the consumer's
flow was resumed for the changelogs, so while ``perform_seek`` awaits the broker:

1. aiokafka's seek sets a partition's position to its committed offset C;
2. the fetcher reads records C..N of that partition and puts them in the stream's queue
   (faust's read offset for it becomes N, aiokafka's position N+1);
3. ``perform_seek`` resumes and sets faust's read offset back to C-1 (the position is
   not moved again);
4. ``flow_control.resume()`` clears the queue: the records not yet taken by the agent
   are gone. Nothing reads them again: the position is past them. They are never
   processed or acked; the committed offset stays at C.

Seen with tracing (`LOOPWATCH_DEBUG_FLOW`, tests/integration/failpoints/flowtrace.py): records
fetched during the seek, then "flow_control.resume clears a queue: 3 items
[otlp/3@6, otlp/3@7, otlp/3@8]", then read offset 5 and position 9 for that partition
until the end. A later record on the partition reveals the gap (faust then even
commits over it; streams/worker/kafka/skips.py reads such gaps back), but with no later
record the partition stalls with its lag: the restart stall of issue 16.

The fix: stop the consumer's flow and suspend flow control *before* faust resumes the
stream partitions and seeks, so nothing is fetched into a queue that is about to be
cleared; faust's own ``on_recovery_completed`` then seeks, clears and resumes both.

The same seek leaves behind the records of a partition with no committed offset (or 0).
Between an assignment and that seek the consumer's flow is stopped, but aiokafka's fetcher
runs: faust drops each record it hands over (the flow is stopped) and still sets its read
offset, and the position moves past them. The seek moves every other partition back to its
committed offset; aiokafka's ``seek_to_committed`` skips one that has none (``if offset and
offset > 0``), so its records fetched meanwhile are never read again. Seen with tracing
when a second worker joined before the first had committed anything on its steps
partitions: "fetched steps/2 (0, 109) flow=False", then the next fetch at 110, and the
runs of 0-109 never detected (tests/integration/test_rebalance.py). The fix: after
faust's seek to the committed offsets, a partition without one is sought to its
beginning, as ``consumer_auto_offset_reset="earliest"`` means for a group with no offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streams.worker.state.store import Rows

log = logging.getLogger(__name__)

_MARK = "_loopwatch_flow_stopped_before_seek"


def _patchable(owner: Any, name: str, missing: str, *also: str) -> Any | None:
    """`owner.name`, to wrap, when it and the attributes `also` exist; else None, with a
    warning that says what is `missing` for it."""
    original = getattr(owner, name, None)
    if original is None or not all(hasattr(owner, other) for other in also):
        names = " or ".join((name, *also))
        log.warning("faust's %s has no %s (a faust upgrade?): %s", owner.__name__, names, missing)
        return None
    return original


def install_recovery_fix() -> bool:
    """Wrap faust's ``Recovery.on_recovery_completed`` (once). False, with a warning,
    when faust no longer has what the fix relies on."""
    from faust.tables.recovery import Recovery

    missing = "the fix for records lost at the end of recovery is not installed"
    original = _patchable(Recovery, "on_recovery_completed", missing)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    async def on_recovery_completed(self: Any, generation_id: int = 0) -> None:
        stop_flow_before_seek(self.app)
        await original(self, generation_id)

    setattr(on_recovery_completed, _MARK, True)
    Recovery.on_recovery_completed = on_recovery_completed  # type: ignore[method-assign]
    return True


_UNCOMMITTED_MARK = "_loopwatch_uncommitted_sought_to_beginning"


def install_uncommitted_seek_fix() -> bool:
    """Wrap the aiokafka driver's ``AIOKafkaConsumerThread.seek_to_committed`` (once):
    stream partitions with no committed offset are sought to their beginning. False, with
    a warning, when faust no longer has it."""
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    missing = "records of uncommitted partitions fetched during a rebalance may be skipped"
    original = _patchable(AIOKafkaConsumerThread, "seek_to_committed", missing, "seek_to_beginning")
    if original is None:
        return False
    if getattr(original, _UNCOMMITTED_MARK, False):
        return True

    @functools.wraps(original)
    async def seek_to_committed(self: Any) -> Mapping[Any, Any]:
        offsets: Mapping[Any, Any] = await original(self)
        # (a table's changelog partitions are never committed: faust's recovery seeks them)
        changelogs = self.app.tables.changelog_topics
        uncommitted = [
            tp for tp, offset in offsets.items() if not offset and tp.topic not in changelogs
        ]
        if uncommitted:
            await self.seek_to_beginning(*uncommitted)
        return offsets

    setattr(seek_to_committed, _UNCOMMITTED_MARK, True)
    AIOKafkaConsumerThread.seek_to_committed = seek_to_committed  # type: ignore[method-assign]
    return True


_FETCH_MARK = "_loopwatch_fetch_wait"


def install_fetch_wait(min_bytes: int, max_wait_ms: int) -> bool:
    """Wrap the aiokafka driver's ``AIOKafkaConsumerThread._create_worker_consumer``: the
    consumer it builds waits for `min_bytes` or `max_wait_ms` before a fetch returns
    (aiokafka's `fetch_min_bytes`, `fetch_max_wait_ms`, read by its `start()` when it builds
    the fetcher). With faust's values a fetch returned as soon as one record arrived: at
    10,000 spans/s keyed, about 100 fetch responses a second, and the agents got batches
    of a few records (docs/PERFORMANCE.md). A second call sets new values;
    `min_bytes` 0 puts faust's method back. False, with a warning, when faust no longer has
    the method."""
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    missing = "fetches keep faust's settings"
    current = _patchable(AIOKafkaConsumerThread, "_create_worker_consumer", missing)
    if current is None:
        return False
    original = getattr(current, _FETCH_MARK, current)
    if not min_bytes:
        AIOKafkaConsumerThread._create_worker_consumer = original  # type: ignore[method-assign]
        return True

    @functools.wraps(original)
    def create_worker_consumer(self: Any, transport: Any) -> Any:
        consumer = original(self, transport)
        consumer._fetch_min_bytes = min_bytes
        consumer._fetch_max_wait_ms = max_wait_ms
        return consumer

    setattr(create_worker_consumer, _FETCH_MARK, original)
    AIOKafkaConsumerThread._create_worker_consumer = create_worker_consumer  # type: ignore[method-assign]
    return True


def stop_flow_before_seek(app: Any) -> None:
    """Nothing reaches the stream queues until faust resumes the flow after its seek."""
    app.consumer.stop_flow()
    app.flow_control.suspend()


@contextlib.contextmanager
def in_event(event: Any) -> Iterator[None]:
    """Make `event` faust's current event: table writes go to its partition."""
    from faust.streams import _current_event

    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


class StoreMemory:
    """One block cache and one write buffer manager for every rocksdb partition of every
    table: rocksdb's memory is bounded by `block_cache_bytes + memtables_bytes` however many
    tables and partitions the worker holds (faust's own options give each partition a cache
    of its own: tables x partitions x the cache size). Index and filter blocks are kept in
    the cache too, so the SST readers do not grow outside it with the data on disk."""

    def __init__(self, block_cache_bytes: int, memtables_bytes: int) -> None:
        import rocksdict

        self.cache = rocksdict.Cache(block_cache_bytes)
        # allow_stall False: past the limit rocksdb flushes the largest memtable, writers
        # never wait (a stalled write would stall the event loop)
        self.write_buffers = rocksdict.WriteBufferManager(memtables_bytes, False)

    def options(self, base: Any) -> Any:
        """rocksdict Options for one partition: `base`'s sizes (faust's RocksDBOptions, from
        the table's options), the shared cache and manager."""
        import rocksdict

        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_max_open_files(base.max_open_files)
        opts.set_write_buffer_size(base.write_buffer_size)
        opts.set_target_file_size_base(base.target_file_size_base)
        opts.set_max_write_buffer_number(base.max_write_buffer_number)
        opts.set_write_buffer_manager(self.write_buffers)
        table = rocksdict.BlockBasedOptions()
        table.set_bloom_filter(base.bloom_filter_size, True)
        table.set_block_cache(self.cache)
        table.set_index_type(rocksdict.BlockBasedIndexType.binary_search())
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        opts.set_block_based_table_factory(table)
        return opts

    def usage(self) -> dict[str, int]:
        """What the shared holders hold now (bytes)."""
        return {"block_cache": self.cache.get_usage(), "memtables": self.write_buffers.get_usage()}


def share_store_memory(tables: Any, memory: StoreMemory) -> int:
    """Make every rocksdb table in `tables` open its partitions with `memory`'s cache and
    write buffer manager; returns how many tables use it (0 for the in-memory store).
    Must run before a partition opens: faust opens them on assignment, through
    `table.data.rocksdb_options.open(path)` -> `as_options()`, which is replaced here."""
    shared = 0
    for table in tables:
        store = table.data
        base = getattr(store, "rocksdb_options", None)
        if base is None or not getattr(base, "use_rocksdict", False):
            continue
        base.as_options = functools.partial(memory.options, base)
        shared += 1
    return shared


def _scan_options() -> Any:
    """Read options for scans (sweeps, recovery reads, the API's listings): blocks read by
    a scan do not go into the shared block cache, which keeps the point reads' blocks (a
    sweep of the retained runs filled it with blocks read once)."""
    import rocksdict

    opts = rocksdict.ReadOptions()
    opts.fill_cache(False)  # type: ignore[call-arg]  # the stub says no argument; it takes one
    return opts


def estimated_keys(table: Any) -> int:
    """How many keys a table holds: rocksdb's estimate over its open partitions (a property
    of each database, no read; faust's offset key included), or the in-memory store's
    count."""
    dbs = getattr(getattr(table, "data", None), "_dbs", None)
    if dbs is None:
        return len(table)
    return sum(db.property_int_value("rocksdb.estimate-num-keys") or 0 for db in dbs.values())


def table_databases(table: Any) -> list[Any]:
    """The rocksdb databases of a table's partitions (none for the in-memory store)."""
    return list(getattr(table.data, "_dbs", {}).values())


def partition_read(table: Any, partition: int, key: bytes) -> bytes | None:
    """One key of one partition of a table, the value as stored (bytes tables: what
    `table.get(key)` gives). rocksdb: the partition's database, opened as faust opens it
    for a read in an event of that partition. The in-memory store keeps no partitions:
    its one dict."""
    store = table.data
    if getattr(store, "_dbs", None) is None:
        value: bytes | None = store.data.get(key)
        return value
    found: bytes | None = store._db_for_partition(partition).get(key)
    return found


def partition_items(
    table: Any, partition: int, after: bytes | None, limit: int
) -> Iterator[tuple[bytes, bytes]]:
    """Up to `limit` items of one partition of a rocksdb table in key order, after the key
    `after` (`table.data._dbs[partition]`, rocksdict's `items(from_key=...)`: faust has no
    per-partition or ranged read), read as the caller iterates. The in-memory store keeps
    no partitions: all its items. faust's own offset key is not an item."""
    dbs = getattr(table.data, "_dbs", None)
    if dbs is None:  # the memory store: a dict of every partition's keys
        from streams.worker.state.store import scan_mapping

        yield from scan_mapping(table.data.data, partition, after, limit)
        return
    db = dbs.get(partition)
    if db is None or limit <= 0:
        return
    offset_key = table.data.offset_key
    scan = _scan_options()
    items = (
        db.items(from_key=after, read_opt=scan) if after is not None else db.items(read_opt=scan)
    )
    read = 0
    for key, value in items:
        if key in (after, offset_key):
            continue
        yield key, value
        read += 1
        if read >= limit:
            return


def prefix_items(
    table: Any, partition: int, prefix: bytes, limit: int
) -> list[tuple[bytes, bytes]]:
    """Up to `limit` items of one partition whose keys start with `prefix` (a seek to the
    prefix, then in key order: `table.data._dbs[partition].items(from_key=prefix)`). The
    in-memory store keeps no partitions: its matching items, whatever `partition`."""
    dbs = getattr(table.data, "_dbs", None)
    if dbs is None:
        data = table.data.data
        keys = sorted(k for k in data if k.startswith(prefix))[:limit]
        return [(k, data[k]) for k in keys]
    db = dbs.get(partition)
    if db is None:
        return []
    out: list[tuple[bytes, bytes]] = []
    for key, value in db.items(from_key=prefix, read_opt=_scan_options()):
        if not key.startswith(prefix) or len(out) >= limit:
            break
        if key != table.data.offset_key:
            out.append((key, value))
    return out


def newest_first(table: Any, partition: int) -> Iterator[tuple[bytes, bytes]]:
    """One partition's items from the last key backwards (rocksdict's
    `items(backwards=True)` on faust's per-partition database); the in-memory store's
    items, whatever `partition`, likewise."""
    dbs = getattr(table.data, "_dbs", None)
    if dbs is None:
        data = table.data.data
        for key in sorted(data, reverse=True):
            yield key, data[key]
        return
    db = dbs.get(partition)
    if db is None:
        return
    offset_key = table.data.offset_key
    for key, value in db.items(backwards=True, read_opt=_scan_options()):
        if key != offset_key:
            yield key, value


class ChangelogWriter:
    """Rows of table partitions written as faust's Table writes them, in bulk: into each
    partition's store (rocksdb: one write batch), then a changelog record each through the
    app's producer (`Producer.send`: an append to aiokafka's batch of that partition); once
    they are delivered, each partition's persisted offset, as faust's `_on_changelog_sent`
    sets it (recovery reads the changelog from there).

    Through the Table each row is a FutureMessage in faust's producer buffer, which one task
    sends a record at a time; while it holds more than 100 the conductor holds every
    stream (`wait_until_ebb`), so a flush of 2,000 rows stalled ingest and detect for
    0.2-0.3 s a second (docs/PERFORMANCE.md). A delete through the Table also reads the key
    twice first; here an absent key's delete costs a tombstone instead."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def write(self, parts: list[tuple[Any, int, Rows]]) -> None:
        """Write each (table, partition, rows) and wait until every record is delivered.
        Raises what the store or the producer raised."""
        from faust.types import TP

        send = self.app.producer.send
        sent = []
        for table, partition, rows in parts:
            store = table.data
            write_store(table, partition, rows)
            topic = table.changelog_topic.get_topic_name()
            futures = [await send(topic, key, value, partition, None, None) for key, value in rows]
            sent.append((store, TP(topic, partition), futures))
        for store, tp, futures in sent:
            if futures:
                results = await asyncio.gather(*futures)
                store.set_persisted_offset(tp, max(r.offset for r in results))


def write_store(table: Any, partition: int, rows: Rows) -> None:
    """The rows (encoded, as the changelog holds them) into one partition of a table's
    store, without a changelog record: rocksdb in one write batch to the partition's
    database; the in-memory store's one dict, decoded as faust restores it from the
    changelog (a windowed key's JSON list becomes its tuple)."""
    store = table.data
    dbs = getattr(store, "_dbs", None)
    if dbs is None:
        from streams.worker.state.store import put_rows

        key_of, value_of = store._decode_key, store._decode_value
        decoded = [
            (table._to_key(key_of(key)), None if value is None else value_of(value))
            for key, value in rows
        ]
        put_rows(store.data, decoded)
        return
    import rocksdict

    batch = rocksdict.WriteBatch(raw_mode=True)
    for key, value in rows:
        if value is None:
            batch.delete(key)
        else:
            batch.put(key, value)
    store._db_for_partition(partition).write(batch)


def windowed_key(table: Any, key: Any, timestamp: float) -> tuple[Any, Any]:
    """`key` in the window a write at `timestamp` goes to (faust's `_set_windowed` writes
    each range of `window.ranges(timestamp)`: a tumbling window's one)."""
    (window_range,) = table.window.ranges(timestamp)
    return (key, window_range)


def windowed_rows(
    table: Any, partition: int, items: list[tuple[Any, Any]], timestamp: float
) -> Rows:
    """`items` ((key, value)) of a windowed table as rows of the window of `timestamp`, for
    `ChangelogWriter.write`: encoded as the table's store and changelog hold them, each
    key registered for faust's expiry of old windows as a write through the table is."""
    store = table.data
    rows = []
    for key, value in items:
        wkey = windowed_key(table, key, timestamp)
        table._maybe_set_key_ttl(wkey, partition)
        rows.append((store._encode_key(wkey), store._encode_value(value)))
    return rows


def windowed_read(table: Any, partition: int, key: Any, timestamp: float) -> Any:
    """The value of `key` in the window of `timestamp` in one partition (the table's
    default when there is none), read as `partition_read` reads."""
    wkey = windowed_key(table, key, timestamp)
    store = table.data
    if getattr(store, "_dbs", None) is None:
        value = store.data.get(wkey)
    else:
        raw = store._db_for_partition(partition).get(store._encode_key(wkey))
        value = None if raw is None else store._decode_value(raw)
    if value is None and table.default is not None:
        return table.default()
    return value


def read_in_assignment(app: Any, message: Any) -> bool:
    """Whether `message` was fetched in the current assignment and no rebalance is under
    way: only then may it be acknowledged. faust forgets a partition's acks and committed
    offset as a revocation begins, before the agents have stopped; until its seek at the
    end of recovery, an ack of a record read before the rebalance (processed meanwhile, or
    taken from a batch buffered across it) goes into a fresh list with no committed offset
    to check it against, and the next commit goes past every record before it that was
    dropped unacknowledged (a batch staged, then abandoned for the rebalance)."""
    return not app.rebalancing and message.generation_id == app.consumer_generation_id


def consumer_if_started(app: Any) -> Any | None:
    """The app's consumer if it has one, without creating it."""
    return getattr(app, "_consumer", None)


def committed_offsets(consumer: Any) -> Mapping[Any, Any] | None:
    """The committed offset per partition faust sought to (None: faust no longer has it)."""
    offsets = getattr(consumer, "_committed_offset", None)
    return offsets if isinstance(offsets, Mapping) else None


def read_offsets(consumer: Any) -> Mapping[Any, Any]:
    """The last offset faust handed to a stream, per partition."""
    offsets: Mapping[Any, Any] = consumer._read_offset
    return offsets
