"""A realistic synthetic span corpus for benchmarks, as OTLP protobuf export messages.

Runs of 5-50 tool steps (each preceded by an LLM span), a few percent looping, several
prompt and tool versions, GenAI conventions, batches of 50-500 spans as a collector sends
them. Deterministic for a given seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span

BASE_NS = 1_790_040_000_000_000_000  # 2026-09-22, in the past (future spans are invalid)
TOOLS = ("lookup_order", "search_cases", "get_customer", "get_export_status", "search_kb")


def _kv(key: str, value: object) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def _run_spans(rng: random.Random, run_no: int, loop_share: float, start_ns: int) -> list[Span]:
    trace_id = rng.getrandbits(128).to_bytes(16, "big")
    root_id = rng.getrandbits(64).to_bytes(8, "big")
    t = start_ns
    start = t
    spans: list[Span] = []
    steps = rng.randint(3, 25)  # tool calls; with their LLM turns 6-50 steps
    looping = rng.random() < loop_share
    prompt_version = ("support-v12", "support-v13", "support-v14")[run_no % 3]
    loop_tool = rng.choice(TOOLS)
    for i in range(steps):
        llm_end = t + rng.randint(200, 900) * 1_000_000
        spans.append(
            Span(
                trace_id=trace_id,
                span_id=rng.getrandbits(64).to_bytes(8, "big"),
                parent_span_id=root_id,
                name="chat gpt-4o",
                kind=Span.SPAN_KIND_CLIENT,
                start_time_unix_nano=t,
                end_time_unix_nano=llm_end,
                attributes=[
                    _kv("gen_ai.operation.name", "chat"),
                    _kv("gen_ai.request.model", "gpt-4o"),
                    _kv("gen_ai.usage.input_tokens", 800 + 120 * i),
                    _kv("gen_ai.prompt.version", prompt_version),
                    _kv("gen_ai.usage.output_tokens", rng.randint(20, 90)),
                ],
            )
        )
        t = llm_end + 5_000_000
        args: dict[str, object]
        result: dict[str, object]
        if looping and i >= steps // 2:
            tool, args, result = loop_tool, {"id": f"X-{run_no}"}, {"status": "same", "version": 1}
        else:
            tool = rng.choice(TOOLS)
            args = {"id": f"{run_no}-{i}", "include_items": bool(i % 2)}
            result = {"status": "ok", "version": i, "items": [f"i{i}", f"j{i}"]}
        end = t + rng.randint(30, 300) * 1_000_000
        spans.append(
            Span(
                trace_id=trace_id,
                span_id=rng.getrandbits(64).to_bytes(8, "big"),
                parent_span_id=root_id,
                name=f"execute_tool {tool}",
                kind=Span.SPAN_KIND_INTERNAL,
                start_time_unix_nano=t,
                end_time_unix_nano=end,
                attributes=[
                    _kv("gen_ai.operation.name", "execute_tool"),
                    _kv("gen_ai.tool.name", tool),
                    _kv("gen_ai.tool.call.id", f"call_{run_no}_{i}"),
                    _kv("gen_ai.tool.version", str(rng.choice((3, 4)))),
                    _kv("gen_ai.tool.call.arguments", json.dumps(args)),
                    _kv("gen_ai.tool.call.result", json.dumps(result)),
                    _kv("agent.step.sequence", i + 1),
                    _kv("gen_ai.prompt.version", prompt_version),
                ],
            )
        )
        t = end + 5_000_000
    spans.append(
        Span(
            trace_id=trace_id,
            span_id=root_id,
            name="invoke_agent support",
            kind=Span.SPAN_KIND_INTERNAL,
            start_time_unix_nano=start,
            end_time_unix_nano=t + 10_000_000,
            attributes=[
                _kv("gen_ai.operation.name", "invoke_agent"),
                _kv("gen_ai.agent.name", "support"),
                _kv("gen_ai.agent.finish_reason", "stop"),
            ],
        )
    )
    return spans


def export_messages(
    total_spans: int,
    seed: int = 7,
    loop_share: float = 0.04,
    batch: tuple[int, int] = (50, 500),
    base_ns: int = BASE_NS,
    run_spacing_ns: int = 3_000_000_000,
) -> Iterator[bytes]:
    """Serialized ExportTraceServiceRequests until `total_spans` spans were emitted.

    Runs interleave the way concurrent agents do: spans of ~20 live runs are mixed in one
    export batch, and a run's root arrives with its last batch.
    """
    rng = random.Random(seed)
    live: list[list[Span]] = []
    run_no = 0
    emitted = 0
    while emitted < total_spans:
        size = rng.randint(*batch)
        request = ExportTraceServiceRequest()
        rs: ResourceSpans = request.resource_spans.add()
        rs.resource.attributes.extend(
            [_kv("service.name", "support-bot"), _kv("deployment.environment", "bench")]
        )
        scope = rs.scope_spans.add()
        scope.scope.name = "loopwatch.bench"
        taken = 0
        while taken < size and emitted + taken < total_spans:
            while len(live) < 20:
                live.append(_run_spans(rng, run_no, loop_share, base_ns + run_no * run_spacing_ns))
                run_no += 1
            run = live[rng.randrange(len(live))]
            chunk = run[:8]
            del run[:8]
            scope.spans.extend(chunk)
            taken += len(chunk)
            if not run:
                live.remove(run)
        emitted += taken
        yield request.SerializeToString()
