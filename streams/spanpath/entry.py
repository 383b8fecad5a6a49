"""The span path's one entry: an OTLP export message (or its decoded spans) in, the steps of
its spans grouped by run out, as a `StepBatch`.

Natively (loopwatch_native, streams/spanpath/native_spec.py) when the extension is built and takes
the policy and the message; else decoded (streams/spanpath/otlp/) and normalized in Python
(streams/spanpath/normalize.py), which stays the fallback and the oracle: the differential tests
(tests/unit/native/test_normalize.py) hold the two equal. The replay, the worker's input
reader, the file reader and the benchmarks all come through here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from detectors.fingerprint import Fingerprinter
from detectors.model import Step
from detectors.policy import Policy
from streams.spanpath import native_spec
from streams.spanpath.normalize import STEP_ERRORS, Normalizer
from streams.spanpath.otlp import OTLP_PROTO, decode_record, decode_record_py
from streams.spanpath.spans import SpanRecord, StepBatch

_BUILD: Any = object()


Decode = Callable[[bytes, str, str], list[SpanRecord]]  # (data, encoding, where)


class SpanPath:
    def __init__(
        self, normalizer: Normalizer, native: Any = _BUILD, decode: Decode = decode_record
    ) -> None:
        """`native`: the extension's span path to use (default: built for the normalizer's
        policy and key; None when the extension is missing or does not take the policy).
        `decode`: the decoder of the messages the native path does not take (the native
        decoder when the extension is built: the same records as the Python one)."""
        self.normalizer = normalizer
        if native is _BUILD:
            native = native_spec.build(normalizer.policy, normalizer.fp)
        self.native = native
        self.decode = decode

    @classmethod
    def python(cls, normalizer: Normalizer) -> SpanPath:
        """The pure-Python path, as a machine without the extension runs it."""
        return cls(normalizer, None, decode_record_py)

    @classmethod
    def of(cls, policy: Policy, fingerprinter: Fingerprinter) -> SpanPath:
        return cls(Normalizer(policy, fingerprinter))

    def message(self, data: bytes, encoding: str = OTLP_PROTO, where: str = "record") -> StepBatch:
        """One export message in `encoding`. Raises DecodeError (naming `where`) for
        malformed input, or an encoding that is not OTLP protobuf or JSON."""
        batch = native_spec.normalize(self.native, data, encoding)
        return batch if batch is not None else self.spans(self.decode(data, encoding, where))

    def steps(self, spans: Sequence[SpanRecord] | StepBatch) -> StepBatch:
        """A message's steps from its decoded spans, or the steps as they are."""
        return spans if isinstance(spans, StepBatch) else self.spans(spans)

    def spans(self, spans: Sequence[SpanRecord]) -> StepBatch:
        """Decoded spans of one message, normalized in Python."""
        invalid_spans: list[tuple[str, str, str]] = []

        def invalid(span: Any, exc: Exception) -> None:
            invalid_spans.append((span.span_id, span.trace_id, type(exc).__name__))

        by_run, skipped, max_end = group_steps(self.normalizer, spans, invalid)
        ends = [span.end_ns for span in spans]  # every span's, valid or not, as natively
        return StepBatch(
            by_run,
            skipped,
            max_end,
            len(spans),
            invalid_spans,
            min(ends, default=0),
            max(ends, default=0),
        )


def group_steps(
    normalizer: Normalizer,
    spans: Iterable[Any],
    on_invalid: Callable[[Any, Exception], None] | None = None,
) -> tuple[dict[str, list[Step]], int, int]:
    """Normalize a decoded batch and group its steps by run id (first-seen order). Returns
    (steps by run, invalid spans skipped, the latest end time of the steps)."""
    by_run: dict[str, list[Step]] = {}
    invalid = 0
    max_end = 0
    step_of = normalizer.step
    for span in spans:
        try:
            step = step_of(span)
        except STEP_ERRORS as exc:
            invalid += 1
            if on_invalid is not None:
                on_invalid(span, exc)
            continue
        by_run.setdefault(step.run_id, []).append(step)
        if step.end_ns > max_end:
            max_end = step.end_ns
    return by_run, invalid, max_end
