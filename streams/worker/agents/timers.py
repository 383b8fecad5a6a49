"""The worker's timers: ticks, consumer lag, the input clock and its marks.

Table writes need the partition of the run, i.e. a stream event. The tick timer
(``LOOPWATCH_TICK_SECONDS``) sends a tiny tick message to each steps-topic partition that
has due work; detect handles the tick after everything already queued on that partition (a
backlog is processed before its runs can time out), releasing, finalizing, evicting
(``LOOPWATCH_MAX_ACTIVE_RUNS``) and sweeping expired finished-run markers and retained runs
of that partition. The tick carries the deadline clock of its send time and detect judges
deadlines by that value: steps ingest delivered before the clock advanced are ahead of the
tick on the partition, steps delivered after it may be behind it. Ticks also go out at once
when the input clock advances and when a handled tick leaves work due (`wake`).

The input clock's timer (``LOOPWATCH_INPUT_CLOCK_PROBE_SECONDS``) reads the input's end
offsets, then sends this worker's delivered input offsets as marks to the steps partitions
other workers own (`send_marks`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streams.worker.agents.messages import encode_mark, encode_tick
from streams.worker.agents.parts import Parts
from streams.worker.faust_internals import read_offsets
from streams.worker.kafka.delivery import Outgoing, ignore_failure

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

TICK_RESEND_SECONDS = 10.0  # one tick in flight per partition, sent again if lost


class Timers:
    def __init__(
        self,
        parts: Parts,
        *,
        ready: Callable[[], bool],
        assigned: Callable[[], set[int]],
        lag_sources: set[str],
        steps_partitions: int = 0,
    ) -> None:
        self.driver = parts.driver
        self.clock = parts.clock
        self.publisher = parts.publisher
        self.steps_topic = parts.topics["steps"]
        self.metrics = parts.metrics
        self.counters = parts.counters
        self.ready = ready
        self.assigned = assigned
        self.lag_sources = lag_sources
        self.tick_sent: dict[int, float] = {}  # partition -> when its tick was sent
        self.steps_partitions = steps_partitions
        self.marked: dict[int, int] = {}  # the delivered offsets of the last marks sent
        self.max_lag = 0  # the largest consumer lag of the last update (/healthz)
        self._waking: asyncio.Future[None] | None = None
        self.clock.on_advance = self.wake

    def wake(self) -> None:
        """Send the ticks that are due now, not at the next timer: after an input clock
        advance (a release waited up to a tick period for it) and after a tick was
        handled. One sender at a time; runs once the caller's synchronous work is done."""
        if self._waking is None or self._waking.done():
            self._waking = asyncio.ensure_future(self.send_ticks())
            self._waking.add_done_callback(_log_failure)

    def tick_handled(self, partition: int) -> None:
        """Detect took the partition's tick: what it leaves due (a tick handles at most
        TICK_MAX_RUNS runs, or the clock moved on since its send) gets the next tick now."""
        self.tick_sent.pop(partition, None)
        self.wake()

    async def send_ticks(self) -> None:
        if not self.ready():
            return
        now = time.time()
        clock_ns = self.clock.now_ns()
        assigned = self.assigned()
        for partition in sorted(self.driver.due_partitions(clock_ns, time.time_ns())):
            if partition not in assigned:
                continue
            sent = self.tick_sent.get(partition)
            if sent is not None and now - sent < TICK_RESEND_SECONDS:
                continue
            self.tick_sent[partition] = now
            tick = Outgoing(
                self.steps_topic, None, encode_tick(time.time_ns(), clock_ns), partition
            )
            _, sent_tick = await self.publisher.send(tick)
            sent_tick.add_done_callback(ignore_failure)  # a lost tick is sent again
        self.metrics.active_runs.set(len(self.driver.index))

    async def advance_input_clock(self) -> None:
        if self.clock.input is None:
            return
        await self.clock.advance()
        self.metrics.input_clock_lag.set(self.clock.lag_seconds() or 0.0)
        await self.send_marks()

    async def send_marks(self) -> None:
        """Tell the steps partitions another worker owns how far this worker's ingest has
        delivered (a mark each, when that moved since the last marks): their input clocks
        take these partitions from the marks rather than the group's commits and the next
        probe, a second later. A worker that owns every steps partition sends none."""
        if self.clock.input is None or not self.ready():
            return
        delivered = self.clock.input.own_deliveries()
        if delivered == self.marked:
            return
        others = set(range(self.steps_partitions)) - self.assigned()
        if not others:
            return
        self.marked = delivered
        value = encode_mark(time.time_ns(), delivered)
        for partition in sorted(others):
            _, sent = await self.publisher.send(Outgoing(self.steps_topic, None, value, partition))
            sent.add_done_callback(ignore_failure)  # the next marks say as much and more
        self.counters["marks_sent"] += len(others)

    def update_lag(self, consumer: Any) -> None:
        """Consumer lag of the input and steps partitions (faust's consumer, if started)."""
        if consumer is None:
            return
        try:
            assignment = consumer.assignment()
        except Exception:
            return
        max_lag = 0
        for tp in assignment:
            if tp.topic not in self.lag_sources:
                continue
            try:
                highwater = consumer.highwater(tp)
                position = read_offsets(consumer).get(tp)
            except Exception:
                continue
            if highwater is None:
                continue
            done = (position + 1) if position is not None else 0
            lag = max(0, highwater - done)
            max_lag = max(max_lag, lag)
            self.metrics.set_consumer_lag(tp.topic, tp.partition, lag)
        self.max_lag = max_lag


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("ticks sent early not sent (the tick timer sends them): %s", exc)
