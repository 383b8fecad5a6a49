"""Input records into steps: one record of the input topic decoded as a whole OTLP batch
and normalized through the span path (streams/spanpath/), by the ingest agent (unkeyed
input) and by the detect agent (keyed input). An undecodable record becomes a dead letter."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from detectors.model import Step
from streams.errors import DecodeError
from streams.spanpath import SpanPath
from streams.spanpath.normalize import Normalizer
from streams.worker.agents.dead_letters import DeadLetters
from streams.worker.kafka.delivery import Sent

if TYPE_CHECKING:
    from alerts.metrics import Metrics

log = logging.getLogger(__name__)


class InputDecoder:
    """Decode + normalize one input record (ingest, and detect on keyed input); an
    undecodable one becomes a dead letter."""

    def __init__(
        self,
        normalizer: Normalizer,
        encoding: str,
        dead_letters: DeadLetters,
        metrics: Metrics,
        counters: dict[str, int],
    ) -> None:
        self.normalizer = normalizer
        self.encoding = encoding
        self.dead_letters = dead_letters
        self.metrics = metrics
        self.counters = counters
        self.span_path = SpanPath(normalizer)

    async def decode(
        self, message: Any, sent: list[Sent]
    ) -> tuple[dict[str, list[Step]], int, int] | None:
        """(steps by run, spans, invalid spans); None when it was dead-lettered (the dead
        letter is added to `sent`)."""
        source = f"{message.topic}/{message.partition}@{message.offset}"
        try:
            batch = self.span_path.message(message.value, self.encoding, source)
        except DecodeError as exc:
            self.metrics.decode_error("decode_error")
            sent.append(await self.dead_letters.send(message, "decode_error", str(exc)))
            return None
        by_run, invalid, n_spans = batch.by_run, batch.invalid, batch.spans
        if invalid:
            self.metrics.decode_error("invalid_span")
            log.warning("%s: %d span(s) could not be normalized and were skipped", source, invalid)
        return by_run, n_spans, invalid

    def count(self, topic: str, n_spans: int) -> None:
        """One decoded input record (ingest, or keyed detect)."""
        self.metrics.record_consumed(topic, spans=n_spans)
        self.counters["records"] += 1
        self.counters["spans"] += n_spans
