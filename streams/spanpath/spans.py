"""The decoded span: what streams/spanpath/otlp/ produces from OTLP bytes and what
streams/spanpath/normalize.py maps to a detectors.model.Step. Plain Python values only.
And `StepBatch`, what the span path makes of one export message on either side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detectors.model import Step

# OTLP Status.code
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2


@dataclass(slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(slots=True)
class SpanRecord:
    """One OTLP span with its resource and scope, ids as lowercase hex.

    Attribute values are converted from OTLP AnyValue to Python: str, bool, int, float,
    bytes, list (ArrayValue) and dict (KeyValueList). `resource` is shared by all spans of
    one ResourceSpans (do not mutate it).
    """

    trace_id: str  # 32 lowercase hex chars
    span_id: str  # 16 lowercase hex chars
    parent_span_id: str | None  # None for a root span
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status_code: int
    status_message: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: list[SpanEvent] = field(default_factory=list)
    scope_name: str = ""


@dataclass(slots=True)
class StepBatch:
    """One export message's steps, whichever span path made them (native or Python, held
    equal by tests/unit/native/test_normalize.py): steps by run (first-seen order), the
    invalid spans skipped and which (span id, trace id, exception name), the latest end of
    a valid step, the span count, and the end range of every span of the message (the
    replay merges sources by it)."""

    by_run: dict[str, list[Step]]
    invalid: int
    max_end: int
    spans: int
    invalid_spans: list[tuple[str, str, str]]
    first_end: int
    last_end: int
