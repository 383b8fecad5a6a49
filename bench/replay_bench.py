"""Decode ceiling vs the replay engine on the same protobuf corpus, the JSON decoders on the
same corpus as OTLP JSON, and replay memory."""

from __future__ import annotations

import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.corpus import export_messages
from detectors.fingerprint import Fingerprinter
from detectors.policy import load_policy
from streams.replay.engine import Engine
from streams.replay.runs import Replay
from streams.runtime import tune_gc
from streams.spanpath import native
from streams.spanpath.otlp import OTLP_JSON, OTLP_PROTO, decode_proto, proto_to_json_bytes
from streams.spanpath.otlp.json_decode import _decode_native as decode_json_native
from streams.spanpath.otlp.json_decode import decode_json_py
from streams.spanpath.otlp.proto import decode_proto_py
from streams.spanpath.spans import SpanRecord
from streams.worker.state.codec import encode_state


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def decode_ceiling(
    messages: list[bytes], decode: Callable[[bytes], list[SpanRecord]] = decode_proto_py
) -> tuple[int, float]:
    """Bare decode rate: the pure-Python (upb) decoder by default, the issue's "ceiling";
    `decode=` measures another decoder (the native one) the same way."""
    spans = 0
    started = time.perf_counter()
    for message in messages:
        for span in decode(message):
            spans += 1
            for _value in span.attributes.values():
                pass
    return spans, time.perf_counter() - started


def replay_engine(
    messages: list[bytes], policy_path: str, encoding: str = OTLP_PROTO
) -> tuple[int, float, Replay]:
    """`loopwatch replay` (streams/replay/runs.py) over the messages: spans, seconds, the replay."""
    policy = load_policy(policy_path)
    replay = Replay(policy, Fingerprinter(b"bench-key"), lambda e: None, lambda s: None)
    started = time.perf_counter()
    for message in messages:
        replay.feed_bytes(message, encoding=encoding)
    replay.close()
    return replay.stats.spans, time.perf_counter() - started, replay


def policy_without_sketches(source: Path, into: Path) -> Path:
    """`source` with `similarity: false`: the span path computes no similarity sketches."""
    policy = yaml.safe_load(source.read_text(encoding="utf-8")) or {}
    policy["similarity"] = False
    into.write_text(yaml.safe_dump(policy), encoding="utf-8")
    return into


def sketches_on_off(spans: int, policy_path: str, rounds: int = 3) -> dict[str, Any]:
    """`loopwatch replay` of one corpus under the policy and under the same policy with
    `similarity: false` (no similarity sketches computed, nothing near-duplicate), in
    alternating rounds, best of each: what the sketches cost the replay."""
    messages = list(export_messages(spans, seed=5))
    tune_gc()  # as `loopwatch replay` runs
    with tempfile.TemporaryDirectory() as tmp:
        off_path = str(policy_without_sketches(Path(policy_path), Path(tmp) / "off.yaml"))
        replay_engine(messages[:20], policy_path)
        replay_engine(messages[:20], off_path)
        best = {"on": float("inf"), "off": float("inf")}
        counted = {}
        for _ in range(rounds):
            for name, path in (("on", policy_path), ("off", off_path)):
                n, seconds, replay = replay_engine(messages, path)
                best[name] = min(best[name], seconds)
                counted[name] = (n, replay.stats.events)
    assert counted["on"][0] == counted["off"][0]
    return {
        "spans": counted["on"][0],
        "rounds": rounds,
        "on_spans_per_s": counted["on"][0] / best["on"],
        "off_spans_per_s": counted["off"][0] / best["off"],
        "events_on": counted["on"][1],
        "events_off": counted["off"][1],
    }


def text_corpus_messages(variants: int = 60) -> list[bytes]:
    """Exports of the near-duplicate corpus (tests/near_duplicate_corpus.py: rephrased
    searches, pages, knowledge-base answers and code agents, with their progress cases and
    traps): tool calls whose arguments and results are words, where every call is
    sketched, unlike the bench corpus's id-keyed calls and item lists."""
    from tests.near_duplicate_corpus import corpus, traps
    from tests.otlp_build import encode_request

    cases = corpus(variants=variants) + traps(variants=variants // 2)
    return [encode_request(case.spans) for case in cases]


def sketches_on_off_text(policy_path: str, rounds: int = 3) -> dict[str, Any]:
    """`sketches_on_off` on the near-duplicate corpus: what the sketches cost where every
    call has words to sketch."""
    messages = text_corpus_messages()
    with tempfile.TemporaryDirectory() as tmp:
        off_path = str(policy_without_sketches(Path(policy_path), Path(tmp) / "off.yaml"))
        best = {"on": float("inf"), "off": float("inf")}
        counted = {}
        for _ in range(rounds):
            for name, path in (("on", policy_path), ("off", off_path)):
                n, seconds, replay = replay_engine(messages, path)
                best[name] = min(best[name], seconds)
                counted[name] = (n, replay.stats.events)
    return {
        "spans": counted["on"][0],
        "rounds": rounds,
        "on_spans_per_s": counted["on"][0] / best["on"],
        "off_spans_per_s": counted["off"][0] / best["off"],
        "events_on": counted["on"][1],
        "events_off": counted["off"][1],
    }


def leak_check(spans: int, policy_path: str, replays: int = 10) -> list[float]:
    """RSS (MiB) after each of `replays` replays of one corpus in this process: flat when
    neither the engine nor the native span path keeps anything of a finished replay."""
    messages = list(export_messages(spans, seed=5))
    out = []
    for _ in range(replays):
        replay_engine(messages, policy_path)
        out.append(round(rss_mib(), 1))
    return out


def state_sizes(messages: list[bytes], policy_path: str) -> list[int]:
    """Serialized RunState sizes (the `runs` table's encoding, streams.worker.state.codec) of the runs
    that are live mid-stream."""
    policy = load_policy(policy_path)
    engine = Engine(policy, Fingerprinter(b"bench-key"), lambda e: None, lambda s: None)
    for message in messages[: len(messages) // 2]:
        engine.feed(decode_proto(message))
    return [len(encode_state(state)) for state in engine.runs.values()]


def memory_profile(
    total_spans: int, policy_path: str, checkpoints: tuple[int, ...]
) -> dict[str, Any]:
    """Stream `total_spans` through one replay without keeping the corpus in memory: RSS
    at the checkpoints (while the replay holds the runs, or spills them past its bound)."""
    policy = load_policy(policy_path)
    replay = Replay(policy, Fingerprinter(b"bench-key"), lambda e: None, lambda s: None)
    out: dict[str, Any] = {"rss_mib": {}}
    pending = list(checkpoints)
    for message in export_messages(total_spans, seed=11):
        replay.feed_bytes(message)
        if pending and replay.stats.spans >= pending[0]:
            out["rss_mib"][str(pending.pop(0))] = round(rss_mib(), 1)
    replay.close()
    out["rss_mib_after_close"] = round(rss_mib(), 1)
    out["held_steps_peak"] = replay.order.held_steps_peak
    out["spilled_steps"] = replay.order.spilled_steps
    out["spill_mib"] = round(replay.order.spill_bytes / 2**20, 1)
    out["runs_finished"] = replay.stats.runs_finished
    out["events"] = replay.stats.events
    return out


def json_decode_rates(lines: list[bytes], rounds: int) -> tuple[float, float | None]:
    """The corpus as OTLP JSON lines (as the Collector's fileexporter writes them): the
    Python decoder's and the native one's bare decode rates, alternating rounds, best of each.
    Native is None when the extension is not built."""
    decoders: list[Callable[[bytes], list[SpanRecord]]] = [decode_json_py]
    if native.ACTIVE == "native":
        decoders.append(decode_json_native)
    best = [float("inf")] * len(decoders)
    counts = [0] * len(decoders)
    for decode in decoders:
        decode_ceiling(lines[:20], decode)
    for _ in range(rounds):
        for i, decode in enumerate(decoders):
            counts[i], seconds = decode_ceiling(lines, decode)
            best[i] = min(best[i], seconds)
    assert len(set(counts)) == 1
    rates = [counts[0] / s for s in best]
    return rates[0], (rates[1] if len(rates) > 1 else None)


def run(spans: int, policy_path: str, rounds: int = 3) -> dict[str, Any]:
    messages = list(export_messages(spans))
    # Warm up both paths once (imports, caches), then measure them in alternating rounds
    # on the same corpus and keep each one's best: on a shared machine a single pair of
    # runs moved the ratio by half of itself (18-35% for the same code).
    native_decode = decode_proto if native.ACTIVE == "native" else None
    decode_ceiling(messages[:20])
    if native_decode is not None:
        decode_ceiling(messages[:20], native_decode)
    replay_engine(messages[:20], policy_path)
    tune_gc()  # as `loopwatch replay` runs (both paths measured under it)
    ceiling_s = replay_s = native_s = float("inf")
    for _ in range(rounds):
        ceiling_spans, seconds = decode_ceiling(messages)
        ceiling_s = min(ceiling_s, seconds)
        if native_decode is not None:
            native_spans, seconds = decode_ceiling(messages, native_decode)
            native_s = min(native_s, seconds)
            assert native_spans == ceiling_spans
        replay_spans, seconds, replay = replay_engine(messages, policy_path)
        replay_s = min(replay_s, seconds)
    assert ceiling_spans == replay_spans
    # the same corpus as OTLP JSON lines (the Collector's fileexporter): decode, then replay
    lines = [proto_to_json_bytes(m) for m in messages]
    json_py, json_native = json_decode_rates(lines, rounds)
    json_replay_s = float("inf")
    for _ in range(rounds):
        json_spans, seconds, _replay = replay_engine(lines, policy_path, OTLP_JSON)
        json_replay_s = min(json_replay_s, seconds)
    assert json_spans == replay_spans
    sizes = state_sizes(messages, policy_path)
    result = {
        "spans": ceiling_spans,
        "messages": len(messages),
        "decode_ceiling_spans_per_s": ceiling_spans / ceiling_s,
        "span_path": native.ACTIVE,
        "span_path_detail": native.describe(),
        "native_decode_spans_per_s": (
            ceiling_spans / native_s if native_decode is not None else None
        ),
        "json_decode_python_spans_per_s": json_py,
        "json_decode_native_spans_per_s": json_native,
        "replay_spans_per_s": replay_spans / replay_s,
        "replay_to_ceiling": (replay_spans / replay_s) / (ceiling_spans / ceiling_s),
        "json_replay_spans_per_s": json_spans / json_replay_s,
        "rounds": rounds,
        "runs": replay.stats.runs_finished,
        "looping_runs": replay.stats.looping_runs,
        "events": replay.stats.events,
        "state_bytes_per_active_run": sum(sizes) / len(sizes) if sizes else 0.0,
        "state_bytes_max": max(sizes, default=0),
        "active_runs_sampled": len(sizes),
    }
    return result
