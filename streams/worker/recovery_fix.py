"""A fix for a faust-streaming (0.15.3) race that loses input records after a restart or a
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

Seen with tracing (`LOOPWATCH_DEBUG_FLOW`, streams/worker/flowtrace.py): records
fetched during the seek, then "flow_control.resume clears a queue: 3 items
[otlp/3@6, otlp/3@7, otlp/3@8]", then read offset 5 and position 9 for that partition
until the end. A later record on the partition reveals the gap (faust then even
commits over it; streams/worker/skips.py reads such gaps back), but with no later
record the partition stalls with its lag: the restart stall of issue 16.

The fix: stop the consumer's flow and suspend flow control *before* faust resumes the
stream partitions and seeks, so nothing is fetched into a queue that is about to be
cleared; faust's own ``on_recovery_completed`` then seeks, clears and resumes both.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("loopwatch.worker")

_MARK = "_loopwatch_flow_stopped_before_seek"


def install() -> bool:
    """Wrap faust's ``Recovery.on_recovery_completed`` (once). False, with a warning,
    when faust no longer has what the fix relies on."""
    try:
        from faust.tables.recovery import Recovery
    except ImportError:  # pragma: no cover - faust is a dependency
        return False
    original = getattr(Recovery, "on_recovery_completed", None)
    if original is None:
        log.warning(
            "faust's Recovery has no on_recovery_completed (a faust upgrade?): the fix for "
            "records lost at the end of recovery is not installed"
        )
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


def stop_flow_before_seek(app: Any) -> None:
    """Nothing reaches the stream queues until faust resumes the flow after its seek."""
    app.consumer.stop_flow()
    app.flow_control.suspend()
