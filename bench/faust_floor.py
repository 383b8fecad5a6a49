"""What faust itself costs the worker: an agent on the worker's input topic, with the
worker's consumer settings and batching (``take_events``, acknowledgements, commits), that
does nothing with the records but count them. Its rate bounds any worker built on faust's
stream from above, as the bare confluent-kafka consume + decode bounds a consumer in
general; the bench reports it beside the trace-keyed worker.

Run as ``python -m bench.faust_floor TOPIC RECORDS`` with the worker's LOOPWATCH_*
environment; prints one JSON line ``{"records", "seconds", "cpu_seconds"}`` (from the
first record taken to the last) and keeps running until killed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any, cast


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def main(argv: list[str]) -> int:
    import faust

    from streams.runtime import tune_gc
    from streams.settings import WorkerSettings

    topic_name, want = argv[0], int(argv[1])
    s = WorkerSettings.from_env()
    app: Any = cast(Any, faust.App)(
        f"{s.app_id}-floor",
        broker=s.broker_url,
        store="memory://",
        datadir=tempfile.mkdtemp(prefix="loopwatch-floor-"),
        processing_guarantee="at_least_once",
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        broker_commit_interval=1.0,
        broker_session_timeout=s.session_timeout_seconds,
        broker_heartbeat_interval=min(3.0, s.session_timeout_seconds / 3),
        consumer_max_fetch_size=s.fetch_partition_mb * 1024 * 1024,  # as the worker's
        stream_wait_empty=False,
        logging_config=None,
    )
    topic = app.topic(topic_name, key_serializer="raw", value_serializer="raw")
    seen = {"records": 0, "started": 0.0, "cpu": 0.0}

    async def floor(stream: Any) -> None:
        async for events in stream.take_events(s.batch_max, within=s.batch_within_ms / 1000):
            if not seen["records"]:
                seen["started"], seen["cpu"] = time.perf_counter(), _cpu_seconds()
            seen["records"] += len(events)
            if seen["records"] >= want and seen["started"]:
                out = {
                    "records": seen["records"],
                    "seconds": time.perf_counter() - seen["started"],
                    "cpu_seconds": _cpu_seconds() - seen["cpu"],
                }
                print(json.dumps(out), flush=True)
                seen["started"] = 0.0  # once

    app.agent(topic, name="floor")(floor)
    worker = faust.Worker(app, loglevel="warning", quiet=True, override_logging=False)
    tune_gc()  # as the worker runs
    worker.execute_from_commandline()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
