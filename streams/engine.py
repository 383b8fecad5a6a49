"""The embedded engine: spans in, events and run summaries out, no broker.

The replay's driver of the shared run loop (streams/runloop.py), which the stream worker
drives too (streams/worker/driver.py). `loopwatch replay` drives it from files; tests drive
it directly.
"""

from __future__ import annotations

import heapq
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detectors.fingerprint import Fingerprinter
from detectors.model import Step
from detectors.policy import Policy
from detectors.state import RunState
from streams import native_spec
from streams.errors import DecodeError, InputError
from streams.native_spec import NativeBatch
from streams.normalize import Normalizer
from streams.otlp import OTLP_PROTO, decode_record
from streams.runloop import MemoryStore, RunLoop, group_steps
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
    """The replay driver of the run loop (streams/runloop.py): batches of one or more
    sources, state in dicts, and an event-time watermark as the clock. The loop releases a
    run's buffered steps on its next arrival or at its end (no release timer) and finalizes
    runs whose deadline the watermark passed. It is also the loop's sink: events and
    summaries go to the callbacks and into `stats`.

    Sources are partitions, as for the worker: each source (an input file) delivers its
    own spans in time order, within the allowed lateness, and the watermark is the minimum,
    over the sources that still have data, of how far each has got (the latest span end it
    delivered; before its first batch, where its data begins). `feed` without a source is
    one source; `feed_sources` reads several merged by time."""

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
        self.span_path = native_spec.build(policy, fingerprinter)  # None: Python normalizer
        self.on_event = on_event
        self.on_summary = on_summary
        self.on_invalid = on_invalid
        self.store = MemoryStore(FINISHED_MEMORY)
        self.loop = RunLoop(policy, self.store, release_timer=False)
        self.runs: dict[str, RunState] = self.store.states  # live runs (tests, tools)
        self.finished = self.store.finished
        self.watermark_ns = 0
        self.marks: dict[int, int] = {}  # open source -> how far it has got (event time)
        self.stats = Stats()

    # ------------------------------------------------------------------ input

    def feed(self, spans: Iterable[SpanRecord] | NativeBatch, source: int = 0) -> None:
        """One delivered batch (an OTLP export message) of `source`: decoded spans, or
        the native normalizer's result for it."""
        self.stats.batches += 1
        if isinstance(spans, NativeBatch):
            self.stats.spans += spans.spans
            for span_id, trace_id, exc in spans.invalid_spans:
                self._report_invalid(span_id, trace_id, exc)
            by_run, invalid, max_end = spans.by_run, spans.invalid, spans.max_end
        else:
            spans = spans if isinstance(spans, list) else list(spans)
            self.stats.spans += len(spans)
            by_run, invalid, max_end = group_steps(self.normalizer, spans, self._invalid)
        self.stats.invalid_spans += invalid
        marks = self.marks
        if max_end > marks.get(source, 0):
            marks[source] = max_end
        low = min(marks.values()) if marks else 0
        if low > self.watermark_ns:
            self.watermark_ns = low
        self.feed_steps(by_run)

    def feed_bytes(
        self, data: bytes, source: int = 0, where: str = "record", encoding: str = OTLP_PROTO
    ) -> None:
        """One OTLP export message of `source` (protobuf, or JSON): the native span path when
        it can take it, else decoded (DecodeError for malformed input) and normalized in
        Python."""
        batch = native_spec.normalize(self.span_path, data, encoding)
        self.feed(batch if batch is not None else decode_record(data, encoding, where), source)

    def open_source(self, source: int, start_ns: int) -> None:
        """`source` has data from `start_ns` on: the watermark waits for it from now."""
        self.marks[source] = start_ns

    def end_source(self, source: int) -> None:
        """`source` has no more data: it no longer holds the watermark back."""
        self.marks.pop(source, None)
        if self.marks:
            low = min(self.marks.values())
            if low > self.watermark_ns:
                self.watermark_ns = low
                self.loop.due(0, low, self)

    def feed_sources(
        self,
        sources: Sequence[Iterable[list[SpanRecord] | NativeBatch]],
        on_batch: Callable[[int], object] | None = None,
        firsts: Sequence[tuple[int, int] | None] | None = None,
    ) -> None:
        """Batches of several sources merged by time: the next batch fed is always the
        one, among each open source's next batch, that ends first (its latest span end;
        ties: the earlier source). One batch per source is held in memory. `on_batch(source)`
        is called after each batch; `close` is left to the caller.

        `firsts[i]`: the (earliest, latest) span end of source i's first batch when known
        (None: not known). Such a source is started (its iterator's first `next`) only when
        that batch is due, so of many files only those overlapping in time are open at
        once; until then its start holds the watermark back as an open source's does."""
        heads: list[
            tuple[
                int, int, list[SpanRecord] | NativeBatch, Iterator[list[SpanRecord] | NativeBatch]
            ]
        ] = []
        waiting: list[tuple[int, int]] = []  # (first batch's latest end, source): not started

        def start(i: int) -> None:
            it = iter(sources[i])
            first = next(it, None)
            if first is None:
                if i in self.marks:  # announced by `firsts`, but nothing came
                    self.end_source(i)
                return
            begins, ends = _span_ends(first)
            if i not in self.marks:
                self.open_source(i, begins)
            heapq.heappush(heads, (ends, i, first, it))

        for i in range(len(sources)):
            known = firsts[i] if firsts is not None else None
            if known is None:
                start(i)
            else:
                self.open_source(i, known[0])
                waiting.append((known[1], i))
        heapq.heapify(waiting)
        while heads or waiting:
            if waiting and (not heads or waiting[0] < heads[0][:2]):
                start(heapq.heappop(waiting)[1])
                continue
            _, i, spans, it = heapq.heappop(heads)
            self.feed(spans, i)
            if on_batch is not None:
                on_batch(i)
            nxt = next(it, None)
            if nxt is None:
                self.end_source(i)
            else:
                heapq.heappush(heads, (_span_ends(nxt)[1], i, nxt, it))

    def _invalid(self, span: Any, exc: Exception) -> None:
        self._report_invalid(span.span_id, span.trace_id, type(exc).__name__)

    def _report_invalid(self, span_id: str, trace_id: str, exc: str) -> None:
        if self.on_invalid is not None:
            self.on_invalid(str(InputError(f"span {span_id} of trace {trace_id}: {exc}")))

    def feed_steps(self, by_run: dict[str, list[Step]]) -> None:
        loop, now = self.loop, self.watermark_ns
        for run_id, steps in by_run.items():
            loop.apply(0, run_id, [(steps, None)], now, self)
        loop.due(0, now, self)

    def close(self) -> None:
        """End of input: finalize every open run (in run id order, for stable output)."""
        self.loop.close(sorted(self.store.states), self.watermark_ns, self)

    # ------------------------------------------------------------------ the loop's sink

    def event(self, event: dict[str, Any]) -> None:
        stats = self.stats
        stats.events += 1
        stats.loops_by_shape[event["shape"]] += 1
        if not event["labels_pending"]:  # else counted with the run's summary
            _count(stats.loops_by_prompt, event["prompt_version"] or "unknown")
        if event["tool_name"]:
            _count(stats.loops_by_tool, f"{event['tool_name']}@{event['tool_version'] or '-'}")
        self.on_event(event)

    def summary(self, summary: dict[str, Any]) -> None:
        stats = self.stats
        stats.runs_finished += 1
        stats.runs_by_outcome[summary["outcome"]] += 1
        _count(stats.runs_by_prompt, summary["prompt_version"] or "unknown")
        for _ in summary["deferred_events"]:  # their run's final slice
            _count(stats.loops_by_prompt, summary["prompt_version"] or "unknown")
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


def _span_ends(spans: list[SpanRecord] | NativeBatch) -> tuple[int, int]:
    """The earliest and the latest span end of a batch (0, 0 when it has none)."""
    if isinstance(spans, NativeBatch):
        return spans.first_end, spans.last_end
    ends = [s.end_ns for s in spans if isinstance(s.end_ns, int)]
    return (min(ends), max(ends)) if ends else (0, 0)


def replay_files(
    engine: Engine,
    files: Sequence[Path],
    on_decode_error: Callable[[DecodeError], None],
    on_progress: Callable[[int], object] | None = None,
) -> None:
    """Feed export files to `engine`, each file a source, merged by time: read one after
    another, a run whose root is in the first file would be finalized before its spans in
    the second are read. `on_progress(bytes)` after each batch: the size of the files read
    to their end. The caller closes the engine.

    Each file's first batch is read ahead (and the file closed again) to learn where it
    starts; a file is then opened when its first batch is due and closed at its end, so a
    directory of rotated exports (one file after another in time) has one or two files
    open, not one per file (the process's file limit)."""
    from streams.files import iter_batches

    done = 0

    def batches(path: Path) -> Iterator[list[SpanRecord] | NativeBatch]:
        nonlocal done
        for _source, spans in iter_batches([path], on_decode_error, engine.span_path):
            yield spans
        done += path.stat().st_size

    def first_batch(path: Path) -> tuple[int, int] | None:
        # errors are reported when the file is read for real (None: read it eagerly)
        read = iter_batches([path], lambda _e: None, engine.span_path)
        try:
            for _source, spans in read:
                return _span_ends(spans)
            return None
        finally:
            read.close()  # and the file with it

    def progress(source: int) -> None:
        if on_progress is not None:
            on_progress(done)

    engine.feed_sources(
        [batches(f) for f in files], progress, firsts=[first_batch(f) for f in files]
    )


def _count(counter: Counter[str], label: str) -> None:
    """Count under a free-form label, at most MAX_LABELS distinct ones (labels come from
    producers' attributes: a bounded table, whatever they send)."""
    if label not in counter and len(counter) >= MAX_LABELS:
        label = "(other)"
    counter[label] += 1
