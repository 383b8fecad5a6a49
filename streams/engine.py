"""The embedded engine: spans in, events and run summaries out, no broker.

It owns the run table (run_id → RunState), the event-time watermark and the finalization
schedule. `loopwatch replay` drives it from files; tests drive it directly. The stream
worker runs the same detectors/pipeline.py functions with its state in a faust Table.
"""

from __future__ import annotations

import heapq
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from alerts.events import build_event
from detectors import pipeline
from detectors.fingerprint import Fingerprinter
from detectors.model import Step
from detectors.policy import Policy
from detectors.state import RunState
from streams.errors import InputError
from streams.normalize import STEP_ERRORS, Normalizer
from streams.spans import SpanRecord

MAX_LABELS = 1_000  # distinct prompt/tool labels counted in Stats; the rest go to "(other)"
FINISHED_MEMORY = 100_000  # finalized run ids remembered to count spans arriving after the end

EventSink = Callable[[dict[str, Any]], object]


def fingerprinter_from_env(warn: Callable[[str], None] | None = None) -> Fingerprinter:
    key = os.environ.get("LOOPWATCH_FINGERPRINT_KEY", "")
    if not key and warn is not None:
        warn(
            "loopwatch: LOOPWATCH_FINGERPRINT_KEY is not set: fingerprints fall back to unkeyed "
            "SHA-256 (set a secret key in production)"
        )
    return Fingerprinter(key.encode("utf-8") if key else None)


@dataclass
class Stats:
    spans: int = 0
    batches: int = 0
    runs_started: int = 0
    runs_finished: int = 0
    events: int = 0
    duplicate_spans: int = 0
    late_spans: int = 0
    spans_after_finalize: int = 0
    invalid_spans: int = 0
    decode_errors: int = 0
    loops_by_shape: Counter[str] = field(default_factory=Counter)
    loops_by_prompt: Counter[str] = field(default_factory=Counter)
    loops_by_tool: Counter[str] = field(default_factory=Counter)
    runs_by_outcome: Counter[str] = field(default_factory=Counter)
    runs_by_prompt: Counter[str] = field(default_factory=Counter)
    looping_runs: int = 0


class Engine:
    def __init__(
        self,
        policy: Policy,
        fingerprinter: Fingerprinter,
        on_event: EventSink,
        on_summary: EventSink | None = None,
        on_invalid: Callable[[str], None] | None = None,
    ) -> None:
        self.policy = policy
        self.normalizer = Normalizer(policy, fingerprinter)
        self.on_event = on_event
        self.on_summary = on_summary
        self.on_invalid = on_invalid
        self.runs: dict[str, RunState] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.deadlines: dict[str, int] = {}
        self.schedule: list[tuple[int, str]] = []
        self.watermark_ns = 0
        self.stats = Stats()
        self._grace_ns = int(policy.finalize_grace_seconds * 1e9)
        self._idle_ns = int(policy.idle_timeout_seconds * 1e9)

    # ------------------------------------------------------------------ input

    def feed(self, spans: Iterable[SpanRecord]) -> None:
        """One delivered batch (an OTLP export message)."""
        self.stats.batches += 1
        by_run: dict[str, list[Step]] = {}
        step_of = self.normalizer.step
        for span in spans:
            self.stats.spans += 1
            try:
                step = step_of(span)
            except STEP_ERRORS as exc:
                self.stats.invalid_spans += 1
                if self.on_invalid is not None:
                    self.on_invalid(
                        str(
                            InputError(
                                f"span {span.span_id} of trace {span.trace_id}: {type(exc).__name__}"
                            )
                        )
                    )
                continue
            by_run.setdefault(step.run_id, []).append(step)
            if step.end_ns > self.watermark_ns:
                self.watermark_ns = step.end_ns
        self.feed_steps(by_run)

    def feed_steps(self, by_run: dict[str, list[Step]]) -> None:
        policy = self.policy
        for run_id, steps in by_run.items():
            state = self.runs.get(run_id)
            if state is None:
                if run_id in self.finished:
                    self.stats.spans_after_finalize += len(steps)
                    continue
                state = pipeline.new_state(run_id)
                self.runs[run_id] = state
                self.stats.runs_started += 1
            before_dup, before_late = state.duplicate_spans, state.late_spans
            for step in steps:
                self._emit(state, pipeline.ingest(policy, state, step))
            self._emit(state, pipeline.release(policy, state))
            self.stats.duplicate_spans += state.duplicate_spans - before_dup
            self.stats.late_spans += state.late_spans - before_late
            self._schedule(run_id, state)
        self._finalize_due()

    def close(self) -> None:
        """End of input: finalize every open run (in run id order, for stable output)."""
        for run_id in sorted(self.runs):
            self._finalize(run_id)
        self.schedule.clear()
        self.deadlines.clear()

    # ------------------------------------------------------------------ finalization

    def _schedule(self, run_id: str, state: RunState) -> None:
        # Deadlines count from when the run was last seen on the watermark, not from its own
        # timestamps: a file of older spans replayed after newer ones (or a lagging
        # collector) must not find its runs already finalized.
        seen_at = max(self.watermark_ns, state.max_end_ns)
        if state.root_end_ns is not None:
            deadline = seen_at + self._grace_ns
        else:
            deadline = seen_at + self._idle_ns
        if self.deadlines.get(run_id) != deadline:
            self.deadlines[run_id] = deadline
            heapq.heappush(self.schedule, (deadline, run_id))

    def _finalize_due(self) -> None:
        schedule = self.schedule
        while schedule and schedule[0][0] <= self.watermark_ns:
            deadline, run_id = heapq.heappop(schedule)
            if self.deadlines.get(run_id) == deadline:
                self._finalize(run_id)

    def _finalize(self, run_id: str) -> None:
        state = self.runs.pop(run_id, None)
        self.deadlines.pop(run_id, None)
        if state is None:
            return
        findings, summary = pipeline.finalize(self.policy, state)
        self._emit(state, findings)
        self.finished[run_id] = None
        if len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)
        stats = self.stats
        stats.runs_finished += 1
        stats.runs_by_outcome[summary["outcome"]] += 1
        _count(stats.runs_by_prompt, summary["prompt_version"] or "unknown")
        if summary["shapes"]:
            stats.looping_runs += 1
        if self.on_summary is not None:
            self.on_summary(summary)

    def _emit(self, state: RunState, findings: list[Any]) -> None:
        for finding in findings:
            event = build_event(finding, state.run_id, self.policy)
            stats = self.stats
            stats.events += 1
            stats.loops_by_shape[event["shape"]] += 1
            _count(stats.loops_by_prompt, event["prompt_version"] or "unknown")
            if event["tool_name"]:
                _count(stats.loops_by_tool, f"{event['tool_name']}@{event['tool_version'] or '-'}")
            self.on_event(event)


def _count(counter: Counter[str], label: str) -> None:
    """Count under a free-form label, at most MAX_LABELS distinct ones (labels come from
    producers' attributes: a bounded table, whatever they send)."""
    if label not in counter and len(counter) >= MAX_LABELS:
        label = "(other)"
    counter[label] += 1
