"""The run loop without a broker: its sink for replays (`Tally`: callbacks and `Stats`) and
`Engine`, a driver that feeds batches in arrival order (tests, benchmarks).

`loopwatch replay` and `gate` are streams/replay/runs.py, which feeds each run whole and so
gives the same result for any order of the input.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from detectors.fingerprint import Fingerprinter
from detectors.holds import HeldCall
from detectors.model import Step
from detectors.policy import Policy
from detectors.state import RunState
from streams.errors import InputError
from streams.runloop.loop import MemoryStore, RunLoop, loops_counted
from streams.spanpath import SpanPath, StepBatch
from streams.spanpath.otlp import OTLP_PROTO
from streams.spanpath.spans import SpanRecord

MAX_LABELS = 1_000  # distinct prompt/tool labels counted in Stats; the rest go to "(other)"
FINISHED_MEMORY = 100_000  # finalized run ids remembered to count spans arriving after the end

EventSink = Callable[[dict[str, Any]], object]


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


class Tally:
    """The replay's sink of the run loop (streams/runloop/loop.py `Sink`): events and summaries
    go to the callbacks, and everything is counted into `stats`."""

    def __init__(
        self,
        on_event: EventSink,
        on_summary: EventSink | None = None,
        on_invalid: Callable[[str], None] | None = None,
    ) -> None:
        self.on_event = on_event
        self.on_summary = on_summary
        self.on_invalid = on_invalid
        self.stats = Stats()

    def arrived(self, batch: StepBatch) -> None:
        """One export message's steps came in: counted, its invalid spans reported (ids
        and the exception's name, never the span's content)."""
        stats = self.stats
        stats.batches += 1
        stats.spans += batch.spans
        stats.invalid_spans += batch.invalid
        if self.on_invalid is not None:
            for span_id, trace_id, exc in batch.invalid_spans:
                self.on_invalid(str(InputError(f"span {span_id} of trace {trace_id}: {exc}")))

    def event(self, event: dict[str, Any]) -> None:
        stats = self.stats
        stats.events += 1
        stats.loops_by_shape[event["shape"]] += 1
        for _ev, run in loops_counted([event], []):
            _count(stats.loops_by_prompt, run["prompt_version"] or "unknown")
        if event["tool_name"]:
            _count(stats.loops_by_tool, f"{event['tool_name']}@{event['tool_version'] or '-'}")
        self.on_event(event)

    def summary(self, summary: dict[str, Any]) -> None:
        stats = self.stats
        stats.runs_finished += 1
        stats.runs_by_outcome[summary["outcome"]] += 1
        _count(stats.runs_by_prompt, summary["prompt_version"] or "unknown")
        for _ev, run in loops_counted([], [summary]):
            _count(stats.loops_by_prompt, run["prompt_version"] or "unknown")
        if summary["shapes"]:
            stats.looping_runs += 1
        if self.on_summary is not None:
            self.on_summary(summary)

    def started(self) -> None:
        self.stats.runs_started += 1

    def counted(self, duplicate_spans: int, late_spans: int) -> None:
        self.stats.duplicate_spans += duplicate_spans
        self.stats.late_spans += late_spans

    def after_finalize(self, spans: int) -> None:
        self.stats.spans_after_finalize += spans

    def evicted_run(self) -> None:
        pass  # the replay has no capacity bound

    def vouched(self, arrival_ns: int) -> None:
        pass  # the replay has no input clock

    def held(self, call: HeldCall) -> None:
        pass  # holds live in the worker; a recording's denials name holds gone long since

    def failed(self, run_id: str, exc: Exception) -> None:
        raise exc  # the replay stops on a failed run, as on a failed arrival


class Engine:
    """The run loop over batches in arrival order, state in dicts, an event-time watermark
    (the latest span end delivered) as the clock: the stream's processing of keyed input
    without a broker, for tests and benchmarks of the loop's bounds and state. The loop
    releases a run's buffered steps on its next arrival or at its end (no release timer)
    and finalizes runs whose deadline the watermark passed, so the result depends on the
    arrival order; `loopwatch replay`, whose result must not, is streams/replay/runs.py."""

    def __init__(
        self,
        policy: Policy,
        fingerprinter: Fingerprinter,
        on_event: EventSink,
        on_summary: EventSink | None = None,
        on_invalid: Callable[[str], None] | None = None,
    ) -> None:
        self.policy = policy
        self.span_path = SpanPath.of(policy, fingerprinter)
        self.tally = Tally(on_event, on_summary, on_invalid)
        self.stats = self.tally.stats
        self.store = MemoryStore(FINISHED_MEMORY)
        self.loop = RunLoop(policy, self.store, release_timer=False)
        self.runs: dict[str, RunState] = self.store.states  # live runs (tests, tools)
        self.finished = self.store.finished
        self.watermark_ns = 0

    def feed(self, spans: Sequence[SpanRecord] | StepBatch) -> None:
        """One delivered batch (an OTLP export message): its decoded spans, or its steps."""
        batch = self.span_path.steps(spans)
        self.tally.arrived(batch)
        if batch.max_end > self.watermark_ns:
            self.watermark_ns = batch.max_end
        self.feed_steps(batch.by_run)

    def feed_bytes(self, data: bytes, where: str = "record", encoding: str = OTLP_PROTO) -> None:
        """One OTLP export message (protobuf, or JSON); DecodeError when it is malformed."""
        self.feed(self.span_path.message(data, encoding, where))

    def feed_steps(self, by_run: dict[str, list[Step]]) -> None:
        loop, now, sink = self.loop, self.watermark_ns, self.tally
        for run_id, steps in by_run.items():
            loop.apply(0, run_id, [(steps, None)], now, sink)
        loop.due(0, now, sink)

    def close(self) -> None:
        """End of input: finalize every open run (in run id order, for stable output)."""
        self.loop.close(sorted(self.store.states), self.watermark_ns, self.tally)


def _count(counter: Counter[str], label: str) -> None:
    """Count under a free-form label, at most MAX_LABELS distinct ones (labels come from
    producers' attributes: a bounded table, whatever they send)."""
    if label not in counter and len(counter) >= MAX_LABELS:
        label = "(other)"
    counter[label] += 1
