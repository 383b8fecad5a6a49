"""The faust wiring of the worker: the app, its topics and tables (rocksdb or memory), the
agents (ingest, detect) and timers, the rebalance callbacks and the on-call API views, all
calling into `Worker` (streams/worker/service.py), which holds the parts.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from detectors.policy import Policy
from streams.spanpath.normalize import Normalizer
from streams.worker import faust_internals
from streams.worker.allocator import QuietTrim
from streams.worker.api.holds import wire_holds, wire_verdicts
from streams.worker.api.views import Views
from streams.worker.kafka.broker import BROKER_PROBE_SECONDS
from streams.worker.kafka.topics import WINDOW_EXPIRES_SECONDS, WINDOW_SECONDS
from streams.worker.service import Worker
from streams.worker.state.holds import HoldBook
from streams.worker.state.store import Rows, Tables

if TYPE_CHECKING:
    from alerts.metrics import Metrics
    from streams.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


# rocksdb's memory by what holds it (summed over every open table partition): the memtables
# and the block cache are bounded by LOOPWATCH_ROCKSDB_* (one cache and one write buffer
# manager for every partition: faust_internals.StoreMemory); the table readers (SST index
# and filter blocks) are kept in that cache, so what is left outside it stays small.
_ROCKSDB_MEMORY = {
    "memtables": "rocksdb.cur-size-all-mem-tables",
    "block_cache": "rocksdb.block-cache-usage",
    "table_readers": "rocksdb.estimate-table-readers-mem",
}


def rocksdb_memory(
    tables: Iterable[Any], shared: faust_internals.StoreMemory | None = None
) -> dict[str, int]:
    """/healthz `store_memory_bytes`: empty for the in-memory store. A cache shared by the
    partitions is counted once (every partition reports all of it)."""
    out: dict[str, int] = {}
    for table in tables:
        for db in faust_internals.table_databases(table):
            for name, prop in _ROCKSDB_MEMORY.items():
                if shared is not None and name == "block_cache":
                    continue
                try:
                    value = db.property_int_value(prop)
                except Exception:  # a closed or foreign db: not worth a failed health answer
                    continue
                out[name] = out.get(name, 0) + int(value or 0)
    if shared is not None and out:
        out["block_cache"] = shared.usage()["block_cache"]
    return out


def commit_interval(s: WorkerSettings) -> float:
    """Unkeyed input: the input clock learns other workers' progress from the commits, so
    they come often (0.25 s); keyed input has no input clock, and each faust commit flushes
    the producer first (a pause: keyed p99 latency 2.5 s at 0.25 s against 1.2-1.5 s at
    1.0 s)."""
    if s.commit_interval_seconds is not None:
        return float(s.commit_interval_seconds)
    return 1.0 if s.input_keyed_by_run else 0.25


def fetch_wait(s: WorkerSettings) -> tuple[int, int]:
    """(min bytes, max wait in ms) of a fetch (faust_internals.install_fetch_wait; 0 bytes:
    faust's own). Keyed input waits for 128 KiB or 40 ms: live traffic was fetched a record
    at a time (at 10k spans/s, 7% of the worker's CPU, and a p99 latency of 2.8 s against
    1.75 here). Unkeyed input keeps faust's: its backlog ran slower with the wait, and its
    live CPU did not change (docs/PERFORMANCE.md)."""
    kb = s.fetch_min_kb
    if kb is None:
        kb = 128 if s.input_keyed_by_run else 0
    return kb * 1024, s.fetch_max_wait_ms


def consumer_conf(s: WorkerSettings) -> dict[str, Any]:
    """How the worker's faust app reads and commits (also bench/faust_floor.py's, which
    measures faust's own cost under the worker with exactly these)."""
    return {
        "broker": s.broker_url,
        "processing_guarantee": "at_least_once",
        "consumer_auto_offset_reset": "earliest",
        "broker_commit_interval": commit_interval(s),
        "broker_session_timeout": s.session_timeout_seconds,
        "broker_heartbeat_interval": min(3.0, s.session_timeout_seconds / 3),
        # a backlog is read in fetches of this size per partition: with faust's 1 MiB the
        # agents waited for records half of the time (bench: trace-keyed 14k -> 28k spans/s)
        "consumer_max_fetch_size": s.fetch_partition_mb * 1024 * 1024,
        "stream_wait_empty": False,
    }


class CurrentWindow:
    """A windowed count table as the checkpoint reads and writes it (streams/worker/state/
    store.py `Tables`): `read` and `rows` of the window of now, written by the tables'
    writer; `items` of every window (the raw table, as the on-call API reads it). Now is
    processing time, `time.time()`: faust's relative_to_now() uses, inside a stream, the
    latest window end seen on the partition, which starts at 0."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        # (sets the table's window, which its expiry and the on-call API go by)
        raw.tumbling(WINDOW_SECONDS, expires=timedelta(seconds=WINDOW_EXPIRES_SECONDS))

    def read(self, partition: int, key: str) -> Any:
        """The current window's value in the partition's store (faust's default, 0, when
        there is none)."""
        return faust_internals.windowed_read(self.raw, partition, key, time.time())

    def rows(self, partition: int, items: list[tuple[str, Any]]) -> Rows:
        """`items` as rows of the current window, for the tables' writer."""
        return faust_internals.windowed_rows(self.raw, partition, items, time.time())

    def items(self) -> Any:
        return self.raw.items()


class LoopwatchService:
    """The faust app, its topics and tables, and a `Worker` wired to them, in the order a
    reader follows: the app, its topics, its tables, the worker, then what faust runs (the
    two agents, the timers) and what it serves (the on-call API, the holds)."""

    def __init__(
        self,
        settings: WorkerSettings,
        policy: Policy,
        normalizer: Normalizer,
        metrics: Metrics,
        detect_partitions: int,
    ) -> None:
        self.settings = s = settings
        # faust clears the stream queues after its end-of-recovery seek: records fetched
        # during the seek were lost (the restart stall, issue 16); and the seek leaves the
        # records of a partition with no committed offset fetched and dropped before it
        faust_internals.install_recovery_fix()
        faust_internals.install_uncommitted_seek_fix()
        # and faust's consumer returns a fetch as soon as one record is there
        faust_internals.install_fetch_wait(*fetch_wait(s))
        s.data_path.mkdir(parents=True, exist_ok=True)
        self.app: Any = make_app(s, detect_partitions)
        topics = self._topics(detect_partitions)
        tables = self._tables(detect_partitions)
        app = self.app
        self.worker = Worker(
            s,
            policy,
            normalizer,
            metrics,
            detect_partitions,
            tables=tables,
            topics=topics,
            consumer=lambda: app.consumer,
            stopping=lambda: bool(app.should_stop),
            assigned=self.assigned_partitions,
            read_in_assignment=functools.partial(faust_internals.read_in_assignment, app),
            request_stop=lambda: os.kill(os.getpid(), signal.SIGTERM),
            flush_producer=lambda: app.producer.flush(),
        )
        self._share_store_memory()
        self._agents()
        self._timers()
        self._api(tables, policy)

    def _topics(self, detect_partitions: int) -> dict[str, Any]:
        """The topics the worker writes (steps, events, runs, dead letters); the input and
        detect's sources are kept for `_agents`."""
        s, app = self.settings, self.app
        raw: dict[str, Any] = {"key_serializer": "raw", "value_serializer": "raw"}
        steps_topic = app.topic(s.steps_topic, partitions=detect_partitions, **raw)
        self.input_topic = app.topic(s.input_topic, **raw)
        keyed = s.input_keyed_by_run
        # keyed input: detect reads the input itself (no hop), and the steps topic's ticks
        self.detect_source = (
            app.topic(s.input_topic, s.steps_topic, **raw) if keyed else steps_topic
        )
        self.detect_topic_names = {s.input_topic, s.steps_topic} if keyed else {s.steps_topic}
        return {
            "steps": steps_topic,
            "events": app.topic(s.events_topic, **raw),
            "runs": app.topic(s.runs_topic, **raw),
            "dead": app.topic(s.dead_letter_topic, **raw),
        }

    def _tables(self, detect_partitions: int) -> Tables:
        from streams.worker.kafka.topics import (
            EPISODES_TABLE,
            FINISHED_TABLE,
            HOLD_COUNTS_TABLE,
            LOOP_COUNTS_TABLE,
            RETAINED_TABLE,
            RUN_COUNTS_TABLE,
            RUNS_TABLE,
            VERSION_COUNTS_TABLE,
            VERSIONS_TABLE,
        )

        s, app = self.settings, self.app

        # Each table's store gets its own dict: faust's rocksdb Store pops keys out of it.
        def opts() -> dict[str, Any]:
            return {"partitions": detect_partitions, "options": s.rocksdb_options()}

        as_bytes: dict[str, Any] = {"key_type": bytes, "value_type": bytes}
        self.runs = app.Table(RUNS_TABLE, **opts(), **as_bytes)
        self.finished = app.Table(FINISHED_TABLE, **opts(), **as_bytes)
        self.retained = app.Table(RETAINED_TABLE, **opts(), **as_bytes)
        self.episodes = app.Table(EPISODES_TABLE, **opts(), **as_bytes)
        # windowed counters: json keys ((label key, (start, end))) and [n, ids] values
        loop_counts = app.Table(LOOP_COUNTS_TABLE, default=int, **opts())
        run_counts = app.Table(RUN_COUNTS_TABLE, default=int, **opts())
        version_counts = app.Table(VERSION_COUNTS_TABLE, default=int, **opts())
        hold_counts = app.Table(HOLD_COUNTS_TABLE, default=int, **opts())
        self.versions = app.Table(VERSIONS_TABLE, **opts(), **as_bytes)
        self.all_tables = (
            self.runs,
            self.finished,
            self.retained,
            self.episodes,
            loop_counts,
            run_counts,
            version_counts,
            hold_counts,
            self.versions,
        )
        return Tables(
            self.runs,
            self.finished,
            CurrentWindow(loop_counts),
            CurrentWindow(run_counts),
            faust_internals.in_event,
            retained=self.retained,
            episodes=self.episodes,
            scan=faust_internals.partition_items,
            read=faust_internals.partition_read,
            count=faust_internals.estimated_keys,
            versions=self.versions,
            version_counts=CurrentWindow(version_counts),
            hold_counts=CurrentWindow(hold_counts),
            writer=faust_internals.ChangelogWriter(app),
        )

    def _share_store_memory(self) -> None:
        """One cache and one write buffer manager for every table partition (before any
        opens)."""
        s = self.settings
        store_memory = faust_internals.StoreMemory(
            s.rocksdb_block_cache_mb * 2**20, s.rocksdb_memtables_mb * 2**20
        )
        faust_internals.share_store_memory(self.all_tables, store_memory)
        self.worker.store_memory = lambda: rocksdb_memory(self.all_tables, store_memory)

    def _agents(self) -> None:
        """The ingest agent (unkeyed input only: the hop), the detect agent, and the
        rebalance callbacks."""
        s, app, worker = self.settings, self.app, self.worker

        async def on_recover() -> None:
            worker.recovered(self.assigned_partitions())

        async def on_revoked(app: Any, revoked: Any = None, **kwargs: Any) -> None:
            worker.revoked(revoked or ())

        self.runs.on_recover(on_recover)
        app.on_partitions_revoked.connect(on_revoked)

        async def ingest(stream: Any) -> None:
            with worker.agent_running("ingest"):
                await worker.ingest.run(stream)

        async def detect(stream: Any) -> None:
            with worker.agent_running("detect"):
                await worker.detect.run(stream, s.batch_max, s.batch_within_ms / 1000)

        if not s.input_keyed_by_run:
            app.agent(self.input_topic, name="ingest")(ingest)
        app.agent(self.detect_source, name="detect")(detect)

    def _timers(self) -> None:
        s, app, worker = self.settings, self.app, self.worker
        timers = worker.timers

        async def ticks() -> None:
            await timers.send_ticks()

        async def lag() -> None:
            timers.update_lag(faust_internals.consumer_if_started(app))

        async def input_clock() -> None:
            await timers.advance_input_clock()

        quiet_trim = QuietTrim()

        async def trim() -> None:
            quiet_trim.check()

        async def state_flush() -> None:
            await worker.detect.flush_if_due()

        async def broker() -> None:
            await worker.probe_broker()

        async def state_dir() -> None:
            await worker.check_state_dir()

        app.timer(interval=s.tick_seconds, name="loopwatch-ticks")(ticks)
        app.timer(interval=5.0, name="loopwatch-lag")(lag)
        if worker.clock.input is not None:
            app.timer(interval=s.input_clock_probe_seconds, name="loopwatch-input-clock")(
                input_clock
            )
        app.timer(interval=1.0, name="loopwatch-malloc-trim")(trim)
        if s.state_flush_ms:
            app.timer(interval=s.state_flush_ms / 1000, name="loopwatch-state-flush")(state_flush)
        app.timer(interval=BROKER_PROBE_SECONDS, name="loopwatch-broker")(broker)
        app.timer(interval=10.0, name="loopwatch-state-dir")(state_dir)

    def _api(self, tables: Tables, policy: Policy) -> None:
        """The on-call API (streams/worker/api/views.py) and the holds: the book every
        worker reads whole, its routes, and the verdicts guards poll."""
        s, app, worker = self.settings, self.app, self.worker
        Views(
            app,
            tables,
            s.retention,
            s.api_token,
            worker.health,
            s.trace_links,
            self.assigned_partitions,
        ).wire()
        self.holds = HoldBook(
            s.bootstrap,
            s.holds_topic,
            default_ttl_seconds=policy.hold_default_ttl_seconds,
            max_ttl_seconds=policy.hold_max_ttl_seconds,
            side_effect=lambda tool: bool((c := policy.tools.get(tool)) and c.side_effect),
        )
        self.holds.start()
        # tool calls that ran under a hold are counted (streams/worker/agents/counting.py)
        worker.detect.driver.loop.held_by = self.holds.held_by
        wire_holds(app, self.holds, s.api_token)
        wire_verdicts(app, self.runs, self.retained, self.holds, s.api_token)

    def assigned_partitions(self) -> set[int]:
        actives = self.app.assignor.assigned_actives()
        return {tp.partition for tp in actives if tp.topic in self.detect_topic_names}


def make_app(s: WorkerSettings, detect_partitions: int) -> Any:
    """The faust app with the worker's settings (consumer_conf: its consumer's)."""
    import faust

    return cast(Any, faust.App)(
        s.app_id,
        store=s.store,
        datadir=str(s.data_path / "{conf.id}"),
        topic_partitions=detect_partitions,
        topic_replication_factor=s.replication_factor,
        web_enabled=True,
        web_bind=s.web_host,
        web_host=s.web_host,
        web_port=s.web_port,
        canonical_url=s.canonical_url,
        web_router_enabled=False,
        web_tables_enabled=False,
        web_stats_enabled=False,
        web_graph_enabled=False,
        web_metrics_enabled=False,
        producer_linger_ms=s.linger_ms,
        # batches of 16 KiB (faust's default) hold 9 run states of the changelog, and
        # aiokafka's sender costs per batch: 39 -> 13 us of CPU a 1.8 kB record at 256 KiB
        producer_max_batch_size=s.producer_batch_kb * 1024,
        table_standby_replicas=0,
        logging_config=None,
        **consumer_conf(s),
    )


def build_app(
    settings: WorkerSettings,
    policy: Policy,
    fingerprinter: Any,
    metrics: Metrics,
    detect_partitions: int,
) -> LoopwatchService:
    """The faust service for `settings` (topics must exist: see streams.worker.kafka.topics)."""
    normalizer = Normalizer(policy, fingerprinter)
    return LoopwatchService(settings, policy, normalizer, metrics, detect_partitions)
