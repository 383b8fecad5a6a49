"""What keeping finished runs costs (the `retained` table, streams/worker/state/retained.py).

1. Record sizes: the bench corpus through the worker's driver (dict tables, retention on):
   bytes per retained run that looped and per clean run (summary only).
2. Disk and RSS at 100k and 1M retained runs: the corpus' records written to a rocksdb
   database opened as the worker opens a table partition (faust's RocksDBOptions with the
   worker's settings), each count in a process of its own; disk after a flush and a
   compaction, peak RSS of that process.
3. The sweep: reading SWEEP_BATCH records' headers in key order from that database
   (rocksdict items(from_key)), per record and per slice.

`python -m bench.retention_bench [--spans N] [--runs 100000,1000000]` prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOOPING_SHARE = 0.05  # of finished runs, for the mixed figures


def record_sizes(total_spans: int) -> dict[str, Any]:
    """Mean encoded bytes of a retained record, looping and clean runs, from the corpus."""
    from bench.corpus import export_messages
    from detectors.fingerprint import Fingerprinter
    from detectors.model import NS
    from detectors.policy import load_policy
    from streams.spanpath import group_steps
    from streams.spanpath.normalize import Normalizer
    from streams.spanpath.otlp import decode_record
    from streams.worker.agents.driver import RunDriver
    from streams.worker.state.retained import Retention, decode

    policy = load_policy(ROOT / "examples" / "loopwatch.yaml")
    normalizer = Normalizer(policy, Fingerprinter(b"bench"))
    driver = RunDriver(policy, retention=Retention.hours(168, 24))
    runs: dict[bytes, bytes] = {}
    finished: dict[bytes, bytes] = {}
    retained: dict[bytes, bytes] = {}
    driver.bind(runs, finished, retained)
    now = time.time_ns()
    for message in export_messages(total_spans, seed=5):
        by_run, _invalid, _n = group_steps(normalizer, decode_record(message, "otlp_proto", "b"))
        for run_id, steps in by_run.items():
            driver.process_run(0, run_id, [(steps, None)], now)
        driver.apply_writes()
    now += 3600 * NS  # everything finalizes
    driver.tick(0, now)
    driver.apply_writes()
    looping = [v for v in retained.values() if decode(v).get("events")]
    clean = [v for v in retained.values() if not decode(v).get("events")]
    return {
        "runs": len(retained),
        "looping_runs": len(looping),
        "looping_bytes": sum(map(len, looping)) / max(1, len(looping)),
        "clean_bytes": sum(map(len, clean)) / max(1, len(clean)),
        "samples": {"looping": [v.hex() for v in looping], "clean": [v.hex() for v in clean]},
    }


def _store_child(path: str, runs: int, samples_file: str) -> None:
    """In a process of its own: write `runs` records (the corpus' real records, cycled,
    under random run ids), flush, compact; print disk, RSS and the sweep's cost."""
    from faust.stores.rocksdb import RocksDBOptions

    from streams.worker.settings import WorkerSettings
    from streams.worker.state.retained import header

    options: Any = WorkerSettings.from_env({}).rocksdb_options()
    db = RocksDBOptions(**options).open(Path(path), read_only=False)
    samples = json.loads(Path(samples_file).read_text())
    looping = [bytes.fromhex(v) for v in samples["looping"]] or [b"R" + bytes(18)]
    clean = [bytes.fromhex(v) for v in samples["clean"]] or [b"R" + bytes(18)]
    every = round(1 / LOOPING_SHARE)
    started = time.perf_counter()
    for i in range(runs):
        value = looping[i % len(looping)] if i % every == 0 else clean[i % len(clean)]
        db.put(hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest().encode(), value)
    write_s = time.perf_counter() - started
    db.flush()
    db.compact_range(None, None)
    disk = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    # the sweep: SWEEP_BATCH headers in key order from a key in the middle
    from streams.worker.agents.driver import SWEEP_BATCH

    started = time.perf_counter()
    n = 0
    for _key, value in db.items(from_key=b"8"):  # from the middle of the key space
        header(value)
        n += 1
        if n == SWEEP_BATCH:
            break
    sweep_s = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "runs": runs,
                "disk_mib": disk / 2**20,
                "rss_mib": rss,
                "write_s": write_s,
                "sweep_slice_ms": sweep_s * 1000,
                "sweep_us_per_record": sweep_s * 1e6 / max(1, n),
            }
        )
    )


def store_cost(runs: int, samples: dict[str, list[str]]) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="loopwatch-retained-")
    samples_file = Path(tmp) / "samples.json"
    samples_file.write_text(json.dumps(samples))
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.retention_bench",
                "--child",
                str(Path(tmp) / "db"),
                str(runs),
                str(samples_file),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            check=True,
            timeout=1800,
        )
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(total_spans: int, counts: tuple[int, ...]) -> dict[str, Any]:
    sizes = record_sizes(total_spans)
    samples = sizes.pop("samples")
    stores = [store_cost(n, samples) for n in counts]
    return {"records": sizes, "stores": stores}


def rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    sizes = result["records"]
    out = [
        (
            "retained run record (looped / clean)",
            f"{sizes['looping_bytes']:,.0f} / {sizes['clean_bytes']:,.0f} bytes",
            f"{sizes['runs']:,} runs of the corpus, {sizes['looping_runs']:,} looped",
        )
    ]
    for s in result["stores"]:
        out.append(
            (
                f"retained table, {s['runs']:,} runs ({LOOPING_SHARE:.0%} looped)",
                f"{s['disk_mib']:,.1f} MiB disk, {s['rss_mib']:,.0f} MiB RSS",
                f"written in {s['write_s']:,.1f} s; a sweep slice {s['sweep_slice_ms']:,.1f} ms "
                f"({s['sweep_us_per_record']:,.2f} us a record)",
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _store_child(argv[1], int(argv[2]), argv[3])
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.retention_bench")
    parser.add_argument("--spans", type=int, default=60_000)
    parser.add_argument("--runs", default="100000,1000000")
    args = parser.parse_args(argv)
    result = run(args.spans, tuple(int(x) for x in args.runs.split(",")))
    width = max(len(r[0]) for r in rows(result))
    for name, value, note in rows(result):
        print(f"{name:<{width}}  {value:<36}  {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
