"""Delivery: `Publisher` sends the worker's outputs and waits until the broker has them.

A send never raises (but CancelledError): an error raised while sending becomes the
delivery's error. A delivery that failed is sent again with backoff, for as long as it
takes (LoopwatchPublishRetrying alerts on it): what reaches this has already outlived the
producer's own retries (faust's producer_request_timeout, 20 min) or cannot be retried by
the producer (authorization, a topic's size or timestamp limits), and an operator's fix
then resumes delivery without a restart. Waiting is abandoned when the worker stops or a
rebalance revokes its partitions (`Abandoned`): what sent the outputs stays unacknowledged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiokafka.errors import MessageSizeTooLargeError

if TYPE_CHECKING:
    from alerts.metrics import Metrics

log = logging.getLogger(__name__)

PUBLISH_RETRY_FIRST_SECONDS = 1.0
PUBLISH_RETRY_MAX_SECONDS = 30.0

Sent = tuple["Outgoing", Any]  # a message as sent, with faust's FutureMessage for it


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message as sent, kept to send it again if its delivery fails. `fallback`: what
    to send instead when the broker refuses it as too large (a dead letter without the
    payload it captured)."""

    topic: Any
    key: bytes | None
    value: bytes
    partition: int | None = None
    timestamp: float | None = None
    headers: Any = None
    fallback: Outgoing | None = None


class Abandoned(Exception):
    """Outputs still waited for delivery when the worker began to stop or its partitions
    were revoked: what sent them stays unacknowledged, and the partition's next owner
    (this worker again, after an eager rebalance) processes it again."""


class Publisher:
    """Send, wait, send again what failed, abandon on stop or revocation.

    `metrics`: the `publish_retries` counter by stage; `counters`: the worker's /healthz
    counters (``publish_retries``); `stopping`: whether the worker began to stop;
    `read_in_assignment`: whether a record was read in the current assignment, with no
    rebalance under way (faust_internals.read_in_assignment), the one test before any
    acknowledgement. Call `revoked()` on every rebalance (eager: each revokes every
    partition). Backoffs default to PUBLISH_RETRY_FIRST_SECONDS doubling to
    PUBLISH_RETRY_MAX_SECONDS."""

    def __init__(
        self,
        metrics: Metrics,
        counters: dict[str, int],
        stopping: Callable[[], bool],
        *,
        read_in_assignment: Callable[[Any], bool],
        first_backoff: float | None = None,
        max_backoff: float | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.metrics = metrics
        self.on_failure = on_failure  # told of each failed delivery (the broker state)
        self.waiting = 0  # outputs whose delivery is awaited (what a forced stop abandons)
        self.counters = counters
        self.stopping = stopping
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.generation = 0  # rebalances so far
        self.read_in_assignment = read_in_assignment

    def revoked(self) -> None:
        self.generation += 1

    def may_acknowledge(self, message: Any) -> bool:
        """Whether `message` may be acknowledged: read in the current assignment, no
        rebalance under way. A record read before a rebalance is left unacknowledged, to be
        redone from the committed offset: acknowledged, it could let faust commit past
        records dropped at the rebalance (streams/worker/faust_internals.py)."""
        return bool(self.read_in_assignment(message))

    @staticmethod
    async def send(out: Outgoing) -> Sent:
        """Send `out`; returns it with faust's FutureMessage for its delivery, never raises
        (but CancelledError): an error raised while sending (the producer's buffer full
        or its metadata unavailable, a request over its size limit) becomes the future's,
        so `deliver` handles it like a failed delivery. topic.send would return the
        producer's future instead; faust sets a failed delivery's error on its
        FutureMessage too, and asyncio logs one nobody awaits as "never retrieved"."""
        topic = out.topic
        try:
            message = topic.as_future_message(
                key=out.key,
                value=out.value,
                partition=out.partition,
                timestamp=out.timestamp,
                headers=out.headers,
            )
            await topic.publish_message(message)
        except Exception as exc:
            message = asyncio.get_running_loop().create_future()
            message.set_exception(exc)
        return out, message

    async def deliver(self, stage: str, sent: list[Sent]) -> None:
        """Wait until every message of `sent` is delivered. One whose delivery failed is
        sent again, with backoff, for as long as it takes: outputs are delayed, never
        dropped, and offsets are not left unacknowledged until a restart. A message
        refused as too large is replaced by its fallback if it has one. Raises Abandoned
        when the worker stops or a rebalance revokes its partitions meanwhile: a detect
        batch would otherwise write state of partitions it no longer owns after their new
        owner restored them."""
        waiting = len(sent)
        self.waiting += waiting
        try:
            await self._deliver(stage, sent)
        finally:
            self.waiting -= waiting

    async def _deliver(self, stage: str, sent: list[Sent]) -> None:
        generation = self.generation
        delay = self.first_backoff or PUBLISH_RETRY_FIRST_SECONDS
        max_delay = self.max_backoff or PUBLISH_RETRY_MAX_SECONDS
        while sent:
            # gather retrieves every error (and returns a cancelled future's as a value)
            results = await asyncio.gather(*(future for _, future in sent), return_exceptions=True)
            failed = [
                (out, result)
                for (out, _), result in zip(sent, results, strict=True)
                if isinstance(result, BaseException)
            ]
            if not failed:
                return
            if self.stopping() or self.generation != generation:
                raise Abandoned
            if self.on_failure is not None:
                self.on_failure(f"{stage} output not delivered ({type(failed[0][1]).__name__})")
            self.metrics.publish_retries.labels(stage=stage).inc(len(failed))
            self.counters["publish_retries"] += len(failed)
            log.warning(
                "%s: %d output(s) not delivered (%s); sending them again in %.1f s",
                stage,
                len(failed),
                type(failed[0][1]).__name__,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)
            if self.stopping() or self.generation != generation:
                raise Abandoned
            sent = []
            for out, error in failed:
                if isinstance(error, MessageSizeTooLargeError) and out.fallback is not None:
                    out = out.fallback
                sent.append(await self.send(out))


def ignore_failure(future: Any) -> None:
    """A done-callback for a send nobody waits for (a tick: a lost one is sent again)."""
    if not future.cancelled():
        future.exception()  # retrieved: asyncio would log it as never retrieved
