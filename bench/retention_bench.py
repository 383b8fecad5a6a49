"""What keeping finished runs costs (the `retained` table, streams/worker/state/retained.py).

1. Record sizes: the bench corpus through the worker's driver (dict tables, retention on):
   bytes per retained run that looped and per clean run (summary only).
2. Disk and RSS at 100k and 1M retained runs: the corpus' records written to a rocksdb
   database opened as the worker opens a table partition (faust's RocksDBOptions with the
   worker's settings), each count in a process of its own; disk after a flush and a
   compaction, peak RSS of that process.
3. The sweep, with the records' expiries spread over a day: what a minute's sweep reads
   (the expiry index from the minute's first entry, and the records due), against a pass
   over every record's header (what the sweep read each minute before the index).

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
RETENTION_S = 24 * 3600  # the records' expiries are spread over a day (clean runs' default)


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
    from streams.worker.state.retained import Retention, decode, is_record_key

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
    records = [v for k, v in retained.items() if is_record_key(k)]  # not the expiry index
    looping = [v for v in records if decode(v).get("events")]
    clean = [v for v in records if not decode(v).get("events")]
    return {
        "runs": len(records),
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
    from streams.worker.state.retained import (
        header,
        index_entry,
        index_key,
        index_value,
        is_record_key,
        restamp,
    )

    options: Any = WorkerSettings.from_env({}).rocksdb_options()
    db = RocksDBOptions(**options).open(Path(path), read_only=False)
    samples = json.loads(Path(samples_file).read_text())
    looping = [bytes.fromhex(v) for v in samples["looping"]] or [b"R" + bytes(18)]
    clean = [bytes.fromhex(v) for v in samples["clean"]] or [b"R" + bytes(18)]
    every = round(1 / LOOPING_SHARE)
    # a day of finishes at a steady rate: expiries spread over RETENTION_S, each record
    # with its expiry index entry, as the worker writes them
    base = time.time_ns()
    step = RETENTION_S * 10**9 // runs
    started = time.perf_counter()
    for i in range(runs):
        value = looping[i % len(looping)] if i % every == 0 else clean[i % len(clean)]
        expires = base + i * step
        key = hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest().encode()
        db.put(key, restamp(value, 0, expires, base))
        db.put(index_key(expires, key), index_value(0))
    write_s = time.perf_counter() - started
    db.flush()
    db.compact_range(None, None)
    disk = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    # peak RSS written and compacted, before the reads below map the files in
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # before the index: a pass read every record's header, once a minute
    from streams.worker.agents.driver import SWEEP_SECONDS

    started = time.perf_counter()
    passed = 0
    for key, value in db.items():
        if not is_record_key(key):
            break
        header(value)
        passed += 1
    pass_s = time.perf_counter() - started
    # with it: a minute's sweep reads the entries that expired in that minute (and one
    # more), and reads and deletes their records (deletes not applied here)
    due_by = base + (RETENTION_S // 2 + SWEEP_SECONDS) * 10**9  # a minute, half a day on
    first = index_key(base + RETENTION_S // 2 * 10**9, b"")
    started = time.perf_counter()
    due = 0
    for key, value in db.items(from_key=first):
        expires_ns, record, _p = index_entry(key, value)
        if expires_ns > due_by:
            break
        header(db[record])
        due += 1
    minute_s = time.perf_counter() - started
    print(
        json.dumps(
            {
                "runs": runs,
                "disk_mib": disk / 2**20,
                "rss_mib": rss,
                "write_s": write_s,
                "pass_records": passed,
                "pass_ms": pass_s * 1000,
                "minute_records": due,
                "minute_ms": minute_s * 1000,
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
                f"written in {s['write_s']:,.1f} s, with the expiry index",
            )
        )
        out.append(
            (
                f"retention sweep a minute, {s['runs']:,} kept over a day",
                f"{s['minute_ms']:,.1f} ms for {s['minute_records']:,} records",
                f"the expired ones; a pass over every record (before the index): "
                f"{s['pass_ms']:,.0f} ms for {s['pass_records']:,}",
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
