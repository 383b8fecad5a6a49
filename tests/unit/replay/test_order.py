"""`loopwatch replay` gives the same events and run summaries for any order of the same
spans (streams/replay/runs.py): across files and inside a file, any batching, any duplication,
files of every format. The deliveries are made here from the repository's own corpora
(tests/support/deliveries.py): the spans dealt into random batches in random order, about 30% of
the batches sent again later, the batches dealt over several files.

Before the replay held runs whole, a shuffled delivery of the examples lost 5-9 of their
15 events (runs finalized on a watermark that a shuffled file drags to its end)."""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from bench.corpus import export_messages
from detectors.fingerprint import Fingerprinter
from detectors.policy import Policy
from streams.cli.main import main
from streams.replay.engine import Engine
from streams.replay.files import expand_paths, write_pb
from streams.replay.runs import Replay, replay_files
from tests.otlp_build import EXAMPLES, example_files, file_messages
from tests.paths import FIXTURES
from tests.spankit import Run, example_policy
from tests.support.deliveries import reshuffle, write_files

POLICY = example_policy()
FRAMEWORKS = FIXTURES / "frameworks"


@cache
def corpus(name: str) -> tuple[bytes, ...]:
    """Export messages of one of the repository's corpora."""
    if name == "examples":
        files = example_files()
    elif name == "frameworks":
        files = sorted(p for p in FRAMEWORKS.iterdir() if p.suffix in (".pb", ".jsonl"))
    else:
        return tuple(export_messages(6_000, seed=11, loop_share=0.2))
    return tuple(m for f in files for m in file_messages(f))


class Result:
    def __init__(self, replay: Replay, events: list[dict[str, Any]], runs: list[dict[str, Any]]):
        self.stats, self.order = replay.stats, replay.order
        self.events = [json.dumps(e, sort_keys=True) for e in events]
        self.duplicates = sum(r["duplicate_spans"] for r in runs)
        # the run summaries less what the delivery decides (how many copies came)
        self.runs = [
            json.dumps({k: v for k, v in r.items() if k != "duplicate_spans"}, sort_keys=True)
            for r in runs
        ]


def replay(paths: list[Path], policy: Policy = POLICY, **options: Any) -> Result:
    events: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    r = Replay(policy, Fingerprinter(b"k"), events.append, runs.append, **options)
    errors: list[Exception] = []
    replay_files(r, expand_paths(paths, errors.append), errors.append)
    r.close()
    assert errors == []
    return Result(r, events, runs)


def in_order(tmp_path: Path, name: str) -> Result:
    path = tmp_path / "in-order" / "traces.pb"
    path.parent.mkdir()
    write_pb(path, reshuffle(corpus(name), random.Random(0), order="time", dup_share=0))
    return replay([path])


@pytest.mark.parametrize("name", ["examples", "frameworks", "bench"])
@pytest.mark.parametrize("seed", range(4))
def test_any_order_batching_duplication_and_split_gives_the_in_order_result(
    tmp_path: Path, name: str, seed: int
) -> None:
    want = in_order(tmp_path, name)
    assert len(want.events) >= 15 and want.stats.spans_after_finalize == 0
    rng = random.Random(seed)
    batches = reshuffle(corpus(name), rng, batch=(1, rng.choice([3, 40, 400])))
    files = write_files(tmp_path / "shuffled", batches, rng, n=rng.randint(1, 5))
    got = replay([tmp_path / "shuffled"])
    # the same events in the same order, byte for byte, and the same summaries
    assert got.events == want.events
    assert got.runs == want.runs
    assert got.stats.spans_after_finalize == 0 and got.stats.late_spans == 0
    assert got.duplicates - want.duplicates == got.stats.spans - want.stats.spans > 0
    assert got.order.disorder_ns > 0 == want.order.disorder_ns
    assert replay(list(reversed(files))).events == want.events  # files named in any order


def test_the_arrival_order_driver_does_depend_on_the_order(tmp_path: Path) -> None:
    """The deliveries above are disordered enough to matter: fed in arrival order to the
    stream's loop (Engine, a watermark on the latest end), the shuffled examples' steps
    are released out of their runtime order and the events change."""
    want = in_order(tmp_path, "examples")
    events: list[dict[str, Any]] = []
    engine = Engine(POLICY, Fingerprinter(b"k"), events.append)
    for message in reshuffle(corpus("examples"), random.Random(1)):
        engine.feed_bytes(message)
    engine.close()
    got = sorted(json.dumps(e, sort_keys=True) for e in events)
    assert got != sorted(want.events)
    assert engine.stats.late_spans > 0


def test_spilled_runs_give_the_result_held_in_memory(tmp_path: Path) -> None:
    """Past its memory bound the replay spills held runs to disk by run id and reads them
    back a bucket at a time: the same runs and events (ordered within each bucket), and
    the spill directory is gone afterwards."""
    rng = random.Random(5)
    write_files(tmp_path / "in", reshuffle(corpus("bench"), rng), rng, n=3)
    held = replay([tmp_path / "in"])
    spill_parent = tmp_path / "spill"
    spill_parent.mkdir()
    spilled = replay([tmp_path / "in"], memory_mb=0.5, spill_dir=str(spill_parent))
    assert held.order.spilled_steps == 0
    assert spilled.order.spilled_steps >= spilled.stats.spans > 0  # every step, once or more
    assert spilled.order.held_steps_peak <= 0.5 * 2**20 / 700 + 400  # the bound, plus a batch
    assert sorted(spilled.events) == sorted(held.events)
    assert sorted(spilled.runs) == sorted(held.runs)
    assert list(spill_parent.iterdir()) == []


def gap_run(trace: int, gap_s: float) -> list[Any]:
    """A looping run whose last call ends `gap_s` after the run's root ended."""
    run = Run(trace=trace)
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "same"})
    run.root()
    run.tool("lookup_order", {"order_id": "A1"}, {"status": "same"}, gap_ms=int(gap_s * 1000))
    return run.spans


def test_a_span_after_its_runs_end_is_counted_the_same_in_any_order() -> None:
    """A span ending past finalize_grace_seconds after the root ended: the stream would
    have finalized the run before it came, so the replay does not feed it, whatever the
    order, and says how large the gap was and which setting bounded it."""
    spans = gap_run(1, gap_s=30) + gap_run(2, gap_s=3)

    def run(batches: list[list[Any]]) -> tuple[list[str], Replay]:
        events: list[dict[str, Any]] = []
        r = Replay(POLICY, Fingerprinter(b"k"), events.append)
        for b in batches:
            r.feed(b)
        r.close()
        return sorted(json.dumps(e, sort_keys=True) for e in events), r

    want, r = run([spans])
    assert r.stats.spans_after_finalize == 1 and r.order.split_runs == 1
    assert r.order.gap_setting == "finalize_grace_seconds"
    assert 20e9 < r.order.largest_gap_ns < 40e9
    backwards, r2 = run([[s] for s in reversed(spans)])
    assert backwards == want and r2.stats.spans_after_finalize == 1


def test_gate_fails_on_spans_after_their_runs_end_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.otlp_build import encode_request

    path = tmp_path / "gap.pb"
    write_pb(path, [encode_request(gap_run(1, gap_s=30)), encode_request(gap_run(2, gap_s=1))])
    config = str(EXAMPLES / "loopwatch.yaml")
    assert main(["gate", "--config", config, "--max-loop-rate", "1", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "gate: FAIL 1 spans came after their run ended" in out
    line = [x for x in err.splitlines() if "came after their run ended" in x]
    assert len(line) == 1 and "finalize_grace_seconds" in line[0] and ">= 30" in line[0]
    allowed = ["gate", "--config", config, "--max-loop-rate", "1", "--allow-after-finalize"]
    assert main([*allowed, str(path)]) == 0
    assert "gate: PASS" in capsys.readouterr().out


def test_many_files_replay_within_a_small_file_limit(tmp_path: Path) -> None:
    """Files are read one after another, one open at a time: 120 files replay under a
    limit of 64 open files with the result of one file."""
    import resource

    messages = corpus("bench")[:150]
    single = tmp_path / "one" / "all.pb"
    single.parent.mkdir()
    write_pb(single, messages)
    parts = tmp_path / "rotated"
    parts.mkdir()
    for n in range(120):
        write_pb(
            parts / f"traces-{n:04d}.pb",
            messages[n * len(messages) // 120 : (n + 1) * len(messages) // 120],
        )
    want = replay([single])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        got = replay([parts])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert (got.events, got.runs) == (want.events, want.runs)


def test_progress_moves_inside_one_large_file(tmp_path: Path) -> None:
    """The progress bar's bytes move message by message inside a file, not only when a
    file ends (one large protobuf file showed 0.0% until its end)."""
    messages = corpus("bench")[:60]
    path = tmp_path / "one.pb"
    write_pb(path, messages)
    seen: list[int] = []
    r = Replay(POLICY, Fingerprinter(b"k"), lambda e: None)
    replay_files(r, [path], print, seen.append)
    r.close()
    assert len(seen) == len(messages)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)  # every message moves it
    assert seen[0] == 4 + len(messages[0]) and seen[-1] == path.stat().st_size
    gz = tmp_path / "one.pb.gz"
    write_pb(gz, messages)
    seen_gz: list[int] = []
    replay_files(Replay(POLICY, Fingerprinter(b"k"), lambda e: None), [gz], print, seen_gz.append)
    assert seen_gz == sorted(seen_gz) and 0 < seen_gz[-1] <= gz.stat().st_size
