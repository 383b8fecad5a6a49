"""`loopwatch produce`: send export files to Kafka the way the Collector's kafkaexporter does.

What the exporter does, from its source (opentelemetry-collector-contrib,
exporter/kafkaexporter/kafka_exporter.go and pkg/batchpersignal/batchpersignal.go):

- one record per export (`ptrace.Traces`), the value marshaled as `otlp_proto`
  (ExportTraceServiceRequest) or `otlp_json` (Collector JSON: hex ids, int64 as strings,
  integer enums); the key is null;
- with `partition_traces_by_id: true`, `batchpersignal.SplitTraces` first cuts the export
  into one Traces per (ResourceSpans, ScopeSpans, trace id), in order of first appearance,
  each carrying a copy of its resource and scope (schema URLs included), and every piece is
  one record keyed by the trace id as lowercase hex (`traceutil.TraceIDToHexOrEmptyString`).
  A trace that appears under two scopes therefore becomes two records with the same key;
- exports without spans never reach an exporter (the OTLP receiver drops them), so an empty
  export message in a file is skipped and counted, not sent.

Every message is decoded with streams.spanpath.otlp before it is sent (a message the worker could
not decode is reported and skipped, never produced) and re-marshaled in the target encoding,
converting between the encodings when the file's differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from detectors.errors import LoopwatchError
from streams.errors import BrokerError, DecodeError
from streams.replay.files import Payload, expand_paths, iter_payloads
from streams.spanpath.otlp import (
    ENCODINGS,
    OTLP_JSON,
    OTLP_PROTO,
    decode_proto,
    json_to_proto_bytes,
    proto_to_json_bytes,
)

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_BOOTSTRAP",
    "ProduceResult",
    "check_broker",
    "cmd_produce",
    "encode_records",
    "produce_payloads",
    "producer_config",
    "split_by_trace",
]

DEFAULT_BOOTSTRAP = "127.0.0.1:19092"
COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")
PROBE_TIMEOUT = 5.0  # seconds a metadata request may take before the broker counts as unreachable
MESSAGE_TIMEOUT_MS = 30_000  # a record not acknowledged within this is a delivery error
MAX_ERROR_MESSAGES = 20  # error texts kept in a ProduceResult (all are counted)

# Applied under whatever the caller passes to produce_payloads().
PRODUCER_DEFAULTS: dict[str, Any] = {
    "acks": "all",
    "enable.idempotence": True,
    "linger.ms": 20,
    "compression.type": "none",
    "message.timeout.ms": MESSAGE_TIMEOUT_MS,
    "log_level": 0,  # connection errors surface as one BrokerError line, not librdkafka chatter
}

Record = tuple[bytes | None, bytes]  # key, value


@dataclass
class ProduceResult:
    """What one produce run did. Counts of records, spans and bytes are acknowledged ones."""

    topic: str
    records: int = 0  # records the broker acknowledged
    spans: int = 0  # spans in those records
    bytes: int = 0  # value bytes of those records
    messages: int = 0  # export messages read from the input (with spans)
    empty_messages: int = 0  # export messages without spans: skipped, as the Collector does
    input_errors: int = 0  # undecodable messages / unreadable files (reported, skipped)
    delivery_errors: int = 0  # records the broker did not acknowledge
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first MAX_ERROR_MESSAGES texts
    first_delivery_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.input_errors == 0 and self.delivery_errors == 0

    def note_error(self, text: str) -> None:
        if len(self.errors) < MAX_ERROR_MESSAGES:
            self.errors.append(text)

    def delivery_failed(self, text: str) -> None:
        self.delivery_errors += 1
        if self.first_delivery_error is None:
            self.first_delivery_error = text
            self.note_error(text)

    def summary(self) -> str:
        line = (
            f"produced {self.records:,} record{'s' if self.records != 1 else ''}"
            f" ({self.spans:,} spans, {self.bytes:,} bytes) to {self.topic}"
            f" in {self.seconds:.2f} s"
        )
        extra = []
        if self.empty_messages:
            extra.append(f"{self.empty_messages:,} empty export(s) skipped")
        if self.input_errors:
            extra.append(f"{self.input_errors:,} input error(s)")
        if self.delivery_errors:
            extra.append(f"{self.delivery_errors:,} delivery error(s)")
        return line + ("; " + ", ".join(extra) if extra else "")


# ---------------------------------------------------------------------------------------
# The exporter's record layout
# ---------------------------------------------------------------------------------------


def split_by_trace(
    req: ExportTraceServiceRequest,
) -> list[tuple[bytes, ExportTraceServiceRequest]]:
    """batchpersignal.SplitTraces + the exporter's key: one request per (resource spans,
    scope spans, trace id), in order of first appearance, keyed by the lowercase hex trace
    id (empty for an empty id)."""
    out: list[tuple[bytes, ExportTraceServiceRequest]] = []
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            groups: dict[bytes, Any] = {}  # trace id -> the piece's ScopeSpans
            for span in ss.spans:
                tid = bytes(span.trace_id)
                target = groups.get(tid)
                if target is None:
                    piece = ExportTraceServiceRequest()
                    new_rs = piece.resource_spans.add()
                    new_rs.resource.CopyFrom(rs.resource)
                    new_rs.schema_url = rs.schema_url
                    target = new_rs.scope_spans.add()
                    target.scope.CopyFrom(ss.scope)
                    target.schema_url = ss.schema_url
                    groups[tid] = target
                    key = tid.hex().encode("ascii") if any(tid) else b""
                    out.append((key, piece))
                target.spans.add().CopyFrom(span)
    return out


def _span_count(req: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)


def encode_records(
    payload: Payload, encoding: str, key_by_trace: bool
) -> tuple[int, list[tuple[bytes | None, bytes, int]]]:
    """One export message -> (spans, [(key, value, spans in the record)]) as the exporter
    would send it. Raises DecodeError (naming payload.source) for an undecodable message."""
    if encoding not in ENCODINGS:
        raise LoopwatchError(f"unknown encoding {encoding!r} (expected {', '.join(ENCODINGS)})")
    source = payload.source
    if payload.encoding == OTLP_JSON:
        pb = json_to_proto_bytes(payload.data, source)  # validates with the worker's decoder
        req = ExportTraceServiceRequest.FromString(pb)
        spans = _span_count(req)
    elif payload.encoding == OTLP_PROTO:
        pb = bytes(payload.data)
        spans = len(decode_proto(pb, source))  # validates with the worker's decoder
        req = None
    else:
        raise DecodeError(f"{source}: unknown encoding {payload.encoding!r}")
    if spans == 0:
        return 0, []

    def value(message: bytes) -> bytes:
        return message if encoding == OTLP_PROTO else proto_to_json_bytes(message, source)

    if not key_by_trace:
        return spans, [(None, value(pb), spans)]
    if req is None:
        req = ExportTraceServiceRequest.FromString(pb)
    return spans, [
        (key, value(piece.SerializeToString()), _span_count(piece))
        for key, piece in split_by_trace(req)
    ]


# ---------------------------------------------------------------------------------------
# Kafka
# ---------------------------------------------------------------------------------------


def producer_config(bootstrap: str, compression: str = "none") -> dict[str, Any]:
    """The producer settings `loopwatch produce` uses (acks=all, idempotent, lingering)."""
    if compression not in COMPRESSIONS:
        raise LoopwatchError(
            f"unknown compression {compression!r} (expected {', '.join(COMPRESSIONS)})"
        )
    return {**PRODUCER_DEFAULTS, "bootstrap.servers": bootstrap, "compression.type": compression}


def check_broker(producer: Producer, bootstrap: str, timeout: float = PROBE_TIMEOUT) -> None:
    """One metadata request; BrokerError unless a broker answers within `timeout` s."""
    try:
        md = producer.list_topics(timeout=timeout)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        reason = err.str() if isinstance(err, KafkaError) else str(exc)
        raise BrokerError(
            f"cannot reach Kafka at {bootstrap} ({reason}): is the broker running? "
            "(scripts/kafka.sh start, or set --bootstrap / $LOOPWATCH_BOOTSTRAP)"
        ) from None
    if not md.brokers:
        raise BrokerError(f"Kafka at {bootstrap} answered without any broker in its metadata")


def produce_payloads(
    producer_config: dict[str, Any],
    topic: str,
    payloads: Iterable[Payload],
    encoding: str = OTLP_PROTO,
    key_by_trace: bool = False,
    *,
    on_error: Callable[[str], None] | None = None,
    probe_timeout: float = PROBE_TIMEOUT,
) -> ProduceResult:
    """Send export messages to `topic` as the kafkaexporter would and wait for every ack.

    `producer_config` is a librdkafka config (at least `bootstrap.servers`); the
    PRODUCER_DEFAULTS fill in what it leaves out. The broker must answer a metadata request
    within `probe_timeout` s, else BrokerError before anything is read. An undecodable
    message is reported through `on_error`, counted and skipped; a DecodeError raised by
    the `payloads` iterator itself (broken file framing) ends the input the same way.
    """
    if encoding not in ENCODINGS:
        raise LoopwatchError(f"unknown encoding {encoding!r} (expected {', '.join(ENCODINGS)})")
    config = {**PRODUCER_DEFAULTS, **producer_config}
    bootstrap = str(config.get("bootstrap.servers", ""))
    if not bootstrap:
        raise BrokerError("no Kafka bootstrap servers configured")
    result = ProduceResult(topic=topic)
    fatal: list[KafkaError] = []

    def on_kafka_error(err: KafkaError) -> None:
        if err.fatal():  # e.g. an idempotence violation; transport errors are retried
            fatal.append(err)

    config.setdefault("error_cb", on_kafka_error)
    try:
        producer = Producer(config)
    except KafkaException as exc:
        raise BrokerError(f"invalid Kafka producer settings: {exc.args[0]}") from None
    started = time.monotonic()
    check_broker(producer, bootstrap, probe_timeout)

    def report(text: str) -> None:
        result.note_error(text)
        if on_error is not None:
            on_error(text)

    def on_delivery(spans: int, size: int) -> Callable[[KafkaError | None, Any], None]:
        def done(err: KafkaError | None, _msg: Any) -> None:
            if err is None:
                result.records += 1
                result.spans += spans
                result.bytes += size
            else:
                result.delivery_failed(f"delivery to {topic} failed: {err.str()}")

        return done

    def send(key: bytes | None, value: bytes, spans: int) -> None:
        callback = on_delivery(spans, len(value))
        while True:
            try:
                producer.produce(topic, value=value, key=key, on_delivery=callback)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                producer.poll(0.1)
            except KafkaException as exc:  # e.g. a record larger than message.max.bytes
                result.delivery_failed(
                    f"cannot send a record of {len(value):,} bytes: {exc.args[0].str()}"
                )
                break
        producer.poll(0)

    iterator = iter(payloads)
    while not fatal:
        try:
            payload = next(iterator)
        except StopIteration:
            break
        except DecodeError as exc:
            result.input_errors += 1
            report(str(exc))
            break
        try:
            _spans, records = encode_records(payload, encoding, key_by_trace)
        except DecodeError as exc:
            result.input_errors += 1
            report(str(exc))
            continue
        if not records:
            result.empty_messages += 1
            continue
        result.messages += 1
        for key, value, n in records:
            send(key, value, n)

    # every record is acknowledged or failed within message.timeout.ms: wait that long
    left = producer.flush(int(config.get("message.timeout.ms", MESSAGE_TIMEOUT_MS)) / 1000 + 10)
    for _ in range(left):
        result.delivery_failed("no acknowledgement before the flush timed out")
    result.seconds = time.monotonic() - started
    if fatal:
        raise BrokerError(f"the Kafka producer failed: {fatal[0].str()}")
    return result


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------


def _file_payloads(
    paths: Iterable[str], report: Callable[[DecodeError], None]
) -> Iterator[Payload]:
    """Payloads of every file in turn; a file that cannot be read (or whose framing breaks)
    is reported and the next one is read (what came before the break is kept)."""
    for path in paths:  # path by path, so problems are reported in command-line order
        for file in expand_paths([path], report):
            try:
                yield from iter_payloads([file])
            except DecodeError as exc:
                report(exc)


def cmd_produce(args: argparse.Namespace) -> int:
    bootstrap = args.bootstrap or os.environ.get("LOOPWATCH_BOOTSTRAP") or DEFAULT_BOOTSTRAP
    config = producer_config(bootstrap, getattr(args, "compression", None) or "none")
    timeout = float(getattr(args, "timeout", None) or PROBE_TIMEOUT)
    file_errors: list[DecodeError] = []

    def skipped(text: str) -> None:
        print(f"loopwatch: skipped: {text}", file=sys.stderr)

    def file_error(exc: DecodeError) -> None:
        file_errors.append(exc)
        skipped(str(exc))

    result = produce_payloads(
        config,
        args.topic,
        _file_payloads(args.paths, file_error),
        args.encoding,
        args.key_by_trace,
        on_error=skipped,
        probe_timeout=timeout,
    )
    result.input_errors += len(file_errors)
    if result.delivery_errors:
        print(
            f"loopwatch: error: {result.delivery_errors} record(s) not delivered:"
            f" {result.first_delivery_error}",
            file=sys.stderr,
        )
    print(result.summary())
    return 0 if result.ok else 1
