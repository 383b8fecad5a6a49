"""streams/worker/faust_internals.py against the installed faust, one test per behaviour the
worker relies on (no broker). A faust upgrade that changes one fails the test named for it.

The recovery fix runs against faust's own Recovery.on_recovery_completed: the seek and the
fetcher are stand-ins. The stand-in seek does what the fetcher does when the flow is open
during the real seek: it puts a fetched record in a stream queue that flow control clears
on resume."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace
from typing import Any

import faust
import pytest
from faust.tables.recovery import Recovery
from faust.types import TP

from streams.worker import faust_internals

INPUT = TP("otlp", 0)


def stand_ins_for_the_seek(monkeypatch: pytest.MonkeyPatch, app: Any, seek: Any) -> None:
    """faust's end of recovery with `seek` for the consumer's seek, one stream partition
    assigned, and no fetcher or standbys."""

    async def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(app.consumer, "perform_seek", seek)
    monkeypatch.setattr(app.consumer, "assignment", lambda: {INPUT})
    monkeypatch.setattr(app._fetcher, "maybe_start", nothing)
    monkeypatch.setattr(app.assignor, "assigned_standbys", lambda: set())


async def end_of_recovery(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Any, Any]:
    """Run faust's end of recovery with the flow open (as the recovery branch leaves it);
    returns (records fetched during the seek, the stream queue, the app)."""
    app: Any = faust.App("recovery-fix-unit", broker="kafka://127.0.0.1:1", store="memory://")
    consumer = app.consumer
    recovery = app.tables.recovery
    queue = app.FlowControlQueue(maxsize=100, clear_on_resume=True)
    fetched: list[str] = []

    async def seek() -> None:
        if consumer.flow_active and app.flow_control.is_active():
            record = f"{INPUT.topic}/{INPUT.partition}@6"
            fetched.append(record)
            queue.put_nowait(record)

    stand_ins_for_the_seek(monkeypatch, app, seek)
    app.flow_control.resume()
    consumer.resume_flow()
    await recovery.on_recovery_completed(app.consumer_generation_id)
    return fetched, queue, app


def test_records_fetched_during_the_seek_are_not_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Recovery, "on_recovery_completed", Recovery.on_recovery_completed)
    assert faust_internals.install_recovery_fix()
    fetched, queue, app = asyncio.run(end_of_recovery(monkeypatch))
    assert queue.qsize() == len(fetched), f"fetched {fetched}, left in the queue {queue.qsize()}"
    # the flow is open again for the stream partitions
    assert app.consumer.flow_active and app.flow_control.is_active()


def test_without_the_fix_faust_clears_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race itself, in faust as installed: if this passes no more, faust changed its end
    of recovery and the recovery fix may be obsolete."""
    original = getattr(Recovery.on_recovery_completed, "__wrapped__", None)
    if original is not None:
        monkeypatch.setattr(Recovery, "on_recovery_completed", original)
    fetched, queue, _ = asyncio.run(end_of_recovery(monkeypatch))
    assert fetched and queue.qsize() == 0


def test_install_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Recovery, "on_recovery_completed", Recovery.on_recovery_completed)
    assert faust_internals.install_recovery_fix()
    wrapped = Recovery.on_recovery_completed
    assert faust_internals.install_recovery_fix()
    assert Recovery.on_recovery_completed is wrapped


# ------------------------------------------------------ the seek of uncommitted partitions


def aiokafka_consumer(committed: dict[Any, int | None], sought: list[tuple[str, Any]]) -> Any:
    """aiokafka's consumer as its seek_to_committed and seek_to_beginning use it."""

    async def committed_offset(tp: Any) -> int | None:
        return committed[tp]

    async def to_beginning(*tps: Any) -> None:
        sought.extend(("beginning", tp) for tp in tps)

    return SimpleNamespace(
        _subscription=SimpleNamespace(assigned_partitions=lambda: set(committed)),
        committed=committed_offset,
        _fetcher=SimpleNamespace(seek_to=lambda tp, offset: sought.append((str(offset), tp))),
        seek_to_beginning=to_beginning,
    )


def consumer_thread(consumer: Any) -> Any:
    """faust's AIOKafkaConsumerThread as its seek methods use it (no thread)."""
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    async def call_thread(method: Any, *args: Any) -> Any:
        return await method(*args)

    app = SimpleNamespace(tables=SimpleNamespace(changelog_topics={"runs-changelog"}))
    thread = SimpleNamespace(_ensure_consumer=lambda: consumer, call_thread=call_thread, app=app)
    thread.seek_to_beginning = functools.partial(AIOKafkaConsumerThread.seek_to_beginning, thread)
    return thread


async def test_aiokafka_seeks_only_partitions_with_a_committed_offset() -> None:
    """What the fix is for: a partition with no committed offset (or 0) keeps the position
    its fetcher reached while faust's flow was stopped."""
    import aiokafka

    committed = {"steps/2": None, "steps/3": 0, "otlp/2": 26}
    sought: list[tuple[str, Any]] = []
    consumer = aiokafka_consumer(committed, sought)
    offsets = await aiokafka.AIOKafkaConsumer.seek_to_committed(consumer)
    assert offsets == committed and sought == [("26", "otlp/2")]


async def test_uncommitted_partitions_are_sought_to_their_beginning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import aiokafka
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    monkeypatch.setattr(
        AIOKafkaConsumerThread, "seek_to_committed", AIOKafkaConsumerThread.seek_to_committed
    )
    assert faust_internals.install_uncommitted_seek_fix()
    wrapped = AIOKafkaConsumerThread.seek_to_committed
    assert faust_internals.install_uncommitted_seek_fix()  # once
    assert AIOKafkaConsumerThread.seek_to_committed is wrapped

    steps2, steps3, otlp2, runs2 = (
        TP("steps", 2),
        TP("steps", 3),
        TP("otlp", 2),
        TP("runs-changelog", 2),
    )
    committed = {steps2: None, steps3: 0, otlp2: 26, runs2: None}
    sought: list[tuple[str, Any]] = []
    consumer = aiokafka_consumer(committed, sought)
    consumer.seek_to_committed = functools.partial(
        aiokafka.AIOKafkaConsumer.seek_to_committed, consumer
    )
    offsets = await AIOKafkaConsumerThread.seek_to_committed(consumer_thread(consumer))
    assert offsets == committed  # faust's perform_seek reads them as before
    # a changelog partition is left where faust's recovery put it
    assert sorted(sought) == [("26", otlp2), ("beginning", steps2), ("beginning", steps3)]


# ------------------------------------------------------------------- how fetches wait


async def worker_consumer() -> Any:
    """The aiokafka consumer faust's driver builds for a worker (not started)."""
    app: Any = faust.App("internals-fetch", broker="kafka://127.0.0.1:1", store="memory://")
    return app.consumer._thread._create_worker_consumer(app.transport)


async def close(consumer: Any) -> None:
    await consumer._client.close()
    consumer._closed = True  # (never started: nothing else to stop)


@pytest.fixture
def faust_s_create(monkeypatch: pytest.MonkeyPatch) -> Any:
    """faust's own `_create_worker_consumer`, installed for the test and put back as it was
    after it (a keyed worker built earlier in this process may have installed the wait)."""
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    current = AIOKafkaConsumerThread._create_worker_consumer
    monkeypatch.setattr(AIOKafkaConsumerThread, "_create_worker_consumer", current)
    assert faust_internals.install_fetch_wait(0, 40)
    return AIOKafkaConsumerThread._create_worker_consumer


async def test_faust_s_worker_consumer_returns_a_fetch_at_the_first_byte(
    faust_s_create: Any,
) -> None:
    """What the patch is for: faust passes fetch_max_wait_ms=1500 and leaves aiokafka's
    fetch_min_bytes at 1, with no setting for either."""
    consumer = await worker_consumer()
    try:
        assert (consumer._fetch_min_bytes, consumer._fetch_max_wait_ms) == (1, 1500)
    finally:
        await close(consumer)


async def test_the_worker_consumer_waits_as_installed(faust_s_create: Any) -> None:
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    assert faust_internals.install_fetch_wait(131072, 40)
    assert faust_internals.install_fetch_wait(65536, 25)  # new values, one wrapper
    consumer = await worker_consumer()
    try:
        assert (consumer._fetch_min_bytes, consumer._fetch_max_wait_ms) == (65536, 25)
    finally:
        await close(consumer)
    assert faust_internals.install_fetch_wait(0, 40)  # 0: faust's own again
    assert AIOKafkaConsumerThread._create_worker_consumer is faust_s_create


def test_without_the_method_the_wait_is_not_installed_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    monkeypatch.delattr(AIOKafkaConsumerThread, "_create_worker_consumer")
    assert not faust_internals.install_fetch_wait(131072, 40)
    assert "has no _create_worker_consumer (a faust upgrade?)" in caplog.text
    assert not hasattr(AIOKafkaConsumerThread, "_create_worker_consumer")


async def test_aiokafka_builds_its_fetcher_from_the_consumer_s_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The patch sets the fields after faust built the consumer: aiokafka must read them
    when `start()` builds the fetcher, not copy them at construction."""
    import aiokafka
    import aiokafka.consumer.consumer as consumer_module

    class Built(Exception):
        pass

    seen: dict[str, Any] = {}

    def fetcher(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise Built

    async def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1", group_id="g")
    consumer._fetch_min_bytes, consumer._fetch_max_wait_ms = 131072, 40
    monkeypatch.setattr(consumer._client, "bootstrap", nothing)
    monkeypatch.setattr(consumer, "_wait_topics", nothing)
    monkeypatch.setattr(consumer_module, "Fetcher", fetcher)
    try:
        with pytest.raises(Built):
            await consumer.start()
        assert (seen["fetch_min_bytes"], seen["fetch_max_wait_ms"]) == (131072, 40)
    finally:
        await close(consumer)


# ---------------------------------------------------------------------------- the reads


def rocksdb_app(tmp_path: Any) -> tuple[Any, Any]:
    app: Any = faust.App(
        "internals-unit", broker="kafka://127.0.0.1:1", store="rocksdb://", datadir=str(tmp_path)
    )
    return app, app.Table("runs", default=int, partitions=2)


class _Message:
    def __init__(self, partition: int) -> None:
        self.topic, self.partition, self.offset = "otlp", partition, 0
        self.tp = TP("otlp", partition)


class _Event:
    def __init__(self, partition: int) -> None:
        self.message = _Message(partition)


def test_in_event_makes_it_the_event_table_writes_go_by(tmp_path: Any) -> None:
    """A write inside `in_event` lands in the rocksdb database of that event's partition,
    and its changelog record goes to the same partition: what batched processing (several
    partitions per `take_events` batch) relies on."""
    app, table = rocksdb_app(tmp_path)
    sent: list[int | None] = []

    def send_changelog(partition: int | None, *args: Any, **kwargs: Any) -> Any:
        sent.append(partition)
        return SimpleNamespace(message=SimpleNamespace(partition=partition))

    table.send_changelog = send_changelog
    event = _Event(1)
    with faust_internals.in_event(event):
        assert faust.current_event() is event
        table["run-a"] = 7
    assert faust.current_event() is None
    assert sent == [1]
    assert table.data._db_for_partition(1).get(table.data._encode_key("run-a")) is not None
    assert table.data._db_for_partition(0).get(table.data._encode_key("run-a")) is None


def test_table_databases_are_the_open_rocksdb_partitions(tmp_path: Any) -> None:
    app, table = rocksdb_app(tmp_path)
    assert faust_internals.table_databases(table) == []
    table.data._db_for_partition(0)
    (db,) = faust_internals.table_databases(table)
    assert isinstance(db.property_int_value("rocksdb.cur-size-all-mem-tables"), int)
    memory: Any = faust.App("internals-memory", broker="kafka://127.0.0.1:1", store="memory://")
    assert faust_internals.table_databases(memory.Table("runs", default=int)) == []


def test_every_partition_of_every_table_opens_with_the_shared_cache_and_manager(
    tmp_path: Any,
) -> None:
    """faust opens a partition through `table.data.rocksdb_options.open(path)`, which calls
    `as_options()`: replaced, every partition of both tables gets the one cache (its capacity
    is what each database reports, not faust's cache per partition) and the one write
    buffer manager (its usage is the memtables of all of them)."""
    app: Any = faust.App(
        "internals-shared", broker="kafka://127.0.0.1:1", store="rocksdb://", datadir=str(tmp_path)
    )
    tables = [app.Table(name, default=int, partitions=2) for name in ("runs", "finished")]
    memory = faust_internals.StoreMemory(3 * 2**20, 5 * 2**20)
    assert faust_internals.share_store_memory(tables, memory) == 2
    dbs = []
    for table in tables:
        for p in (0, 1):
            db = table.data._db_for_partition(p)
            db[b"k" * 8 + bytes([p])] = b"v" * 100_000
            dbs.append(db)
    assert {db.property_int_value("rocksdb.block-cache-capacity") for db in dbs} == {3 * 2**20}
    memtables = sum(db.property_int_value("rocksdb.cur-size-all-mem-tables") for db in dbs)
    assert memory.usage()["memtables"] >= memtables >= 4 * 100_000
    # the in-memory store has no rocksdb options: nothing to share
    plain: Any = faust.App("internals-plain", broker="kafka://127.0.0.1:1", store="memory://")
    assert faust_internals.share_store_memory([plain.Table("runs", default=int)], memory) == 0


def test_store_memory_counts_a_shared_cache_once(tmp_path: Any) -> None:
    """/healthz store_memory_bytes: every partition reports the whole shared cache; summed
    it would be counted once per partition."""
    from streams.worker.faust_app import rocksdb_memory

    app: Any = faust.App(
        "internals-count", broker="kafka://127.0.0.1:1", store="rocksdb://", datadir=str(tmp_path)
    )
    table = app.Table("runs", default=int, partitions=4)
    memory = faust_internals.StoreMemory(8 * 2**20, 8 * 2**20)
    faust_internals.share_store_memory([table], memory)
    for p in range(4):
        db = table.data._db_for_partition(p)
        for i in range(300):
            db[f"run-{i}".encode()] = b"x" * 1000
        db.flush()
        for i in range(300):
            assert db[f"run-{i}".encode()] == b"x" * 1000  # read back: blocks in the cache
    held = rocksdb_memory([table], memory)
    assert held["block_cache"] == memory.usage()["block_cache"] > 0
    assert held["block_cache"] < 4 * table.data._db_for_partition(0).property_int_value(
        "rocksdb.block-cache-usage"
    )


def test_partition_items_reads_one_partition_in_key_order_from_a_key(tmp_path: Any) -> None:
    """The retained-run sweep reads a partition's records a slice at a time: rocksdict's
    `items(from_key=...)` on faust's per-partition database, without faust's offset key."""
    app: Any = faust.App(
        "internals-items", broker="kafka://127.0.0.1:1", store="rocksdb://", datadir=str(tmp_path)
    )
    table = app.Table("retained", partitions=2, key_type=bytes, value_type=bytes)
    table.send_changelog = lambda *a, **k: SimpleNamespace(message=SimpleNamespace(partition=0))
    for i in range(10):
        with faust_internals.in_event(_Event(i % 2)):
            table[f"run-{i}".encode()] = f"v{i}".encode()
    table.data.set_persisted_offset(TP("otlp", 1), 42)  # faust's own key in the same db
    lazy = faust_internals.partition_items(table, 1, None, 3)
    assert not isinstance(lazy, list)  # read as iterated: a sweep holds one record at a time
    assert next(lazy) == (b"run-1", b"v1")
    first = list(faust_internals.partition_items(table, 1, None, 3))
    assert first == [(b"run-1", b"v1"), (b"run-3", b"v3"), (b"run-5", b"v5")]
    rest = list(faust_internals.partition_items(table, 1, first[-1][0], 10))
    assert rest == [(b"run-7", b"v7"), (b"run-9", b"v9")]
    assert list(faust_internals.partition_items(table, 5, None, 10)) == []  # not open here
    # the retained table's expiry index (streams/worker/state/retained.py): rocksdb's
    # bytewise order puts its keys after every run id, in expiry order, and a scan from
    # its prefix reads them only
    from streams.worker.state.retained import INDEX, index_key

    with faust_internals.in_event(_Event(1)):
        for expires in (300, 7, 10**15):
            table[index_key(expires, b"run-x")] = b"\x00\x01"
    assert [k for k, _ in faust_internals.partition_items(table, 1, None, 10)][5:] == [
        index_key(7, b"run-x"),
        index_key(300, b"run-x"),
        index_key(10**15, b"run-x"),
    ]
    assert len(list(faust_internals.partition_items(table, 1, INDEX, 10))) == 3
    for expires in (300, 7, 10**15):
        with faust_internals.in_event(_Event(1)):
            del table[index_key(expires, b"run-x")]
    memory: Any = faust.App("internals-items-m", broker="kafka://127.0.0.1:1", store="memory://")
    mtable = memory.Table("retained", key_type=bytes, value_type=bytes)
    mtable.data.data.update({b"b": b"2", b"a": b"1", b"c": b"3"})
    assert list(faust_internals.partition_items(mtable, 0, b"a", 10)) == [
        (b"b", b"2"),
        (b"c", b"3"),
    ]
    # a prefix: a seek to it, then its keys only (what `query run 773fd730` relies on)
    assert faust_internals.prefix_items(table, 1, b"run-", 2) == [
        (b"run-1", b"v1"),
        (b"run-3", b"v3"),
    ]
    assert faust_internals.prefix_items(table, 0, b"run-8", 10) == [(b"run-8", b"v8")]
    assert faust_internals.prefix_items(table, 0, b"zz", 10) == []
    assert faust_internals.prefix_items(mtable, 0, b"b", 10) == [(b"b", b"2")]
    # from the last key backwards (the latest loop episodes), without faust's offset key
    newest = faust_internals.newest_first(table, 1)
    assert [next(newest), next(newest)] == [(b"run-9", b"v9"), (b"run-7", b"v7")]
    assert list(faust_internals.newest_first(table, 5)) == []
    assert [k for k, _ in faust_internals.newest_first(mtable, 0)] == [b"c", b"b", b"a"]


def test_the_consumer_is_read_without_being_created(tmp_path: Any) -> None:
    app, _table = rocksdb_app(tmp_path)
    assert faust_internals.consumer_if_started(app) is None
    consumer = app.consumer
    assert faust_internals.consumer_if_started(app) is consumer


async def test_the_consumer_keeps_committed_and_read_offsets_per_partition(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_committed_offset` (what faust sought to after an assignment) and `_read_offset`
    (where faust's stream is in a partition) are mappings by TP; faust's own seek moves
    the read offset (the driver's seek is a stand-in)."""
    app, _table = rocksdb_app(tmp_path)
    consumer = app.consumer
    committed = faust_internals.committed_offsets(consumer)
    assert committed is not None and INPUT not in committed
    assert faust_internals.read_offsets(consumer).get(INPUT) is None

    async def driver_seek(tp: Any, offset: int) -> None:
        return None

    monkeypatch.setattr(consumer, "_seek", driver_seek)
    await consumer.seek(INPUT, 5)
    assert faust_internals.read_offsets(consumer)[INPUT] == 5


def test_scans_of_a_rocksdb_partition_read_in_order_and_leave_the_shared_cache_alone(
    tmp_path: Any,
) -> None:
    """`partition_items`, `prefix_items` and `newest_first` read one partition's database
    (rocksdict's `items(from_key=, backwards=, read_opt=)`), skipping faust's offset key;
    their blocks do not go into the shared cache (sweeps read each block once: in the
    cache they pushed out the point reads' blocks and grew the worker by its capacity)."""
    app: Any = faust.App(
        "internals-scan", broker="kafka://127.0.0.1:1", store="rocksdb://", datadir=str(tmp_path)
    )
    table = app.Table("retained", default=int, partitions=2)
    memory = faust_internals.StoreMemory(16 * 2**20, 8 * 2**20)
    faust_internals.share_store_memory([table], memory)
    db = table.data._db_for_partition(1)
    for i in range(2000):
        db[b"r%04d" % i] = b"v" * 1000
    db[table.data.offset_key] = b"7"
    db.flush()  # to an SST: reads now go through the block cache
    before = memory.usage()["block_cache"]
    keys = [k for k, _ in faust_internals.partition_items(table, 1, None, 5000)]
    assert keys == [b"r%04d" % i for i in range(2000)]
    after = [k for k, _ in faust_internals.partition_items(table, 1, b"r0100", 3)]
    assert after == [b"r0101", b"r0102", b"r0103"]
    assert [k for k, _ in faust_internals.prefix_items(table, 1, b"r19", 3)] == [
        b"r1900",
        b"r1901",
        b"r1902",
    ]
    newest = faust_internals.newest_first(table, 1)
    assert [next(newest)[0] for _ in range(2)] == [b"r1999", b"r1998"]
    assert list(faust_internals.partition_items(table, 0, None, 10)) == []
    assert memory.usage()["block_cache"] - before < 100_000  # 2 MB read, none of it kept
    db.get(b"r0500")  # a point read fills it
    assert memory.usage()["block_cache"] > before


def test_estimated_keys_of_a_table_reads_rocksdbs_estimate_or_counts_the_memory_store(
    tmp_path: Any,
) -> None:
    """/healthz `finished_markers`: rocksdb's `estimate-num-keys` of every open partition
    (no read; faust's offset key is one of them), the in-memory store's count."""
    app, table = rocksdb_app(tmp_path)
    assert faust_internals.estimated_keys(table) == 0  # no partition open
    for p in (0, 1):
        db = table.data._db_for_partition(p)
        for i in range(50):
            db[b"run-%d-%02d" % (p, i)] = b"v"
    assert faust_internals.estimated_keys(table) == 100
    memory: Any = faust.App("internals-count-mem", broker="kafka://127.0.0.1:1", store="memory://")
    plain = memory.Table("finished", default=int)
    plain.data.data.update({b"a": b"1", b"b": b"2"})
    assert faust_internals.estimated_keys(plain) == 2


# ---------------------------------------------------------------------------- the writes


class _Producer:
    """faust's `Producer.send` as the writer calls it: the record, and a future of its
    metadata (offsets from 100 on)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes | None, int]] = []

    async def send(
        self,
        topic: str,
        key: bytes,
        value: bytes | None,
        partition: int,
        timestamp: Any,
        headers: Any,
    ) -> Any:
        self.sent.append((topic, key, value, partition))
        future = asyncio.get_running_loop().create_future()
        future.set_result(SimpleNamespace(offset=99 + len(self.sent)))
        return future


def bytes_table(tmp_path: Any, name: str = "values") -> tuple[Any, Any]:
    app: Any = faust.App(
        f"writer-{name}",
        broker="kafka://127.0.0.1:1",
        store="rocksdb://",
        datadir=str(tmp_path / name),
    )
    return app, app.Table("runs", key_type=bytes, value_type=bytes, partitions=2)


def test_partition_read_reads_what_faust_reads_in_that_partition_s_event(tmp_path: Any) -> None:
    """A key written in partition 1's event: read from partition 1 it is what faust's Table
    gives there (and outside any event, where faust searches every partition); from
    partition 0 it is absent, as for faust in partition 0's event. Partitions not opened
    yet open as faust's read opens them. The memory store: its one dict."""
    app, table = bytes_table(tmp_path)
    table.send_changelog = lambda *args, **kwargs: SimpleNamespace(
        message=SimpleNamespace(partition=1)
    )
    with faust_internals.in_event(_Event(1)):
        table[b"run-a"] = b"state"
        assert table.get(b"run-a") == b"state"
    assert table.get(b"run-a") == b"state"  # faust's search of every partition
    assert faust_internals.partition_read(table, 1, b"run-a") == b"state"
    assert type(faust_internals.partition_read(table, 1, b"run-a")) is bytes
    with faust_internals.in_event(_Event(0)):
        assert table.get(b"run-a") is None
    assert faust_internals.partition_read(table, 0, b"run-a") is None
    assert faust_internals.partition_read(table, 1, b"run-b") is None
    memory: Any = faust.App("internals-read", broker="kafka://127.0.0.1:1", store="memory://")
    kept = memory.Table("runs", key_type=bytes, value_type=bytes, partitions=2)
    kept.data.data[b"run-a"] = b"state"
    assert faust_internals.partition_read(kept, 0, b"run-a") == b"state"
    assert faust_internals.partition_read(kept, 1, b"run-b") is None


async def test_the_changelog_writer_writes_what_faust_s_table_writes(tmp_path: Any) -> None:
    """The same rows through faust's Table (in their partition's event) and through the
    writer: the same store contents per partition and the same changelog records; the
    persisted offset is the last delivered record's, as faust's `_on_changelog_sent`
    sets it."""
    rows = {1: [(b"a", b"1"), (b"b", b"2"), (b"a", None)], 0: [(b"c", b"3")]}
    app, table = bytes_table(tmp_path, "faust")
    by_faust: list[tuple[bytes, bytes | None, int]] = []

    def send_changelog(partition: int, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        by_faust.append((key, value, partition))
        return SimpleNamespace(message=SimpleNamespace(partition=partition))

    table.send_changelog = send_changelog
    for partition, items in rows.items():
        with faust_internals.in_event(_Event(partition)):
            for key, value in items:
                if value is None:
                    table.pop(key, None)
                else:
                    table[key] = value

    app2, table2 = bytes_table(tmp_path, "writer")
    producer = _Producer()
    writer = faust_internals.ChangelogWriter(SimpleNamespace(producer=producer))
    await writer.write([(table2, p, items) for p, items in rows.items()])

    topic = table2.changelog_topic.get_topic_name()
    assert [(k, v, p) for _t, k, v, p in producer.sent] == by_faust
    assert {t for t, *_ in producer.sent} == {topic}
    for p in (0, 1):
        mine = dict(faust_internals.partition_items(table2, p, None, 10))
        assert mine == dict(faust_internals.partition_items(table, p, None, 10))
    assert dict(faust_internals.partition_items(table2, 1, None, 10)) == {b"b": b"2"}
    assert table2.data.persisted_offset(TP(topic, 1)) == 102  # the third record sent
    assert table2.data.persisted_offset(TP(topic, 0)) == 103


async def test_the_changelog_writer_s_records_restore_the_same_store(tmp_path: Any) -> None:
    """What recovery does with the records the writer sent (faust's
    apply_changelog_batch) gives back the store the writer wrote."""
    app, table = bytes_table(tmp_path, "source")
    producer = _Producer()
    writer = faust_internals.ChangelogWriter(SimpleNamespace(producer=producer))
    await writer.write([(table, 0, [(b"k1", b"v1"), (b"k2", b"v2")]), (table, 1, [(b"k3", b"x")])])
    await writer.write([(table, 0, [(b"k1", None)])])
    events = [
        SimpleNamespace(
            message=SimpleNamespace(key=k, value=v, partition=p, offset=i, tp=TP(topic, p))
        )
        for i, (topic, k, v, p) in enumerate(producer.sent)
    ]
    _app2, restored = bytes_table(tmp_path, "restored")
    restored.data.apply_changelog_batch(events, lambda k: k, lambda v: v)
    for p in (0, 1):
        assert dict(faust_internals.partition_items(restored, p, None, 10)) == dict(
            faust_internals.partition_items(table, p, None, 10)
        )
    assert dict(faust_internals.partition_items(restored, 0, None, 10)) == {b"k2": b"v2"}


async def test_the_changelog_writer_raises_a_failed_delivery(tmp_path: Any) -> None:
    app, table = bytes_table(tmp_path)

    class Failing(_Producer):
        async def send(self, *args: Any) -> Any:
            future = asyncio.get_running_loop().create_future()
            future.set_exception(RuntimeError("KafkaTimeoutError"))
            return future

    writer = faust_internals.ChangelogWriter(SimpleNamespace(producer=Failing()))
    with pytest.raises(RuntimeError, match="KafkaTimeoutError"):
        await writer.write([(table, 0, [(b"k", b"v")])])
    assert table.data.persisted_offset(TP(table.changelog_topic.get_topic_name(), 0)) is None


async def test_the_changelog_writer_writes_the_memory_store_s_one_dict() -> None:
    app: Any = faust.App("writer-memory", broker="kafka://127.0.0.1:1", store="memory://")
    table = app.Table("runs", key_type=bytes, value_type=bytes, partitions=2)
    producer = _Producer()
    writer = faust_internals.ChangelogWriter(SimpleNamespace(producer=producer))
    await writer.write([(table, 1, [(b"a", b"1"), (b"b", b"2")])])
    await writer.write([(table, 1, [(b"a", None)])])
    assert table.data.data == {b"b": b"2"}
    assert [(k, v, p) for _t, k, v, p in producer.sent] == [
        (b"a", b"1", 1),
        (b"b", b"2", 1),
        (b"a", None, 1),
    ]


def counts_table(tmp_path: Any, store: str, name: str) -> Any:
    """A windowed count table as the service declares it (faust_app: json keys, a
    tumbling window with an expiry)."""
    from datetime import timedelta

    app: Any = faust.App(
        f"counts-{name}", broker="kafka://127.0.0.1:1", store=store, datadir=str(tmp_path / name)
    )
    table = app.Table("loop_counts", default=int, partitions=2)
    table.tumbling(60, expires=timedelta(seconds=600))
    return table


def store_contents(table: Any, partition: int) -> dict[Any, Any]:
    if getattr(table.data, "_dbs", None) is None:
        return dict(table.data.data)
    return dict(faust_internals.partition_items(table, partition, None, 100))


@pytest.mark.parametrize("store", ["rocksdb://", "memory://"])
async def test_windowed_rows_write_what_faust_s_windowed_table_writes(
    tmp_path: Any, store: str
) -> None:
    """Counts written through faust's windowed Table (in their partition's event, in the
    window of the time given) and as `windowed_rows` through the writer: the same store
    contents, changelog records whose bytes are faust's key and value encoded, and the
    same keys registered for faust's expiry of old windows; `windowed_read` reads back
    faust's value of the window, and the default where there is none."""
    at = 1_800_000_030.0
    items = {1: [('["identical_repetition",1]', [3, [7]]), ('["x",1]', [1, [8]])], 0: [("k", 2)]}
    table = counts_table(tmp_path, store, "faust")
    by_faust: list[tuple[Any, Any, int]] = []

    def send_changelog(partition: int, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        by_faust.append((key, value, partition))
        return SimpleNamespace(message=SimpleNamespace(partition=partition))

    table.send_changelog = send_changelog
    windows = table.tumbling(60, expires=600).relative_to(lambda event=None: at)
    for partition, pairs in items.items():
        with faust_internals.in_event(_Event(partition)):
            for key, value in pairs:
                windows[key] = value

    mine = counts_table(tmp_path, store, "writer")
    producer = _Producer()
    writer = faust_internals.ChangelogWriter(SimpleNamespace(producer=producer))
    await writer.write(
        [(mine, p, faust_internals.windowed_rows(mine, p, pairs, at)) for p, pairs in items.items()]
    )
    encode_key, encode_value = mine.data._encode_key, mine.data._encode_value
    assert [(k, v, p) for _t, k, v, p in producer.sent] == [
        (encode_key(k), encode_value(v), p) for k, v, p in by_faust
    ]
    assert producer.sent[0][1] == b'["[\\"identical_repetition\\",1]",[1800000000.0,1800000059.9]]'
    for p in (0, 1):
        assert store_contents(mine, p) == store_contents(table, p)
    assert mine._partition_timestamp_keys == table._partition_timestamp_keys
    assert mine._partition_latest_timestamp == table._partition_latest_timestamp
    with faust_internals.in_event(_Event(1)):
        want = windows['["identical_repetition",1]'].value()
    assert faust_internals.windowed_read(mine, 1, '["identical_repetition",1]', at) == want
    assert faust_internals.windowed_read(mine, 1, '["identical_repetition",1]', at + 60) == 0
    if store == "rocksdb://":  # (the memory store keeps every partition in one dict)
        assert faust_internals.windowed_read(mine, 0, '["identical_repetition",1]', at) == 0


# read_in_assignment: when faust marks a rebalance and a message's generation


def rebalance_listener(app: Any, calls: list[str]) -> Any:
    """faust's rebalance listener for aiokafka over a stand-in consumer thread that records
    what faust's consumer would do, and when."""
    from faust.transport.drivers.aiokafka import ConsumerRebalanceListener

    async def revoked(tps: Any) -> None:
        calls.append(f"consumer forgets its acks (rebalancing={app.rebalancing})")

    async def assigned(tps: Any, generation: int) -> None:
        calls.append(f"assigned in generation {generation}")

    coordinator = SimpleNamespace(generation=7)
    thread = SimpleNamespace(
        app=app,
        on_partitions_revoked=revoked,
        on_partitions_assigned=assigned,
        _ensure_consumer=lambda: SimpleNamespace(_coordinator=coordinator),
    )
    return ConsumerRebalanceListener(thread)


async def test_a_rebalance_is_marked_before_the_consumer_forgets_its_acks() -> None:
    app: Any = faust.App("rebalance-unit", broker="kafka://127.0.0.1:1", store="memory://")
    calls: list[str] = []
    listener = rebalance_listener(app, calls)
    assert not app.rebalancing
    await listener.on_partitions_revoked([])
    assert calls == ["consumer forgets its acks (rebalancing=True)"]
    await listener.on_partitions_assigned([])
    assert app.consumer_generation_id == 7 and calls[-1] == "assigned in generation 7"


async def test_after_a_revocation_faust_commits_past_a_record_never_acknowledged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Why nothing read before a rebalance may be acknowledged during it: faust's consumer
    forgets the partition's committed offset as the revocation begins, so an ack then is
    committed with no gap check."""
    app: Any = faust.App("revoked-acks-unit", broker="kafka://127.0.0.1:1", store="memory://")
    consumer = app.consumer
    tp = TP("steps", 2)
    consumer._committed_offset[tp] = 217  # 217.. dropped, unacknowledged, at the rebalance
    consumer._acked[tp] = [326, 327]
    assert consumer._new_offset(tp) is None  # faust waits for 217..325

    async def the_apps_part(revoked: Any) -> None:  # (tables, flow control, the signal)
        return None

    monkeypatch.setattr(consumer, "_on_partitions_revoked", the_apps_part)
    await consumer.on_partitions_revoked({tp})
    consumer._acked[tp] = [326, 327]  # acknowledged after that
    assert consumer._new_offset(tp) == 328


def test_faust_commits_past_one_unacknowledged_record_followed_by_acknowledged_ones() -> None:
    """Why detect acknowledges in read order (streams/worker/agents/detect.py `in_order`): a
    record held for the input clock, unacknowledged while the records after it are, would
    be committed over, and lost at the next restart. `_new_offset` waits for a gap of two
    or more at the head, not for a gap of one."""
    app: Any = faust.App("ack-order-unit", broker="kafka://127.0.0.1:1", store="memory://")
    consumer = app.consumer
    tp = TP("steps", 1)
    consumer._committed_offset[tp] = 217  # the next to read: 217 is not acknowledged
    consumer._acked[tp] = [219, 220]
    assert consumer._new_offset(tp) is None  # 217 and 218 missing: waits
    consumer._acked[tp] = [218, 219, 220]
    assert consumer._new_offset(tp) == 221  # 217 alone missing: committed over


async def test_a_rebalance_ends_only_after_the_seek(monkeypatch: pytest.MonkeyPatch) -> None:
    app: Any = faust.App("rebalance-end-unit", broker="kafka://127.0.0.1:1", store="memory://")
    during_seek: list[bool] = []

    async def seek() -> None:
        during_seek.append(app.rebalancing)

    stand_ins_for_the_seek(monkeypatch, app, seek)
    app.on_rebalance_start()
    await app.tables.recovery.on_recovery_completed(app.consumer_generation_id)
    assert during_seek == [True] and not app.rebalancing


def test_a_fetched_record_carries_the_generation_it_was_read_in() -> None:
    app: Any = faust.App("generation-unit", broker="kafka://127.0.0.1:1", store="memory://")
    app.consumer_generation_id = 4
    record = SimpleNamespace(
        topic="steps",
        partition=2,
        offset=326,
        timestamp=None,
        timestamp_type=0,
        headers=[],
        key=None,
        value=b"",
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=0,
    )
    message = app.consumer._to_message(TP("steps", 2), record)
    assert message.generation_id == 4
    assert faust_internals.read_in_assignment(app, message)
    app.on_rebalance_start()
    assert not faust_internals.read_in_assignment(app, message)  # under way
    app.on_rebalance_end()
    app.consumer_generation_id = 5
    assert not faust_internals.read_in_assignment(app, message)  # read before it
