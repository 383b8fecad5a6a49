"""Detection's share of the replay, on its own: the bench corpus is normalized to steps
once (the native span path, else the Python normalizer), then those steps are fed through
fresh engines (run loop, pipeline, detectors, events and summaries), best of `rounds`, in
one process. `python -m bench.detect_split [--spans N] [--rounds R] [--profile]`.

`--against DIR`: DIR is another version's source tree (`git archive REV | tar -x -C DIR`);
its engine is loaded beside this one and the two are measured in alternating rounds in this
process, so both see the same machine load (a shared machine moves single runs by 30%).
`--profile` adds a cProfile of one detection round (call counts per function)."""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import sys
import time
from pathlib import Path
from typing import Any

from bench.corpus import export_messages
from detectors.fingerprint import Fingerprinter
from detectors.policy import Policy, load_policy
from streams.replay.engine import Engine
from streams.runtime import tune_gc
from streams.spanpath import SpanPath
from streams.spanpath.spans import StepBatch

ROOT = Path(__file__).resolve().parents[1]
KEY = b"bench-key"
FIELDS = tuple(StepBatch.__dataclass_fields__)


def normalized(messages: list[bytes], policy: Policy) -> list[StepBatch]:
    """Each message as the batch `Engine.feed` takes (steps grouped by run)."""
    span_path = SpanPath.of(policy, Fingerprinter(KEY))
    return [span_path.message(message) for message in messages]


def load_other(tree: Path) -> tuple[Any, Any]:
    """(Engine, its batch class) of the version in `tree`: its packages are imported from there
    under their own names, then this version's are put back (the loaded classes keep their
    modules through their globals; the engine imports nothing lazily on this path)."""
    names = ("detectors", "streams", "alerts")
    ours = {k: m for k, m in sys.modules.items() if k.split(".")[0] in names}
    for k in ours:
        del sys.modules[k]
    sys.path.insert(0, str(tree))
    try:
        engine_mod = importlib.import_module("streams.replay.engine")
        spans_mod = importlib.import_module("streams.spanpath.spans")
        # StepBatch since issue 40; before, native_spec.NativeBatch
        batch_class = (
            getattr(spans_mod, "StepBatch", None)
            or importlib.import_module("streams.spanpath.native_spec").NativeBatch
        )
    finally:
        sys.path.remove(str(tree))
        for k in [k for k in sys.modules if k.split(".")[0] in names]:
            del sys.modules[k]
        sys.modules.update(ours)
    if not str(engine_mod.__file__).startswith(str(tree)):
        raise SystemExit(f"{tree}: streams.replay.engine was not loaded from there")
    return engine_mod.Engine, batch_class


def detect(
    batches: list[Any], policy: Policy, engine_class: Any = Engine
) -> tuple[int, float, float, Any]:
    """(spans, wall seconds, CPU seconds of this process, the engine)."""
    engine = engine_class(policy, Fingerprinter(KEY), lambda e: None, lambda s: None)
    started, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        engine.feed(batch)
    engine.close()
    return (
        engine.stats.spans,
        time.perf_counter() - started,
        time.process_time() - cpu,
        engine,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.detect_split")
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--policy", default=str(ROOT / "examples" / "loopwatch.yaml"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--against", type=Path, help="another version's source tree")
    args = parser.parse_args(argv)
    policy = load_policy(args.policy)
    messages = list(export_messages(args.spans, seed=args.seed))
    batches = normalized(messages, policy)
    versions: list[tuple[str, Any, list[Any]]] = [("this", Engine, batches)]
    if args.against is not None:
        other_engine, other_batch = load_other(args.against.resolve())
        other = [other_batch(*(getattr(b, f) for f in FIELDS)) for b in batches]
        versions.insert(0, (str(args.against), other_engine, other))
    for _name, engine_class, feed in versions:
        detect(feed[:20], policy, engine_class)  # warm up
    tune_gc()
    best = {name: [float("inf"), float("inf")] for name, _, _ in versions}
    outputs = {}
    for i in range(args.rounds):
        for name, engine_class, feed in versions[:: 1 if i % 2 else -1]:  # alternate first
            spans, seconds, cpu, engine = detect(feed, policy, engine_class)
            best[name] = [min(best[name][0], seconds), min(best[name][1], cpu)]
            outputs[name] = (engine.stats.events, engine.stats.runs_finished)
    # CPU time as well: on a shared machine the wall time also counts waiting for a core
    for name, (wall, cpu) in best.items():
        events, runs = outputs[name]
        print(
            f"{name}: detection {wall / spans * 1e6:.2f} us/span wall, {cpu / spans * 1e6:.2f} "
            f"us/span CPU ({spans} spans, best of {args.rounds}; {events} events, {runs} runs)"
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
