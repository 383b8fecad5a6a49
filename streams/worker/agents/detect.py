"""The detect agent: per run, in the faust table ``runs``, the pure pipeline over its steps
(`RunDriver`), then its events and summaries out, then its state.

It takes messages in batches (``stream.take_events``) and applies each run's steps of a
batch in arrival order. The batch's events and summaries are sent and acknowledged by the
broker first; its state changes are then staged, and written to the tables (changelog and
rocksdb) once per flush interval (``LOOPWATCH_STATE_FLUSH_MS``): a run touched by several
batches of an interval is written once (Kafka Streams' record cache, quix-streams'
``Checkpoint.commit``). The batches' records are acknowledged only after the flush that
wrote their effects, so offsets are never committed past state that is not in the
changelog. So: outputs, then state, then offsets; a crash between them redoes records whose
outputs may already be out (at least once, as before), and the fired markers in a flushed
state stop any re-emission after it.

A rebalance (Publisher.generation) or a stop drops what is staged, unacknowledged: the
records are processed again from their committed offsets by the partition's next owner, and an
acknowledgement from before the rebalance never reaches faust (it would commit the new
assignment past records whose state was dropped).

A tick (streams/worker/agents/timers.py) releases, finalizes and evicts the due runs of its
partition, judged by the clock it was sent with. With keyed input detect reads the input
topic itself (no hop): records are decoded here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from detectors.model import Step
from streams.worker.agents.dead_letters import DeadLetters
from streams.worker.agents.deadline_clock import DeadlineClock
from streams.worker.agents.driver import Outputs, RunDriver
from streams.worker.agents.ingest import InputReader
from streams.worker.agents.messages import (
    TICK_VALUE_PREFIX,
    decode_run_groups,
    decode_steps,
    key_text,
    sent_clock,
    tick_clock,
    to_json,
)
from streams.worker.api.keys import aggregate_key
from streams.worker.kafka.delivery import Abandoned, Outgoing, Publisher, Sent
from streams.worker.kafka.skips import SkipGuard
from streams.worker.state.store import Tables

log = logging.getLogger("loopwatch.worker")

Groups = dict[tuple[int, str], list[tuple[Any, list[Step], int | None]]]


class StateWriteError(Exception):
    """A table write failed (a full disk, an I/O error): the batch's state is not (all)
    written, so the batch must not be acknowledged."""


class Detect:
    def __init__(
        self,
        driver: RunDriver,
        tables: Tables,
        reader: InputReader,
        skips: SkipGuard,
        publisher: Publisher,
        dead_letters: DeadLetters,
        clock: DeadlineClock,
        events_topic: Any,
        runs_topic: Any,
        metrics: Any,
        counters: dict[str, int],
        *,
        keyed_input_topic: str | None,
        on_tick: Callable[[int], None],
        on_state_error: Callable[[str], None] = lambda error: None,
        flush_seconds: float = 0.0,
        flush_max_runs: int = 10_000,
    ) -> None:
        self.driver = driver
        self.tables = tables
        self.reader = reader
        self.skips = skips
        self.publisher = publisher
        self.dead_letters = dead_letters
        self.clock = clock
        self.events_topic = events_topic
        self.runs_topic = runs_topic
        self.metrics = metrics
        self.counters = counters
        self.keyed_input_topic = keyed_input_topic  # keyed input: decoded here
        self.on_tick = on_tick  # a tick of this partition is handled: another may be sent
        self.on_state_error = on_state_error  # the worker stops (exit status 3)
        self.failed: str | None = None  # a table write failed: nothing more is done
        self.flush_seconds = flush_seconds  # 0: every batch
        self.flush_max_runs = flush_max_runs  # ... or when this many runs have staged writes
        # staged: written and acknowledged by the next flush
        self.staged: list[Any] = []  # events of the batches since the last flush
        self.staged_refetched: list[Any] = []  # records read back for them
        self.staged_events: dict[int, Any] = {}  # partition -> an event of it (table routing)
        self.staged_generation = 0
        self.last_flush = time.monotonic()
        self.lock = asyncio.Lock()  # a batch and a flush never interleave
        self.stream: Any = None

    async def run(self, stream: Any, batch_max: int, within_seconds: float) -> None:
        """The agent. take_events acks the batch in a `finally`, also when the batch is
        cancelled or fails mid-publish (a stop, a revocation): its offsets would be
        committed with the outputs unsent. One more reference per message, released only
        by the flush that wrote the batch's state, keeps such a batch unacked."""
        self.stream = stream
        # A stop drops what is staged, unacknowledged (processed again after the restart,
        # at least once): written during faust's stop, the changelog sends could reach a
        # producer already closed, and the stop then ended as a crash.
        async for events in stream.take_events(batch_max, within=within_seconds):
            for event in events:
                event.message.incref()
            async with self.lock:
                if self.failed is not None:
                    await self.halt()
                try:
                    await self.batch(events)
                    self.counters["detect_batches"] += 1
                    if self.flush_due():
                        await self.ack(self.flush())
                except Abandoned:
                    log.info("detect: a batch waiting for delivery was abandoned (rebalance)")
                    continue  # unacked: processed again from the committed offsets
                except StateWriteError as exc:
                    self.state_write_failed(exc)
                    await self.halt()

    def state_write_failed(self, exc: StateWriteError) -> None:
        """Nothing staged is acknowledged, and no later batch is processed: its acks would
        let faust commit past the failed one on the partitions they share."""
        self.failed = str(exc)
        self.on_state_error(self.failed)

    async def halt(self) -> None:
        """After a failed table write: hold the agent (and its lock) until the stop."""
        await asyncio.get_running_loop().create_future()

    def flush_due(self) -> bool:
        if not self.staged:
            return False
        return (
            time.monotonic() - self.last_flush >= self.flush_seconds
            or len(self.driver.store.pending_runs) >= self.flush_max_runs
        )

    async def flush_if_due(self) -> None:
        """From a timer: a quiet stream still gets its staged state written and its records
        acknowledged within about one flush interval."""
        if self.publisher.stopping():
            return  # (see `run`: a stop drops what is staged)
        if self.stream is not None and not self.lock.locked() and self.flush_due():
            async with self.lock:
                try:
                    await self.ack(self.flush())
                except StateWriteError as exc:
                    self.state_write_failed(exc)  # the agent halts at its next batch

    async def ack(self, events: list[Any]) -> None:
        for event in events:
            await self.stream.ack(event)

    def flush(self) -> list[Any]:
        """Write the staged state to the tables; returns the events now to acknowledge
        (none when a rebalance since they were staged has dropped them)."""
        events, refetched, routing = self.staged, self.staged_refetched, self.staged_events
        self.staged, self.staged_refetched, self.staged_events = [], [], {}
        self.last_flush = time.monotonic()
        if self.staged_generation != self.publisher.generation:
            self.driver.discard_writes()
            return []
        if self.failed is not None:
            return []
        tables = self.tables
        by_name = {"runs": tables.runs, "finished": tables.finished}
        try:
            for table, partition, key, value in self.driver.take_writes():
                with tables.in_event(routing[partition]):
                    if value is None:
                        by_name[table].pop(key, None)
                    else:
                        by_name[table][key] = value
        except Exception as exc:  # rocksdb: "IO error: No space left on device: ..."
            self.driver.discard_writes()
            raise StateWriteError(f"{type(exc).__name__}: {exc}"[:300]) from exc
        self.skips.ack_refetched(refetched)
        return events

    async def batch(self, events: list[Any]) -> None:
        """Detection and outputs of `events`; their state changes are staged for `flush`.
        Raises Abandoned when a rebalance overtakes it (nothing staged then)."""
        generation = self.publisher.generation
        if self.staged and self.staged_generation != generation:
            self.flush()  # staged before a rebalance: dropped (nothing to acknowledge)
        groups: Groups = {}
        ticks: dict[int, tuple[Any, int | None]] = {}
        dead: list[Sent] = []  # dead letters: delivered before the batch acks
        refetched: list[Any] = []  # acknowledged with the batch, once it is done
        for event in events:
            message = event.message
            records = [message]
            skipped = self.skips.skipped_before(message)
            if skipped is not None:
                # Records the stream skipped go first, attributed to this event: same
                # partition, so the table writes land where they belong. A failed read
                # raises: the batch, and the record that revealed the gap, stay unacked.
                read_back = await self.skips.refetch(*skipped, message)
                refetched += read_back
                records[:0] = [e.message for e in read_back]
            for record in records:
                try:
                    await self._collect(record, event, record is message, groups, ticks, dead)
                except Exception as exc:
                    log.exception(
                        "detect: unreadable message %s/%s@%s",
                        record.topic,
                        record.partition,
                        record.offset,
                    )
                    dead.append(
                        await self.dead_letters.send(record, "internal_error", type(exc).__name__)
                    )
        partition_event: dict[int, Any] = {}
        outputs = await self._detect(groups, ticks, partition_event, dead)
        # outputs, acknowledged by the broker before the state that fired them
        try:
            await self._publish(outputs, partition_event)
            await self.publisher.deliver("detect", dead)
            if self.publisher.generation != generation:
                raise Abandoned  # delivered, but the partitions were revoked meanwhile
        except BaseException:
            self.driver.discard_writes()
            self.staged, self.staged_refetched, self.staged_events = [], [], {}
            raise
        self.staged += events
        self.staged_refetched += refetched
        self.staged_events.update(partition_event)
        self.staged_generation = generation
        if groups:
            self.metrics.last_processed_timestamp.set(time.time())
        self.metrics.active_runs.set(len(self.driver.index))

    async def _collect(
        self,
        record: Any,
        event: Any,
        streamed: bool,
        groups: Groups,
        ticks: dict[int, tuple[Any, int | None]],
        dead: list[Sent],
    ) -> None:
        """Add one record's steps to `groups` (keyed input: decoded here; steps topic: as
        ingest grouped them) or its tick to `ticks`. `streamed` is False for a record read
        back after a skip: a missed tick is not replayed, the next one does its work."""
        if record.topic == self.keyed_input_topic:
            decoded = await self.reader.decode(record, dead)
            if decoded is None:
                return
            by_run, n_spans, _ = decoded
            self.reader.count(record.topic, n_spans)
            for run_id, steps in by_run.items():
                groups.setdefault((record.partition, run_id), []).append((event, steps, None))
            return
        # Counted like input records: the stall alert pairs each topic's lag with its
        # consumed records, and lag is exported for the steps topic too.
        self.metrics.record_consumed(record.topic)
        value = record.value
        if value is not None and bytes(value[:1]) == TICK_VALUE_PREFIX:
            if streamed:
                ticks[record.partition] = (event, tick_clock(value))
            return
        clock = sent_clock(record)
        if record.key is None:  # partition-grouped: several runs
            for run_id, steps in decode_run_groups(value):
                groups.setdefault((record.partition, run_id), []).append((event, steps, clock))
            return
        groups.setdefault((record.partition, key_text(record.key)), []).append(
            (event, decode_steps(value), clock)
        )

    async def _detect(
        self,
        groups: Groups,
        ticks: dict[int, tuple[Any, int | None]],
        partition_event: dict[int, Any],
        dead: list[Sent],
    ) -> list[tuple[int, Outputs]]:
        """Detection (pure; the table writes stay pending in the driver)."""
        runs, finished = self.tables.runs, self.tables.finished
        outputs: list[tuple[int, Outputs]] = []
        for (partition, run_id), items in groups.items():
            try:
                out = self.driver.process_run(
                    runs,
                    finished,
                    partition,
                    run_id,
                    [(steps, clock) for _, steps, clock in items],
                    time.time_ns(),
                )
            except Exception as exc:
                log.exception("detect: run %s failed; its message(s) are dead-lettered", run_id)
                for ev, _, _ in items:
                    dead.append(
                        await self.dead_letters.send(
                            ev.message, "internal_error", type(exc).__name__
                        )
                    )
                continue
            outputs.append((partition, out))
            partition_event[partition] = items[-1][0]
            self.counters["run_parts"] += len(items)
            now = time.time()
            for ev, _, _ in items:
                ts = ev.message.timestamp
                if ts:
                    self.metrics.processing_latency.observe(max(0.0, now - ts))
        for partition, (event, sent_at) in ticks.items():
            self.on_tick(partition)
            # The clock as the tick was sent, not as it is now: a step delivered after the
            # send (and committed, advancing the clock) may still be queued behind the tick.
            now_ns = self.clock.now_ns() if sent_at is None else sent_at
            try:
                out = self.driver.tick(runs, finished, partition, now_ns)
            except Exception:
                log.exception("detect: tick of partition %s failed", partition)
                continue
            outputs.append((partition, out))
            partition_event[partition] = event
        return outputs

    async def _publish(self, outputs: list[tuple[int, Outputs]], events_of: dict[int, Any]) -> None:
        """Send the events and summaries, wait for the broker's acks (sending again what
        failed), then count them."""
        m = self.metrics
        send = self.publisher.send
        sent = []
        for _, out in outputs:
            for ev in out.events:
                key = ev["run_id"].encode("utf-8")
                sent.append(await send(Outgoing(self.events_topic, key, to_json(ev))))
            for summary in out.summaries:
                key = summary["run_id"].encode("utf-8")
                sent.append(await send(Outgoing(self.runs_topic, key, to_json(summary))))
        await self.publisher.deliver("detect", sent)
        loops: dict[tuple[int, str], int] = {}
        runs: dict[tuple[int, str], int] = {}

        def count_loop(partition: int, ev: dict[str, Any], prompt_version: Any) -> None:
            m.observe_event({**ev, "prompt_version": prompt_version})
            labels = (ev["shape"], prompt_version, ev["tool_version"])
            group = (partition, aggregate_key(labels, partition))
            loops[group] = loops.get(group, 0) + 1

        for partition, out in outputs:
            for ev in out.events:
                self.counters["events"] += 1
                if not ev.get("labels_pending"):  # else with its run's summary, below
                    count_loop(partition, ev, ev["prompt_version"])
            for summary in out.summaries:
                # loops that fired before the run's labels were known: the final slice
                for deferred in summary.get("deferred_events", ()):
                    count_loop(partition, deferred, summary["prompt_version"])
                m.observe_run(summary)
                labels = (
                    summary["prompt_version"],
                    summary["outcome"],
                    summary["termination_reason"],
                )
                group = (partition, aggregate_key(labels, partition))
                runs[group] = runs.get(group, 0) + 1
                self.counters["runs_finished"] += 1
            if out.duplicate_spans:
                m.duplicate_spans.inc(out.duplicate_spans)
            if out.late_spans:
                m.late_spans.inc(out.late_spans)
            if out.spans_after_finalize:
                m.spans_after_finalize.inc(out.spans_after_finalize)
            for _ in range(out.evicted):
                m.run_evicted("capacity")
        # windowed counters: one write per label group and partition, not per event / run
        tables = self.tables
        try:
            for (partition, label_key), n in loops.items():
                with tables.in_event(events_of[partition]):
                    tables.loop_counts[label_key] += n
            for (partition, label_key), n in runs.items():
                with tables.in_event(events_of[partition]):
                    tables.run_counts[label_key] += n
        except Exception as exc:
            raise StateWriteError(f"{type(exc).__name__}: {exc}"[:300]) from exc
