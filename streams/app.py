"""The Kafka stream service: a faust app running the same pure pipeline as `loopwatch replay`.

Topology (contracts.md §1, §6; architecture.md "The flow")::

    otlp_spans ──ingest──▶ loopwatch-steps ──detect──▶ loop_detected (key run_id)
      (raw OTLP batches)   steps by run id     │       loop_runs     (key run_id)
          │                                    └─ tables runs, finished, loop_counts,
          └─ undecodable ─▶ loopwatch-dead-letters     run_counts (changelogs)
                            (digest + headers)

* **ingest** decodes each record as one whole OTLP batch, normalizes every span and forwards
  the steps grouped by run: by default one message per destination partition per record
  (the runs inside, each on the partition its run id hashes to, exactly as if keyed by it:
  per-message overhead, not table writes, dominated the hop), or with
  ``LOOPWATCH_STEPS_GROUPING=run`` one message per run per record keyed by run id. With
  ``LOOPWATCH_INPUT_KEYED_BY_RUN`` (the collector keys records by trace id and ``run_key``
  is ``trace``) there is no hop: detect reads the input topic itself.
* **detect** keeps one `RunState` per live run in the faust table ``runs`` and calls
  ``detectors.run`` ingest/release/finalize exactly as `streams.engine.Engine` does.
  It takes messages in batches (``stream.take_events``): each run's steps of the batch are
  applied in arrival order and its state is written once per batch. The batch's events and
  summaries are sent and acknowledged by the broker *before* the table writes, so a state
  whose fired markers reached the changelog never belongs to an undelivered event.
* **time**: a run's clock is its event time (``max_end_ns`` of its spans) advanced by the
  wall-clock time since its last span arrived. At arrival this is exactly the replay's
  ``release(policy, state)``; afterwards it releases buffered steps once
  ``allowed_lateness_seconds`` of wall time passed, finalizes ``finalize_grace_seconds`` after
  the root span ended, or after ``idle_timeout_seconds`` without new spans. Wall-clock
  deadlines live in an in-memory `DeadlineIndex`, rebuilt from the table whenever partitions
  are assigned (restart/rebalance; downtime does not count: deadlines restart from then).
* **timer ticks**: table writes need the partition of the run, i.e. a stream event. A timer
  (``LOOPWATCH_TICK_SECONDS``) sends a tiny tick message to each steps-topic partition that
  has due work; detect handles the tick after everything already queued on that partition
  (a backlog is processed before its runs can time out), releasing, finalizing, evicting
  (``LOOPWATCH_MAX_ACTIVE_RUNS``) and expiring finished-run markers of that partition.
  The tick carries the deadline clock of its send time and detect judges deadlines by
  that value: steps ingest delivered before the clock advanced are ahead of the tick on
  the partition, steps delivered after it may be behind it.
* **finished runs**: table ``finished`` (run id -> finished time, expired after
  ``LOOPWATCH_FINISHED_TTL_SECONDS``) makes late spans of a finished run count as
  ``spans_after_finalize`` (metric ``late_spans``) instead of opening a new run.
* **idempotent outputs**: at-least-once; the event id is deterministic and a fired episode
  is a marker in RunState, so a redelivered message may republish an id, never a new one.
* **on-call API** (faust web): ``/healthz``, ``/runs/{run_id}`` (routed to the owner of the
  key), ``/loops`` and ``/runs`` from windowed count tables (60 s tumbling, 24 h), optional
  bearer token. Read-only; faust's own table/router/stats pages are turned off.

Everything above the "faust wiring" line is pure (no faust, no broker) and unit-tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import heapq
import hmac
import json
import logging
import re
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, cast

from aiokafka.errors import MessageSizeTooLargeError

from alerts.events import build_event, event_id
from detectors import run as pipeline
from detectors.codec import decode_state, encode_state
from detectors.errors import DecodeError
from detectors.model import STEP_FIELDS, Step
from detectors.policy import Policy
from detectors.state import (
    WIN_ACTION,
    WIN_CODE,
    WIN_OUTCOME,
    WIN_POS,
    WIN_SPAN,
    WIN_TOOL,
    RunState,
)
from streams.input_clock import InputClock, KafkaInputProbe
from streams.normalize import STEP_ERRORS, Normalizer
from streams.otlp import decode_record
from streams.refetch import OffsetGaps, Refetcher

log = logging.getLogger("loopwatch.worker")

NS = 1_000_000_000
# The input clock holds deadlines only while its probe answers: after this long without an
# answer (broker unreachable, offsets unavailable) deadlines follow the wall clock again.
INPUT_PROBE_STALE_NS = 30 * NS
ENVELOPE_VERSION = 1
# A failed delivery is sent again after these backoffs, for as long as it takes
# (LoopwatchPublishRetrying alerts on it). What reaches this has already outlived the
# producer's own retries (faust's producer_request_timeout, 20 min) or cannot be retried
# by the producer (authorization, a topic's size or timestamp limits): an operator's fix
# then resumes delivery without a restart.
PUBLISH_RETRY_FIRST_SECONDS = 1.0
PUBLISH_RETRY_MAX_SECONDS = 30.0
# Steps messages are split to stay under this (the producer refuses requests over 1 MB;
# a record of many small spans encodes to more steps JSON than its own protobuf).
MAX_STEPS_MESSAGE_BYTES = 512 * 1024
TICK_VALUE_PREFIX = b"{"  # steps messages are JSON arrays, ticks JSON objects


def encode_tick(sent_ns: int, clock_ns: int) -> bytes:
    """A tick: its send time and the deadline clock (wall or input clock) at that time."""
    return json.dumps({"tick": sent_ns, "clock": clock_ns}).encode()


CLOCK_HEADER = "loopwatch-input-clock"  # on steps messages: the input clock at send time


def sent_clock(message: Any) -> int | None:
    """The input clock a steps message was sent at (its CLOCK_HEADER); None without one."""
    headers = getattr(message, "headers", None) or ()
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in pairs:
        if name == CLOCK_HEADER and value:
            try:
                return int(bytes(value))
            except ValueError:
                return None
    return None


def tick_clock(value: bytes) -> int | None:
    """The deadline clock a tick carries; None for a tick without one (older workers)."""
    clock = json.loads(value).get("clock")
    return clock if isinstance(clock, int) and not isinstance(clock, bool) else None


_END = STEP_FIELDS.index("end_ns")

# Labels of the /loops and /runs aggregates (order = the row fields).
LOOP_LABELS = ("shape", "prompt_version", "tool_version")
RUN_LABELS = ("prompt_version", "outcome", "termination_reason")
MAX_SINCE_SECONDS = 366 * 86400  # as `loopwatch query`; counters keep 24 h
_SINCE_RE = re.compile(r"^([0-9]{1,9})([smhd]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


# ============================================================================ pure core


def encode_steps(steps: Iterable[Step]) -> bytes:
    """The internal topic's value: compact JSON of ``[step.to_list(), ...]``."""
    return _json([s.to_list() for s in steps])


def decode_steps(value: bytes) -> list[Step]:
    data = json.loads(value)
    if not isinstance(data, list):
        raise ValueError("steps message is not a JSON array")
    return [Step.from_list(item) for item in data]


def encode_run_groups(groups: Iterable[tuple[str, list[Step]]]) -> bytes:
    """A partition-grouped steps message (no key): ``[[run_id, [step, ...]], ...]``."""
    return json.dumps(
        [[run_id, [s.to_list() for s in steps]] for run_id, steps in groups],
        separators=(",", ":"),
    ).encode("utf-8")


def decode_run_groups(value: bytes) -> list[tuple[str, list[Step]]]:
    data = json.loads(value)
    if not isinstance(data, list):
        raise ValueError("steps message is not a JSON array")
    out = []
    for run_id, steps in data:
        if not isinstance(run_id, str) or not isinstance(steps, list):
            raise ValueError("grouped steps message: expected [run_id, [steps]] pairs")
        out.append((run_id, [Step.from_list(item) for item in steps]))
    return out


def split_to_fit(
    groups: list[tuple[str, list[Step]]],
    encode: Callable[[list[tuple[str, list[Step]]]], bytes],
    limit: int,
) -> list[bytes]:
    """`encode(groups)` as one value, or as several (groups, then a run's steps, halved in
    order) when it is over `limit` bytes. A single step is never split."""
    value = encode(groups)
    if len(value) <= limit or (len(groups) == 1 and len(groups[0][1]) <= 1):
        return [value]
    if len(groups) > 1:
        mid = len(groups) // 2
        return split_to_fit(groups[:mid], encode, limit) + split_to_fit(groups[mid:], encode, limit)
    run_id, steps = groups[0]
    mid = len(steps) // 2
    return split_to_fit([(run_id, steps[:mid])], encode, limit) + split_to_fit(
        [(run_id, steps[mid:])], encode, limit
    )


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message as sent, kept to send it again if its delivery fails. `fallback`: what
    to send instead when the broker refuses it as too large (a dead letter without the
    payload it captured)."""

    topic: Any
    key: bytes | None
    value: bytes
    partition: int | None = None
    timestamp: float | None = None
    headers: Any = None
    fallback: Outgoing | None = None


class Abandoned(Exception):
    """Outputs still waited for delivery when the worker began to stop or its partitions
    were revoked: what sent them stays unacknowledged, and the partition's next owner
    (this worker again, after an eager rebalance) processes it again."""


def key_partition(key: bytes, partitions: int) -> int:
    """The partition the Kafka Java client / aiokafka default partitioner (and so faust's
    table router) gives `key`: murmur2, positive, modulo the partition count."""
    from aiokafka.partitioner import murmur2

    return int(murmur2(key) & 0x7FFFFFFF) % partitions


@dataclass(slots=True)
class Envelope:
    """A `runs` table value: a small header (what the deadline index needs) + the state.

    Stored as ``<header JSON>\\n<RunState, detectors.codec>`` so that rebuilding the deadline
    index after a rebalance parses only the headers.
    """

    partition: int
    seen_ns: int  # wall time the run's latest span arrived (its clock's anchor)
    first_ns: int  # wall time the run's first span arrived
    max_end_ns: int
    root_end_ns: int | None
    pending: int
    # Unkeyed input with the input clock (`RunDriver.process_run`): the run's event time
    # the clock has vouched for (None until then, and always with keyed input), and the
    # arrival waiting for it: (wall time, the run's latest end as of then).
    confirmed_end_ns: int | None = None
    candidate: tuple[int, int] | None = None

    def vouch(self, clock_ns: int) -> None:
        """The input clock reached `clock_ns`: everything produced before then is ahead of
        the message or tick carrying it, so the candidate arrival's event time is safe."""
        if self.candidate is not None and clock_ns >= self.candidate[0]:
            self.confirmed_end_ns = max(self.confirmed_end_ns or 0, self.candidate[1])
            self.candidate = None

    def header(self) -> bytes:
        return json.dumps(
            {
                "v": ENVELOPE_VERSION,
                "p": self.partition,
                "seen": self.seen_ns,
                "first": self.first_ns,
                "max_end": self.max_end_ns,
                "root_end": self.root_end_ns,
                "pending": self.pending,
                "confirmed": self.confirmed_end_ns,
                "cand": self.candidate,
            },
            separators=(",", ":"),
        ).encode("utf-8")


def encode_envelope(state: RunState, env: Envelope) -> bytes:
    """`env` (its state-derived fields refreshed from `state`) + the encoded state."""
    env.max_end_ns = state.max_end_ns
    env.root_end_ns = state.root_end_ns
    env.pending = len(state.pending)
    return env.header() + b"\n" + encode_state(state)


def decode_header(raw: bytes) -> Envelope:
    head, _, _ = bytes(raw).partition(b"\n")
    h = json.loads(head)
    if h.get("v") != ENVELOPE_VERSION:
        raise ValueError(f"run envelope version {h.get('v')!r} is not {ENVELOPE_VERSION}")
    candidate = h.get("cand")  # these two are absent in envelopes written before them
    return Envelope(
        h["p"],
        h["seen"],
        h["first"],
        h["max_end"],
        h["root_end"],
        h["pending"],
        h.get("confirmed"),
        (candidate[0], candidate[1]) if candidate else None,
    )


def decode_envelope(raw: bytes) -> tuple[Envelope, RunState]:
    raw = bytes(raw)
    env = decode_header(raw)
    _, _, body = raw.partition(b"\n")
    return env, decode_state(body)


def encode_finished(finished_ns: int, partition: int) -> bytes:
    return json.dumps([finished_ns, partition]).encode("utf-8")


def decode_finished(raw: bytes) -> tuple[int, int]:
    finished_ns, partition = json.loads(raw)
    return int(finished_ns), int(partition)


@dataclass(slots=True)
class Deadline:
    partition: int
    seen_ns: int
    release_at: int | None  # buffered steps become ready (run clock passed the lateness)
    finalize_at: int  # root ended + grace, or idle timeout
    evict: bool = False

    @property
    def due(self) -> int:
        if self.evict:
            return 0
        if self.release_at is not None and self.release_at < self.finalize_at:
            return self.release_at
        return self.finalize_at


class DeadlineIndex:
    """In-memory wall-clock schedule of the live runs of this worker, per partition.

    Rebuilt from the `runs` table headers on partition assignment; lazy-deletion heaps.
    """

    def __init__(self) -> None:
        self.entries: dict[str, Deadline] = {}
        self._heaps: dict[int, list[tuple[int, str]]] = {}
        self.evicting = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self.entries

    def get(self, run_id: str) -> Deadline | None:
        return self.entries.get(run_id)

    def set(self, run_id: str, deadline: Deadline) -> None:
        old = self.entries.get(run_id)
        if old is not None and old.evict:
            deadline.evict = True  # stays marked until the eviction happens
        self.entries[run_id] = deadline
        heapq.heappush(self._heaps.setdefault(deadline.partition, []), (deadline.due, run_id))

    def remove(self, run_id: str) -> None:
        old = self.entries.pop(run_id, None)
        if old is not None and old.evict:
            self.evicting -= 1

    def clear(self) -> None:
        self.entries.clear()
        self._heaps.clear()
        self.evicting = 0

    def _top(self, partition: int) -> tuple[int, str] | None:
        heap = self._heaps.get(partition)
        while heap:
            due, run_id = heap[0]
            entry = self.entries.get(run_id)
            if entry is not None and entry.partition == partition and entry.due == due:
                return heap[0]
            heapq.heappop(heap)
        return None

    def next_due(self, partition: int) -> int | None:
        top = self._top(partition)
        return None if top is None else top[0]

    def partitions(self) -> list[int]:
        return list(self._heaps)

    def pop_due(self, partition: int, now_ns: int) -> list[str]:
        """Run ids of `partition` whose deadline passed (removed from the heap, kept in
        `entries`: the caller finalizes, reschedules or removes each one)."""
        out: list[str] = []
        while True:
            top = self._top(partition)
            if top is None or top[0] > now_ns:
                return out
            heapq.heappop(self._heaps[partition])
            out.append(top[1])

    def mark_evictions(self, max_active: int, now_ns: int) -> int:
        """Mark the oldest idle runs beyond `max_active` for eviction; returns how many."""
        excess = len(self.entries) - self.evicting - max_active
        if excess <= 0:
            return 0
        candidates = heapq.nsmallest(
            excess,
            ((d.seen_ns, run_id) for run_id, d in self.entries.items() if not d.evict),
        )
        for _seen, run_id in candidates:
            entry = self.entries[run_id]
            entry.evict = True
            self.evicting += 1
            heapq.heappush(self._heaps.setdefault(entry.partition, []), (0, run_id))
        return len(candidates)


class FinishedIndex:
    """Finished-run markers per partition, oldest first, for TTL cleanup."""

    def __init__(self) -> None:
        self._by_partition: dict[int, deque[tuple[int, str]]] = {}
        self.size = 0

    def add(self, partition: int, finished_ns: int, run_id: str) -> None:
        self._by_partition.setdefault(partition, deque()).append((finished_ns, run_id))
        self.size += 1

    def clear(self) -> None:
        self._by_partition.clear()
        self.size = 0

    def rebuild(self, items: Iterable[tuple[int, int, str]]) -> None:
        """items: (partition, finished_ns, run_id)."""
        self.clear()
        for partition, finished_ns, run_id in sorted(items, key=lambda x: (x[0], x[1])):
            self.add(partition, finished_ns, run_id)

    def oldest(self, partition: int) -> int | None:
        q = self._by_partition.get(partition)
        return q[0][0] if q else None

    def partitions(self) -> list[int]:
        return [p for p, q in self._by_partition.items() if q]

    def pop_expired(self, partition: int, cutoff_ns: int) -> list[str]:
        q = self._by_partition.get(partition)
        out = []
        while q and q[0][0] <= cutoff_ns:
            out.append(q.popleft()[1])
            self.size -= 1
        return out


@dataclass(slots=True)
class Outputs:
    events: list[dict[str, Any]] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)
    evicted: int = 0
    spans_after_finalize: int = 0
    duplicate_spans: int = 0


Table = MutableMapping[bytes, bytes]


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
                log.warning("runs table: unreadable entry for %r skipped", _text(key))
                continue
            if partitions is not None and env.partition not in partitions:
                continue
            env.seen_ns = max(env.seen_ns, now_ns)
            self.index.set(_text(key), self.deadline_for(env))
        items = []
        for key, raw in finished:
            try:
                finished_ns, partition = decode_finished(raw)
            except (ValueError, TypeError):
                continue
            if partitions is None or partition in partitions:
                items.append((partition, finished_ns, _text(key)))
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
        before_dup = state.duplicate_spans
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
            self.cache.pop(_text(key), None)
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


def _ignore_failure(future: Any) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: asyncio would log it as never retrieved


def _encode_first_steps(groups: list[tuple[str, list[Step]]]) -> bytes:
    return encode_steps(groups[0][1])


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def _text(key: Any) -> str:
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key).decode("utf-8", "replace")
    return str(key)


def group_steps(normalizer: Normalizer, spans: Iterable[Any]) -> tuple[dict[str, list[Step]], int]:
    """Normalize a decoded batch and group its steps by run id (first-seen order), as
    Engine.feed does. Returns (steps by run, number of invalid spans skipped)."""
    by_run: dict[str, list[Step]] = {}
    invalid = 0
    step_of = normalizer.step
    for span in spans:
        try:
            step = step_of(span)
        except STEP_ERRORS:
            invalid += 1
            continue
        by_run.setdefault(step.run_id, []).append(step)
    return by_run, invalid


def dead_letter_record(
    value: bytes | None,
    *,
    reason: str,
    error: str,
    topic: str,
    partition: int,
    offset: int,
    capture_payload: bool,
) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(value, headers) of a dead letter. The value is a digest of the payload unless
    payload capture is enabled: raw telemetry may carry customer data."""
    payload = bytes(value) if value is not None else b""
    digest = hashlib.sha256(payload).hexdigest()
    headers = [
        ("reason", reason.encode()),
        ("source_topic", topic.encode()),
        ("source_partition", str(partition).encode()),
        ("source_offset", str(offset).encode()),
        ("error", error.encode("utf-8", "replace")[:1000]),
        ("payload_sha256", digest.encode()),
        ("payload_length", str(len(payload)).encode()),
        ("payload_captured", b"true" if capture_payload else b"false"),
    ]
    if capture_payload:
        return payload, headers
    body = {"payload_sha256": digest, "payload_length": len(payload), "value": None}
    return _json(body), headers


_TRACE_ID_KEY = re.compile(rb"[0-9a-f]{32}")


def dead_letter_key(key: bytes | None, capture_payload: bool) -> bytes | None:
    """The key of a dead letter. An undecodable record's key is unvalidated input like its
    value (a canary in it reached the dead-letter topic and faust's debug log): unless
    payload capture is enabled, only a trace-id key (what the collector writes) is kept,
    any other key becomes its SHA-256 (records with one key still share a partition)."""
    if not key or capture_payload:
        return key
    key = bytes(key)
    if _TRACE_ID_KEY.fullmatch(key):
        return key
    return hashlib.sha256(key).hexdigest().encode()


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return cast(Callable[[int], int], ctypes.CDLL("libc.so.6").malloc_trim)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_free_memory() -> None:
    """Hand glibc's free heap pages back to the OS. Bursts (a backlog of pending producer
    messages, big batches) left 70-85 MB free but still mapped in the main arena (mallinfo2
    at 100k finished runs), so RSS ratcheted up with every new peak."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# ---------------------------------------------------------------------------- API helpers


class BadRequest(ValueError):
    """A malformed query parameter (HTTP 400)."""


class PeerError(RuntimeError):
    """Another worker did not answer its share of an aggregate (HTTP 503)."""


def parse_since(text: str | None, default: str = "1h") -> tuple[str, int]:
    """'90s', '15m', '1h', '7d' (a bare number is seconds) -> seconds, 1 s .. 366 d.

    The windowed counters keep 24 h, so a longer window covers what is kept."""
    raw = (text if text is not None else default).strip()
    m = _SINCE_RE.match(raw)
    if not m:
        raise BadRequest(f"since={raw!r}: expected a positive duration like 90s, 15m, 1h or 1d")
    seconds = int(m.group(1)) * _UNIT[m.group(2)]
    if seconds <= 0 or seconds > MAX_SINCE_SECONDS:
        raise BadRequest(f"since={raw!r}: must be between 1s and 366d")
    return raw, seconds


def parse_by(text: str | None) -> list[str]:
    if text is None:
        return list(LOOP_LABELS)
    labels = [part.strip() for part in text.split(",")]
    if not labels or any(not part for part in labels):
        raise BadRequest(
            f"by={text!r}: expected a comma-separated subset of {','.join(LOOP_LABELS)}"
        )
    unknown = [label for label in labels if label not in LOOP_LABELS]
    if unknown:
        raise BadRequest(f"by: unknown label {unknown[0]!r}; labels: {', '.join(LOOP_LABELS)}")
    if len(set(labels)) != len(labels):
        raise BadRequest(f"by={text!r}: a label is repeated")
    return labels


def aggregate_key(labels: Iterable[Any], partition: int) -> str:
    """Windowed count table key: the labels plus the partition (each partition keeps its own
    counter: a key updated from two partitions would otherwise collide in the store)."""
    return json.dumps([*labels, partition], separators=(",", ":"))


def iter_window_counts(items: Iterable[tuple[Any, Any]]) -> Iterator[tuple[list[Any], float, int]]:
    """Raw windowed-table items -> (labels, window end, count). Keys are
    (key, (start, end)) tuples (memory store) or their JSON lists (rocksdb)."""
    for key, value in items:
        try:
            label_key, window = key
            _start, end = window
            labels = json.loads(label_key)[:-1]
            count = int(value)
        except (TypeError, ValueError):
            continue
        yield labels, float(end), count


def sum_windows(
    items: Iterable[tuple[Any, Any]],
    names: tuple[str, ...],
    by: list[str],
    since_seconds: int,
    now: float,
    value_name: str,
) -> list[dict[str, Any]]:
    cutoff = now - since_seconds
    totals: dict[tuple[Any, ...], int] = {}
    positions = [names.index(label) for label in by]
    for labels, end, count in iter_window_counts(items):
        if end < cutoff or len(labels) != len(names):
            continue
        group = tuple(labels[i] for i in positions)
        totals[group] = totals.get(group, 0) + count
    rows = [{**dict(zip(by, group, strict=True)), value_name: n} for group, n in totals.items()]
    rows.sort(key=lambda r: (-r[value_name], json.dumps([r[b] for b in by])))
    return rows


def merge_rows(
    rows: Iterable[dict[str, Any]], by: list[str], value_name: str
) -> list[dict[str, Any]]:
    totals: dict[tuple[Any, ...], int] = {}
    for row in rows:
        group = tuple(row.get(b) for b in by)
        totals[group] = totals.get(group, 0) + int(row.get(value_name, 0))
    out = [{**dict(zip(by, g, strict=True)), value_name: n} for g, n in totals.items()]
    out.sort(key=lambda r: (-r[value_name], json.dumps([r[b] for b in by])))
    return out


def run_view(run_id: str, raw: bytes | None, finished: bool) -> dict[str, Any]:
    """GET /runs/{run_id}: bounded state, digests only."""
    if raw is None:
        return {
            "run_id": run_id,
            "found": False,
            "finished": finished,
            "state": None,
            "steps": [],
            "findings": [],
        }
    env, state = decode_envelope(raw)
    findings = []
    for marker in state.fired:
        shape, _, key = marker.partition("|")
        findings.append({"shape": shape, "episode": key, "event_id": event_id(run_id, shape, key)})
    return {
        "run_id": run_id,
        "found": True,
        "finished": finished,
        "state": {
            "steps": state.position,
            "tool_calls": state.tool_calls,
            "spans": state.spans,
            "duplicate_spans": state.duplicate_spans,
            "late_spans": state.late_spans,
            "pending": len(state.pending),
            "shapes": list(state.shapes),
            "prompt_version": state.prompt_version,
            "agent_name": state.agent_name,
            "termination": state.termination,
            "root_seen": state.root_seen,
            "last_span_arrived_at": round(env.seen_ns / NS, 3),
        },
        "steps": [
            {
                "position": entry[WIN_POS],
                "span_id": entry[WIN_SPAN],
                "tool_name": entry[WIN_TOOL],
                "action_fp": entry[WIN_ACTION],
                "outcome_digest": entry[WIN_OUTCOME],
                "error_code": entry[WIN_CODE],
            }
            for entry in state.window
        ],
        "findings": findings,
    }


def check_bearer(header: str | None, token: str | None) -> bool:
    if not token:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())


# ============================================================================ faust wiring


@contextlib.contextmanager
def _in_event(event: Any) -> Iterator[None]:
    """Make `event` faust's current event: table writes go to its partition.

    Batched processing (take_events) handles several partitions per batch; faust's table and
    rocksdb store pick the partition from the current event, so each run's writes happen
    with an event of that run's partition set.
    """
    from faust.streams import _current_event

    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


class LoopwatchService:
    """The faust app and everything it wires together (built by `build_app`)."""

    def __init__(
        self,
        settings: Any,
        policy: Policy,
        normalizer: Normalizer,
        metrics: Any,
        detect_partitions: int,
    ) -> None:
        import faust

        self.settings = s = settings
        self.policy = policy
        self.normalizer = normalizer
        self.metrics = metrics
        self.driver = RunDriver(
            policy,
            finished_ttl_seconds=s.finished_ttl_seconds,
            max_active_runs=s.max_active_runs,
            tick_seconds=s.tick_seconds,
            cache_size=s.state_cache_size,
        )
        self.keyed = s.input_keyed_by_run
        self.detect_partitions = detect_partitions
        self.started = time.time()
        self.ready = False
        self.tick_sent: dict[int, float] = {}
        self._last_ack: dict[Any, asyncio.Future[None]] = {}  # per input partition
        self._gaps = OffsetGaps()
        self._refetchers: dict[str, Refetcher] = {}  # by topic
        # Unkeyed input: deadlines wait for the group's progress through every input
        # partition (streams/input_clock.py); keyed input keeps a trace on one partition.
        # On by default (LOOPWATCH_INPUT_CLOCK=false turns it off).
        self.input_clock: InputClock | None = (
            InputClock(time.time_ns()) if s.input_clock and not self.keyed else None
        )
        self._input_probe: KafkaInputProbe | None = None
        self._max_lag_warned_ns = 0
        self._head_check_off = False  # faust internals the head-skip check reads are missing
        self._revocations = 0  # rebalances so far (eager: each revokes every partition)
        self._probe_ok_ns = time.time_ns()
        self.counters = {
            "records": 0,
            "spans": 0,
            "run_parts": 0,
            "events": 0,
            "runs_finished": 0,
            "dead_letters": 0,
            "detect_batches": 0,
            "step_messages_sent": 0,
            "refetched_records": 0,  # input records the stream skipped, read back
            "publish_retries": 0,  # outputs sent again after a failed delivery
        }

        s.data_path.mkdir(parents=True, exist_ok=True)
        self.app: Any = cast(Any, faust.App)(
            s.app_id,
            broker=s.broker_url,
            store=s.store,
            datadir=str(s.data_path / "{conf.id}"),
            processing_guarantee="at_least_once",
            topic_partitions=detect_partitions,
            topic_replication_factor=s.replication_factor,
            consumer_auto_offset_reset="earliest",
            web_enabled=True,
            web_bind=s.web_host,
            web_host=s.web_host,
            web_port=s.web_port,
            canonical_url=s.canonical_url,
            web_router_enabled=False,
            web_tables_enabled=False,
            web_stats_enabled=False,
            web_graph_enabled=False,
            web_metrics_enabled=False,
            broker_commit_interval=1.0,
            broker_session_timeout=s.session_timeout_seconds,
            broker_heartbeat_interval=min(3.0, s.session_timeout_seconds / 3),
            producer_linger_ms=s.linger_ms,
            stream_wait_empty=False,
            table_standby_replicas=0,
            logging_config=None,
        )
        app = self.app
        raw: dict[str, Any] = {"key_serializer": "raw", "value_serializer": "raw"}
        self.input_topic = app.topic(s.input_topic, **raw)
        self.steps_topic = app.topic(s.steps_topic, partitions=detect_partitions, **raw)
        self.events_topic = app.topic(s.events_topic, **raw)
        self.runs_topic = app.topic(s.runs_topic, **raw)
        self.dead_topic = app.topic(s.dead_letter_topic, **raw)
        self.detect_source = (
            app.topic(s.input_topic, s.steps_topic, **raw) if self.keyed else self.steps_topic
        )
        self.detect_topic_names = {s.input_topic, s.steps_topic} if self.keyed else {s.steps_topic}

        from datetime import timedelta

        from streams.topics import (
            FINISHED_TABLE,
            LOOP_COUNTS_TABLE,
            RUN_COUNTS_TABLE,
            RUNS_TABLE,
            WINDOW_EXPIRES_SECONDS,
            WINDOW_SECONDS,
        )

        # Each table's store gets its own dict: faust's rocksdb Store pops keys out of it.
        def opts() -> dict[str, Any]:
            return {"partitions": detect_partitions, "options": s.rocksdb_options()}

        as_bytes: dict[str, Any] = {"key_type": bytes, "value_type": bytes}
        self.runs = app.Table(RUNS_TABLE, **opts(), **as_bytes)
        self.finished = app.Table(FINISHED_TABLE, **opts(), **as_bytes)
        # windowed counters: json keys ((label key, (start, end))) and int values
        self.loop_counts_raw = app.Table(LOOP_COUNTS_TABLE, default=int, **opts())
        self.loop_counts = self.loop_counts_raw.tumbling(
            WINDOW_SECONDS, expires=timedelta(seconds=WINDOW_EXPIRES_SECONDS)
        ).relative_to(_wall_clock)
        self.run_counts_raw = app.Table(RUN_COUNTS_TABLE, default=int, **opts())
        self.run_counts = self.run_counts_raw.tumbling(
            WINDOW_SECONDS, expires=timedelta(seconds=WINDOW_EXPIRES_SECONDS)
        ).relative_to(_wall_clock)

        self.runs.on_recover(self._on_recover)
        app.on_partitions_revoked.connect(self._on_revoked)
        self._wire_agents()
        self._wire_timers()
        self._wire_views()

    # ------------------------------------------------------------------ rebalance

    def assigned_partitions(self) -> set[int]:
        actives = self.app.assignor.assigned_actives()
        return {tp.partition for tp in actives if tp.topic in self.detect_topic_names}

    async def _on_recover(self) -> None:
        partitions = self.assigned_partitions()
        started = time.monotonic()
        self.driver.rebuild(
            list(self.runs.items()), list(self.finished.items()), partitions, time.time_ns()
        )
        self.tick_sent.clear()
        self.ready = True
        self.metrics.active_runs.set(len(self.driver.index))
        log.info(
            "partitions %s recovered: %d live runs, %d finished markers (%.2f s)",
            sorted(partitions),
            len(self.driver.index),
            self.driver.finished_index.size,
            time.monotonic() - started,
        )

    def _probe(self) -> KafkaInputProbe:
        if self._input_probe is None:
            s = self.settings
            self._input_probe = KafkaInputProbe(s.bootstrap, s.app_id, s.input_topic)
        return self._input_probe

    async def _on_revoked(self, app: Any, revoked: Any = None, **kwargs: Any) -> None:
        self.ready = False
        self._revocations += 1
        self._gaps.forget()
        for tp in revoked or ():
            self.metrics.forget_consumer_lag(tp.topic, tp.partition)

    # ------------------------------------------------------------------ agents

    def _wire_agents(self) -> None:
        app = self.app
        s = self.settings

        async def ingest(stream: Any) -> None:
            # Manual acks: an input record is acknowledged (and its offset committable)
            # only once its step messages are delivered. With automatic acks a record was
            # acked when its sends were merely queued; on a graceful stop or a revocation
            # faust flushes its producer buffer, lets the agents run on, then commits, so
            # records were committed whose steps were never sent.
            manual = stream.noack()
            async for event in manual.events():
                self._ack_when_delivered(manual, event, await self.ingest_event(event))

        async def detect(stream: Any) -> None:
            async for events in stream.take_events(s.batch_max, within=s.batch_within_ms / 1000):
                # take_events acks the batch in a `finally`, also when the batch is cancelled
                # or fails mid-publish (a stop, a revocation): its offsets would be committed
                # with the outputs unsent. One more reference per message, released only
                # after detect_batch has published and written, keeps such a batch unacked.
                for event in events:
                    event.message.incref()
                try:
                    await self.detect_batch(events)
                except Abandoned:
                    log.info("detect: a batch waiting for delivery was abandoned (rebalance)")
                    continue  # unacked: processed again from the committed offsets
                for event in events:
                    await stream.ack(event)
                self.counters["detect_batches"] += 1

        if not self.keyed:
            app.agent(self.input_topic, name="ingest")(ingest)
        app.agent(self.detect_source, name="detect")(detect)

    async def _refetch(self, first: int, end: int, revealed_by: Any) -> list[Any]:
        """Offsets [first, end) of the topic partition of `revealed_by` that the stream
        skipped (streams/refetch.py), read back from the broker. A failed read raises: the
        record that revealed the gap is then not acknowledged."""
        topic, partition = revealed_by.topic, revealed_by.partition
        refetcher = self._refetchers.get(topic)
        if refetcher is None:
            refetcher = self._refetchers[topic] = Refetcher(self.settings.bootstrap, topic)
        log.warning(
            "offsets %d..%d of %s/%d were skipped by the stream; reading them again",
            first,
            end - 1,
            topic,
            partition,
        )
        events = await asyncio.get_running_loop().run_in_executor(
            None, refetcher.read, partition, first, end
        )
        self.counters["refetched_records"] += len(events)
        return events

    async def ingest_event(self, event: Any) -> list[tuple[Any, list[tuple[Outgoing, Any]]]]:
        """Ingest one streamed input record, after any records the stream skipped before it
        (read back from the broker). Returns each record ingested, the read-back ones first
        and `event` last, with what it sent (see _send)."""
        records = []
        skipped = self._skipped_before(event.message)
        if skipped is not None:
            records = await self._refetch(*skipped, event.message)
        records.append(event)
        return [(record, await self.ingest_record(record)) for record in records]

    def _skipped_before(self, message: Any) -> tuple[int, int] | None:
        """Offsets [first, end) of `message`'s partition the stream skipped before it
        (streams/refetch.py). The first record after an assignment is checked against
        the committed offset faust's consumer sought to (a faust internal: no broker call
        on the hot path)."""
        offsets = getattr(self.app.consumer, "_committed_offset", None)
        if not isinstance(offsets, Mapping):
            offsets = {}
            if not self._head_check_off:
                self._head_check_off = True
                log.warning(
                    "faust's consumer has no _committed_offset mapping (a faust upgrade?): "
                    "a skip of a partition's first record after an assignment goes unseen"
                )
        committed = offsets.get(message.tp)
        return self._gaps.observe(
            message.topic,
            message.partition,
            message.offset,
            committed if isinstance(committed, int) else None,
        )

    def _ack_refetched(self, events: list[Any]) -> None:
        """Acknowledge read-back records to faust's consumer (streams/refetch.py): it
        commits only up to the first offset it has not seen acknowledged."""
        consumer = self.app.consumer
        for event in events:
            consumer.ack(event.message)

    def _ack_when_delivered(
        self, stream: Any, event: Any, records: list[tuple[Any, list[Any]]]
    ) -> None:
        """Ack `event` (and the records read back before it, see ingest_event) once their
        steps are delivered (sent again until they are, see _deliver), after the previous
        record of its partition: faust commits up to the first gap in the acked offsets,
        but on a freshly assigned partition it does not see a gap at the head, so an
        out-of-order ack would commit past a record still in flight."""
        tp = event.message.tp
        before = self._last_ack.get(tp)

        async def ack() -> None:
            if before is not None:
                await asyncio.wait([before])  # its outcome is its own: never stop the chain
            try:
                await self._deliver("ingest", [sent for _, out in records for sent in out])
                self._ack_refetched([record for record, _ in records[:-1]])
                await stream.ack(event)
            except Abandoned:
                pass  # unacknowledged: the partition's next owner processes the records
            except Exception:
                log.exception("ingest: record %s not acknowledged", event.message.offset)

        task = asyncio.ensure_future(ack())
        self._last_ack[tp] = task
        task.add_done_callback(
            lambda t: self._last_ack.pop(tp, None) if self._last_ack.get(tp) is t else None
        )

    async def _decode(
        self, message: Any, sent: list[tuple[Outgoing, Any]]
    ) -> tuple[dict[str, list[Step]], int, int] | None:
        """Decode + normalize one input record; None when it was dead-lettered (the dead
        letter is added to `sent`)."""
        source = f"{message.topic}/{message.partition}@{message.offset}"
        try:
            spans = decode_record(message.value, self.settings.input_encoding, source)
        except DecodeError as exc:
            self.metrics.decode_error("decode_error")
            sent.append(await self._dead_letter(message, "decode_error", str(exc)))
            return None
        by_run, invalid = group_steps(self.normalizer, spans)
        if invalid:
            self.metrics.decode_error("invalid_span")
            log.warning("%s: %d span(s) could not be normalized and were skipped", source, invalid)
        return by_run, len(spans), invalid

    async def ingest_record(self, event: Any) -> list[tuple[Outgoing, Any]]:
        """Forward one input record's steps; returns what it sent (see _send)."""
        message = event.message
        sent: list[tuple[Outgoing, Any]] = []
        try:
            decoded = await self._decode(message, sent)
            if decoded is None:
                return sent
            by_run, n_spans, _invalid = decoded
            outgoing = []
            ts = message.timestamp
            headers = self._clock_headers()
            limit = MAX_STEPS_MESSAGE_BYTES
            if self.settings.steps_grouping == "run":
                for run_id, steps in by_run.items():
                    key = run_id.encode("utf-8")
                    for value in split_to_fit([(run_id, steps)], _encode_first_steps, limit):
                        outgoing.append(Outgoing(self.steps_topic, key, value, None, ts, headers))
            else:
                # One message per destination partition: the partition the run id would be
                # keyed to, so table ownership and the /runs/{id} routing are unchanged.
                n = self.detect_partitions
                by_partition: dict[int, list[tuple[str, list[Step]]]] = {}
                for run_id, steps in by_run.items():
                    p = key_partition(run_id.encode("utf-8"), n)
                    by_partition.setdefault(p, []).append((run_id, steps))
                for p, groups in by_partition.items():
                    for value in split_to_fit(groups, encode_run_groups, limit):
                        outgoing.append(Outgoing(self.steps_topic, None, value, p, ts, headers))
        except Exception as exc:  # never crash the agent on input
            log.exception(
                "ingest: unexpected error on %s/%s@%s",
                message.topic,
                message.partition,
                message.offset,
            )
            sent.append(await self._dead_letter(message, "internal_error", type(exc).__name__))
            return sent
        for out in outgoing:
            sent.append(await self._send(out))
        self.counters["step_messages_sent"] += len(outgoing)
        self._count_input(message.topic, n_spans)
        return sent

    def _clock_headers(self) -> dict[str, bytes] | None:
        """The input clock a steps message is sent at (RunDriver.process_run): every input
        record committed by then has its steps ahead of this message on the steps topic."""
        if self.input_clock is None:
            return None
        return {CLOCK_HEADER: str(self.clock_ns()).encode()}

    @staticmethod
    async def _send(out: Outgoing) -> tuple[Outgoing, Any]:
        """Send `out`; returns it with faust's FutureMessage for its delivery, never raises
        (but CancelledError): an error raised while sending (the producer's buffer full
        or its metadata unavailable, a request over its size limit) becomes the future's,
        so _deliver handles it like a failed delivery. topic.send would return the
        producer's future instead; faust sets a failed delivery's error on its
        FutureMessage too, and asyncio logs one nobody awaits as "never retrieved"."""
        topic = out.topic
        try:
            message = topic.as_future_message(
                key=out.key,
                value=out.value,
                partition=out.partition,
                timestamp=out.timestamp,
                headers=out.headers,
            )
            await topic.publish_message(message)
        except Exception as exc:
            message = asyncio.get_running_loop().create_future()
            message.set_exception(exc)
        return out, message

    async def _deliver(self, stage: str, sent: list[tuple[Outgoing, Any]]) -> None:
        """Wait until every message of `sent` is delivered. One whose delivery failed is
        sent again, with backoff, for as long as it takes (see PUBLISH_RETRY_*): outputs
        are delayed, never dropped, and offsets are not left unacknowledged until a
        restart. A message refused as too large is replaced by its fallback if it has one.
        Raises Abandoned when the worker stops or a rebalance revokes its partitions
        meanwhile: a detect batch would otherwise write state of partitions it no longer
        owns after their new owner restored them."""
        generation = self._revocations
        delay = PUBLISH_RETRY_FIRST_SECONDS
        while sent:
            # gather retrieves every error (and returns a cancelled future's as a value)
            results = await asyncio.gather(*(future for _, future in sent), return_exceptions=True)
            failed = [
                (out, result)
                for (out, _), result in zip(sent, results, strict=True)
                if isinstance(result, BaseException)
            ]
            if not failed:
                return
            if self._stopping() or self._revocations != generation:
                raise Abandoned
            self.metrics.publish_retries.labels(stage=stage).inc(len(failed))
            self.counters["publish_retries"] += len(failed)
            log.warning(
                "%s: %d output(s) not delivered (%s); sending them again in %.1f s",
                stage,
                len(failed),
                type(failed[0][1]).__name__,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, PUBLISH_RETRY_MAX_SECONDS)
            if self._stopping() or self._revocations != generation:
                raise Abandoned
            sent = []
            for out, error in failed:
                if isinstance(error, MessageSizeTooLargeError) and out.fallback is not None:
                    out = out.fallback
                sent.append(await self._send(out))

    def _stopping(self) -> bool:
        return bool(self.app.should_stop)

    async def _dead_letter(self, message: Any, reason: str, error: str) -> tuple[Outgoing, Any]:
        """Send a dead letter; returns it as _send does. With the payload captured, the
        fallback (sent if the broker refuses it as too large) leaves the payload out."""
        fields = {
            "reason": reason,
            "error": error,
            "topic": message.topic,
            "partition": message.partition,
            "offset": message.offset,
        }
        value, headers = dead_letter_record(message.value, **fields, capture_payload=False)
        out = Outgoing(
            self.dead_topic, dead_letter_key(message.key, False), value, None, None, headers
        )
        if self.settings.dlq_capture_payload:
            value, headers = dead_letter_record(message.value, **fields, capture_payload=True)
            key = dead_letter_key(message.key, True)
            out = Outgoing(self.dead_topic, key, value, None, None, headers, fallback=out)
        self.metrics.dead_letter(reason)
        self.counters["dead_letters"] += 1
        return await self._send(out)

    def _count_input(self, topic: str, n_spans: int) -> None:
        """One decoded input record (ingest, or keyed detect)."""
        self.metrics.record_consumed(topic, spans=n_spans)
        self.counters["records"] += 1
        self.counters["spans"] += n_spans

    async def _collect(
        self,
        record: Any,
        event: Any,
        streamed: bool,
        groups: dict[tuple[int, str], list[tuple[Any, list[Step], int | None]]],
        ticks: dict[int, tuple[Any, int | None]],
        dead: list[tuple[Outgoing, Any]],
    ) -> None:
        """Add one record's steps to `groups` (keyed input: decoded here; steps topic: as
        ingest grouped them) or its tick to `ticks`. `streamed` is False for a record read
        back after a skip: a missed tick is not replayed, the next one does its work."""
        if self.keyed and record.topic == self.settings.input_topic:
            decoded = await self._decode(record, dead)
            if decoded is None:
                return
            by_run, n_spans, _ = decoded
            self._count_input(record.topic, n_spans)
            for run_id, steps in by_run.items():
                groups.setdefault((record.partition, run_id), []).append((event, steps, None))
            return
        # Counted like input records: the stall alert pairs each topic's lag with its
        # consumed records, and lag is exported for the steps topic too.
        self.metrics.record_consumed(record.topic)
        value = record.value
        if value is not None and bytes(value[:1]) == TICK_VALUE_PREFIX:
            if streamed:
                ticks[record.partition] = (event, tick_clock(value))
            return
        clock = sent_clock(record)
        if record.key is None:  # partition-grouped: several runs
            for run_id, steps in decode_run_groups(value):
                groups.setdefault((record.partition, run_id), []).append((event, steps, clock))
            return
        groups.setdefault((record.partition, _text(record.key)), []).append(
            (event, decode_steps(value), clock)
        )

    async def detect_batch(self, events: list[Any]) -> None:
        groups: dict[tuple[int, str], list[tuple[Any, list[Step], int | None]]] = {}
        ticks: dict[int, tuple[Any, int | None]] = {}
        dead: list[tuple[Outgoing, Any]] = []  # dead letters: delivered before the batch acks
        refetched: list[Any] = []  # acknowledged with the batch, once it is done
        for event in events:
            message = event.message
            records = [message]
            skipped = self._skipped_before(message)
            if skipped is not None:
                # Records the stream skipped (streams/refetch.py) go first, attributed to this
                # event: same partition, so the table writes land where they belong. A failed
                # read raises: the batch, and the record that revealed the gap, stay unacked.
                read_back = await self._refetch(*skipped, message)
                refetched += read_back
                records[:0] = [e.message for e in read_back]
            for record in records:
                try:
                    await self._collect(record, event, record is message, groups, ticks, dead)
                except Exception as exc:
                    log.exception(
                        "detect: unreadable message %s/%s@%s",
                        record.topic,
                        record.partition,
                        record.offset,
                    )
                    dead.append(
                        await self._dead_letter(record, "internal_error", type(exc).__name__)
                    )
        # 1. detection (pure; the table writes stay pending in the driver)
        partition_event: dict[int, Any] = {}
        outputs: list[tuple[int, Outputs]] = []
        for (partition, run_id), items in groups.items():
            try:
                out = self.driver.process_run(
                    self.runs,
                    self.finished,
                    partition,
                    run_id,
                    [(steps, clock) for _, steps, clock in items],
                    time.time_ns(),
                )
            except Exception as exc:
                log.exception("detect: run %s failed; its message(s) are dead-lettered", run_id)
                for ev, _, _ in items:
                    dead.append(
                        await self._dead_letter(ev.message, "internal_error", type(exc).__name__)
                    )
                continue
            outputs.append((partition, out))
            partition_event[partition] = items[-1][0]
            self.counters["run_parts"] += len(items)
            now = time.time()
            for ev, _, _ in items:
                ts = ev.message.timestamp
                if ts:
                    self.metrics.processing_latency.observe(max(0.0, now - ts))
        for partition, (event, sent_clock) in ticks.items():
            self.tick_sent.pop(partition, None)
            # The clock as the tick was sent, not as it is now: a step delivered after the
            # send (and committed, advancing the clock) may still be queued behind the tick.
            now_ns = self.clock_ns() if sent_clock is None else sent_clock
            try:
                out = self.driver.tick(self.runs, self.finished, partition, now_ns)
            except Exception:
                log.exception("detect: tick of partition %s failed", partition)
                continue
            outputs.append((partition, out))
            partition_event[partition] = event
        # 2. outputs, acknowledged by the broker before 3. the state that fired them
        try:
            await self._publish(outputs, partition_event)
        except BaseException:
            self.driver.discard_writes()
            raise
        await self._deliver("detect", dead)
        writes = self.driver.take_writes()
        tables = {"runs": self.runs, "finished": self.finished}
        for table, partition, key, value in writes:
            with _in_event(partition_event[partition]):
                if value is None:
                    tables[table].pop(key, None)
                else:
                    tables[table][key] = value
        self._ack_refetched(refetched)
        if groups:
            self.metrics.last_processed_timestamp.set(time.time())
        self.metrics.active_runs.set(len(self.driver.index))

    async def _publish(self, outputs: list[tuple[int, Outputs]], events_of: dict[int, Any]) -> None:
        """Send the events and summaries, wait for the broker's acks (sending again what
        failed, see _deliver), then count them."""
        m = self.metrics
        sent = []
        for _, out in outputs:
            for ev in out.events:
                key = ev["run_id"].encode("utf-8")
                sent.append(await self._send(Outgoing(self.events_topic, key, _json(ev))))
            for summary in out.summaries:
                key = summary["run_id"].encode("utf-8")
                sent.append(await self._send(Outgoing(self.runs_topic, key, _json(summary))))
        await self._deliver("detect", sent)
        loops: dict[tuple[int, str], int] = {}
        runs: dict[tuple[int, str], int] = {}
        for partition, out in outputs:
            for ev in out.events:
                m.observe_event(ev)
                labels = (ev["shape"], ev["prompt_version"], ev["tool_version"])
                group = (partition, aggregate_key(labels, partition))
                loops[group] = loops.get(group, 0) + 1
                self.counters["events"] += 1
            for summary in out.summaries:
                m.observe_run(summary)
                labels = (
                    summary["prompt_version"],
                    summary["outcome"],
                    summary["termination_reason"],
                )
                group = (partition, aggregate_key(labels, partition))
                runs[group] = runs.get(group, 0) + 1
                self.counters["runs_finished"] += 1
            if out.duplicate_spans:
                m.duplicate_spans.inc(out.duplicate_spans)
            if out.spans_after_finalize:
                m.late_spans.inc(out.spans_after_finalize)
            for _ in range(out.evicted):
                m.run_evicted("capacity")
        # windowed counters: one write per label group and partition, not per event / run
        for (partition, label_key), n in loops.items():
            with _in_event(events_of[partition]):
                self.loop_counts[label_key] += n
        for (partition, label_key), n in runs.items():
            with _in_event(events_of[partition]):
                self.run_counts[label_key] += n

    # ------------------------------------------------------------------ timers

    def _wire_timers(self) -> None:
        async def ticks() -> None:
            await self.send_ticks()

        async def lag() -> None:
            self.update_lag()

        async def input_clock() -> None:
            await self.advance_input_clock()

        async def trim() -> None:
            release_free_memory()

        self.app.timer(interval=self.settings.tick_seconds, name="loopwatch-ticks")(ticks)
        self.app.timer(interval=5.0, name="loopwatch-lag")(lag)
        if self.input_clock is not None:
            self.app.timer(interval=self.settings.tick_seconds, name="loopwatch-input-clock")(
                input_clock
            )
        self.app.timer(interval=30.0, name="loopwatch-malloc-trim")(trim)

    def clock_ns(self) -> int:
        """Now, for run deadlines: the wall clock, held back to the input clock while the
        probe answers and by at most `input_clock_max_lag_seconds` (a broker that cannot
        say, or a partition whose commits stopped, must not freeze every run forever)."""
        now = time.time_ns()
        if self.input_clock is None or now - self._probe_ok_ns > INPUT_PROBE_STALE_NS:
            return now
        floor = now - int(self.settings.input_clock_max_lag_seconds * NS)
        if self.input_clock.now_ns < floor:
            if now - self._max_lag_warned_ns > 60 * NS:
                self._max_lag_warned_ns = now
                log.warning(
                    "input clock %.0f s behind (max %.0f s): deadlines follow wall clock minus "
                    "the maximum; a backlog older than that may be finalized early",
                    (now - self.input_clock.now_ns) / NS,
                    self.settings.input_clock_max_lag_seconds,
                )
            return floor
        return min(now, self.input_clock.now_ns)

    async def advance_input_clock(self) -> None:
        if self.input_clock is None:
            return
        at = time.time_ns()
        offsets = await asyncio.get_running_loop().run_in_executor(None, self._probe().read)
        if offsets is not None:
            self.input_clock.observe(at, *offsets)
            self._probe_ok_ns = time.time_ns()
        self.metrics.input_clock_lag.set(self.input_clock_lag_seconds() or 0.0)

    def input_clock_lag_seconds(self) -> float | None:
        """How far the input clock trails the wall clock (the gauge and /healthz); None
        without an input clock."""
        if self.input_clock is None:
            return None
        return max(0, time.time_ns() - self.input_clock.now_ns) / NS

    async def send_ticks(self) -> None:
        if not self.ready:
            return
        now = time.time()
        clock_ns = self.clock_ns()
        assigned = self.assigned_partitions()
        for partition in sorted(self.driver.due_partitions(clock_ns)):
            if partition not in assigned:
                continue
            sent = self.tick_sent.get(partition)
            if sent is not None and now - sent < 10.0:
                continue  # one tick in flight per partition (resent if lost)
            self.tick_sent[partition] = now
            tick = Outgoing(
                self.steps_topic, None, encode_tick(time.time_ns(), clock_ns), partition
            )
            _, sent_tick = await self._send(tick)
            sent_tick.add_done_callback(_ignore_failure)  # a lost tick is sent again
        self.metrics.active_runs.set(len(self.driver.index))

    def update_lag(self) -> None:
        consumer = getattr(self.app, "_consumer", None)
        if consumer is None:
            return
        try:
            assignment = consumer.assignment()
        except Exception:
            return
        sources = {self.settings.input_topic, self.settings.steps_topic}
        for tp in assignment:
            if tp.topic not in sources:
                continue
            try:
                highwater = consumer.highwater(tp)
                position = consumer._read_offset.get(tp)
            except Exception:
                continue
            if highwater is None:
                continue
            done = (position + 1) if position is not None else 0
            self.metrics.set_consumer_lag(tp.topic, tp.partition, max(0, highwater - done))

    # ------------------------------------------------------------------ web views

    def _wire_views(self) -> None:
        app = self.app
        service = self

        def denied(view: Any, request: Any) -> Any:
            if check_bearer(request.headers.get("Authorization"), service.settings.api_token):
                return None
            return view.json(
                {"error": "missing or wrong bearer token (Authorization: Bearer <token>)"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="loopwatch"'},
            )

        async def healthz(view: Any, request: Any) -> Any:
            return view.json(service.health())

        async def local_run(view: Any, request: Any, run_id: str) -> Any:
            key = run_id.encode("utf-8")
            raw = service.runs.get(key)
            finished = service.finished.get(key) is not None
            return view.json(run_view(run_id, raw, finished))

        routed_run = app.table_route(table=self.runs, match_info="run_id")(local_run)

        async def run_page(view: Any, request: Any, run_id: str) -> Any:
            if (resp := denied(view, request)) is not None:
                return resp
            if not run_id or len(run_id) > 512:
                return view.json({"error": "run_id: expected 1 to 512 characters"}, status=400)
            return await routed_run(view, request, run_id=run_id)

        async def loops_page(view: Any, request: Any) -> Any:
            if (resp := denied(view, request)) is not None:
                return resp
            try:
                by = parse_by(request.query.get("by"))
                since, seconds = parse_since(request.query.get("since"))
            except BadRequest as exc:
                return view.json({"error": str(exc)}, status=400)
            rows = sum_windows(
                service.loop_counts_raw.items(), LOOP_LABELS, by, seconds, time.time(), "events"
            )
            try:
                rows = await service.gather_peers(request, rows, by, "events")
            except PeerError as exc:
                return view.json({"error": f"{exc}: the answer would be partial"}, status=503)
            return view.json({"by": by, "since": since, "rows": rows})

        async def runs_page(view: Any, request: Any) -> Any:
            if (resp := denied(view, request)) is not None:
                return resp
            try:
                since, seconds = parse_since(request.query.get("since"))
            except BadRequest as exc:
                return view.json({"error": str(exc)}, status=400)
            by = list(RUN_LABELS)
            rows = sum_windows(
                service.run_counts_raw.items(), RUN_LABELS, by, seconds, time.time(), "runs"
            )
            try:
                rows = await service.gather_peers(request, rows, by, "runs")
            except PeerError as exc:
                return view.json({"error": f"{exc}: the answer would be partial"}, status=503)
            return view.json({"since": since, "rows": rows})

        app.page("/healthz")(healthz)
        app.page("/runs/{run_id}")(run_page)
        app.page("/loops")(loops_page)
        app.page("/runs")(runs_page)

    async def gather_peers(
        self, request: Any, rows: list[dict[str, Any]], by: list[str], value_name: str
    ) -> list[dict[str, Any]]:
        """Each worker holds the aggregates of its partitions: ask the others and sum."""
        if request.query.get("scope") == "local":
            return rows
        try:
            hosts = set(self.app.router.tables_metadata())
        except Exception:
            return rows
        me = str(self.app.conf.canonical_url).rstrip("/")
        peers = [h for h in hosts if str(h).rstrip("/") != me]
        if not peers:
            return rows
        all_rows = list(rows)
        headers = {}
        if auth := request.headers.get("Authorization"):
            headers["Authorization"] = auth
        for host in peers:
            url = request.url.with_host(_host_of(host)).with_port(_port_of(host))
            url = url.update_query(scope="local")
            try:
                async with self.app.http_client.get(url, headers=headers, timeout=10) as resp:
                    if resp.status != 200:
                        raise PeerError(f"worker {host} answered HTTP {resp.status}")
                    data = await resp.json()
            except PeerError:
                raise
            except Exception as exc:
                raise PeerError(f"worker {host} did not answer ({type(exc).__name__})") from None
            all_rows.extend(data.get("rows", []))
        return merge_rows(all_rows, by, value_name)

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "ready": self.ready,
            "active_runs": len(self.driver.index),
            "finished_markers": self.driver.finished_index.size,
            "assigned_partitions": sorted(self.assigned_partitions()) if self.ready else [],
            **self.counters,
            "state_writes": self.driver.state_writes,
            "input_topic": self.settings.input_topic,
            "keyed_input": self.keyed,
            "input_clock_behind_seconds": (
                None if (lag := self.input_clock_lag_seconds()) is None else round(lag, 1)
            ),
            "app_id": self.settings.app_id,
            "uptime_seconds": round(time.time() - self.started, 1),
        }


def _wall_clock(event: Any = None) -> float:
    """Window timestamps are processing time. (faust's relative_to_now() uses, inside a
    stream, the latest window end seen on the partition, which starts at 0.)"""
    return time.time()


def _host_of(url: Any) -> str:
    from yarl import URL

    return URL(str(url)).host or "127.0.0.1"


def _port_of(url: Any) -> int:
    from yarl import URL

    return URL(str(url)).port or 80


def build_app(
    settings: Any,
    policy: Policy,
    fingerprinter: Any,
    metrics: Any,
    detect_partitions: int,
) -> LoopwatchService:
    """The faust service for `settings` (topics must exist: see streams.topics)."""
    normalizer = Normalizer(policy, fingerprinter)
    return LoopwatchService(settings, policy, normalizer, metrics, detect_partitions)


__all__ = [
    "Deadline",
    "DeadlineIndex",
    "Envelope",
    "FinishedIndex",
    "LoopwatchService",
    "Outputs",
    "RunDriver",
    "build_app",
    "check_bearer",
    "dead_letter_key",
    "dead_letter_record",
    "decode_envelope",
    "decode_steps",
    "encode_envelope",
    "encode_steps",
    "group_steps",
    "parse_by",
    "parse_since",
    "run_view",
    "sum_windows",
]
