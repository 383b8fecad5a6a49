"""What the order of the input costs `loopwatch replay`: one corpus written to two files
(OTLP JSON lines and gzipped protobuf), once in time order (each file in time order) and
once shuffled (spans in random batches of 40-120, ~30% of the batches re-sent, dealt at
random over the two files). Each delivery is replayed by the real command in its own
process, in alternating rounds: wall time (best), peak RSS (max) and the events, which
must be the same.

    python -m bench.order_bench --spans 200000
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.corpus import export_messages
from streams.replay.files import write_jsonl, write_pb
from streams.spanpath.otlp import proto_to_json_bytes
from tests.support.deliveries import reshuffle, write_files

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "examples" / "loopwatch.yaml"


def deliveries(messages: list[bytes], workdir: Path, seed: int = 1) -> dict[str, Path]:
    """{"in order": dir, "shuffled": dir} with the same spans."""
    rng = random.Random(seed)
    ordered = workdir / "in-order"
    ordered.mkdir()
    batches = reshuffle(messages, rng, order="time", batch=(40, 120), dup_share=0)
    write_jsonl(ordered / "traces.jsonl", [proto_to_json_bytes(b) for b in batches[0::2]])
    write_pb(ordered / "traces.pb.gz", batches[1::2])
    shuffled = workdir / "shuffled"
    write_files(shuffled, reshuffle(messages, rng, batch=(40, 120)), rng, n=2)
    return {"in order": ordered, "shuffled": shuffled}


# `loopwatch replay` that prints its own peak RSS (VmHWM, KiB) last on stderr: ru_maxrss
# would count the parent's memory too (a child started by vfork inherits its high-water mark)
_REPLAY = (
    "import sys\n"
    "from streams.cli.main import main\n"
    "try:\n    code = main(sys.argv[1:])\n"
    "finally:\n"
    "    hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM:')]\n"
    "    print(hwm[0].split()[1], file=sys.stderr)\n"
    "raise SystemExit(code)\n"
)


def replay_process(path: Path, out: Path, policy: Path = POLICY) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of `loopwatch replay` over `path` (events to `out`), in
    a new process."""
    argv = [sys.executable, "-c", _REPLAY, "replay", "--config", str(policy), "--output", str(out)]
    env = dict(os.environ, LOOPWATCH_FINGERPRINT_KEY="bench-key")
    started = time.perf_counter()
    done = subprocess.run([*argv, str(path)], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"replay of {path} failed: {done.stderr[-2000:]}")
    return seconds, int(done.stderr.strip().splitlines()[-1]) / 1024


def order_cost(messages: list[bytes], rounds: int = 3) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loopwatch-order-") as tmp:
        work = Path(tmp)
        paths = deliveries(messages, work)
        best: dict[str, float] = {}
        rss: dict[str, float] = {}
        events: dict[str, list[str]] = {}
        for i in range(rounds):
            for name, path in paths.items():
                out = work / f"{name.replace(' ', '-')}-{i}.jsonl"
                seconds, peak = replay_process(path, out)
                best[name] = min(best.get(name, float("inf")), seconds)
                rss[name] = max(rss.get(name, 0.0), peak)
                events[name] = sorted(out.read_text().splitlines())
    spans = sum(1 for _ in _spans(messages))
    return {
        "spans": spans,
        "events": {name: len(e) for name, e in events.items()},
        "same_events": events["in order"] == events["shuffled"],
        "seconds": best,
        "peak_rss_mib": rss,
        "rounds": rounds,
    }


def _spans(messages: list[bytes]) -> Any:
    from streams.spanpath.otlp import decode_proto

    for m in messages:
        yield from decode_proto(m)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.order_bench")
    parser.add_argument("--spans", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--examples", action="store_true", help="the example traces instead")
    args = parser.parse_args(argv)
    if args.examples:
        from tests.otlp_build import example_files, file_messages

        messages = [m for f in example_files() for m in file_messages(f)]
    else:
        messages = list(export_messages(args.spans, seed=3, loop_share=0.2))
    result = order_cost(messages, args.rounds)
    print(f"{result['spans']:,} spans, best of {result['rounds']} rounds")
    for name in ("in order", "shuffled"):
        print(
            f"  {name:<9} {result['events'][name]:>6,} events  "
            f"{result['seconds'][name]:7.2f} s  peak RSS {result['peak_rss_mib'][name]:7.1f} MiB"
        )
    print(f"  same events: {result['same_events']}")
    return 0 if result["same_events"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
