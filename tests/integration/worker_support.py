"""Support of the integration tests: `WorkerProc` (tests/support/worker_proc.py, shared
with the bench) runs `loopwatch worker` as a subprocess against the real broker.

Also shared by the reliability tests (chaos, malformed stream, canary): the bench corpus as
input (`rooted_corpus`), the replay oracle (`Oracle`), reading a whole topic
(`read_to_end`), the worker's metrics and crash lines in its log, and `LONG`
(``LOOPWATCH_CHAOS_LONG=1``, `make chaos`: the long variants).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.corpus import export_messages
from detectors.policy import load_policy
from tests.otlp_build import replay_messages
from tests.support.worker_proc import EXAMPLE_POLICY, FINGERPRINT_KEY, reader

LONG = os.environ.get("LOOPWATCH_CHAOS_LONG", "").lower() in ("1", "true", "yes", "on")


def values(records: list[Any]) -> list[dict[str, Any]]:
    return [json.loads(r.value()) for r in records]


def headers_of(record: Any) -> dict[str, str]:
    return {k: v.decode() for k, v in (record.headers() or [])}


def read_to_end(topic: str, timeout: float = 60.0) -> list[Any]:
    """Every record of `topic` up to its end offsets at the call (group-less consumer)."""
    consumer = reader()
    try:
        md = consumer.list_topics(topic, timeout=10)
        ends = {}
        for p in md.topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            out.append(msg)
            if (msg.offset() or 0) >= ends[msg.partition()] - 1:
                del ends[msg.partition()]
        assert not ends, f"{topic}: not read to the end within {timeout} s ({ends})"
        return out
    finally:
        consumer.close()


# ---------------------------------------------------------------------------- input + oracle


def rooted_corpus(total_spans: int, seed: int) -> list[bytes]:
    """The bench corpus (`bench.corpus.export_messages`: concurrent runs, a few % looping)
    an hour in the past, without the runs the generator cut off before their root span
    (they would end by idle timeout only)."""
    past = time.time_ns() - 3_600_000_000_000
    requests = [
        ExportTraceServiceRequest.FromString(m)
        for m in export_messages(total_spans, seed=seed, base_ns=past, run_spacing_ns=50_000_000)
    ]
    rooted = {
        sp.trace_id
        for req in requests
        for rs in req.resource_spans
        for ss in rs.scope_spans
        for sp in ss.spans
        if not sp.parent_span_id
    }
    out = []
    for req in requests:
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                keep = [sp for sp in ss.spans if sp.trace_id in rooted]
                del ss.spans[:]
                ss.spans.extend(keep)
        if any(ss.spans for rs in req.resource_spans for ss in rs.scope_spans):
            out.append(req.SerializeToString())
    return out


_EVENT_KEYS = ("shape", "event_id", "count", "first_sequence", "last_sequence", "trigger_span_id")
_SUMMARY_KEYS = (
    "outcome",
    "steps",
    "tool_calls",
    "spans",
    "distinct_actions",
    "duplicate_spans",
    "late_spans",
    "shapes",
)


@dataclass
class Oracle:
    """What `loopwatch replay` (streams/replay/runs.py, the example policy, the workers'
    fingerprint key) computes from groups of export messages (each group replayed on its
    own; a run must not be in two)."""

    messages: list[bytes] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)  # by run id
    event_ids: set[str] = field(default_factory=set)
    by_run_shape: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    runs: set[tuple[str, str]] = field(default_factory=set)  # (run_id, outcome)

    @classmethod
    def of(cls, groups: list[list[bytes]]) -> Oracle:
        policy = load_policy(EXAMPLE_POLICY)
        oracle = cls()
        for messages in groups:
            events, summaries = replay_messages(messages, policy, FINGERPRINT_KEY.encode())
            assert not {s["run_id"] for s in summaries} & set(oracle.summaries), (
                "one run, two groups"
            )
            oracle.messages.extend(messages)
            oracle.events.extend(events)
            oracle.summaries.update((s["run_id"], s) for s in summaries)
        oracle.event_ids = {e["event_id"] for e in oracle.events}
        oracle.by_run_shape = by_run_shape(oracle.events)
        oracle.runs = {(r, s["outcome"]) for r, s in oracle.summaries.items()}
        assert len(oracle.event_ids) == len(oracle.events), "replay ids are unique"
        return oracle

    @property
    def run_ids(self) -> set[str]:
        return set(self.summaries)

    def differences(
        self, events: list[dict[str, Any]], summaries: list[dict[str, Any]]
    ) -> tuple[list[str], list[str]]:
        """(problems, run ids that differ) of a stream's events and summaries against the
        replay: the same event ids, per (run, shape) the replay's ids and no other (no
        episode fired twice under two ids), one outcome per run, the replay's. Copies of
        one event or summary (at-least-once) are not a difference."""
        ids = {e["event_id"] for e in events}
        missing, invented = self.event_ids - ids, ids - self.event_ids
        got_by_run_shape = by_run_shape(events)
        refired = {
            k: sorted(v) for k, v in got_by_run_shape.items() if v != self.by_run_shape.get(k)
        }
        refired |= {k: [] for k in self.by_run_shape if k not in got_by_run_shape}
        runs = {(s["run_id"], s["outcome"]) for s in summaries}
        two_outcomes = sorted(r for r, n in Counter(r for r, _ in runs).items() if n > 1)
        problems = []
        if missing:
            problems.append(f"{len(missing)} expected event ids missing: {sorted(missing)[:10]}")
        if invented:
            shapes = Counter(e["shape"] for e in events if e["event_id"] in invented)
            problems.append(f"{len(invented)} unexpected event ids ({dict(shapes)})")
        if refired:
            sample = dict(list(refired.items())[:5])
            problems.append(
                f"{len(refired)} (run, shape) with ids other than the replay's: {sample}"
            )
        if two_outcomes:
            problems.append(f"runs with two different outcomes: {two_outcomes[:10]}")
        if runs != self.runs:
            lost, extra = self.runs - runs, runs - self.runs
            problems.append(
                f"run summaries differ: {len(lost)} expected (run, outcome) missing "
                f"{sorted(lost)[:5]}, {len(extra)} unexpected {sorted(extra)[:5]}"
            )
        differ = {r for r, _ in refired} | {r for r, _ in self.runs ^ runs}
        differ |= {e["run_id"] for e in self.events if e["event_id"] in missing}
        differ |= {e["run_id"] for e in events if e["event_id"] in invented}
        return problems, sorted(differ)

    def describe(
        self, run_id: str, events: list[dict[str, Any]], summaries: list[dict[str, Any]]
    ) -> list[str]:
        """The replay's and the stream's events and summaries of one run."""
        lines = []
        for name, evs in (("replay", self.events), ("stream", events)):
            lines += [
                f"    {name} event   {[e.get(k) for k in _EVENT_KEYS]}"
                for e in evs
                if e["run_id"] == run_id
            ]
        summary = self.summaries.get(run_id)
        if summary:
            lines.append(f"    replay summary {[summary.get(k) for k in _SUMMARY_KEYS]}")
        lines += [
            f"    stream summary {[s.get(k) for k in _SUMMARY_KEYS]}"
            for s in summaries
            if s["run_id"] == run_id
        ]
        return lines


def by_run_shape(events: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for e in events:
        out[(e["run_id"], e["shape"])].add(e["event_id"])
    return dict(out)
