"""Dead letters: an input or steps record the worker cannot process goes to the dead-letter
topic as a digest (SHA-256 and length of the payload) with the reason, the error's type and
the source offset in its headers, unless LOOPWATCH_DLQ_CAPTURE_PAYLOAD=true. A bad record
never crashes an agent: a crashed agent that restarts on the same record is a stuck
pipeline."""

from __future__ import annotations

import hashlib
import logging
import re
from typing import TYPE_CHECKING, Any

from streams.worker.agents.messages import to_json
from streams.worker.kafka.delivery import Outgoing, Publisher, Sent

if TYPE_CHECKING:
    from alerts.metrics import Metrics

log = logging.getLogger(__name__)

_TRACE_ID_KEY = re.compile(rb"[0-9a-f]{32}")


def dead_letter_record(
    value: bytes | None,
    *,
    reason: str,
    error: str,
    topic: str,
    partition: int,
    offset: int,
    capture_payload: bool,
) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(value, headers) of a dead letter. The value is a digest of the payload unless
    payload capture is enabled: raw telemetry may carry customer data."""
    payload = bytes(value) if value is not None else b""
    digest = hashlib.sha256(payload).hexdigest()
    headers = [
        ("reason", reason.encode()),
        ("source_topic", topic.encode()),
        ("source_partition", str(partition).encode()),
        ("source_offset", str(offset).encode()),
        ("error", error.encode("utf-8", "replace")[:1000]),
        ("payload_sha256", digest.encode()),
        ("payload_length", str(len(payload)).encode()),
        ("payload_captured", b"true" if capture_payload else b"false"),
    ]
    if capture_payload:
        return payload, headers
    body = {"payload_sha256": digest, "payload_length": len(payload), "value": None}
    return to_json(body), headers


def dead_letter_key(key: bytes | None, capture_payload: bool) -> bytes | None:
    """The key of a dead letter. An undecodable record's key is unvalidated input like its
    value (a canary in it reached the dead-letter topic and faust's debug log): unless
    payload capture is enabled, only a trace-id key (what the collector writes) is kept,
    any other key becomes its SHA-256 (records with one key still share a partition)."""
    if not key or capture_payload:
        return key
    key = bytes(key)
    if _TRACE_ID_KEY.fullmatch(key):
        return key
    return hashlib.sha256(key).hexdigest().encode()


class DeadLetters:
    """Sends dead letters to `topic` through `publisher`, counted in `metrics` and
    `counters` once, when sent (a resend is not counted again)."""

    def __init__(
        self,
        topic: Any,
        publisher: Publisher,
        metrics: Metrics,
        counters: dict[str, int],
        capture_payload: bool,
    ) -> None:
        self.topic = topic
        self.publisher = publisher
        self.metrics = metrics
        self.counters = counters
        self.capture_payload = capture_payload

    async def internal_error(self, message: Any, exc: Exception, where: str) -> Sent:
        """A record `where` (an agent) failed on with an unexpected error: logged with its
        traceback, and dead-lettered as ``internal_error`` with the exception's name (never
        its message, which may quote the record)."""
        log.error(
            "%s: unexpected error on %s/%s@%s; the record is dead-lettered",
            where,
            message.topic,
            message.partition,
            message.offset,
            exc_info=exc,
        )
        return await self.send(message, "internal_error", type(exc).__name__)

    async def send(self, message: Any, reason: str, error: str) -> Sent:
        """Send a dead letter for `message`; returns it as Publisher.send does. With the
        payload captured, the fallback (sent if the broker refuses it as too large) leaves
        the payload out."""
        fields = {
            "reason": reason,
            "error": error,
            "topic": message.topic,
            "partition": message.partition,
            "offset": message.offset,
        }
        value, headers = dead_letter_record(message.value, **fields, capture_payload=False)
        out = Outgoing(self.topic, dead_letter_key(message.key, False), value, None, None, headers)
        if self.capture_payload:
            value, headers = dead_letter_record(message.value, **fields, capture_payload=True)
            key = dead_letter_key(message.key, True)
            out = Outgoing(self.topic, key, value, None, None, headers, fallback=out)
        self.metrics.dead_letter(reason)
        self.counters["dead_letters"] += 1
        return await self.publisher.send(out)
