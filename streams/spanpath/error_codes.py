"""A tool call's error code: the code the span or its result states (an error type, an
``ok: false`` result's code, an exception event's type, a known code in the status message),
else, for a framework's own failure type, the transient cause its messages match. Messages
are matched, never copied: they may hold customer text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from detectors.policy import Policy
from detectors.toolcall import refine_code, result_code, short_code
from streams.spanpath.spans import STATUS_ERROR, SpanRecord


class ErrorCodes:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.known = policy.known_error_codes
        self.status_codes = sorted(policy.transient_error_codes | policy.missing_data_codes)

    def code(
        self, span: SpanRecord, error_type: Any, result: Any, message: Callable[[], Any]
    ) -> str | None:
        """`message()`: the span's error message field (read only when needed)."""
        code = self.stated(span, error_type, result)
        if code is None or code in self.known:
            return code
        return refine_code(self.policy, code, messages(span, message()))

    def stated(self, span: SpanRecord, error_type: Any, result: Any) -> str | None:
        code = short_code(error_type)
        if code is not None:
            return code
        code = result_code(result)
        if code is not None:
            return code
        if span.status_code == STATUS_ERROR:
            for event in span.events:
                if event.name == "exception":
                    exc = short_code(event.attributes.get("exception.type"))
                    if exc is not None:
                        return exc
            # Status messages may hold customer text: only match known codes, never copy.
            message = span.status_message.lower()
            for known in self.status_codes:
                if known in message:
                    return known
            return "error"
        return None


def messages(span: SpanRecord, message: Any) -> list[str]:
    texts = [
        e.attributes["exception.message"]
        for e in span.events
        if e.name == "exception" and isinstance(e.attributes.get("exception.message"), str)
    ]
    if span.status_message:
        texts.append(span.status_message)
    if isinstance(message, str):
        texts.append(message)
    return texts
