"""`RunDriver`: the detect agent's logic over two key/value tables, no faust, no broker.

Per run: decode its envelope (or take it from a small write-through cache), apply the
steps of a batch with the pure pipeline (detectors/pipeline.py), choose its next deadline, and
keep the table write pending until the caller has published the batch's outputs
(`take_writes`): a state whose fired markers reached the changelog never belongs to an
event that was not delivered. Ticks release, finalize and evict due runs of a partition.
Clock values are passed in.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from alerts.events import build_event
from detectors import pipeline
from detectors.model import Step
from detectors.policy import Policy
from detectors.state import RunState
from streams.errors import DecodeError
from streams.worker.deadlines import Deadline, DeadlineIndex, FinishedIndex
from streams.worker.formats import key_text
from streams.worker.store import (
    Envelope,
    Table,
    decode_envelope,
    decode_finished,
    decode_header,
    encode_envelope,
    encode_finished,
)

log = logging.getLogger("loopwatch.worker")

NS = 1_000_000_000


@dataclass(slots=True)
class Outputs:
    events: list[dict[str, Any]] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)
    evicted: int = 0
    spans_after_finalize: int = 0  # of runs already finished: counted, not fed
    late_spans: int = 0  # behind released steps of their run (out of order): still fed
    duplicate_spans: int = 0


class RunDriver:
    """The detect agent's logic over two key/value tables, no faust: `runs` (run id ->
    envelope) and `finished` (run id -> finished marker). Clock values are passed in."""

    def __init__(
        self,
        policy: Policy,
        *,
        finished_ttl_seconds: float = 3600.0,
        max_active_runs: int = 200_000,
        tick_seconds: float = 1.0,
        cache_size: int = 10_000,
    ) -> None:
        self.policy = policy
        self.index = DeadlineIndex()
        self.finished_index = FinishedIndex()
        # Decoded states of recently touched runs (write-through: the table always has the
        # same state encoded). Saves the decode on the next message of a run; cleared on
        # every rebalance, and an entry is taken out while its run is being processed, so a
        # failure can never leave a half-updated state cached.
        self.cache: OrderedDict[str, tuple[Envelope, RunState]] = OrderedDict()
        self.cache_size = cache_size
        # Table writes of the current batch, not yet applied: the caller publishes the
        # batch's events and summaries, waits for the broker's acks, and only then writes
        # the tables (`take_writes`). A state whose fired markers are in the changelog never
        # belongs to an event that was not delivered. Reads see these first.
        self.pending_runs: dict[bytes, tuple[int, bytes | None]] = {}
        self.pending_finished: dict[bytes, tuple[int, bytes | None]] = {}
        self.state_writes = 0
        self.max_active_runs = max_active_runs
        self.finished_ttl_ns = int(finished_ttl_seconds * NS)
        self.tick_ns = int(tick_seconds * NS)
        self._lateness_ns = int(policy.allowed_lateness_seconds * NS)
        self._grace_ns = int(policy.finalize_grace_seconds * NS)
        self._idle_ns = int(policy.idle_timeout_seconds * NS)

    # ------------------------------------------------------------------ scheduling

    def deadline_for(self, env: Envelope) -> Deadline:
        seen = env.seen_ns
        release_at = seen + self._lateness_ns if env.pending else None
        # root ended: grace from the last arrival (as the engine); else the idle timeout
        finalize_at = seen + (self._grace_ns if env.root_end_ns is not None else self._idle_ns)
        return Deadline(env.partition, seen, release_at, finalize_at)

    def rebuild(
        self,
        runs: Iterable[tuple[bytes, bytes]],
        finished: Iterable[tuple[bytes, bytes]],
        partitions: set[int] | None,
        now_ns: int,
    ) -> None:
        """Rebuild the in-memory indexes from the tables (after partition assignment).

        Downtime does not count against a run: its clock restarts at `now_ns`, so a worker
        catching up a backlog does not finalize runs whose spans are still queued.
        """
        self.index.clear()
        self.cache.clear()  # (writes of a batch still in flight stay pending: they belong
        for key, raw in runs:  # to outputs that are being published)
            try:
                env = decode_header(raw)
            except (ValueError, KeyError, TypeError):
                log.warning("runs table: unreadable entry for %r skipped", key_text(key))
                continue
            if partitions is not None and env.partition not in partitions:
                continue
            env.seen_ns = max(env.seen_ns, now_ns)
            self.index.set(key_text(key), self.deadline_for(env))
        items = []
        for key, raw in finished:
            try:
                finished_ns, partition = decode_finished(raw)
            except (ValueError, TypeError):
                continue
            if partitions is None or partition in partitions:
                items.append((partition, finished_ns, key_text(key)))
        self.finished_index.rebuild(items)

    def due_partitions(self, now_ns: int) -> set[int]:
        """Partitions with work for a tick: due runs or finished markers past their TTL."""
        self.index.mark_evictions(self.max_active_runs, now_ns)
        due = set()
        for p in self.index.partitions():
            at = self.index.next_due(p)
            if at is not None and at <= now_ns:
                due.add(p)
        cutoff = now_ns - self.finished_ttl_ns
        for p in self.finished_index.partitions():
            oldest = self.finished_index.oldest(p)
            if oldest is not None and oldest <= cutoff:
                due.add(p)
        return due

    # ------------------------------------------------------------------ processing

    def process_run(
        self,
        runs: Table,
        finished: Table,
        partition: int,
        run_id: str,
        batches: list[tuple[list[Step], int | None]],
        now_ns: int,
    ) -> Outputs:
        """Steps of one run, from one or more messages in arrival order, each with the
        input clock it was sent at (None: keyed input, wall-clock mode, older workers); one
        state write (pending until `take_writes`). Nothing shared changes unless it succeeds.

        Release at arrival: a run's spans on unkeyed input come from several input
        partitions, one possibly far behind, so a span with a late end time can arrive
        before earlier ones and its end time must not release them. The event time used
        is then only what the input clock vouches for: the run's latest end as of an
        earlier arrival (the candidate), once a message or tick sent at an input clock
        past that arrival comes in (everything produced before then has been forwarded,
        ahead of it). This holds when an exporter sends a trace's spans within
        `allowed_lateness` of their order, the assumption the replay makes about arrival
        order. One candidate at a time: confirmation trails arrivals by about the input
        clock's lag, however often the run's messages come."""
        out = Outputs()
        key = run_id.encode("utf-8")
        loaded = self._load(runs, key, run_id)
        if loaded is None:
            if self._is_finished(finished, key):
                out.spans_after_finalize = sum(len(steps) for steps, _ in batches)
                return out
            state = pipeline.new_state(run_id)
            env = Envelope(partition, now_ns, now_ns, 0, None, 0)
        else:
            env, state = loaded
        policy = self.policy
        before_dup, before_late = state.duplicate_spans, state.late_spans
        findings = []
        for steps, sent_clock in batches:
            watermark = None  # the run's own latest end: arrivals are in export order
            if sent_clock is not None:
                env.vouch(sent_clock)
                watermark = env.confirmed_end_ns or 0
            for step in steps:
                findings.extend(pipeline.ingest(policy, state, step))
            findings.extend(pipeline.release(policy, state, watermark))
            if sent_clock is not None and (env.candidate is None or env.candidate[0] == now_ns):
                env.candidate = (now_ns, state.max_end_ns)
        out.events = [build_event(f, run_id, policy) for f in findings]
        out.duplicate_spans = state.duplicate_spans - before_dup
        out.late_spans = state.late_spans - before_late
        env.partition, env.seen_ns = partition, now_ns
        self.pending_runs[key] = (partition, encode_envelope(state, env))
        self._keep(run_id, env, state)
        self.index.set(run_id, self.deadline_for(env))
        return out

    def tick(self, runs: Table, finished: Table, partition: int, now_ns: int) -> Outputs:
        """Due releases, finalizations, evictions and marker expiry of one partition."""
        out = Outputs()
        policy = self.policy
        for run_id in self.index.pop_due(partition, now_ns):
            deadline = self.index.get(run_id)
            key = run_id.encode("utf-8")
            try:
                loaded = self._load(runs, key, run_id)
            except (DecodeError, ValueError, KeyError, TypeError):
                log.exception("runs table: unreadable state of run %s left alone", run_id)
                loaded = None
            if deadline is None or loaded is None:
                self.index.remove(run_id)
                continue
            env, state = loaded
            if deadline.evict or deadline.finalize_at <= now_ns:
                findings, summary = pipeline.finalize(policy, state)
                out.events.extend(build_event(f, run_id, policy) for f in findings)
                out.summaries.append(summary)
                if deadline.evict:
                    out.evicted += 1
                self.pending_runs[key] = (partition, None)
                self.pending_finished[key] = (partition, encode_finished(now_ns, partition))
                self.finished_index.add(partition, now_ns, run_id)
                self.index.remove(run_id)
                continue
            # Release: the run clock is its event time advanced by the wall time since its
            # last span arrived. Past that arrival, the clock vouches for all of it.
            env.vouch(now_ns)
            if now_ns >= env.seen_ns:
                env.confirmed_end_ns = max(env.confirmed_end_ns or 0, state.max_end_ns)
            watermark = state.max_end_ns + (now_ns - env.seen_ns)
            findings = pipeline.release(policy, state, watermark)
            out.events.extend(build_event(f, run_id, policy) for f in findings)
            self.pending_runs[key] = (partition, encode_envelope(state, env))
            self._keep(run_id, env, state)
            nxt = self.deadline_for(env)
            if nxt.release_at is not None and nxt.release_at <= now_ns:
                nxt.release_at = now_ns + self.tick_ns  # blocked by ordering: retry later
            self.index.set(run_id, nxt)
        for run_id in self.finished_index.pop_expired(partition, now_ns - self.finished_ttl_ns):
            key = run_id.encode("utf-8")
            if self._is_finished(finished, key):
                self.pending_finished[key] = (partition, None)
        return out

    def take_writes(self) -> list[tuple[str, int, bytes, bytes | None]]:
        """The pending table writes, (table, partition, key, value or None = delete), and
        forget them: the caller applies them (after the outputs were acknowledged)."""
        writes = [("runs", p, k, v) for k, (p, v) in self.pending_runs.items()]
        writes += [("finished", p, k, v) for k, (p, v) in self.pending_finished.items()]
        self.state_writes += len(self.pending_runs)
        self.pending_runs.clear()
        self.pending_finished.clear()
        return writes

    def discard_writes(self) -> None:
        """The outputs could not be published: drop the batch's writes and every cached
        state (the tables still hold the states before the batch)."""
        for key in self.pending_runs:
            self.cache.pop(key_text(key), None)
        self.pending_runs.clear()
        self.pending_finished.clear()
        self.cache.clear()

    def apply_writes(self, runs: Table, finished: Table) -> int:
        """take_writes + apply, for plain mappings (tests, tools)."""
        writes = self.take_writes()
        for table, _p, key, value in writes:
            target = runs if table == "runs" else finished
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
        return len(writes)

    def _is_finished(self, finished: Table, key: bytes) -> bool:
        pending = self.pending_finished.get(key)
        if pending is not None:
            return pending[1] is not None
        return finished.get(key) is not None

    def _load(self, runs: Table, key: bytes, run_id: str) -> tuple[Envelope, RunState] | None:
        cached = self.cache.pop(run_id, None)
        if cached is not None:
            return cached
        pending = self.pending_runs.get(key)
        raw = pending[1] if pending is not None else runs.get(key)
        return None if raw is None else decode_envelope(raw)

    def _keep(self, run_id: str, env: Envelope, state: RunState) -> None:
        if self.cache_size <= 0:
            return
        self.cache[run_id] = (env, state)
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
