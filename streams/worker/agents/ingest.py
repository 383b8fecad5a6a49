"""The ingest agent (unkeyed input): decode each input record as one whole OTLP batch,
normalize every span and forward the steps grouped by run to the internal steps topic.

By default one message per destination partition per record (the runs inside, each on the
partition its run id hashes to, exactly as if keyed by it: per-message overhead, not table
writes, dominated the hop), or with ``LOOPWATCH_STEPS_GROUPING=run`` one message per run
per record keyed by run id. Manual acks: a record is acknowledged only once its step
messages are delivered, in offset order per partition."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from detectors.model import Step
from streams.worker.agents.messages import (
    MAX_STEPS_MESSAGE_BYTES,
    encode_first_steps,
    encode_run_groups,
    key_partition,
    split_to_fit,
)
from streams.worker.agents.parts import Parts
from streams.worker.kafka.delivery import Abandoned, Outgoing, Sent

log = logging.getLogger(__name__)


class Ingest:
    def __init__(self, parts: Parts, detect_partitions: int, steps_grouping: str) -> None:
        self.reader = parts.reader
        self.skips = parts.skips
        self.publisher = parts.publisher
        self.dead_letters = parts.dead_letters
        self.clock = parts.clock
        self.steps_topic = parts.topics["steps"]
        self.detect_partitions = detect_partitions
        self.steps_grouping = steps_grouping
        self.counters = parts.counters
        self.last_ack: dict[Any, asyncio.Future[None]] = {}  # per input partition

    async def run(self, stream: Any) -> None:
        """The agent. Manual acks: with automatic acks a record was acked when its sends
        were merely queued; on a graceful stop or a revocation faust flushes its producer
        buffer, lets the agents run on, then commits, so records were committed whose
        steps were never sent."""
        manual = stream.noack()
        async for event in manual.events():
            if not self.publisher.may_acknowledge(event.message):
                # read before a rebalance began: redone from the committed offset
                self.counters["records_read_before_rebalance"] += 1
                continue
            self.ack_when_delivered(manual, event, await self.event(event))

    async def event(self, event: Any) -> list[tuple[Any, list[Sent]]]:
        """Ingest one streamed input record, after any records the stream skipped before it
        (read back from the broker). Returns each record ingested, the read-back ones first
        and `event` last, with what it sent."""
        records = await self.skips.read_back(event.message)
        records.append(event)
        return [(record, await self.record(record)) for record in records]

    def ack_when_delivered(
        self, stream: Any, event: Any, records: list[tuple[Any, list[Sent]]]
    ) -> None:
        """Ack `event` (and the records read back before it) once their steps are
        delivered (sent again until they are), after the previous record of its
        partition: faust commits up to the first gap in the acked offsets, but on a freshly
        assigned partition it does not see a gap at the head, so an out-of-order ack would
        commit past a record still in flight."""
        tp = event.message.tp
        before = self.last_ack.get(tp)

        async def ack() -> None:
            if before is not None:
                await asyncio.wait([before])  # its outcome is its own: never stop the chain
            try:
                await self.publisher.deliver("ingest", [sent for _, out in records for sent in out])
                if not self.publisher.may_acknowledge(event.message):
                    return  # a rebalance began: see Publisher.may_acknowledge
                self.skips.ack_refetched([record for record, _ in records[:-1]])
                await stream.ack(event)
                first = records[0][0].message.offset
                self.clock.delivered(event.message.partition, first, event.message.offset + 1)
            except Abandoned:
                pass  # unacknowledged: the partition's next owner processes the records
            except Exception:
                log.exception("ingest: record %s not acknowledged", event.message.offset)

        task = asyncio.ensure_future(ack())
        self.last_ack[tp] = task
        task.add_done_callback(
            lambda t: self.last_ack.pop(tp, None) if self.last_ack.get(tp) is t else None
        )

    async def record(self, event: Any) -> list[Sent]:
        """Forward one input record's steps; returns what it sent."""
        message = event.message
        sent: list[Sent] = []
        try:
            decoded = await self.reader.decode(message, sent)
            if decoded is None:
                return sent
            by_run, n_spans, _invalid = decoded
            outgoing = self._messages(by_run, message.timestamp)
        except Exception as exc:  # never crash the agent on input
            sent.append(await self.dead_letters.internal_error(message, exc, "ingest"))
            return sent
        for out in outgoing:
            sent.append(await self.publisher.send(out))
        if message.timestamp:
            self.reader.metrics.stage_seconds.labels("ingest").observe(
                max(0.0, time.time() - message.timestamp)
            )
        self.counters["step_messages_sent"] += len(outgoing)
        self.reader.count(message.topic, n_spans)
        return sent

    def _messages(self, by_run: dict[str, list[Step]], ts: float | None) -> list[Outgoing]:
        outgoing = []
        headers = self.clock.headers()
        limit = MAX_STEPS_MESSAGE_BYTES
        topic = self.steps_topic
        if self.steps_grouping == "run":
            for run_id, steps in by_run.items():
                key = run_id.encode("utf-8")
                for value in split_to_fit([(run_id, steps)], encode_first_steps, limit):
                    outgoing.append(Outgoing(topic, key, value, None, ts, headers))
            return outgoing
        # One message per destination partition: the partition the run id would be keyed
        # to, so table ownership and the /runs/{id} routing are unchanged.
        n = self.detect_partitions
        by_partition: dict[int, list[tuple[str, list[Step]]]] = {}
        for run_id, steps in by_run.items():
            p = key_partition(run_id.encode("utf-8"), n)
            by_partition.setdefault(p, []).append((run_id, steps))
        for p, groups in by_partition.items():
            for value in split_to_fit(groups, encode_run_groups, limit):
                outgoing.append(Outgoing(topic, None, value, p, ts, headers))
        return outgoing
