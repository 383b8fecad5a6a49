"""Detection's share of the replay, on its own: the bench corpus is normalized to steps
once (the native span path, else the Python normalizer), then those steps are fed through
fresh engines (run loop, pipeline, detectors, events and summaries), best of `rounds`, in
one process. `python -m bench.detect_split [--spans N] [--rounds R] [--profile]`.

`--profile` adds a cProfile of one detection round (call counts per function)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from bench.corpus import export_messages
from detectors.fingerprint import Fingerprinter
from detectors.policy import Policy, load_policy
from streams import native_spec
from streams.engine import Engine
from streams.native_spec import NativeBatch
from streams.otlp import decode_proto
from streams.runloop import group_steps
from streams.runtime import tune_gc

ROOT = Path(__file__).resolve().parents[1]
KEY = b"bench-key"


def normalized(messages: list[bytes], policy: Policy) -> list[NativeBatch]:
    """Each message as the batch `Engine.feed` takes (steps grouped by run)."""
    engine = Engine(policy, Fingerprinter(KEY), lambda e: None)
    out = []
    for message in messages:
        batch = native_spec.normalize(engine.span_path, message)
        if batch is None:
            spans = decode_proto(message)
            by_run, invalid, max_end = group_steps(engine.normalizer, spans)
            ends = [s.end_ns for s in spans]
            batch = NativeBatch(by_run, invalid, max_end, len(spans), [], min(ends), max(ends))
        out.append(batch)
    return out


def detect(batches: list[NativeBatch], policy: Policy) -> tuple[int, float, Engine]:
    engine = Engine(policy, Fingerprinter(KEY), lambda e: None, lambda s: None)
    started = time.perf_counter()
    for batch in batches:
        engine.feed(batch)
    engine.close()
    return engine.stats.spans, time.perf_counter() - started, engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.detect_split")
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--policy", default=str(ROOT / "examples" / "loopwatch.yaml"))
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    policy = load_policy(args.policy)
    messages = list(export_messages(args.spans, seed=args.seed))
    batches = normalized(messages, policy)
    detect(batches[:20], policy)  # warm up
    tune_gc()
    best = float("inf")
    for _ in range(args.rounds):
        spans, seconds, engine = detect(batches, policy)
        best = min(best, seconds)
    print(
        f"detection: {best / spans * 1e6:.2f} us/span ({spans} spans, best of {args.rounds}; "
        f"{engine.stats.events} events, {engine.stats.runs_finished} runs)"
    )
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        detect(batches, policy)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
