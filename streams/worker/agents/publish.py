"""The detect agent's outputs out: ``loop_detected`` events and run summaries, keyed by run
id, sent and acknowledged by the broker (failed sends sent again) before the state that
fired them is written (streams/worker/agents/checkpoint.py)."""

from __future__ import annotations

from typing import Any

from streams.worker.agents.driver import Outputs
from streams.worker.agents.messages import to_json
from streams.worker.kafka.delivery import Outgoing, Publisher


async def publish(
    publisher: Publisher, events_topic: Any, runs_topic: Any, outputs: list[tuple[int, Outputs]]
) -> None:
    send = publisher.send
    sent = []
    for _, out in outputs:
        for ev in out.events:
            key = ev["run_id"].encode("utf-8")
            sent.append(await send(Outgoing(events_topic, key, to_json(ev))))
        for summary in out.summaries:
            key = summary["run_id"].encode("utf-8")
            sent.append(await send(Outgoing(runs_topic, key, to_json(summary))))
    await publisher.deliver("detect", sent)
