"""Golden, malformed-input and fuzz tests for streams/spanpath/otlp/.

The golden export is produced by the real OpenTelemetry SDK (TracerProvider, fixed ids and
times, the SDK's own OTLP encoder); JSON_FIXTURE is the same data written by hand the way
the Collector's JSON encoding looks, with its quirks. Both must decode to EXPECTED exactly.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode

from detectors.errors import LoopwatchError
from streams.errors import DecodeError
from streams.spanpath.otlp import (
    ANY_VALUE_KINDS,
    SPAN_KINDS,
    decode_json,
    decode_proto,
    decode_record,
    json_to_proto_bytes,
    proto_to_json_bytes,
)
from streams.spanpath.spans import SpanEvent, SpanRecord

T0 = 1_764_417_600_000_000_000  # 2025-11-29T12:00:00Z in ns
TRACE_A = "0af7651916cd43dd8448eb211c80319c"
TRACE_B = "4bf92f3577b34da6a3ce929d0e0e4736"
ROOT = "b7ad6b7169203331"
TOOL = "00f067aa0ba902b7"
LLM = "53995c3f42cd8ad8"
I64_MAX = 9_223_372_036_854_775_807


class FixedIds(IdGenerator):
    def __init__(self) -> None:
        self.traces = [int(TRACE_A, 16), int(TRACE_B, 16)]
        self.spans = [int(ROOT, 16), int(TOOL, 16), int(LLM, 16)]

    def generate_trace_id(self) -> int:
        return self.traces.pop(0)

    def generate_span_id(self) -> int:
        return self.spans.pop(0)


def _kv(key: str, value: AnyValue) -> KeyValue:
    return KeyValue(key=key, value=value)


def sdk_request() -> ExportTraceServiceRequest:
    """Three spans from the real SDK: an agent root, a tool child (trace A), an LLM span (B)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource(
            {
                "service.name": "support-bot",
                "prompt.version": "support-v12",
                "deployment.replicas": 3,
                "canary": False,
            }
        ),
        id_generator=FixedIds(),
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    agents = provider.get_tracer("openinference.instrumentation.langchain", "0.1.50")
    llms = provider.get_tracer("opentelemetry.instrumentation.openai", "0.40.0")

    root = agents.start_span(
        "invoke_agent support",
        kind=SpanKind.INTERNAL,
        attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support"},
        start_time=T0,
    )
    root.add_event(
        "loop_guard", {"guard.reason": "max_turns", "guard.turns": 6}, timestamp=T0 + 4_500_000
    )
    root.set_status(Status(StatusCode.ERROR, "Max turns exceeded: {'max_turns': 6}"))
    tool = agents.start_span(
        "execute_tool lookup_order",
        context=trace.set_span_in_context(root),
        kind=SpanKind.CLIENT,
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "lookup_order",
            "gen_ai.tool.call.id": "call_1",
            "agent.step.sequence": 3,
            "big": I64_MAX,
            "neg": -7,
            "ratio": 0.25,
            "cached": True,
            "tags": ["a", "b"],
            "flags": [True, False],
            "ids": [1, 2, 3],
            "weights": [0.5, 1.5],
        },
        start_time=T0 + 1_000_000,
    )
    tool.add_event(
        "exception",
        {"exception.type": "TimeoutError", "exception.message": "upstream timeout"},
        timestamp=T0 + 1_900_000,
    )
    tool.set_status(Status(StatusCode.ERROR, "timeout"))
    tool.end(end_time=T0 + 2_000_000)
    root.end(end_time=T0 + 5_000_000)
    llm = llms.start_span(
        "chat gpt-4o",
        kind=SpanKind.CLIENT,
        attributes={"gen_ai.usage.input_tokens": 1200, "gen_ai.usage.output_tokens": 80},
        start_time=T0 + 6_000_000,
    )
    llm.set_status(Status(StatusCode.OK))
    llm.end(end_time=T0 + 7_000_000)

    request = encode_spans(exporter.get_finished_spans())
    # Values the SDK's attribute API cannot express but OTLP can: kvlist, bytes, a mixed
    # nested array, an empty AnyValue and an empty string.
    tool_pb = request.resource_spans[0].scope_spans[0].spans[0]
    assert tool_pb.name == "execute_tool lookup_order"
    tool_pb.attributes.extend(
        [
            _kv(
                "gen_ai.tool.call.arguments",
                AnyValue(
                    kvlist_value=KeyValueList(
                        values=[
                            _kv("order_id", AnyValue(string_value="A-17")),
                            _kv("include_items", AnyValue(bool_value=False)),
                            _kv(
                                "limits",
                                AnyValue(
                                    kvlist_value=KeyValueList(
                                        values=[_kv("max", AnyValue(int_value=5))]
                                    )
                                ),
                            ),
                        ]
                    )
                ),
            ),
            _kv(
                "mixed",
                AnyValue(
                    array_value=ArrayValue(
                        values=[
                            AnyValue(string_value="x"),
                            AnyValue(int_value=1),
                            AnyValue(array_value=ArrayValue(values=[AnyValue(double_value=2.0)])),
                        ]
                    )
                ),
            ),
            _kv("blob", AnyValue(bytes_value=b"\x00\x01\xfe")),
            _kv("nothing", AnyValue()),
            _kv("empty", AnyValue(string_value="")),
        ]
    )
    return request


RESOURCE = {
    "service.name": "support-bot",
    "prompt.version": "support-v12",
    "deployment.replicas": 3,
    "canary": False,
}
AGENTS_SCOPE = "openinference.instrumentation.langchain"

EXPECTED = [
    SpanRecord(
        trace_id=TRACE_A,
        span_id=TOOL,
        parent_span_id=ROOT,
        name="execute_tool lookup_order",
        kind=3,
        start_ns=T0 + 1_000_000,
        end_ns=T0 + 2_000_000,
        status_code=2,
        status_message="timeout",
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "lookup_order",
            "gen_ai.tool.call.id": "call_1",
            "agent.step.sequence": 3,
            "big": I64_MAX,
            "neg": -7,
            "ratio": 0.25,
            "cached": True,
            "tags": ["a", "b"],
            "flags": [True, False],
            "ids": [1, 2, 3],
            "weights": [0.5, 1.5],
            "gen_ai.tool.call.arguments": {
                "order_id": "A-17",
                "include_items": False,
                "limits": {"max": 5},
            },
            "mixed": ["x", 1, [2.0]],
            "blob": b"\x00\x01\xfe",
            "nothing": None,
            "empty": "",
        },
        resource=RESOURCE,
        events=[
            SpanEvent(
                "exception",
                T0 + 1_900_000,
                {"exception.type": "TimeoutError", "exception.message": "upstream timeout"},
            )
        ],
        scope_name=AGENTS_SCOPE,
    ),
    SpanRecord(
        trace_id=TRACE_A,
        span_id=ROOT,
        parent_span_id=None,
        name="invoke_agent support",
        kind=1,
        start_ns=T0,
        end_ns=T0 + 5_000_000,
        status_code=2,
        status_message="Max turns exceeded: {'max_turns': 6}",
        attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support"},
        resource=RESOURCE,
        events=[
            SpanEvent("loop_guard", T0 + 4_500_000, {"guard.reason": "max_turns", "guard.turns": 6})
        ],
        scope_name=AGENTS_SCOPE,
    ),
    SpanRecord(
        trace_id=TRACE_B,
        span_id=LLM,
        parent_span_id=None,
        name="chat gpt-4o",
        kind=3,
        start_ns=T0 + 6_000_000,
        end_ns=T0 + 7_000_000,
        status_code=1,
        status_message="",
        attributes={"gen_ai.usage.input_tokens": 1200, "gen_ai.usage.output_tokens": 80},
        resource=RESOURCE,
        events=[],
        scope_name="opentelemetry.instrumentation.openai",
    ),
]

# The same export as hand-written Collector-style JSON. Quirks on purpose: hex ids (one in
# uppercase), int64 as strings and as numbers, enums as integers and as names, snake_case
# keys in places, unknown fields at every level, kvlist/array/bytes values.
JSON_FIXTURE = """
{"resourceSpans": [{
  "resource": {"attributes": [
    {"key": "service.name", "value": {"stringValue": "support-bot"}},
    {"key": "prompt.version", "value": {"stringValue": "support-v12"}},
    {"key": "deployment.replicas", "value": {"intValue": "3"}},
    {"key": "canary", "value": {"boolValue": false}}],
    "droppedAttributesCount": 0},
  "schemaUrl": "https://opentelemetry.io/schemas/1.27.0",
  "scopeSpans": [{
    "scope": {"name": "openinference.instrumentation.langchain", "version": "0.1.50"},
    "spans": [{
      "traceId": "0AF7651916CD43DD8448EB211C80319C",
      "spanId": "00f067aa0ba902b7",
      "parentSpanId": "b7ad6b7169203331",
      "traceState": "",
      "flags": 256,
      "name": "execute_tool lookup_order",
      "kind": "SPAN_KIND_CLIENT",
      "startTimeUnixNano": "1764417600001000000",
      "endTimeUnixNano": 1764417600002000000,
      "attributes": [
        {"key": "gen_ai.operation.name", "value": {"stringValue": "execute_tool"}},
        {"key": "gen_ai.tool.name", "value": {"stringValue": "lookup_order"}},
        {"key": "gen_ai.tool.call.id", "value": {"stringValue": "call_1"}},
        {"key": "agent.step.sequence", "value": {"intValue": 3}},
        {"key": "big", "value": {"intValue": "9223372036854775807"}},
        {"key": "neg", "value": {"intValue": "-7"}},
        {"key": "ratio", "value": {"doubleValue": 0.25}},
        {"key": "cached", "value": {"boolValue": true}},
        {"key": "tags", "value": {"arrayValue": {"values": [
          {"stringValue": "a"}, {"stringValue": "b"}]}}},
        {"key": "flags", "value": {"arrayValue": {"values": [
          {"boolValue": true}, {"boolValue": false}]}}},
        {"key": "ids", "value": {"arrayValue": {"values": [
          {"intValue": "1"}, {"intValue": 2}, {"intValue": "3"}]}}},
        {"key": "weights", "value": {"arrayValue": {"values": [
          {"doubleValue": 0.5}, {"doubleValue": 1.5}]}}},
        {"key": "gen_ai.tool.call.arguments", "value": {"kvlistValue": {"values": [
          {"key": "order_id", "value": {"stringValue": "A-17"}},
          {"key": "include_items", "value": {"boolValue": false}},
          {"key": "limits", "value": {"kvlistValue": {"values": [
            {"key": "max", "value": {"intValue": "5"}}]}}}]}}},
        {"key": "mixed", "value": {"arrayValue": {"values": [
          {"stringValue": "x"}, {"intValue": "1"},
          {"arrayValue": {"values": [{"doubleValue": 2}]}}]}}},
        {"key": "blob", "value": {"bytesValue": "AAH+"}},
        {"key": "nothing", "value": {}},
        {"key": "empty", "value": {"stringValue": ""}}],
      "events": [{"timeUnixNano": "1764417600001900000", "name": "exception",
        "attributes": [
          {"key": "exception.type", "value": {"stringValue": "TimeoutError"}},
          {"key": "exception.message", "value": {"stringValue": "upstream timeout"}}],
        "droppedAttributesCount": 0}],
      "status": {"code": 2, "message": "timeout"},
      "someFutureField": {"nested": [1, 2, 3]}
    }, {
      "trace_id": "0af7651916cd43dd8448eb211c80319c",
      "span_id": "b7ad6b7169203331",
      "parentSpanId": "",
      "name": "invoke_agent support",
      "kind": 1,
      "start_time_unix_nano": 1764417600000000000,
      "endTimeUnixNano": "1764417600005000000",
      "attributes": [
        {"key": "gen_ai.operation.name", "value": {"stringValue": "invoke_agent"}},
        {"key": "gen_ai.agent.name", "value": {"string_value": "support"}}],
      "events": [{"time_unix_nano": "1764417600004500000", "name": "loop_guard",
        "attributes": [
          {"key": "guard.reason", "value": {"stringValue": "max_turns"}},
          {"key": "guard.turns", "value": {"intValue": "6"}}]}],
      "status": {"code": "STATUS_CODE_ERROR", "message": "Max turns exceeded: {'max_turns': 6}"}
    }]
  }, {
    "scope": {"name": "opentelemetry.instrumentation.openai", "version": "0.40.0"},
    "spans": [{
      "traceId": "4bf92f3577b34da6a3ce929d0e0e4736",
      "spanId": "53995c3f42cd8ad8",
      "name": "chat gpt-4o",
      "kind": 3,
      "startTimeUnixNano": "1764417600006000000",
      "endTimeUnixNano": "1764417600007000000",
      "attributes": [
        {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "1200"}},
        {"key": "gen_ai.usage.output_tokens", "value": {"intValue": 80}}],
      "status": {"code": 1}
    }]
  }]
}]}
"""


@pytest.fixture(scope="module")
def golden_pb() -> bytes:
    return sdk_request().SerializeToString()


# --------------------------------------------------------------------------- golden


def test_proto_golden_from_sdk(golden_pb: bytes) -> None:
    assert decode_proto(golden_pb, "golden") == EXPECTED


def test_proto_resource_dict_is_shared_per_resource_spans(golden_pb: bytes) -> None:
    spans = decode_proto(golden_pb)
    assert spans[0].resource is spans[1].resource is spans[2].resource


def test_traces_data_is_byte_identical(golden_pb: bytes) -> None:
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    assert decode_proto(TracesData.FromString(golden_pb).SerializeToString()) == EXPECTED


def test_json_golden_fixture() -> None:
    assert decode_json(JSON_FIXTURE, "fixture") == EXPECTED
    assert decode_json(JSON_FIXTURE.encode("utf-8"), "fixture") == EXPECTED


def test_json_accepts_instrumentation_library_spans() -> None:
    doc = json.loads(JSON_FIXTURE)
    rs = doc["resourceSpans"][0]
    rs["instrumentationLibrarySpans"] = rs.pop("scopeSpans")
    for ss in rs["instrumentationLibrarySpans"]:
        ss["instrumentationLibrary"] = ss.pop("scope")
    assert decode_json(json.dumps(doc)) == EXPECTED


def test_json_accepts_bom_and_empty_document() -> None:
    assert decode_json(b"\xef\xbb\xbf" + JSON_FIXTURE.encode()) == EXPECTED
    assert decode_json(b"{}") == []
    assert decode_json(b'{"resourceSpans": []}') == []


def test_json_value_forms() -> None:
    doc = {
        "resourceSpans": [
            {
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": TRACE_A,
                                "spanId": ROOT,
                                "parentSpanId": "0000000000000000",
                                "attributes": [
                                    {"key": "nan", "value": {"doubleValue": "NaN"}},
                                    {"key": "inf", "value": {"doubleValue": "-Infinity"}},
                                    {"key": "dstr", "value": {"doubleValue": "2.5e3"}},
                                    {"key": "dint", "value": {"doubleValue": 7}},
                                    {"key": "urlsafe", "value": {"bytesValue": "-_8"}},
                                    {"key": "nullval", "value": {"stringValue": None}},
                                    {"key": "novalue"},
                                    {"value": {"stringValue": "proto3 omits an empty key"}},
                                    {"key": "ifloat", "value": {"intValue": 12.0}},
                                    {"key": "imin", "value": {"intValue": "-9223372036854775808"}},
                                    {"key": "dup", "value": {"stringValue": "first"}},
                                    {"key": "dup", "value": {"stringValue": "last"}},
                                ],
                            }
                        ]
                    }
                ]
            }
        ]
    }
    (span,) = decode_json(json.dumps(doc))
    a = span.attributes
    assert span.parent_span_id is None  # an all-zero parent is no parent
    assert span.start_ns == 0 and span.end_ns == 0 and span.kind == 0 and span.name == ""
    assert a["nan"] != a["nan"]  # NaN
    assert a["inf"] == float("-inf")
    assert a["dstr"] == 2500.0 and a["dint"] == 7.0 and type(a["dint"]) is float
    assert a["urlsafe"] == b"\xfb\xff"
    assert a["nullval"] is None and a["novalue"] is None
    assert a["ifloat"] == 12 and type(a["ifloat"]) is int
    assert a["imin"] == -(2**63)
    assert a["dup"] == "last"
    assert a[""] == "proto3 omits an empty key"


def test_any_value_kind_table_covers_the_proto_oneof() -> None:
    oneof = AnyValue.DESCRIPTOR.oneofs_by_name["value"]
    assert {k.proto_field for k in ANY_VALUE_KINDS} == {f.name for f in oneof.fields}
    assert [k.json_key for k in ANY_VALUE_KINDS][:3] == ["stringValue", "boolValue", "intValue"]


def test_decode_record_dispatch(golden_pb: bytes) -> None:
    assert decode_record(golden_pb, "otlp_proto", "r") == EXPECTED
    assert decode_record(JSON_FIXTURE.encode(), "otlp_json", "r") == EXPECTED
    with pytest.raises(DecodeError, match=r"^r: unknown encoding \"otlp_avro\""):
        decode_record(golden_pb, "otlp_avro", "r")
    with pytest.raises(DecodeError, match=r"^r: record has no value$"):
        decode_record(None, "otlp_proto", "r")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- conversion


def test_proto_to_json_is_collector_style(golden_pb: bytes) -> None:
    out = proto_to_json_bytes(golden_pb)
    assert b"\n" not in out
    doc = json.loads(out)
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == TRACE_A
    assert span["spanId"] == TOOL
    assert span["parentSpanId"] == ROOT
    assert span["kind"] == 3
    assert span["startTimeUnixNano"] == str(T0 + 1_000_000)
    assert span["status"] == {"code": 2, "message": "timeout"}
    assert decode_json(out) == EXPECTED


def test_json_to_proto_round_trip(golden_pb: bytes) -> None:
    pb = json_to_proto_bytes(JSON_FIXTURE)
    assert decode_proto(pb) == EXPECTED
    # proto -> JSON -> proto keeps every field, including the ones the decoder ignores
    back = json_to_proto_bytes(proto_to_json_bytes(golden_pb))
    assert ExportTraceServiceRequest.FromString(back) == ExportTraceServiceRequest.FromString(
        golden_pb
    )


def test_conversion_errors_are_decode_errors() -> None:
    with pytest.raises(DecodeError, match=r"^x: truncated or corrupt protobuf"):
        proto_to_json_bytes(b"\x0a\x05\x01", "x")
    with pytest.raises(DecodeError, match=r"^x: invalid JSON at line 1 column 2"):
        json_to_proto_bytes("{]", "x")
    bad_link = json.loads(JSON_FIXTURE)
    bad_link["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["links"] = [
        {"traceId": "abc", "spanId": ROOT}
    ]
    with pytest.raises(DecodeError, match=r"spans\[0\]\.links\[0\] traceId is not 16 bytes"):
        json_to_proto_bytes(json.dumps(bad_link), "x")


# --------------------------------------------------------------------------- malformed proto


def _request(**span_fields: object) -> bytes:
    req = ExportTraceServiceRequest()
    spans = req.resource_spans.add().scope_spans.add().spans
    spans.add(trace_id=bytes.fromhex(TRACE_A), span_id=bytes.fromhex(ROOT), name="ok")
    fields: dict[str, object] = {"trace_id": bytes.fromhex(TRACE_A), "span_id": bytes.fromhex(TOOL)}
    fields.update(span_fields)
    spans.add(**fields)
    return req.SerializeToString()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (_request(trace_id=b"\x01" * 6), "span 1 has traceId of 6 bytes, expected 16"),
        (_request(trace_id=b""), "span 1 missing traceId"),
        (_request(span_id=b""), "span 1 missing spanId"),
        (_request(span_id=b"\x01" * 9), "span 1 has spanId of 9 bytes, expected 8"),
        (_request(parent_span_id=b"\x01" * 4), "span 1 has parentSpanId of 4 bytes, expected 8"),
        (_request(trace_id=bytes(16)), "span 1 has an all-zero (invalid) traceId or spanId"),
        (
            _request(attributes=[_kv("k", AnyValue(string_value_strindex=2))]),
            "span 1: attribute 'k': value uses string_value_strindex",
        ),
        (
            _request(
                events=[{"name": "e", "attributes": [_kv("k", AnyValue(string_value_strindex=1))]}]
            ),
            "span 1: event 0: attribute 'k': value uses string_value_strindex",
        ),
        (b"\x0a\x05\x12\x03", "truncated or corrupt protobuf: Wire format was corrupt"),
        (b"\xff" * 12, "truncated or corrupt protobuf"),
        (_request(name="abc").replace(b"abc", b"a\xffc"), "String field had bad UTF-8"),
    ],
)
def test_proto_malformed(data: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode_proto(data, "examples/x.pb#3")
    assert str(err.value).startswith("examples/x.pb#3: ")
    assert reason in str(err.value)
    assert type(err.value) is DecodeError and isinstance(err.value, LoopwatchError)


def test_proto_malformed_resource_and_types() -> None:
    req = ExportTraceServiceRequest()
    req.resource_spans.add().resource.attributes.add(
        key="svc", value=AnyValue(string_value_strindex=1)
    )
    with pytest.raises(DecodeError, match=r"^p: resourceSpans\[0\]\.resource: attribute 'svc'"):
        decode_proto(req.SerializeToString(), "p")
    with pytest.raises(DecodeError, match=r"^p: expected bytes for otlp_proto, got str$"):
        decode_proto("not bytes", "p")  # type: ignore[arg-type]


def test_proto_valid_edge_inputs() -> None:
    assert decode_proto(b"") == []
    assert decode_proto(bytearray(_request())) == decode_proto(memoryview(_request()))
    # an all-zero parent id means no parent
    (_ok, span) = decode_proto(_request(parent_span_id=bytes(8)))
    assert span.parent_span_id is None


# --------------------------------------------------------------------------- malformed JSON


def _doc(span: dict[str, object]) -> str:
    base: dict[str, object] = {"traceId": TRACE_A, "spanId": TOOL}
    base.update(span)
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [base]}]}]})


def _attr(value: object) -> str:
    return _doc({"attributes": [{"key": "k", "value": value}]})


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ("{]", "invalid JSON at line 1 column 2: Expecting property name"),
        (
            '{"resourceSpans": [\n  {"scopeSpans": }]}',
            "invalid JSON at line 2 column 18: Expecting value",
        ),
        (b'{"a": "\xff"}', "JSON is not valid UTF-8 (byte offset 7)"),
        ("[1, 2]", "top-level JSON value is not an object (array)"),
        ('{"resourceSpans": {}}', "resourceSpans is not a list (object)"),
        ('{"resourceSpans": [7]}', "resourceSpans[0] is not an object (number)"),
        ('{"resourceSpans": [{"scopeSpans": "x"}]}', "resourceSpans[0]: scopeSpans is not a list"),
        (
            '{"resourceSpans": [{"resource": {"attributes": {}}}]}',
            "resourceSpans[0].resource: attributes is not a list (object)",
        ),
        ('{"resourceSpans": [{"scopeSpans": [{"spans": [[]]}]}]}', "span 0 is not an object"),
        (_doc({"traceId": "0af7651916cd"}), "span 0 has traceId of 12 hex characters, expected 32"),
        (_doc({"traceId": "zz" * 16}), "span 0: traceId is not hexadecimal"),
        (_doc({"traceId": 12}), "span 0: traceId is not a string (number)"),
        (_doc({"spanId": None}), "span 0 missing spanId"),
        (_doc({"spanId": ""}), "span 0 missing spanId"),
        (_doc({"spanId": "0" * 16}), "span 0: spanId is all zeros (invalid)"),
        (_doc({"parentSpanId": "abc"}), "span 0 has parentSpanId of 3 hex characters"),
        (
            _doc({"startTimeUnixNano": "abc"}),
            "span 0: startTimeUnixNano is not an integer: a string of 3 characters",
        ),
        (_doc({"endTimeUnixNano": "-5"}), "span 0: endTimeUnixNano is negative"),
        (_doc({"endTimeUnixNano": -5}), "span 0: endTimeUnixNano is negative"),
        (_doc({"startTimeUnixNano": str(2**64)}), "startTimeUnixNano is out of range"),
        (_doc({"startTimeUnixNano": 1.5}), "startTimeUnixNano is not an integer: 1.5"),
        (_doc({"startTimeUnixNano": True}), "startTimeUnixNano is not an integer: true"),
        (_doc({"kind": "SPAN_KIND_BOGUS"}), 'kind is not a known enum value: "SPAN_KIND_BOGUS"'),
        (_doc({"kind": 2**40}), "span 0: kind is out of range"),
        (_doc({"status": {"code": [2]}}), "status.code is not an enum integer or name (array)"),
        (_doc({"status": "ERROR"}), "span 0: status is not an object (string)"),
        (_doc({"name": 5}), "span 0: name is not a string (number)"),
        (_doc({"attributes": {"k": "v"}}), "span 0: attributes is not a list (object)"),
        (_doc({"attributes": ["k"]}), "span 0: attribute 0 is not an object (string)"),
        (_doc({"attributes": [{"key": 5}]}), "span 0: attribute 0 key is not a string (number)"),
        (_attr({"stringValue": 5}), "span 0: attribute 'k': stringValue is not a string (number)"),
        (_attr({"boolValue": "true"}), "attribute 'k': boolValue is not a boolean (string)"),
        (_attr({"intValue": "1.5"}), "attribute 'k': intValue is not an integer (string)"),
        (_attr({"intValue": str(2**63)}), "attribute 'k': intValue is out of range"),
        (_attr({"doubleValue": "x1"}), "attribute 'k': doubleValue is not a number (string)"),
        (_attr({"bytesValue": "***"}), "attribute 'k': bytesValue is not valid base64"),
        (_attr({"stringValue": "a", "intValue": "1"}), "attribute 'k': value has more than one"),
        (_attr("plain"), "attribute 'k': value is not an object (string)"),
        (_attr({"arrayValue": []}), "attribute 'k': arrayValue is not an object (array)"),
        (
            _attr({"arrayValue": {"values": [{"intValue": "x"}]}}),
            "attribute 'k': [0]: intValue is not an integer",
        ),
        (_attr({"kvlistValue": {"values": 3}}), "kvlistValue.values is not a list (number)"),
        (_attr({"stringValueStrindex": 1}), "value uses stringValueStrindex"),
        (_doc({"events": {}}), "span 0: events is not a list (object)"),
        (_doc({"events": [{"timeUnixNano": "x"}]}), "span 0: event 0: timeUnixNano is not an"),
        (_doc({"events": [{"attributes": 1}]}), "span 0: event 0: attributes is not a list"),
        ("[" * 100_000, "invalid JSON: nested too deeply"),
        ('{"a": ' + "1" * 5000 + "}", "invalid JSON: number too large"),
        (_attr({"stringValue": "\ud800"}), "string with an unpaired surrogate escape"),
        ('{"a": "\ud800"}', "JSON text has an unpaired surrogate (character 7)"),
    ],
)
def test_json_malformed(data: str | bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode_json(data, "record otlp_spans[2]@17")
    assert str(err.value).startswith("record otlp_spans[2]@17: ")
    assert reason in str(err.value)
    assert type(err.value) is DecodeError


def test_json_deep_value_nesting_is_bounded() -> None:
    value: dict[str, object] = {"stringValue": "leaf"}
    for _ in range(70):
        value = {"arrayValue": {"values": [value]}}
    with pytest.raises(DecodeError, match="value nesting deeper than 64"):
        decode_json(_attr(value), "r")


def test_errors_do_not_echo_attribute_values() -> None:
    secret = "SECRET-customer-text"
    cases = [
        _attr({"intValue": secret}),
        _attr({"doubleValue": secret}),
        _attr({"bytesValue": secret + "!"}),
        _attr({"boolValue": secret}),
        _attr({"arrayValue": {"values": [{"intValue": secret}]}}),
    ]
    for data in cases:
        with pytest.raises(DecodeError) as err:
            decode_json(data, "r")
        assert secret not in str(err.value), str(err.value)


def test_the_message_names_the_span_by_position() -> None:
    doc = json.loads(JSON_FIXTURE)
    doc["resourceSpans"][0]["scopeSpans"][1]["spans"][0]["spanId"] = "00f067"
    with pytest.raises(
        DecodeError, match=r"^f: span 2 has spanId of 6 hex characters, expected 16$"
    ):
        decode_json(json.dumps(doc), "f")


# --------------------------------------------------------------------------- fuzz

HEX_RE = re.compile(r"[0-9a-f]+")
FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _check(decode: object, data: object) -> list[SpanRecord]:
    """Either a list of well-formed SpanRecords or exactly DecodeError naming the source."""
    try:
        out = decode(data, "fuzz")  # type: ignore[operator]
    except DecodeError as e:
        assert str(e).startswith("fuzz: ")
        return []
    assert isinstance(out, list)
    for r in out:
        assert isinstance(r, SpanRecord)
        assert len(r.trace_id) == 32 and HEX_RE.fullmatch(r.trace_id)
        assert len(r.span_id) == 16 and HEX_RE.fullmatch(r.span_id)
        assert r.parent_span_id is None or (
            len(r.parent_span_id) == 16 and HEX_RE.fullmatch(r.parent_span_id)
        )
        assert r.start_ns >= 0 and r.end_ns >= 0
        assert isinstance(r.attributes, dict) and isinstance(r.resource, dict)
    return out


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    _check(decode_proto, data)
    _check(decode_json, data)


@FUZZ
@given(st.data())
def test_fuzz_mutated_proto(data: st.DataObject) -> None:
    buf = bytearray(sdk_pb())
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        i = data.draw(st.integers(0, len(buf) - 1))
        if op == "flip":
            buf[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            del buf[i : i + data.draw(st.integers(1, 8))]
        if not buf:
            break
    _check(decode_proto, bytes(buf))


@FUZZ
@given(st.data())
def test_fuzz_mutated_json(data: st.DataObject) -> None:
    text = list(JSON_FIXTURE)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text) - 1))
        text[i] = data.draw(st.sampled_from(list('{}[]",:0a-9 \\nAZ')))
    _check(decode_json, "".join(text).encode("utf-8", "surrogatepass"))


_SDK_PB: list[bytes] = []


def sdk_pb() -> bytes:
    if not _SDK_PB:
        _SDK_PB.append(sdk_request().SerializeToString())
    return _SDK_PB[0]


# Random JSON structures shaped like OTLP: the right keys, values plausible or junk.
junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=6,
)


def maybe(plausible: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    """Mostly a plausible value, about one time in 15 a junk one (so that whole documents
    still decode often enough for the round-trip property to be exercised)."""
    return st.integers(0, 14).flatmap(lambda i: junk if i == 0 else plausible)


def hex_id(n: int) -> st.SearchStrategy[object]:
    ids = st.binary(min_size=n, max_size=n).filter(any)  # all-zero ids are invalid
    return st.one_of(ids.map(bytes.hex), ids.map(lambda b: b.hex().upper()))


def otlp_docs(
    maybe: Callable[[st.SearchStrategy[Any]], st.SearchStrategy[Any]],
) -> st.SearchStrategy[dict[str, Any]]:
    """OTLP-shaped JSON documents; `maybe` decides how often a value is junk."""
    any_value = st.recursive(
        st.one_of(
            st.fixed_dictionaries({"stringValue": maybe(st.text(max_size=6))}),
            st.fixed_dictionaries(
                {"intValue": maybe(st.integers(-(2**63), 2**63 - 1).map(str) | st.integers(-9, 9))}
            ),
            st.fixed_dictionaries({"boolValue": maybe(st.booleans())}),
            st.fixed_dictionaries({"doubleValue": maybe(st.floats(allow_nan=False))}),
            st.fixed_dictionaries(
                {
                    "bytesValue": maybe(
                        st.binary(max_size=5).map(lambda b: base64.b64encode(b).decode())
                    )
                }
            ),
            st.just({}),
        ),
        lambda c: st.one_of(
            st.fixed_dictionaries({"arrayValue": st.fixed_dictionaries({"values": st.lists(c)})}),
            st.fixed_dictionaries(
                {
                    "kvlistValue": st.fixed_dictionaries(
                        {
                            "values": st.lists(
                                st.fixed_dictionaries({"key": st.text(max_size=3), "value": c}),
                                max_size=3,
                            )
                        }
                    )
                }
            ),
        ),
        max_leaves=5,
    )
    key_values = st.lists(
        st.fixed_dictionaries({"key": maybe(st.text(max_size=5)), "value": maybe(any_value)}),
        max_size=3,
    )
    uint64s = st.integers(0, 2**64 - 1)
    span_docs = st.fixed_dictionaries(
        {"traceId": maybe(hex_id(16)), "spanId": maybe(hex_id(8))},
        optional={
            "parentSpanId": maybe(hex_id(8) | st.just("")),
            "name": maybe(st.text(max_size=6)),
            "kind": maybe(st.integers(-1, 7) | st.sampled_from(sorted(SPAN_KINDS))),
            "startTimeUnixNano": maybe(uint64s.map(str) | uint64s),
            "endTimeUnixNano": maybe(uint64s.map(str) | uint64s),
            "attributes": maybe(key_values),
            "events": maybe(
                st.lists(
                    st.fixed_dictionaries(
                        {},
                        optional={
                            "name": maybe(st.text(max_size=4)),
                            "timeUnixNano": maybe(uint64s.map(str)),
                            "attributes": maybe(key_values),
                        },
                    ),
                    max_size=2,
                )
            ),
            "status": maybe(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "code": maybe(st.integers(0, 2) | st.just("STATUS_CODE_OK")),
                        "message": maybe(st.text(max_size=4)),
                    },
                )
            ),
        },
    )
    return st.fixed_dictionaries(
        {
            "resourceSpans": maybe(
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "resource": maybe(
                                st.fixed_dictionaries({"attributes": maybe(key_values)})
                            ),
                            "scopeSpans": maybe(
                                st.lists(
                                    st.fixed_dictionaries(
                                        {
                                            "scope": maybe(
                                                st.fixed_dictionaries({"name": st.text(max_size=4)})
                                            ),
                                            "spans": maybe(st.lists(span_docs, max_size=3)),
                                        }
                                    ),
                                    max_size=2,
                                )
                            ),
                        }
                    ),
                    max_size=2,
                )
            )
        }
    )


@FUZZ
@given(otlp_docs(maybe))
def test_fuzz_random_json_structures(doc: dict[str, Any]) -> None:
    data = json.dumps(doc).encode()
    records = _check(decode_json, data)
    if records:
        # whatever decodes also converts to protobuf and decodes to the same spans
        assert repr(decode_proto(json_to_proto_bytes(data))) == repr(records)


@FUZZ
@given(otlp_docs(lambda plausible: plausible))
def test_fuzz_valid_json_round_trips_through_protobuf(doc: dict[str, Any]) -> None:
    data = json.dumps(doc).encode()
    records = decode_json(data, "fuzz")
    pb = json_to_proto_bytes(data)
    assert repr(decode_proto(pb)) == repr(records)
    assert repr(decode_json(proto_to_json_bytes(pb))) == repr(records)
