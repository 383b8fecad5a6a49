"""The stream service: `Worker` wires the worker's parts together and answers for them
(readiness, /healthz); streams/worker/faust_app.py connects it to faust.

Topology (docs/CONTRACTS.md §1, §6; docs/ARCHITECTURE.md "The flow")::

    otlp_spans ──ingest──▶ loopwatch-steps ──detect──▶ loop_detected (key run_id)
      (raw OTLP batches)   steps by run id     │       loop_runs     (key run_id)
          │                                    └─ tables runs, finished, retained,
          └─ undecodable ─▶ loopwatch-dead-letters     episodes, versions and the counts
                            (digest + headers)

The parts, one concern each (streams/worker/; docs/ARCHITECTURE.md "The parts"): agents/
(decode, ingest and detect, the steps they run in order: publish, counting, checkpoint;
the driver over runloop/loop.py, timers, the deadline clock, dead letters, the steps
topic's messages, `Parts`), state/ (the tables and their formats), kafka/ (topics,
delivery, broker state, input clock, records the stream skipped), api/ (the on-call API),
faust_internals.py (faust's private internals, one door) and faust_app.py (the app,
topics, tables, agents and timers).

Time: a run's clock is its event time (``max_end_ns`` of its spans) advanced by the
wall-clock time since its last span arrived; deadlines live in an in-memory index rebuilt
from the table whenever partitions are assigned (downtime does not count). Finished runs
are markers in the table ``finished`` (TTL ``LOOPWATCH_FINISHED_TTL_SECONDS``), so spans
of a finished run are counted instead of opening a new run. Outputs are at-least-once with
deterministic event ids and fired markers in the run state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from detectors.policy import Policy
from streams.spanpath import native
from streams.spanpath.normalize import Normalizer
from streams.worker.agents.checkpoint import Checkpoint, nothing_to_flush
from streams.worker.agents.counting import Counting
from streams.worker.agents.dead_letters import DeadLetters
from streams.worker.agents.deadline_clock import DeadlineClock
from streams.worker.agents.decode import InputDecoder
from streams.worker.agents.detect import Detect
from streams.worker.agents.driver import RunDriver
from streams.worker.agents.ingest import Ingest
from streams.worker.agents.parts import Parts
from streams.worker.agents.timers import Timers
from streams.worker.kafka.broker import BrokerLink, MetadataProbe
from streams.worker.kafka.delivery import Publisher
from streams.worker.kafka.input_clock import InputClock, KafkaInputProbe
from streams.worker.kafka.skips import SkipGuard
from streams.worker.state.statedir import writable
from streams.worker.state.store import Tables

if TYPE_CHECKING:
    from alerts.metrics import Metrics
    from streams.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

# /healthz is not ready when nothing was processed for this long while records wait
STALLED_SECONDS = 60.0
# the exit status after a failed table write (a full disk): a restart recovers
FATAL_EXIT_STATUS = 3
# ... and how long /readyz answers 503 with the reason before the stop closes the web
# server: a probe or a scrape in that moment sees why, not only a closed port
FATAL_HOLD_SECONDS = 2.0

COUNTERS = (
    "records",
    "spans",
    "run_parts",
    "events",
    "runs_finished",
    "dead_letters",
    "detect_batches",
    "step_messages_sent",
    "refetched_records",  # input records the stream skipped, read back
    "publish_retries",  # outputs sent again after a failed delivery
    "marks_sent",  # this worker's delivered input offsets, to the steps partitions of others
    "marks_read",  # other workers' marks taken by the input clock
    "records_read_before_rebalance",  # taken after it began: left to be redone
)


def run_driver(s: WorkerSettings, policy: Policy, tables: Tables) -> RunDriver:
    """The run loop over the worker's tables, with its bounds and retention."""
    driver = RunDriver(
        policy,
        finished_ttl_seconds=s.finished_ttl_seconds,
        max_active_runs=s.max_active_runs,
        tick_seconds=s.tick_seconds,
        cache_size=s.state_cache_size,
        arrival_hold_seconds=s.arrival_hold_ms / 1000,
        links=s.trace_links,
        retention=s.retention,
    )
    driver.bind(tables.runs, tables.finished, tables.retained, tables.episodes)
    if tables.scan is not None:
        driver.store.scan = tables.scan
    if tables.read is not None:
        driver.store.read = tables.read
    return driver


def deadline_clock(s: WorkerSettings) -> DeadlineClock:
    """Unkeyed input: deadlines wait for the group's progress through every input partition
    (streams/worker/kafka/input_clock.py); keyed input keeps a trace on one partition."""
    unkeyed = s.input_clock and not s.input_keyed_by_run
    return DeadlineClock(
        InputClock(time.time_ns()) if unkeyed else None,
        s.input_clock_max_lag_seconds,
        lambda: KafkaInputProbe(s.bootstrap, s.app_id, s.input_topic),
    )


class Worker:
    """The worker's parts wired over the given topics and tables (faust's in the service,
    fakes in tests): ingest, detect, timers, and what they share."""

    def __init__(
        self,
        settings: WorkerSettings,
        policy: Policy,
        normalizer: Normalizer,
        metrics: Metrics,
        detect_partitions: int,
        *,
        tables: Tables,
        topics: dict[str, Any],
        consumer: Callable[[], Any],
        stopping: Callable[[], bool],
        assigned: Callable[[], set[int]],
        read_in_assignment: Callable[[Any], bool],
        refetcher: Callable[[str], Any] | None = None,
        request_stop: Callable[[], None] = lambda: None,
        flush_producer: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        s = self.settings = settings
        self.policy = policy
        self.normalizer = normalizer
        self.metrics = metrics
        self.tables = tables
        self.topics = topics  # steps, events, runs, dead
        self.assigned = assigned
        self.keyed = s.input_keyed_by_run
        self.started = time.time()
        self.ready = False
        self.store_memory: Callable[[], dict[str, int]] = dict  # rocksdb: set by the service
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.driver = run_driver(s, policy, tables)
        self.clock = deadline_clock(s)
        self.broker = BrokerLink(metrics, reminder_seconds=s.broker_reminder_seconds)
        self.broker_probe: Any = None  # MetadataProbe, made by the first probe
        self.state_dir_error: str | None = None
        self.crashed: dict[str, str] = {}  # agent -> the error that ended it
        self.fatal: str | None = None  # a table write failed: the worker is stopping
        self.fatal_hold_seconds = FATAL_HOLD_SECONDS
        self.request_stop = request_stop  # SIGTERM to itself: the bounded stop
        self._progress = (-1, time.monotonic())  # (records + detect batches, when it changed)
        self.publisher = Publisher(
            metrics,
            self.counters,
            stopping,
            read_in_assignment=read_in_assignment,
            on_failure=lambda what: self.broker.failure("delivery", what),
        )
        self.parts = self._parts(consumer, refetcher)
        self._agents(detect_partitions, assigned, flush_producer or nothing_to_flush)

    def _parts(self, consumer: Callable[[], Any], refetcher: Callable[[str], Any] | None) -> Parts:
        """What the agents share: dead letters, the skip guard and the input decoder on top
        of the tables, the driver, the clock and the publisher."""
        s, counters = self.settings, self.counters
        dead_letters = DeadLetters(
            self.topics["dead"], self.publisher, self.metrics, counters, s.dlq_capture_payload
        )
        if refetcher is None:
            skips = SkipGuard.for_broker(s.bootstrap, consumer, counters)
        else:
            skips = SkipGuard(consumer, counters, refetcher)
        reader = InputDecoder(
            self.normalizer, s.input_encoding, dead_letters, self.metrics, counters
        )
        self.dead_letters, self.skips, self.reader = dead_letters, skips, reader
        return Parts(
            self.metrics,
            counters,
            self.tables,
            self.driver,
            self.clock,
            self.publisher,
            dead_letters,
            skips,
            reader,
            self.topics,
        )

    def _agents(
        self,
        detect_partitions: int,
        assigned: Callable[[], set[int]],
        flush_producer: Callable[[], Awaitable[None]],
    ) -> None:
        """The ingest agent, the timers, and the detect agent with its counting and
        checkpoint."""
        s, parts = self.settings, self.parts
        self.ingest = Ingest(parts, detect_partitions, s.steps_grouping)
        self.timers = Timers(
            parts,
            ready=lambda: self.ready,
            assigned=assigned,
            lag_sources={s.input_topic, s.steps_topic},
            steps_partitions=detect_partitions,
        )
        self.counting = Counting(self.metrics, self.counters, self.tables)
        checkpoint = Checkpoint(
            parts,
            self.counting,
            flush_producer=flush_producer,
            flush_seconds=s.state_flush_ms / 1000,
        )
        self.detect = Detect(
            parts,
            checkpoint,
            self.counting,
            keyed_input_topic=s.input_topic if self.keyed else None,
            on_tick=self.timers.tick_handled,
            on_state_error=self.state_write_failed,
        )

    def recovered(self, partitions: set[int]) -> None:
        """Partitions were assigned and their tables restored: rebuild the schedules."""
        started = time.monotonic()
        tables = self.tables
        self.driver.rebuild(list(tables.runs.items()), partitions, time.time_ns())
        self.counting.recover(partitions)
        self.timers.tick_sent.clear()
        self.ready = True
        self.metrics.active_runs.set(len(self.driver.index))
        log.info(
            "partitions %s recovered: %d live runs, about %d finished markers (%.2f s)",
            sorted(partitions),
            len(self.driver.index),
            tables.count(tables.finished),
            time.monotonic() - started,
        )

    def revoked(self, revoked: Iterable[Any] = ()) -> None:
        """A rebalance (eager: it revokes every partition)."""
        self.ready = False
        self.publisher.revoked()
        self.skips.forget()
        for tp in revoked:
            self.metrics.forget_consumer_lag(tp.topic, tp.partition)

    def state_write_failed(self, error: str) -> None:
        """A table write failed (a full disk): stop after FATAL_HOLD_SECONDS (not ready
        meanwhile), exit status 3. The batch is not
        acknowledged, so its records are processed again after the restart; with the disk
        still full the restart is one line and exit status 2 (statedir.prepare)."""
        if self.fatal is not None:
            return
        self.fatal = error
        log.error(
            "table state write failed (%s): the batch is not acknowledged and is processed "
            "again after a restart; stopping with exit status %d",
            error,
            FATAL_EXIT_STATUS,
        )
        # nothing more is processed meanwhile: detect holds its lock until the stop
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self.fatal_hold_seconds <= 0:
            self.request_stop()
        else:
            loop.call_later(self.fatal_hold_seconds, self.request_stop)

    @contextlib.contextmanager
    def agent_running(self, name: str) -> Iterator[None]:
        """An agent's run: an error that ends it (a table write the disk refused) makes the
        worker not ready, with the error, instead of a stream that silently stopped."""
        try:
            yield
        except Exception as exc:
            self.crashed[name] = f"{type(exc).__name__}: {exc}"[:300]
            log.error("agent %s stopped: %s", name, self.crashed[name])
            raise

    async def probe_broker(self) -> None:
        """Ask the broker for metadata (in an executor); update the broker state."""
        s = self.settings
        if self.broker_probe is None:
            self.broker_probe = MetadataProbe(s.bootstrap, s.input_topic)
        loop = asyncio.get_running_loop()
        error = await loop.run_in_executor(None, self.broker_probe.read)
        self.broker.probe_result(error is None, error or "")
        # loopwatch_ready (and the stall check) follow readiness whether or not anyone asks
        self.metrics.ready.set(0 if self.readiness()[0] == "not_ready" else 1)

    async def check_state_dir(self) -> None:
        """Write a small file in the data dir (in an executor): unhealthy while it fails."""
        path = self.settings.data_path
        error = await asyncio.get_running_loop().run_in_executor(None, writable, path)
        if error != self.state_dir_error:
            if error is not None:
                log.error(
                    "data dir %s is not writable: %s; table writes fail, so processing stops "
                    "(nothing is acknowledged) and /healthz is not ready until it is fixed",
                    path,
                    error,
                )
            else:
                log.warning("data dir %s is writable again", path)
        self.state_dir_error = error

    def stalled_seconds(self) -> float:
        """Seconds without a record or detect batch processed while the consumer lag is
        above 0 (0 when it is not): a consumer that stopped delivering records."""
        done = self.counters["records"] + self.counters["detect_batches"]
        now = time.monotonic()
        if done != self._progress[0] or self.timers.max_lag == 0 or not self.ready:
            self._progress = (done, now)
        return now - self._progress[1]

    def readiness(self) -> tuple[str, list[str]]:
        """("ok" | "degraded" | "not_ready", reasons). not_ready: /healthz answers 503."""
        s = self.settings
        broker = self.broker
        not_ready: list[str] = []
        degraded: list[str] = []
        if not self.ready:
            not_ready.append(
                "recovery not finished: partitions assigned, tables being restored"
                if self.assigned()
                else "no partitions assigned yet (starting or rebalancing)"
            )
        down = broker.disconnected_for()
        if broker.state == "disconnected":
            reason = f"broker disconnected for {down:.0f} s"
            if down >= s.ready_broker_seconds:
                not_ready.append(f"{reason} (bound {s.ready_broker_seconds:.0f} s)")
            else:
                degraded.append(reason)
        elif broker.state == "degraded":
            degraded.append(f"broker degraded: {broker.last_failure_what}")
        lag = self.clock.lag_seconds()
        if lag is not None and lag > s.ready_max_input_clock_lag_seconds:
            not_ready.append(
                f"input clock {lag:.0f} s behind (bound {s.ready_max_input_clock_lag_seconds:.0f} s)"
            )
        if (stalled := self.stalled_seconds()) >= STALLED_SECONDS:
            not_ready.append(
                f"nothing processed for {stalled:.0f} s with a consumer lag of "
                f"{self.timers.max_lag} records"
            )
        if self.timers.max_lag > s.ready_max_consumer_lag:
            not_ready.append(
                f"consumer lag {self.timers.max_lag} records (bound {s.ready_max_consumer_lag})"
            )
        if self.state_dir_error is not None:
            not_ready.append(f"data dir not writable: {self.state_dir_error}")
        if self.fatal is not None:
            not_ready.append(f"table state write failed ({self.fatal}): stopping")
        for name, error in sorted(self.crashed.items()):
            not_ready.append(f"agent {name} stopped ({error}): restart the worker")
        if not_ready:
            return "not_ready", not_ready + degraded
        if degraded:
            return "degraded", degraded
        return "ok", []

    def health(self) -> dict[str, Any]:
        s = self.settings
        status, reasons = self.readiness()
        self.metrics.ready.set(0 if status == "not_ready" else 1)
        return {
            "status": status,
            "ready": status != "not_ready",
            "reasons": reasons,
            "recovered": self.ready,
            "broker": self.broker.snapshot(),
            "consumer_lag_max": self.timers.max_lag,
            "active_runs": len(self.driver.index),
            # unkeyed arrivals waiting for the input clock (streams/worker/agents/arrivals.py)
            "held_arrivals": len(self.driver.arrivals),
            "held_steps": self.driver.arrivals.steps,
            "finished_markers": self.tables.count(self.tables.finished),
            "assigned_partitions": sorted(self.assigned()) if self.ready else [],
            **self.counters,
            "state_writes": self.driver.state_writes,
            "state_write_bytes": self.driver.store.state_write_bytes,
            "input_topic": s.input_topic,
            "keyed_input": self.keyed,
            "input_clock_behind_seconds": (
                None if (lag := self.clock.lag_seconds()) is None else round(lag, 1)
            ),
            "app_id": s.app_id,
            "span_path": native.ACTIVE,
            "store_memory_bytes": self.store_memory(),
            "uptime_seconds": round(time.time() - self.started, 1),
        }
