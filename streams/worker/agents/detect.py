"""The detect agent: per run, in the faust table ``runs``, the pure pipeline over its steps
(`RunDriver`); then, in this order, its outputs out (publish.py) and counted (counting.py:
metrics now, tables staged), its counts and state written and its records acknowledged
(checkpoint.py). A crash between them redoes
records whose outputs may already be out (at least once), and the fired markers in a
written state stop any re-emission after it.

It takes messages in batches (``stream.take_events``) and applies each run's steps of a
batch in arrival order. A rebalance (Publisher.generation) or a stop drops what is staged,
unacknowledged: the records are processed again from their committed offsets by the
partition's next owner, and an acknowledgement from before the rebalance never reaches
faust (it would commit the new assignment past records whose state was dropped).

A tick (streams/worker/agents/timers.py) releases, finalizes and evicts the due runs of its
partition, judged by the clock it was sent with. With keyed input detect reads the input
topic itself (no hop): records are decoded here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from detectors.model import Step
from streams.worker.agents.arrivals import Arrival
from streams.worker.agents.checkpoint import Checkpoint, StateWriteError
from streams.worker.agents.counting import Counting
from streams.worker.agents.driver import Outputs
from streams.worker.agents.messages import (
    MARK_VALUE_PREFIX,
    TICK_VALUE_PREFIX,
    PackedSteps,
    decode_run_groups,
    decode_steps,
    key_text,
    mark_offsets,
    packed_run_steps,
    sent_clock,
    tick_clock,
)
from streams.worker.agents.parts import Parts
from streams.worker.agents.publish import publish
from streams.worker.kafka.delivery import Abandoned, Sent

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

Groups = dict[tuple[int, str], list[tuple[Any, list[Step], int | None]]]
Held = list[tuple[int, str, Any, PackedSteps, int]]  # (partition, run id, event, steps, clock)


class Detect:
    def __init__(
        self,
        parts: Parts,
        checkpoint: Checkpoint,
        counting: Counting,
        *,
        keyed_input_topic: str | None,
        on_tick: Callable[[int], None],
        on_state_error: Callable[[str], None] = lambda error: None,
    ) -> None:
        self.driver = parts.driver
        self.tables = parts.tables
        self.reader = parts.reader
        self.skips = parts.skips
        self.publisher = parts.publisher
        self.dead_letters = parts.dead_letters
        self.clock = parts.clock
        self.checkpoint = checkpoint
        self.counting = counting
        self.events_topic = parts.topics["events"]
        self.runs_topic = parts.topics["runs"]
        self.metrics = parts.metrics
        self.counters = parts.counters
        self.keyed_input_topic = keyed_input_topic  # keyed input: decoded here
        self.on_tick = on_tick  # a tick of this partition is handled: another may be sent
        self.on_state_error = on_state_error  # the worker stops (exit status 3)
        self.lock = asyncio.Lock()  # a batch and a flush never interleave
        self.stream: Any = None
        # events with arrivals held for the input clock (streams/worker/agents/arrivals.py):
        # id -> [event, arrivals not yet applied]. Acknowledged once all are, by the flush
        # after the batch that applied the last one, and never before an event read ahead
        # of it on its partition: faust commits past one unacknowledged record followed by
        # acknowledged ones (`Consumer._new_offset` allows a gap of one at the head), so
        # events wait in read order (`unstaged`) behind one that is held
        self.holding: dict[int, list[Any]] = {}
        self.unstaged: dict[Any, deque[Any]] = {}  # message.tp -> events, in read order
        self.held_generation = -1

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
                if self.checkpoint.failed is not None:
                    await self.halt()
                try:
                    started = time.monotonic()
                    await self.batch(events)
                    self.stage_seconds("batch", time.monotonic() - started)
                    self.counters["detect_batches"] += 1
                    if self.checkpoint.due():
                        await self.timed_flush()
                except Abandoned:
                    log.info("detect: a batch waiting for delivery was abandoned (rebalance)")
                    continue  # unacked: processed again from the committed offsets
                except StateWriteError as exc:
                    self.state_write_failed(exc)
                    await self.halt()

    def state_write_failed(self, exc: StateWriteError) -> None:
        """Nothing staged is acknowledged, and no later batch is processed: its acks would
        let faust commit past the failed one on the partitions they share."""
        self.checkpoint.failed = str(exc)
        self.on_state_error(str(exc))

    async def halt(self) -> None:
        """After a failed table write: hold the agent (and its lock) until the stop."""
        await asyncio.get_running_loop().create_future()

    async def flush_if_due(self) -> None:
        """From a timer: a quiet stream still gets its staged state written and its records
        acknowledged within about one flush interval."""
        if self.publisher.stopping():
            return  # (see `run`: a stop drops what is staged)
        if self.stream is not None and not self.lock.locked() and self.checkpoint.due():
            async with self.lock:
                try:
                    await self.timed_flush()
                except StateWriteError as exc:
                    self.state_write_failed(exc)  # the agent halts at its next batch

    async def timed_flush(self) -> None:
        """The checkpoint's flush and the acks it allows (the caller holds the lock)."""
        started = time.monotonic()
        await self.ack(await self.checkpoint.flush())
        self.stage_seconds("flush", time.monotonic() - started)

    async def ack(self, events: list[Any]) -> None:
        for event in events:
            await self.stream.ack(event)

    async def batch(self, events: list[Any]) -> None:
        """Detection and outputs of `events`; their state changes are staged for `flush`.
        Raises Abandoned when a rebalance overtakes it (nothing staged then)."""
        generation = self.publisher.generation
        checkpoint = self.checkpoint
        checkpoint.drop_if_stale()  # staged before a rebalance: nothing to acknowledge
        if self.held_generation != generation:  # held before it: never acknowledged
            self.driver.arrivals.clear()
            self.holding.clear()
            self.unstaged.clear()
            self.held_generation = generation
        events = self.read_in_assignment(events)
        groups: Groups = {}
        ticks: dict[int, tuple[Any, int | None]] = {}
        held: Held = []
        dead: list[Sent] = []  # dead letters: delivered before the batch acks
        refetched: list[Any] = []  # acknowledged with the batch, once it is done
        for event in events:
            message = event.message
            # Records the stream skipped go first, attributed to this event: same partition,
            # so the table writes land where they belong. A failed read raises: the batch,
            # and the record that revealed the gap, stay unacked.
            read_back = await self.skips.read_back(message)
            refetched += read_back
            for record in [*(e.message for e in read_back), message]:
                try:
                    streamed = record is message
                    await self._collect(record, event, streamed, groups, ticks, held, dead)
                except Exception as exc:
                    dead.append(await self.dead_letters.internal_error(record, exc, "detect"))
        partition_event: dict[int, Any] = {}
        outputs, applied = await self._detect(groups, held, ticks, partition_event, dead)
        # outputs, acknowledged by the broker before the state that fired them
        try:
            await publish(self.publisher, self.events_topic, self.runs_topic, outputs)
            self.counting.stage(outputs, self.driver.store.writes)
            await self.publisher.deliver("detect", dead)
            if self.publisher.generation != generation:
                raise Abandoned  # delivered, but the partitions were revoked meanwhile
        except BaseException:
            checkpoint.drop()
            raise
        checkpoint.stage(self.in_order(events), refetched, partition_event, generation)
        if groups or applied:
            self.metrics.last_processed_timestamp.set(time.time())
        self.metrics.active_runs.set(len(self.driver.index))

    def in_order(self, events: list[Any]) -> list[Any]:
        """The events to acknowledge with this batch: of every partition, in read order,
        those up to the first one whose arrivals are still held (this batch's `events`
        join the events waiting behind earlier ones)."""
        unstaged, holding = self.unstaged, self.holding
        for event in events:
            unstaged.setdefault(event.message.tp, deque()).append(event)
        ready = []
        for tp in list(unstaged):
            waiting = unstaged[tp]
            while waiting and id(waiting[0]) not in holding:
                ready.append(waiting.popleft())
            if not waiting:
                del unstaged[tp]
        return ready

    def read_in_assignment(self, events: list[Any]) -> list[Any]:
        """`events` without those read before a rebalance began (taken into a batch before
        it, handed over after it): never processed, never acknowledged, they are redone
        from the committed offset. Processed and acknowledged after a staged batch before
        them was dropped, they let faust commit past that batch: its runs were lost."""
        current = [event for event in events if self.publisher.may_acknowledge(event.message)]
        if len(current) < len(events):
            self.counters["records_read_before_rebalance"] += len(events) - len(current)
        return current

    def stage_seconds(self, stage: str, seconds: float) -> None:
        self.metrics.stage_seconds.labels(stage).observe(max(0.0, seconds))

    async def _collect(
        self,
        record: Any,
        event: Any,
        streamed: bool,
        groups: Groups,
        ticks: dict[int, tuple[Any, int | None]],
        held: Held,
        dead: list[Sent],
    ) -> None:
        """Add one record's steps to `groups` (keyed input: decoded here; steps topic: as
        ingest grouped them), to `held` (sent at an input clock: applied once the clock
        passes their arrival) or its tick to `ticks`. `streamed` is False for a record read
        back after a skip: a missed tick is not replayed, the next one does its work, and
        its steps are applied at once."""
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
            if bytes(value[: len(MARK_VALUE_PREFIX)]) == MARK_VALUE_PREFIX:
                self.clock.marked(mark_offsets(value))  # read back or not: still true
                self.counters["marks_read"] += 1
                return
            if streamed:
                ticks[record.partition] = (event, tick_clock(value))
            return
        clock = sent_clock(record)
        p = record.partition
        if clock is not None and streamed and self.driver.arrivals.hold_ns > 0:
            held += [
                (p, run_id, event, steps, clock)
                for run_id, steps in packed_run_steps(record.key, value)
            ]
            return
        if record.key is None:  # partition-grouped: several runs
            parts = decode_run_groups(value)
        else:
            parts = [(key_text(record.key), decode_steps(value))]
        for run_id, steps in parts:
            groups.setdefault((p, run_id), []).append((event, steps, clock))

    async def _settle(
        self,
        partition: int,
        run_id: str,
        events: list[Any],
        result: Outputs | Exception,
        outputs: list[tuple[int, Outputs]],
        dead: list[Sent],
    ) -> None:
        """One run's steps applied from the records of `events`: its outputs, or the
        exception its processing raised (nothing of it stored) and its records
        dead-lettered."""
        if isinstance(result, Exception):
            what = f"detect (run {run_id})"
            for ev in events:
                dead.append(await self.dead_letters.internal_error(ev.message, result, what))
            return
        outputs.append((partition, result))
        self.counters["run_parts"] += len(events)

    async def _hold_and_apply(
        self,
        held: Held,
        tick_clocks: dict[int, int],
        outputs: list[tuple[int, Outputs]],
        partition_event: dict[int, Any],
        dead: list[Sent],
    ) -> bool:
        """Hold this batch's arrivals, then apply every held one the input clocks read in
        it (its messages' and its ticks', `tick_clocks`) have passed, or that were held too
        long, and those of the runs the ticks will release or finalize. An event whose held
        arrivals are all applied leaves `holding` (`in_order` then acknowledges it).
        Returns whether any arrival was applied."""
        arrivals, holding = self.driver.arrivals, self.holding
        now_ns = time.time_ns()
        now = now_ns / 1e9
        for partition, run_id, event, steps, clock in held:
            arrivals.saw(partition, clock)
            arrivals.hold(partition, Arrival(now_ns, run_id, steps, clock, event))
            entry = holding.setdefault(id(event), [event, 0])
            entry[1] += 1
            if ts := event.message.timestamp:  # read now (the wait for the clock is not in it)
                self.metrics.processing_latency.observe(max(0.0, now - ts))
        for partition, clock in tick_clocks.items():
            arrivals.saw(partition, clock)
        applied_any = False
        for partition in list(arrivals.queues):
            tick_ns = tick_clocks.get(partition)
            for applied, result in self.driver.apply_arrivals(partition, now_ns, tick_ns):
                tokens = [a.token for a in applied]
                await self._settle(partition, applied[0].run_id, tokens, result, outputs, dead)
                partition_event[partition] = tokens[-1]
                applied_any = True
                for a in applied:
                    entry = holding[id(a.token)]
                    entry[1] -= 1
                    if entry[1] == 0:
                        del holding[id(a.token)]
        return applied_any

    async def _detect(
        self,
        groups: Groups,
        held: Held,
        ticks: dict[int, tuple[Any, int | None]],
        partition_event: dict[int, Any],
        dead: list[Sent],
    ) -> tuple[list[tuple[int, Outputs]], bool]:
        """Detection (pure; the table writes stay pending in the driver): the steps applied
        at once, then the held arrivals the batch's clocks let go, then the ticks. Returns
        the outputs and whether any held arrival was applied."""
        outputs: list[tuple[int, Outputs]] = []
        for (partition, run_id), items in groups.items():
            result: Outputs | Exception
            try:
                batches = [(steps, clock) for _, steps, clock in items]
                result = self.driver.process_run(partition, run_id, batches, time.time_ns())
            except Exception as exc:
                result = exc
            events = [ev for ev, _, _ in items]
            await self._settle(partition, run_id, events, result, outputs, dead)
            partition_event[partition] = events[-1]
            if isinstance(result, Exception):
                continue
            now = time.time()
            for ev, _, _ in items:
                ts = ev.message.timestamp
                if ts:
                    self.metrics.processing_latency.observe(max(0.0, now - ts))
        # The clock as each tick was sent, not as it is now: a step delivered after the send
        # (and committed, advancing the clock) may still be queued behind the tick.
        tick_clocks = {
            partition: self.clock.now_ns() if sent_at is None else sent_at
            for partition, (_event, sent_at) in ticks.items()
        }
        applied = await self._hold_and_apply(held, tick_clocks, outputs, partition_event, dead)
        for partition, (event, _sent_at) in ticks.items():
            self.on_tick(partition)
            if event.message.timestamp:
                self.stage_seconds("tick", time.time() - event.message.timestamp)
            now_ns = tick_clocks[partition]
            try:
                out = self.driver.tick(partition, now_ns)
            except Exception:
                log.exception("detect: tick of partition %s failed", partition)
                continue
            for run_id, error in out.failures:  # the other runs' outputs go out
                log.error(
                    "detect: run %s of partition %s failed at its deadline: %s",
                    run_id,
                    partition,
                    type(error).__name__,
                    exc_info=error,
                )
            outputs.append((partition, out))
            partition_event[partition] = event
        now = time.time()  # arrivals the input clock vouched for, by messages or ticks
        for _partition, out in outputs:
            for arrival_ns in out.vouched_arrivals:
                self.stage_seconds("input_clock", now - arrival_ns / 1e9)
        return outputs, applied
