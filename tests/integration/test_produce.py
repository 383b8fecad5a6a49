"""`loopwatch produce` against the real broker: the records the Collector's kafkaexporter
would write (one per export, or one per resource/scope/trace with partition_traces_by_id,
keyed by the lowercase hex trace id), read back with a plain confluent-kafka consumer.

The corpus is recorded with the real opentelemetry-sdk and encoded by the SDK's own OTLP
encoder (`encode_spans`), then written in the fileexporter formats by streams.replay.files.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from streams.cli.main import main
from streams.cli.produce import ProduceResult, produce_payloads, producer_config
from streams.replay.files import Payload, iter_payloads, write_jsonl, write_pb
from streams.spanpath.otlp import decode_record, proto_to_json_bytes
from streams.spanpath.spans import SpanRecord
from tests.support.kafka import (
    bootstrap,
    create_topics,
    delete_topics,
    require_broker,
    unique_topic,
)

pytestmark = pytest.mark.kafka

PARTITIONS = 4
TIMEOUT = 30.0
T0 = 1_796_000_000_000_000_000
MS = 1_000_000
HEX32 = re.compile(r"[0-9a-f]{32}").fullmatch


# ---------------------------------------------------------------------------------------
# The corpus: real SDK spans, several traces, services and scopes per export
# ---------------------------------------------------------------------------------------


class Collect(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def record_runs(service: str, runs: int, collect: Collect, clock: list[int]) -> None:
    """`runs` agent runs of one service: an invoke_agent root (agent scope) and three
    execute_tool children (tools scope) each."""
    provider = TracerProvider(resource=Resource({"service.name": service}))
    provider.add_span_processor(collect)
    agent = provider.get_tracer("lw.test.agent", "1.0")
    tools = provider.get_tracer("lw.test.tools", "2.0")
    for r in range(runs):
        start = clock[0]
        root = agent.start_span(
            "invoke_agent support",
            kind=SpanKind.INTERNAL,
            attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support"},
            start_time=start,
        )
        ctx = set_span_in_context(root)
        for i in range(3):
            clock[0] += 10 * MS
            child = tools.start_span(
                "execute_tool lookup_order",
                context=ctx,
                kind=SpanKind.CLIENT,
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "lookup_order",
                    "gen_ai.tool.call.arguments": json.dumps({"order_id": f"{service}-{r}"}),
                    "agent.step.sequence": i + 1,
                },
                start_time=clock[0],
            )
            if i == 2:
                child.set_status(Status(StatusCode.ERROR, "not found"))
            child.end(end_time=clock[0] + 5 * MS)
        clock[0] += 10 * MS
        root.end(end_time=clock[0])
    provider.shutdown()


def build_exports() -> list[bytes]:
    """Serialized ExportTraceServiceRequests the way a BatchSpanProcessor would ship them:
    five runs of two services, children first, batches cutting across traces."""
    collect = Collect()
    clock = [T0]
    record_runs("support-bot", 3, collect, clock)
    record_runs("billing-bot", 2, collect, clock)
    spans = collect.spans  # end order: children before their root
    cuts = [0, 6, 13, len(spans)]
    return [
        encode_spans(spans[a:b]).SerializeToString(deterministic=True)
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]


def span_key(s: SpanRecord) -> tuple[str, str]:
    return (s.trace_id, s.span_id)


def sorted_spans(spans: list[SpanRecord]) -> list[SpanRecord]:
    return sorted(spans, key=span_key)


def expected_keyed_records(messages: list[bytes]) -> Counter[str]:
    """Oracle for partition_traces_by_id: records per trace id = the number of distinct
    (export, resource, scope) groups the trace has spans in."""
    groups = set()
    for i, raw in enumerate(messages):
        for s in decode_record(raw, "otlp_proto", f"export {i}"):
            groups.add((i, json.dumps(s.resource, sort_keys=True), s.scope_name, s.trace_id))
    return Counter(trace for *_rest, trace in groups)


@pytest.fixture(scope="module")
def exports() -> list[bytes]:
    messages = build_exports()
    spans = [s for i, m in enumerate(messages) for s in decode_record(m, "otlp_proto", str(i))]
    assert len(messages) == 3 and len(spans) == 20
    assert len({s.trace_id for s in spans}) == 5
    return messages


@pytest.fixture
def corpus(tmp_path: Path, exports: list[bytes]) -> Path:
    """traces.pb holds the first two exports, traces.jsonl (Collector JSON) the third."""
    d = tmp_path / "corpus"
    d.mkdir()
    write_pb(d / "a-traces.pb", exports[:2])
    write_jsonl(d / "b-traces.jsonl", [proto_to_json_bytes(exports[2])])
    return d


# ---------------------------------------------------------------------------------------
# Broker helpers
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broker() -> str:
    require_broker()
    return bootstrap()


@pytest.fixture
def topic(broker: str) -> Iterator[str]:
    name = unique_topic("it-produce")
    create_topics([name], PARTITIONS)
    yield name
    delete_topics([name])


Consumed = tuple[int, bytes | None, bytes]  # partition, key, value


def consume(topic: str, expect: int, settle: float = 1.5) -> list[Consumed]:
    """Every record of `topic`: waits for `expect`, then a little longer for extras."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap(),
            "group.id": unique_topic("it-produce-group"),
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    got: list[Consumed] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + TIMEOUT
        settle_until: float | None = None
        while time.monotonic() < (settle_until or deadline):
            msg = consumer.poll(0.25)
            if msg is not None:
                assert msg.error() is None, msg.error()
                value = msg.value()
                assert isinstance(value, bytes)
                got.append((msg.partition() or 0, msg.key(), value))
            if settle_until is None and len(got) >= expect:
                settle_until = time.monotonic() + settle
    finally:
        consumer.close()
    return got


def produce_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["produce", "--bootstrap", bootstrap(), *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def all_spans(messages: list[bytes]) -> list[SpanRecord]:
    return sorted_spans(
        [s for i, m in enumerate(messages) for s in decode_record(m, "otlp_proto", str(i))]
    )


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


def test_unkeyed_one_record_per_export(
    topic: str, corpus: Path, exports: list[bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = produce_cli(capsys, "--topic", topic, str(corpus))
    assert (rc, err) == (0, "")
    assert re.fullmatch(
        rf"produced 3 records \(20 spans, [0-9,]+ bytes\) to {topic} in [0-9.]+ s\n", out
    ), out

    got = consume(topic, 3)
    assert len(got) == 3
    assert [key for _, key, _ in got] == [None, None, None]
    # each record is one whole export; protobuf input is sent byte-for-byte as the SDK encoded it
    decoded = [decode_record(value, "otlp_proto", "record") for _, _, value in got]
    want = [decode_record(m, "otlp_proto", "export") for m in exports]
    assert sorted(map(sorted_spans, decoded), key=lambda s: span_key(s[0])) == sorted(
        map(sorted_spans, want), key=lambda s: span_key(s[0])
    )
    values = {value for _, _, value in got}
    assert exports[0] in values and exports[1] in values


def test_key_by_trace(
    topic: str, corpus: Path, exports: list[bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    oracle = expected_keyed_records(exports)
    n = sum(oracle.values())
    assert n > len(exports)  # the exports really do mix traces and scopes

    rc, out, err = produce_cli(capsys, "--topic", topic, "--key-by-trace", str(corpus))
    assert (rc, err) == (0, "")
    assert out.startswith(f"produced {n} records (20 spans, ")

    got = consume(topic, n)
    assert len(got) == n
    keys: Counter[str] = Counter()
    partitions: dict[bytes, set[int]] = {}
    spans: list[SpanRecord] = []
    for partition, key, value in got:
        assert key is not None and HEX32(key.decode("ascii")), key
        keys[key.decode()] += 1
        partitions.setdefault(key, set()).add(partition)
        record_spans = decode_record(value, "otlp_proto", "record")
        assert record_spans
        # every span of a keyed record belongs to the key's trace, under one resource/scope
        assert {s.trace_id for s in record_spans} == {key.decode()}
        assert (
            len({(json.dumps(s.resource, sort_keys=True), s.scope_name) for s in record_spans}) == 1
        )
        spans.extend(record_spans)
    assert keys == oracle
    assert all(len(p) == 1 for p in partitions.values()), partitions
    assert sorted_spans(spans) == all_spans(exports)


def test_otlp_json_encoding(topic: str, broker: str, exports: list[bytes]) -> None:
    """produce_payloads with mixed input encodings -> Collector-style JSON values."""
    payloads = [
        Payload("mem#1", "otlp_proto", exports[0]),
        Payload("mem#2", "otlp_json", proto_to_json_bytes(exports[1])),
        Payload("mem#3", "otlp_proto", exports[2]),
    ]
    errors: list[str] = []
    result = produce_payloads(
        producer_config(broker, "zstd"), topic, payloads, "otlp_json", True, on_error=errors.append
    )
    assert isinstance(result, ProduceResult)
    n = sum(expected_keyed_records(exports).values())
    assert (result.records, result.spans, result.messages) == (n, 20, 3)
    assert (result.input_errors, result.delivery_errors, errors) == (0, 0, [])

    got = consume(topic, n)
    assert len(got) == n
    spans: list[SpanRecord] = []
    for _, key, value in got:
        assert b"\n" not in value
        doc = json.loads(value)  # Collector JSON: lowerCamelCase, hex ids, integer enums
        span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        assert key is not None and span["traceId"] == key.decode()
        assert HEX32(span["traceId"]) and re.fullmatch(r"[0-9a-f]{16}", span["spanId"])
        assert isinstance(span["kind"], int) and isinstance(span["startTimeUnixNano"], str)
        spans.extend(decode_record(value, "otlp_json", "record"))
    assert sorted_spans(spans) == all_spans(exports)
    assert result.bytes == sum(len(v) for _, _, v in got)


def test_unkeyed_json_from_files(
    topic: str, corpus: Path, exports: list[bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = produce_cli(
        capsys, "--topic", topic, "--encoding", "otlp_json", str(corpus / "a-traces.pb")
    )
    assert (rc, err) == (0, "")
    assert out.startswith("produced 2 records (")
    got = consume(topic, 2)
    assert sorted(
        (sorted_spans(decode_record(v, "otlp_json", "r")) for _, _, v in got),
        key=lambda s: span_key(s[0]),
    ) == sorted(
        (sorted_spans(decode_record(m, "otlp_proto", "e")) for m in exports[:2]),
        key=lambda s: span_key(s[0]),
    )
    assert [k for _, k, _ in got] == [None, None]


def test_broker_unreachable(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    rc = main(["produce", "--bootstrap", f"127.0.0.1:{port}", "--topic", "x", str(corpus)])
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert rc == 2
    assert elapsed < 10.0
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"loopwatch: error: cannot reach Kafka at 127.0.0.1:{port} ")
    assert "is the broker running?" in err


def test_corrupt_input_is_reported_and_the_rest_produced(
    topic: str, tmp_path: Path, exports: list[bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "mixed"
    d.mkdir()
    write_pb(d / "1-good.pb", [exports[0]])
    # a message that frames fine but is not protobuf, then a length running past the end
    (d / "2-bad.pb").write_bytes(
        len(b"\xff\xff\xff garbage").to_bytes(4, "big")
        + b"\xff\xff\xff garbage"
        + (1000).to_bytes(4, "big")
        + b"short"
    )
    (d / "3-bad.jsonl").write_text('{"resourceSpans": [\n')
    write_jsonl(d / "4-good.jsonl", [proto_to_json_bytes(exports[1])])
    missing = tmp_path / "missing.pb"

    rc, out, err = produce_cli(capsys, "--topic", topic, str(d), str(missing))
    assert rc == 1
    lines = err.splitlines()
    assert len(lines) == 4, err
    assert all(line.startswith("loopwatch: skipped: ") for line in lines)
    assert lines[0].startswith(f"loopwatch: skipped: {d / '2-bad.pb'}#1: ")
    assert lines[1].startswith(f"loopwatch: skipped: {d / '2-bad.pb'}: message 2 ")
    assert lines[2].startswith(f"loopwatch: skipped: {d / '3-bad.jsonl'}")
    assert lines[3] == f"loopwatch: skipped: {missing}: no such file or directory"
    assert out.startswith("produced 2 records (")
    assert out.rstrip().endswith("; 4 input error(s)")

    got = consume(topic, 2)
    assert sorted_spans(
        [s for _, _, v in got for s in decode_record(v, "otlp_proto", "r")]
    ) == all_spans(exports[:2])


def test_empty_export_is_skipped(topic: str, broker: str, exports: list[bytes]) -> None:
    """The OTLP receiver drops exports without spans: they never become records."""
    payloads = [Payload("e#1", "otlp_proto", b""), Payload("e#2", "otlp_proto", exports[2])]
    result = produce_payloads(producer_config(broker), topic, payloads, "otlp_proto", False)
    assert (result.records, result.empty_messages, result.ok) == (1, 1, True)
    assert [v for _, _, v in consume(topic, 1)] == [exports[2]]


def test_files_round_trip_through_iter_payloads(corpus: Path, exports: list[bytes]) -> None:
    """The corpus files hold what the test thinks they hold (guards the oracle)."""
    payloads = list(iter_payloads([corpus]))
    assert [p.encoding for p in payloads] == ["otlp_proto", "otlp_proto", "otlp_json"]
    assert [p.data for p in payloads[:2]] == exports[:2]
    got: list[Any] = decode_record(payloads[2].data, "otlp_json", "j")
    assert sorted_spans(got) == sorted_spans(decode_record(exports[2], "otlp_proto", "p"))
