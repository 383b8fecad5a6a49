"""Failpoints for worker subprocesses of the integration tests: imported at interpreter
start when a test puts this directory first on the worker's PYTHONPATH (test_faults.py),
enabled one by one with ``LOOPWATCH_FAILPOINT_<NAME>``; ``LOOPWATCH_TRACE_FLOW=1`` adds
flowtrace.py's tracing. Never on a production path: only tests put this directory there.

``LOOPWATCH_FAILPOINT_SEEK_RACE=1``: at the end of table recovery, after aiokafka's seek
to the committed offsets and before faust records them, wait (up to 5 s) until the
fetcher has put a few stream records in a queue, when the flow lets it. This turns the race
of streams/worker/faust_internals.py, which a loaded machine hits now and then, into one
that happens on every restart with a backlog whenever the flow is open during the seek.
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


if os.environ.get("LOOPWATCH_FAILPOINT_SEEK_RACE"):
    _seek_race()
if os.environ.get("LOOPWATCH_TRACE_FLOW"):
    import flowtrace  # this directory is on the path

    flowtrace.install()
