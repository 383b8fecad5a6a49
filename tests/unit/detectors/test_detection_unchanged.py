"""Detection's outputs are pinned: the events and run summaries (JSON, sorted keys, in
emission order) of a set of corpora hash to the digests recorded in
tests/fixtures/detection_golden.json. Speed work on the run loop, the pipeline and the
detectors must leave every byte of them as it was.

The corpora: the bench corpus at several seeds and loop shares, the same corpus perturbed
(small batches, spans reordered beyond the allowed lateness, re-sent duplicates, conflicting
duplicates, lost spans), the examples under their policy, and the framework recordings
under the example policy.

An intended change of outputs re-records the digests, and says so in its commit:
    .venv/bin/python -m tests.unit.detectors.test_detection_unchanged --update
(`--dump DIR` writes each corpus's outputs as JSON lines, to diff two versions.)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.corpus import export_messages
from detectors.fingerprint import Fingerprinter
from detectors.policy import Policy, load_policy
from streams.replay.engine import Engine
from streams.replay.files import iter_batches
from streams.spanpath.otlp import decode_proto
from streams.spanpath.spans import STATUS_ERROR, STATUS_OK, SpanRecord
from tests.otlp_build import encode_request
from tests.paths import REPO
from tests.spankit import Run

ROOT = REPO
GOLDEN = ROOT / "tests" / "fixtures" / "detection_golden.json"
EXAMPLES = ROOT / "examples"
FRAMEWORKS = ROOT / "tests" / "fixtures" / "frameworks"
POLICY = load_policy(EXAMPLES / "loopwatch.yaml")
KEY = b"golden-key"
SPANS = 4_000  # per bench corpus: every detector fires in these at the looping shares


def _bench(seed: int, loop_share: float) -> Callable[[], Iterator[bytes]]:
    return lambda: export_messages(SPANS, seed=seed, loop_share=loop_share)


def _bench_spans(seed: int) -> list[SpanRecord]:
    return [s for m in export_messages(SPANS, seed=seed, loop_share=0.3) for s in decode_proto(m)]


def _example_spans(seed: int) -> list[SpanRecord]:
    """Every example's spans, the runs interleaved (each run's spans in their order)."""
    rng = random.Random(seed)
    runs = [[s for batch in _files([p])() for s in batch] for p in _fixtures(EXAMPLES)]
    out: list[SpanRecord] = []
    while runs:
        run = runs[rng.randrange(len(runs))]
        out.extend(run[:3])
        del run[:3]
        runs = [r for r in runs if r]
    return out


def _random_spans(seed: int) -> list[SpanRecord]:
    """Runs of random steps over small value domains, so that every detector's paths are
    taken: every contract of the example policy (progress rules, polling, pagination, side
    effects with and without idempotency keys, reconciliation), transient, missing-data and
    ambiguous errors, empty results, parallel calls, plans, summaries, token drops,
    handoffs, other spans, sequenced and unsequenced runs, task types."""
    rng = random.Random(seed)
    codes = [None] * 8 + ["404", "429", "timeout", "503", "invalid_argument", "no_results"]

    def pick(*values: Any) -> Any:
        return rng.choice(values)

    out: list[SpanRecord] = []
    for trace in range(1, 121):
        run = Run(trace, pick("v1", "v2"), pick(None, "support", "research"), rng.random() < 0.5)
        if rng.random() < 0.3:
            run.version_only_on_root()
        tokens = 1_000
        for _ in range(rng.randint(3, 45)):
            roll = rng.random()
            if roll < 0.55:
                tool = pick(
                    "lookup_order",
                    "get_order",
                    "get_export_status",
                    "search_cases",
                    "search_orders",
                    "issue_refund",
                    "get_refund_status",
                    "update_ticket",
                    "unknown_tool",
                )
                n = rng.randint(1, 3)
                args = {
                    "order_id": f"o{n}",
                    "ticket_id": f"t{n}",
                    "query": pick(" Shoes", "shoes", "hats"),
                    "cursor": pick(None, "c1", "c2"),
                }
                if rng.random() < 0.5:
                    args["idempotency_key"] = pick("k1", "k2")
                result = pick(
                    {"status": pick("pending", "complete", "failed"), "version": rng.randint(1, 3)},
                    {"case_ids": [f"c{rng.randint(1, 6)}", f"c{rng.randint(1, 6)}"]},
                    [],
                    {},
                    None,
                    {"ok": True},
                )
                code = pick(*codes)
                run.tool(
                    tool,
                    args,
                    result if code is None else None,
                    error=code,
                    parallel=rng.random() < 0.1,
                    gap_ms=pick(5, 20, 400, 3_000),
                )
            elif roll < 0.8:
                tokens = tokens + 300 if rng.random() < 0.8 else tokens // 3
                calls = [(pick("lookup_order", "search_cases"), {"order_id": "o1"})]
                run.llm(
                    tokens, rng.randint(10, 900), tool_calls=calls if rng.random() < 0.5 else None
                )
            elif roll < 0.85:
                run.plan([{"tool": pick("a", "b")}, {"tool": "c"}])
            elif roll < 0.88:
                run.summary()
            elif roll < 0.95:
                run.handoff(pick("router", "billing", "support"), pick("router", "billing"))
            else:
                run.other("db.query", {"db.system": "postgresql"})
        run.root(status=pick(STATUS_OK, STATUS_OK, STATUS_ERROR))
        out.extend(run.spans)
    return out


def _perturbed(spans: list[SpanRecord], seed: int) -> Iterator[bytes]:
    """Spans as a careless exporter delivers them: batches of 1-40 spans, a local shuffle
    that moves some spans far behind (late spans), re-sent spans (duplicates), a re-sent
    span with other content (integrity conflict), lost spans (incomplete runs)."""
    rng = random.Random(seed)
    out: list[SpanRecord] = []
    for span in spans:
        roll = rng.random()
        if roll < 0.01:
            continue  # lost
        out.append(span)
        if roll < 0.04:
            out.append(span)  # re-sent as is
        elif roll < 0.05:
            out.append(dataclasses.replace(span, name=span.name + " (again)"))
    for _ in range(len(out) // 10):  # local reordering, now and then far
        i = rng.randrange(len(out))
        j = min(
            len(out) - 1, i + (rng.randint(1, 8) if rng.random() < 0.9 else rng.randint(50, 400))
        )
        out[i], out[j] = out[j], out[i]
    i = 0
    while i < len(out):
        n = rng.randint(1, 40)
        yield encode_request(out[i : i + n])
        i += n


def _files(paths: list[Path]) -> Callable[[], Iterator[bytes | list[SpanRecord]]]:
    def read() -> Iterator[bytes | list[SpanRecord]]:
        errors: list[Exception] = []
        for path in paths:
            for _source, spans in iter_batches([path], errors.append):
                assert isinstance(spans, list)
                yield spans
        assert errors == []

    return read


def _fixtures(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith((".pb", ".jsonl", ".pb.gz")))


CORPORA: dict[str, tuple[Callable[[], Iterator[Any]], Policy]] = {
    **{
        f"bench-seed{seed}-loops{share}": (_bench(seed, share), POLICY)
        for seed, share in ((7, 0.04), (11, 0.3), (23, 1.0))
    },
    **{
        f"perturbed-seed{seed}": ((lambda s=seed: _perturbed(_bench_spans(s), s)), POLICY)
        for seed in (5, 6)
    },
    **{
        f"random-seed{seed}": ((lambda s=seed: _perturbed(_random_spans(s), s)), POLICY)
        for seed in (1, 2, 3, 4)
    },
    **{
        f"examples-perturbed-seed{seed}": (
            (lambda s=seed: _perturbed(_example_spans(s), s)),
            POLICY,
        )
        for seed in (1, 2, 3)
    },
    "examples": (_files(_fixtures(EXAMPLES)), POLICY),
    "frameworks": (_files(_fixtures(FRAMEWORKS)), POLICY),
}


def outputs(name: str) -> list[str]:
    """The corpus's events and summaries, one JSON text each, in emission order."""
    read, policy = CORPORA[name]
    out: list[str] = []

    def emit(kind: str) -> Callable[[dict[str, Any]], None]:
        return lambda item: out.append(json.dumps([kind, item], sort_keys=True))

    engine = Engine(policy, Fingerprinter(KEY), emit("event"), emit("summary"), emit("invalid"))
    for batch in read():
        if isinstance(batch, bytes):
            engine.feed_bytes(batch)
        else:
            engine.feed(batch)
    engine.close()
    return out


def digest(lines: list[str]) -> dict[str, Any]:
    kinds = [json.loads(line)[0] for line in lines]
    return {
        "events": kinds.count("event"),
        "summaries": kinds.count("summary"),
        "invalid": kinds.count("invalid"),
        "sha256": hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest(),
    }


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_detection_outputs_are_unchanged(name: str) -> None:
    golden = json.loads(GOLDEN.read_text())
    got = digest(outputs(name))
    assert got == golden[name], (
        f"{name}: detection outputs changed; if on purpose, re-record (module docstring)"
    )


def test_every_corpus_has_a_golden_digest_and_the_corpora_fire() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert set(golden) == set(CORPORA)
    # the pin is only as good as what the corpora exercise
    assert all(golden[name]["summaries"] > 0 for name in golden)
    assert sum(golden[name]["events"] for name in golden) > 100


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.unit.detectors.test_detection_unchanged")
    parser.add_argument("--update", action="store_true", help="re-record the digests")
    parser.add_argument("--dump", type=Path, help="write each corpus's outputs here")
    args = parser.parse_args()
    recorded = {}
    for name in sorted(CORPORA):
        lines = outputs(name)
        recorded[name] = digest(lines)
        if args.dump is not None:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        print(name, recorded[name])
    if args.update:
        GOLDEN.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
