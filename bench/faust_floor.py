"""What faust itself costs the worker: an agent on the worker's input topic, with the
worker's consumer settings and batching (``take_events``, acknowledgements, commits), that
does nothing with the records but count them. Its rate bounds any worker built on faust's
stream from above, as the bare confluent-kafka consume + decode bounds a consumer in
general; the bench reports it beside the trace-keyed worker.

Run as ``python -m bench.faust_floor TOPIC RECORDS`` with the worker's LOOPWATCH_*
environment; prints one JSON line ``{"records", "seconds"}`` (from the first record taken
to the last) and keeps running until killed.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from typing import Any, cast


def main(argv: list[str]) -> int:
    import faust

    from streams.runtime import tune_gc
    from streams.worker import faust_internals
    from streams.worker.faust_app import consumer_conf, fetch_wait
    from streams.worker.settings import WorkerSettings

    topic_name, want = argv[0], int(argv[1])
    s = WorkerSettings.from_env()
    faust_internals.install_fetch_wait(*fetch_wait(s))  # as the worker fetches
    app: Any = cast(Any, faust.App)(
        f"{s.app_id}-floor",
        store="memory://",
        datadir=tempfile.mkdtemp(prefix="loopwatch-floor-"),
        web_enabled=False,
        logging_config=None,
        **consumer_conf(s),  # as the worker reads and commits
    )
    topic = app.topic(topic_name, key_serializer="raw", value_serializer="raw")
    seen = {"records": 0, "started": 0.0, "reported": False}

    async def floor(stream: Any) -> None:
        async for events in stream.take_events(s.batch_max, within=s.batch_within_ms / 1000):
            if not seen["records"]:
                seen["started"] = time.perf_counter()
            seen["records"] += len(events)
            if seen["records"] >= want and not seen["reported"]:
                seconds = time.perf_counter() - seen["started"]
                print(json.dumps({"records": seen["records"], "seconds": seconds}), flush=True)
                seen["reported"] = True

    app.agent(topic, name="floor")(floor)
    worker = faust.Worker(app, loglevel="warning", quiet=True, override_logging=False)
    tune_gc()  # as the worker runs
    worker.execute_from_commandline()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
