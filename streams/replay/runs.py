"""`loopwatch replay` and `gate`: the same spans give the same events and run summaries in
any order, across files and inside a file, with any batching and duplication.

Every export message is normalized and its steps are held by run until the end of the
input; then each run is fed to the run loop whole (`RunLoop.whole`, streams/runloop/loop.py):
in runtime order, cut at the first gap in its span end times that the stream's
finalization would not have waited for. Nothing about a run depends on where its spans
were in the input. Runs come out ordered by their earliest span start, then run id.

Memory: a held step costs about STEP_BYTES. Past `memory_mb` the held runs are spilled to
temporary files bucketed by run id (`Spill`), and at the end read back one bucket at a
time, so a run's steps always meet and memory stays near the bound whatever the input's
size (up to BUCKETS times the bound on disk).
"""

from __future__ import annotations

import contextlib
import marshal
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alerts.trace_links import TraceLinks
from detectors.errors import LoopwatchError
from detectors.fingerprint import Fingerprinter
from detectors.model import Step, step_values
from detectors.policy import Policy
from streams.errors import DecodeError
from streams.replay.engine import Tally
from streams.runloop.loop import MemoryStore, RunLoop
from streams.spanpath import SpanPath, StepBatch
from streams.spanpath.otlp import OTLP_PROTO
from streams.spanpath.spans import SpanRecord

STEP_BYTES = 700  # a held step: measured 680 B with the native span path (shared strs)
DEFAULT_MEMORY_MB = 512  # about 770k held steps before the first spill
BUCKETS = 128

EventSink = Callable[[dict[str, Any]], object]


@dataclass
class Order:
    """What the replay saw of the input's order and what it held (for the report)."""

    # the farthest a batch of a file reached back behind the latest end before it in that
    # file (the order between files never matters: they are read one after another)
    disorder_ns: int = 0
    split_runs: int = 0  # runs cut at a gap the stream would not have waited for
    largest_gap_ns: int = 0
    gap_setting: str = ""  # the policy setting that bounded that gap
    held_steps_peak: int = 0
    spilled_steps: int = 0
    spill_bytes: int = 0


class Spill:
    """Held runs on disk, bucketed by run id: each spill appends one marshal record per
    bucket (a list of (run id, step field tuples)). A private temporary directory, removed
    by `close`; marshal is safe to read here because only this process wrote it."""

    def __init__(self, parent: str | None = None) -> None:
        try:
            self.dir = Path(tempfile.mkdtemp(prefix="loopwatch-replay-", dir=parent))
        except OSError as exc:
            raise LoopwatchError(
                f"cannot create a spill directory in {parent or tempfile.gettempdir()}: "
                f"{exc.strerror} (set TMPDIR, or raise --memory-mb)"
            ) from None
        self.bytes = 0

    def _path(self, bucket: int) -> Path:
        return self.dir / f"{bucket:03d}.marshal"

    def write(self, runs: dict[str, list[Step]]) -> None:
        buckets: dict[int, list[tuple[str, list[tuple[Any, ...]]]]] = {}
        for run_id, steps in runs.items():
            bucket = zlib.crc32(run_id.encode()) % BUCKETS
            buckets.setdefault(bucket, []).append((run_id, list(map(step_values, steps))))
        for bucket, items in buckets.items():
            data = marshal.dumps(items, 4)
            try:
                with open(self._path(bucket), "ab") as f:
                    f.write(data)
            except OSError as exc:
                raise LoopwatchError(
                    f"cannot spill held spans to {self.dir}: {exc.strerror} "
                    "(free space there, set TMPDIR elsewhere, or raise --memory-mb)"
                ) from None
            self.bytes += len(data)

    def buckets(self) -> Iterator[dict[str, list[Step]]]:
        """Each bucket's runs with all their steps (a bucket's file is removed once read)."""
        for bucket in range(BUCKETS):
            path = self._path(bucket)
            if not path.exists():
                continue
            runs: dict[str, list[Step]] = {}
            with open(path, "rb") as f:
                while True:
                    try:
                        items = marshal.load(f)
                    except EOFError:
                        break
                    for run_id, values in items:
                        steps = [Step(*v) for v in values]
                        held = runs.get(run_id)
                        if held is None:
                            runs[run_id] = steps
                        else:
                            held.extend(steps)
            path.unlink()
            yield runs

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class Replay:
    """Export messages in, in any order; at `close`, every run's events and summary."""

    def __init__(
        self,
        policy: Policy,
        fingerprinter: Fingerprinter,
        on_event: EventSink,
        on_summary: EventSink | None = None,
        on_invalid: Callable[[str], None] | None = None,
        *,
        memory_mb: float = DEFAULT_MEMORY_MB,
        spill_dir: str | None = None,
        links: TraceLinks | None = None,
    ) -> None:
        self.policy = policy
        self.span_path = SpanPath.of(policy, fingerprinter)
        self.tally = Tally(on_event, on_summary, on_invalid)
        self.stats = self.tally.stats
        self.order = Order()
        # each run comes whole, once: no finished runs to remember
        self.loop = RunLoop(policy, MemoryStore(0), release_timer=False, links=links)
        self.held: dict[str, list[Step]] = {}
        self.held_steps = 0
        self.max_held = max(1, int(memory_mb * 1024 * 1024 / STEP_BYTES))
        self.spill_dir = spill_dir
        self.spill: Spill | None = None
        self._latest_end = 0

    def feed(self, spans: Sequence[SpanRecord] | StepBatch) -> None:
        """One export message: its decoded spans, or its steps."""
        batch = self.span_path.steps(spans)
        self.tally.arrived(batch)
        if batch.by_run and batch.first_end:
            order = self.order
            if self._latest_end - batch.first_end > order.disorder_ns:
                order.disorder_ns = self._latest_end - batch.first_end
            if batch.last_end > self._latest_end:
                self._latest_end = batch.last_end
        held = self.held
        for run_id, steps in batch.by_run.items():
            have = held.get(run_id)
            if have is None:
                held[run_id] = steps
            else:
                have.extend(steps)
            self.held_steps += len(steps)
        if self.held_steps > self.order.held_steps_peak:
            self.order.held_steps_peak = self.held_steps
        if self.held_steps > self.max_held:
            self._spill()

    def start_source(self) -> None:
        """The batches fed from now on are another file's (for `Order.disorder_ns`)."""
        self._latest_end = 0

    def feed_bytes(self, data: bytes, where: str = "record", encoding: str = OTLP_PROTO) -> None:
        """One OTLP export message (protobuf, or JSON); DecodeError when it is malformed."""
        self.feed(self.span_path.message(data, encoding, where))

    def _spill(self) -> None:
        if self.spill is None:
            self.spill = Spill(self.spill_dir)
        self.spill.write(self.held)
        self.order.spilled_steps += self.held_steps
        self.order.spill_bytes = self.spill.bytes
        self.held = {}
        self.held_steps = 0

    def close(self) -> None:
        """End of input: every held run, whole."""
        if self.spill is None:
            self._runs(self.held)
        else:
            try:
                if self.held:
                    self._spill()
                for runs in self.spill.buckets():
                    self._runs(runs)
            finally:
                self.spill.close()
        self.held = {}
        self.held_steps = 0

    def _runs(self, runs: dict[str, list[Step]]) -> None:
        def earliest(run_id: str) -> tuple[int, str]:
            return min(s.start_ns for s in runs[run_id]), run_id

        order, loop, sink = self.order, self.loop, self.tally
        for run_id in sorted(runs, key=earliest):
            gap, setting = loop.whole(run_id, runs.pop(run_id), sink)
            if gap:
                order.split_runs += 1
                if gap > order.largest_gap_ns:
                    order.largest_gap_ns, order.gap_setting = gap, setting


def replay_files(
    replay: Replay,
    files: Sequence[Path],
    on_decode_error: Callable[[DecodeError], None],
    on_progress: Callable[[int], object] | None = None,
) -> None:
    """Feed export files to `replay`, one after another (their order does not matter).
    `on_progress(bytes)` before each message is fed: the bytes read of the files so far (of
    a gzipped file, its compressed bytes). The caller closes the replay."""
    from streams.replay.files import iter_batches

    done = 0  # bytes of the files read to their end

    def read(n: int) -> None:  # n bytes of this file read, before each of its messages
        if on_progress is not None:
            on_progress(done + n)

    for path in files:
        replay.start_source()
        for _source, spans in iter_batches([path], on_decode_error, replay.span_path, read):
            replay.feed(spans)
        with contextlib.suppress(OSError):
            done += path.stat().st_size


def parse_memory_mb(text: str) -> float:
    """A memory bound in MiB (`--memory-mb`, LOOPWATCH_REPLAY_MEMORY_MB): a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"expected a number of MiB > 0, got {text!r}")
    return value


def memory_mb_from_env() -> float:
    raw = os.environ.get("LOOPWATCH_REPLAY_MEMORY_MB", "")
    if not raw:
        return DEFAULT_MEMORY_MB
    try:
        return parse_memory_mb(raw)
    except ValueError as exc:
        raise LoopwatchError(f"LOOPWATCH_REPLAY_MEMORY_MB: {exc}") from None
