"""streams/worker/kafka/delivery.py: the Publisher with fake topics and metrics passed to its
constructor (no faust, no broker)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError
from prometheus_client import CollectorRegistry

from alerts.metrics import Metrics
from streams.worker.kafka.delivery import Abandoned, Outgoing, Publisher


class Topic:
    """Records what was sent; `failures`: the next deliveries' errors, `refusals`: the next
    sends' errors raised at once."""

    def __init__(
        self, failures: Iterable[BaseException] = (), refusals: Iterable[BaseException] = ()
    ) -> None:
        self.sent: list[bytes] = []
        self.failures = list(failures)
        self.refusals = list(refusals)

    def as_future_message(self, **kw: Any) -> Any:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.kw = kw  # type: ignore[attr-defined]
        return fut

    async def publish_message(self, fut: Any) -> None:
        if self.refusals:
            raise self.refusals.pop(0)
        self.sent.append(fut.kw["value"])
        if self.failures:
            fut.set_exception(self.failures.pop(0))
        else:
            fut.set_result(None)


def publisher(stopping: bool = False) -> tuple[Publisher, dict[str, int], Metrics]:
    counters = {"publish_retries": 0}
    metrics = Metrics(CollectorRegistry())
    pub = Publisher(
        metrics,
        counters,
        lambda: stopping,
        read_in_assignment=lambda message: True,
        first_backoff=0.001,
        max_backoff=0.002,
    )
    return pub, counters, metrics


async def test_a_failed_delivery_is_sent_again_until_delivered() -> None:
    pub, counters, metrics = publisher()
    topic = Topic(failures=[KafkaTimeoutError(), KafkaTimeoutError()])
    await pub.deliver("detect", [await pub.send(Outgoing(topic, b"k", b"v"))])
    assert topic.sent == [b"v", b"v", b"v"]
    assert counters["publish_retries"] == 2
    sample = metrics.registry.get_sample_value(
        "loopwatch_publish_retries_total", {"stage": "detect"}
    )
    assert sample == 2


async def test_a_send_that_raises_at_once_is_a_failed_delivery() -> None:
    pub, counters, _ = publisher()
    topic = Topic(refusals=[RuntimeError("buffer full")])
    out, future = await pub.send(Outgoing(topic, None, b"v"))
    assert isinstance(future.exception(), RuntimeError) and topic.sent == []
    await pub.deliver("ingest", [(out, future)])
    assert topic.sent == [b"v"] and counters["publish_retries"] == 1


async def test_refused_as_too_large_the_fallback_is_sent() -> None:
    pub, _, _ = publisher()
    topic = Topic(failures=[MessageSizeTooLargeError()])
    out = Outgoing(topic, None, b"with payload", fallback=Outgoing(topic, None, b"digest"))
    await pub.deliver("ingest", [await pub.send(out)])
    assert topic.sent == [b"with payload", b"digest"]


async def test_waiting_is_abandoned_when_stopping() -> None:
    pub, _, _ = publisher(stopping=True)
    topic = Topic(failures=[KafkaTimeoutError()])
    with pytest.raises(Abandoned):
        await pub.deliver("detect", [await pub.send(Outgoing(topic, None, b"v"))])
    assert topic.sent == [b"v"]  # not sent again


async def test_waiting_is_abandoned_when_a_rebalance_revokes_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pub, _, _ = publisher()
    topic = Topic(failures=[KafkaTimeoutError()])
    sleep = asyncio.sleep

    async def revoke_while_waiting(delay: float) -> None:
        pub.revoked()
        await sleep(0)

    monkeypatch.setattr(asyncio, "sleep", revoke_while_waiting)
    with pytest.raises(Abandoned):
        await pub.deliver("detect", [await pub.send(Outgoing(topic, None, b"v"))])
    assert topic.sent == [b"v"]


async def test_delivered_outputs_return_at_once() -> None:
    pub, counters, _ = publisher()
    topic = Topic()
    sent = [await pub.send(Outgoing(topic, None, bytes([i]))) for i in range(3)]
    await pub.deliver("detect", sent)
    assert len(topic.sent) == 3 and counters["publish_retries"] == 0
