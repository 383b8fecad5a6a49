"""Test helpers for the guard: a real OpenTelemetry SDK tracer provider exporting to memory
(set once, globally: the guard and its integrations use the global API, as agents do), a
fake tool that counts its invocations outside the answers it returns, and a scripted model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_EXPORTER: InMemorySpanExporter | None = None


def memory_exporter() -> InMemorySpanExporter:
    """The process's in-memory exporter behind the global tracer provider (installed on
    first use), emptied."""
    global _EXPORTER
    if _EXPORTER is None:
        _EXPORTER = InMemorySpanExporter()
        provider = TracerProvider(
            resource=Resource.create({"service.name": "guarded-agent", "prompt.version": "v1"})
        )
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
        assert trace.get_tracer_provider() is provider, "another test set the global provider"
    _EXPORTER.clear()
    return _EXPORTER


def export_message(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> bytes:
    """The spans as the SDK's OTLP exporter sends them (one ExportTraceServiceRequest)."""
    return encode_spans(list(spans)).SerializeToString()


@dataclass
class FakeTool:
    """A tool that records every invocation (outside what it returns) and answers from a
    list (the last answer repeats); an answer that is an exception is raised."""

    name: str
    answers: list[Any]
    invocations: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, **kwargs: Any) -> Any:
        self.invocations.append(dict(kwargs))
        answer = self.answers[min(len(self.invocations), len(self.answers)) - 1]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def scripted(calls: list[tuple[str, dict[str, Any]]]) -> Callable[[list[Any]], Iterator[Any]]:
    """A model that proposes these calls in order, whatever the answers (the stubborn
    model of a loop); each item is (tool, arguments)."""

    def model(_answers: list[Any]) -> Iterator[Any]:
        yield from calls

    return model
