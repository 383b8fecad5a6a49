"""Tracing of faust's flow control for a worker under test (``LOOPWATCH_TRACE_FLOW=1``,
see sitecustomize.py): logs seeks, pauses, resumes, queue clears (with the records they
discard), the stream records fetched and each input record ingest takes. How the restart
stall was found (streams/worker/faust_internals.py)."""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("loopwatch.flowtrace")


def _tps(tps: Any) -> str:
    return ",".join(
        sorted(
            f"{t.topic.rsplit('-', 1)[-1]}/{t.partition}" for t in tps if "changelog" not in t.topic
        )
    )


def install() -> None:
    from faust.transport import consumer as fc
    from mode.utils import queues

    Consumer = fc.Consumer

    orig_clear = queues.FlowControlEvent.clear

    def clear(self: Any) -> None:
        for q in list(self._queues):
            items = list(getattr(q, "_queue", ()))
            if items:
                desc = []
                for ev in items:
                    m = getattr(ev, "message", None)
                    if m is not None:
                        desc.append(f"{m.topic.rsplit('-', 1)[-1]}/{m.partition}@{m.offset}")
                log.info("TRACE flow_control.resume clears a queue: %d items %s", len(items), desc)
        orig_clear(self)

    queues.FlowControlEvent.clear = clear  # type: ignore[method-assign]

    orig_seek = Consumer.perform_seek

    @functools.wraps(orig_seek)
    async def perform_seek(self: Any) -> None:
        log.info("TRACE perform_seek start read=%s", _read(self))
        await orig_seek(self)
        log.info("TRACE perform_seek end read=%s", _read(self))

    Consumer.perform_seek = perform_seek  # type: ignore[method-assign]

    for name in ("pause_partitions", "resume_partitions"):
        orig = getattr(Consumer, name)

        def wrap(orig: Any = orig, name: str = name) -> Any:
            @functools.wraps(orig)
            def f(self: Any, tps: Any) -> Any:
                tps = set(tps)
                if _tps(tps):
                    log.info("TRACE %s %s", name, _tps(tps))
                return orig(self, tps)

            return f

        setattr(Consumer, name, wrap())

    for name in ("stop_flow", "resume_flow"):
        orig = getattr(Consumer, name)

        def wrap0(orig: Any = orig, name: str = name) -> Any:
            @functools.wraps(orig)
            def f(self: Any) -> Any:
                log.info("TRACE %s", name)
                return orig(self)

            return f

        setattr(Consumer, name, wrap0())

    orig_getmany = Consumer._wait_next_records

    @functools.wraps(orig_getmany)
    async def _wait_next_records(self: Any, timeout: float) -> Any:
        records, active = await orig_getmany(self, timeout)
        if records:
            got = {
                f"{tp.topic.rsplit('-', 1)[-1]}/{tp.partition}": (rs[0].offset, rs[-1].offset)
                for tp, rs in records.items()
                if "changelog" not in tp.topic
            }
            if got:
                log.info(
                    "TRACE fetched %s active_now=%s flow=%s",
                    got,
                    _tps(active or ()),
                    self.flow_active,
                )
        return records, active

    Consumer._wait_next_records = _wait_next_records  # type: ignore[method-assign]

    from streams.worker.agents.ingest import Ingest

    orig_event = Ingest.event

    @functools.wraps(orig_event)
    async def event(self: Any, ev: Any) -> Any:
        m = ev.message
        log.info("TRACE ingest takes otlp/%s@%s", m.partition, m.offset)
        return await orig_event(self, ev)

    Ingest.event = event  # type: ignore[method-assign]


def _read(consumer: Any) -> dict[str, Any]:
    return {
        f"{tp.topic.rsplit('-', 1)[-1]}/{tp.partition}": v
        for tp, v in consumer._read_offset.items()
        if "changelog" not in tp.topic and "otlp" in tp.topic
    }
