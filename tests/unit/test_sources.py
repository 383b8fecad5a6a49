"""Replay sources are partitions (streams/engine.py): each input file is a source, files are
read merged by time, and the watermark is the minimum over the sources that still have
data, so how a corpus is split over files does not change its events."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.corpus import export_messages
from detectors.fingerprint import Fingerprinter
from streams.engine import Engine, replay_files
from streams.files import iter_batches, write_jsonl, write_pb
from streams.otlp import decode_proto
from tests.otlp_build import encode_request, to_json
from tests.spankit import example_policy

POLICY = example_policy()


def exported_in_time_order(total_spans: int, seed: int) -> list[bytes]:
    """The bench corpus (~20 interleaved live runs, 20% looping) as an SDK's batch span
    processor exports it: spans in the order they end, 40 to 120 per export."""
    spans = sorted(
        (
            s
            for m in export_messages(total_spans, seed=seed, loop_share=0.2)
            for s in decode_proto(m)
        ),
        key=lambda s: (s.end_ns, s.span_id),
    )
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(spans):
        n = rng.randint(40, 120)
        out.append(encode_request(spans[i : i + n]))
        i += n
    return out


CORPUS = exported_in_time_order(12_000, seed=5)


def replay(files: list[Path]) -> tuple[list[str], list[str], Any]:
    """Events and summaries (JSON, sorted: the order between runs is the sources' order)."""
    events: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    engine = Engine(POLICY, Fingerprinter(b"k"), events.append, summaries.append)
    errors: list[Exception] = []
    replay_files(engine, files, errors.append)
    engine.close()
    assert errors == []
    return (
        sorted(json.dumps(e, sort_keys=True) for e in events),
        sorted(json.dumps(s, sort_keys=True) for s in summaries),
        engine.stats,
    )


def one_after_another(files: list[Path]) -> list[str]:
    """The old reading: file by file, one watermark."""
    events: list[dict[str, Any]] = []
    engine = Engine(POLICY, Fingerprinter(b"k"), events.append)
    for path in files:
        for _source, spans in iter_batches([path], print):
            engine.feed(spans)
    engine.close()
    return sorted(json.dumps(e, sort_keys=True) for e in events)


def test_a_corpus_split_over_two_overlapping_files_gives_the_events_of_one_file(
    tmp_path: Path,
) -> None:
    whole = tmp_path / "whole.pb"
    write_pb(whole, CORPUS)
    rng = random.Random(1)
    picks = [rng.random() < 0.5 for _ in CORPUS]
    first = tmp_path / "a.jsonl"  # the same corpus as OTLP JSON and gzipped protobuf
    second = tmp_path / "b.pb.gz"
    write_jsonl(first, [to_json(m) for m, p in zip(CORPUS, picks, strict=True) if p])
    write_pb(second, [m for m, p in zip(CORPUS, picks, strict=True) if not p])
    want_events, want_runs, want = replay([whole])
    assert want.events > 50 and want.spans_after_finalize == 0
    got_events, got_runs, got = replay([first, second])
    assert got_events == want_events
    assert got_runs == want_runs
    assert (got.spans, got.spans_after_finalize, got.late_spans) == (want.spans, 0, 0)
    assert replay([second, first])[:2] == (want_events, want_runs)  # whatever the order
    # read one after another, runs with a root in the first file end before their spans
    # in the second are read: the split would change the events
    assert one_after_another([first, second]) != want_events


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5), st.integers(0, 1000))
def test_any_split_over_sources_gives_the_same_events(n: int, seed: int) -> None:
    """Export batches dealt to 1-5 sources (each keeps its batches in order), the sources
    in a random order: the events and summaries of the corpus in one source."""
    batches = [decode_proto(m, "corpus") for m in CORPUS[:150]]

    def run(sources: list[list[Any]]) -> tuple[list[str], list[str]]:
        events: list[dict[str, Any]] = []
        summaries: list[dict[str, Any]] = []
        engine = Engine(POLICY, Fingerprinter(b"k"), events.append, summaries.append)
        engine.feed_sources(sources)
        engine.close()
        return sorted(json.dumps(e, sort_keys=True) for e in events), sorted(
            json.dumps(s, sort_keys=True) for s in summaries
        )

    rng = random.Random(seed)
    dealt: list[list[Any]] = [[] for _ in range(n)]
    for batch in batches:
        dealt[rng.randrange(n)].append(batch)
    rng.shuffle(dealt)
    assert run(dealt) == run([batches])


def test_one_source_is_the_plain_feed() -> None:
    batches = [decode_proto(m, "corpus") for m in CORPUS[:100]]
    out: list[list[dict[str, Any]]] = [[], []]
    fed = Engine(POLICY, Fingerprinter(b"k"), out[0].append)
    for batch in batches:
        fed.feed(batch)
    fed.close()
    merged = Engine(POLICY, Fingerprinter(b"k"), out[1].append)
    merged.feed_sources([batches])
    merged.close()
    assert out[0] == out[1]  # same events in the same order


def test_many_files_replay_within_a_small_file_limit(tmp_path: Path) -> None:
    """Rotated exports (each file after the previous one in time) are read with one or two
    files open at a time: 120 files replay under a limit of 64 open files, with the events
    of the corpus in one file. Opening every file up front ran out of descriptors
    ("Too many open files": those files' spans were lost with a decode error each)."""
    import resource

    messages = CORPUS[:150]
    single = tmp_path / "one" / "all.pb"
    single.parent.mkdir()
    write_pb(single, messages)
    parts = tmp_path / "rotated"
    parts.mkdir()
    files = []
    for n in range(120):
        path = parts / f"traces-{n:04d}.pb"
        write_pb(path, messages[n * len(messages) // 120 : (n + 1) * len(messages) // 120])
        files.append(path)
    want = replay([single])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        got = replay(files)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert got == want
