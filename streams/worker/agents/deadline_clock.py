"""The deadline clock: the wall clock, held back to the input clock (streams/worker/kafka/input_clock.py)
for unkeyed input, so that a run is not finalized while spans that may belong to it wait in
another input partition's backlog (docs/OPERATIONS.md "Input partitioning")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from detectors.model import NS
from streams.worker.agents.messages import CLOCK_HEADER
from streams.worker.kafka.input_clock import InputClock

log = logging.getLogger(__name__)

# The input clock holds deadlines only while its probe answers: after this long without an
# answer (broker unreachable, offsets unavailable) deadlines follow the wall clock again.
INPUT_PROBE_STALE_NS = 30 * NS


class DeadlineClock:
    """`now_ns()` for run deadlines. `input`: the input clock (None: keyed input, or
    LOOPWATCH_INPUT_CLOCK=false); `probe`: makes the reader of the group's offsets (only
    called when the clock advances)."""

    def __init__(
        self,
        input_clock: InputClock | None,
        max_lag_seconds: float,
        probe: Callable[[], Any],
    ) -> None:
        self.input = input_clock
        self.max_lag_seconds = max_lag_seconds
        self._make_probe = probe
        self._probe: Any = None
        # the probe's last answer, or when it was first asked: faust starts its timers only
        # once table recovery is done, and a recovery longer than the staleness must not put
        # the backlog that follows on the wall clock (None: not asked yet, the clock holds)
        self.probe_ok_ns: int | None = None
        self._max_lag_warned_ns = 0
        self.on_advance: Callable[[], None] | None = None  # the timers' tick sender

    def now_ns(self) -> int:
        """Now, for run deadlines: the wall clock, held back to the input clock while the
        probe answers and by at most `max_lag_seconds` (a broker that cannot say, or a
        partition whose commits stopped, must not freeze every run forever)."""
        now = time.time_ns()
        if self.input is None:
            return now
        if self.probe_ok_ns is not None and now - self.probe_ok_ns > INPUT_PROBE_STALE_NS:
            return now
        floor = now - int(self.max_lag_seconds * NS)
        if self.input.now_ns < floor:
            if now - self._max_lag_warned_ns > 60 * NS:
                self._max_lag_warned_ns = now
                log.warning(
                    "input clock %.0f s behind (max %.0f s): deadlines follow wall clock minus "
                    "the maximum; a backlog older than that may be finalized early",
                    (now - self.input.now_ns) / NS,
                    self.max_lag_seconds,
                )
            return floor
        return min(now, self.input.now_ns)

    def delivered(self, partition: int, first: int, end: int) -> None:
        """Ingest delivered the steps of input records `first` .. `end` - 1 of `partition`
        (streams/worker/kafka/input_clock.py): when that advances the input clock, ticks go
        out at once (`on_advance`) rather than at the next timer."""
        if self.input is not None:
            self._advanced(self.input.delivered(partition, first, end))

    def marked(self, delivered: Mapping[int, int]) -> None:
        """Another worker's mark (detect read it on the steps topic): its delivered input
        offsets. Ticks go out at once when that advances the input clock."""
        if self.input is not None:
            self._advanced(self.input.marked(delivered))

    def _advanced(self, advanced: bool) -> None:
        if advanced and self.on_advance is not None:
            self.on_advance()

    def headers(self) -> dict[str, bytes] | None:
        """The input clock a steps message is sent at (RunDriver.process_run): every input
        record committed by then has its steps ahead of this message on the steps topic."""
        if self.input is None:
            return None
        return {CLOCK_HEADER: str(self.now_ns()).encode()}

    async def advance(self) -> None:
        """Read the group's progress (in an executor) and advance the input clock."""
        if self.input is None:
            return
        at = time.time_ns()
        if self._probe is None:
            self._probe = self._make_probe()
        if self.probe_ok_ns is None:
            self.probe_ok_ns = at  # the staleness counts from the first question
        offsets = await asyncio.get_running_loop().run_in_executor(None, self._probe.read)
        if offsets is not None:
            before = self.input.now_ns
            clock = self.input.observe(at, *offsets)
            self.probe_ok_ns = time.time_ns()
            self._advanced(clock > before)

    def lag_seconds(self) -> float | None:
        """How far the input clock trails the wall clock (the gauge and /healthz); None
        without an input clock."""
        if self.input is None:
            return None
        return max(0, time.time_ns() - self.input.now_ns) / NS
