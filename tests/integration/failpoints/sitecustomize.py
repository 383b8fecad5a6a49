"""Failpoints for worker subprocesses of the integration tests: imported at interpreter
start when a test puts this directory first on the worker's PYTHONPATH (test_faults.py),
enabled one by one with ``LOOPWATCH_FAILPOINT_<NAME>``; ``LOOPWATCH_TRACE_FLOW=1`` adds
flowtrace.py's tracing. Never on a production path: only tests put this directory there.

``LOOPWATCH_FAILPOINT_SEEK_RACE=1``: at the end of table recovery, after aiokafka's seek
to the committed offsets and before faust records them, wait (up to 5 s) until the
fetcher has put a few stream records in a queue, when the flow lets it. This turns the race
of streams/worker/faust_internals.py, which a loaded machine hits now and then, into one
that happens on every restart with a backlog whenever the flow is open during the seek.

``LOOPWATCH_FAILPOINT_KILL_AT=counts:N`` (or ``states:N``): SIGKILL the worker in its Nth
checkpoint flush that writes counts (streams/worker/agents/checkpoint.py), once the counts
(or the counts and the run states) are in the changelog and before the batches' records
are acknowledged: the crash between counting and the offset commit, on every start.

``LOOPWATCH_FAILPOINT_HOLD_ACROSS_REBALANCE=N``: the detect agent's Nth batch waits (up
to 120 s), its records taken from the stream, until a rebalance has assigned the
partitions again, then goes on, is flushed at once, and faust commits right after that
flush (its commit timer fires every 0.25 s; here before the end-of-recovery seek). What
two workers hit now and then when the second joins during a backlog: records read before
the rebalance, handed to the agent after it began (test_rebalance.py).
"""

from __future__ import annotations

import os
import sys


def _seek_race() -> None:
    import asyncio

    from faust.transport.drivers import aiokafka as driver

    original = driver.Consumer.seek_to_committed

    async def seek_to_committed(self):  # type: ignore[no-untyped-def]
        offsets = await original(self)
        app = self.app
        open_flow = self.flow_active and app.flow_control.is_active()
        queues = list(getattr(app.flow_control, "_queues", ()))
        if open_flow:
            # until a few records wait in a queue (the agent takes them one by one), or 5 s
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5.0
            while loop.time() < deadline and sum(q.qsize() for q in queues) < 4:
                await asyncio.sleep(0.001)
        held = sum(q.qsize() for q in queues)
        print(
            f"failpoint seek_race: flow {'open' if open_flow else 'stopped'} during the seek, "
            f"{held} records queued",
            file=sys.stderr,
            flush=True,
        )
        return offsets

    driver.Consumer.seek_to_committed = seek_to_committed


def _kill_at(where: str, nth: int) -> None:
    import signal

    from streams.worker.agents.checkpoint import Checkpoint
    from streams.worker.state.store import Writes

    flushes = 0

    def kill(what: str) -> None:
        print(f"failpoint kill_at: SIGKILL after the {what} of flush {flushes}", file=sys.stderr)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    original_rows = Writes.by_partition

    def rows(self):  # type: ignore[no-untyped-def]
        nonlocal flushes
        if self.counts:  # called by the flush once its counts are written and flushed
            flushes += 1
            if where == "counts" and flushes == nth:
                kill("counts")
        return original_rows(self)

    original_flush = Checkpoint.flush

    async def flush(self):  # type: ignore[no-untyped-def]
        before = flushes
        events = await original_flush(self)
        if where == "states" and flushes == nth and before < nth:
            await self.flush_producer()
            kill("counts and states")
        return events

    Writes.by_partition = rows
    Checkpoint.flush = flush


def _hold_across_rebalance(nth: int) -> None:
    import asyncio
    import time

    from streams.worker.agents.detect import Detect

    original_batch, original_flush = Detect.batch, Detect.timed_flush
    batches = 0
    handed_over = False

    async def batch(self, events):  # type: ignore[no-untyped-def]
        nonlocal batches, handed_over
        batches += 1
        if batches == nth:
            app = self.stream.app
            generation = app.consumer_generation_id
            print(f"failpoint hold_across_rebalance: batch {nth} held", file=sys.stderr)
            sys.stderr.flush()
            deadline = time.monotonic() + 120
            while app.consumer_generation_id == generation and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            print("failpoint hold_across_rebalance: handed over", file=sys.stderr)
            sys.stderr.flush()
            self.checkpoint.last_flush = float("-inf")  # flushed at once
            handed_over = True
        return await original_batch(self, events)

    async def timed_flush(self):  # type: ignore[no-untyped-def]
        nonlocal handed_over
        await original_flush(self)
        if handed_over:  # faust's commit timer (every 0.25 s) fires before the seek
            handed_over = False
            await self.stream.app.consumer.commit()

    Detect.batch = batch
    Detect.timed_flush = timed_flush


if os.environ.get("LOOPWATCH_FAILPOINT_HOLD_ACROSS_REBALANCE"):
    _hold_across_rebalance(int(os.environ["LOOPWATCH_FAILPOINT_HOLD_ACROSS_REBALANCE"]))
if os.environ.get("LOOPWATCH_FAILPOINT_KILL_AT"):
    _where, _, _nth = os.environ["LOOPWATCH_FAILPOINT_KILL_AT"].partition(":")
    _kill_at(_where, int(_nth))
if os.environ.get("LOOPWATCH_FAILPOINT_SEEK_RACE"):
    _seek_race()
if os.environ.get("LOOPWATCH_TRACE_FLOW"):
    import flowtrace  # this directory is on the path

    flowtrace.install()
