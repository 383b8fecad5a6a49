"""Helpers for the bench and the broker tests that talk to the real local Kafka broker
(``scripts/kafka.sh start``): its address, an admin client, topics.

Broker tests never skip: an unreachable broker is an error with the command that fixes it.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

DEFAULT_BOOTSTRAP = "127.0.0.1:19092"


def bootstrap() -> str:
    """The broker address (``LOOPWATCH_BOOTSTRAP``, else the local dev broker)."""
    return os.environ.get("LOOPWATCH_BOOTSTRAP", DEFAULT_BOOTSTRAP)


def admin_client() -> AdminClient:
    # log_level 0: no librdkafka connection-refused chatter on stderr while probing
    return AdminClient({"bootstrap.servers": bootstrap(), "log_level": 0})


def require_broker(timeout: float = 10.0) -> None:
    """Raise RuntimeError unless the broker answers a metadata request within ``timeout`` s."""
    addr = bootstrap()
    admin = admin_client()
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            md = admin.list_topics(timeout=max(0.5, min(3.0, left)))
            if md.brokers:
                return
        except KafkaException as exc:
            last = exc
        time.sleep(0.2)
    detail = f" ({last})" if last else ""
    raise RuntimeError(
        f"Kafka broker not reachable at {addr}{detail}: "
        "run `make kafka-up` or `scripts/kafka.sh start`"
    )


def unique_topic(prefix: str = "test") -> str:
    """A topic name no other test (or earlier run) uses: ``<prefix>-<12 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _wait_metadata(admin: AdminClient, names: list[str], present: bool, timeout: float) -> None:
    """Topic creation/deletion futures complete on the controller; wait until the broker's
    metadata agrees, so a producer or consumer started right after sees the change."""
    deadline = time.monotonic() + timeout
    while True:
        topics = admin.list_topics(timeout=max(0.5, deadline - time.monotonic())).topics
        ok = all(
            (n in topics and topics[n].error is None and len(topics[n].partitions) > 0)
            if present
            else (n not in topics)
            for n in names
        )
        if ok:
            return
        if time.monotonic() >= deadline:
            state = "created" if present else "deleted"
            raise TimeoutError(f"topics not {state} within {timeout} s: {names}")
        time.sleep(0.1)


def create_topics(
    names: Iterable[str],
    partitions: int = 4,
    *,
    replication_factor: int = 1,
    config: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> list[str]:
    """Create topics (an existing one is fine) and wait until they are usable."""
    names = list(names)
    if not names:
        return names
    admin = admin_client()
    specs = [NewTopic(n, partitions, replication_factor, config=config or {}) for n in names]
    futures = admin.create_topics(specs, operation_timeout=timeout, request_timeout=timeout)
    for fut in futures.values():
        try:
            fut.result(timeout)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    _wait_metadata(admin, names, present=True, timeout=timeout)
    return names


def delete_topics(names: Iterable[str], *, timeout: float = 30.0) -> None:
    """Delete topics (a missing one is fine) and wait until they are gone."""
    names = list(names)
    if not names:
        return
    admin = admin_client()
    futures = admin.delete_topics(names, operation_timeout=timeout, request_timeout=timeout)
    for fut in futures.values():
        try:
            fut.result(timeout)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise
    _wait_metadata(admin, names, present=False, timeout=timeout)
