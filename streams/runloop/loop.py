"""One run loop for both drivers: steps of runs in, findings and summaries out, deadlines
scheduled. `loopwatch replay` (streams/replay/engine.py) and the worker (streams/worker/agents/driver.py)
both call it and re-implement none of it; they differ in where bytes come from, where state
lives and what the clock is:

* the store (`RunStore`): a dict (`MemoryStore`, replay) or the worker's tables with their
  envelope encoding, write-through cache and pending writes (streams/worker/state/store.py);
* the clock: ``now_ns`` is passed to every call, the replay's event-time watermark or the
  worker's wall / input clock;
* the sink (`Sink`): where events, summaries and counts go.

Per run: dedup, reorder and detect with the pure pipeline (detectors/pipeline.py) on
arrival; release what the run's event time (or what an input clock vouches for) allows;
schedule its deadline: finalization `finalize_grace_seconds` after the last arrival once
the root span ended, else `idle_timeout_seconds`; with a release timer (the worker: no new
span may come to release buffered steps), also a release `allowed_lateness_seconds` after
the last arrival. A run past its deadline is released, or finalized into its summary.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Protocol

from alerts.events import build_event
from alerts.trace_links import TraceLinks
from detectors import holds, pipeline
from detectors.holds import HeldCall
from detectors.model import NS, TOOL, Finding, Step
from detectors.policy import Policy
from detectors.state import DEFERRED_CAP, RunState
from streams.errors import DecodeError
from streams.runloop.deadlines import Deadline, DeadlineIndex

log = logging.getLogger(__name__)

# Arrivals of one run waiting for the input clock at once (Envelope.candidates): each is
# released as soon as the clock passes it, not after the one before it was.
MAX_CANDIDATES = 8

# the order an exporter sends a run's spans in (as they end); ties fixed by the content
_EXPORT_ORDER = attrgetter("end_ns", "span_id", "content_digest")


@dataclass(slots=True)
class Envelope:
    """What the loop keeps about a run beside its state (in the worker, the header of its
    `runs` table value): when it last arrived, by the driver's clock, and what the
    deadline index needs."""

    partition: int
    seen_ns: int  # clock at the run's latest arrival (its deadlines' anchor)
    first_ns: int  # clock at the run's first arrival
    max_end_ns: int
    root_end_ns: int | None
    pending: int
    # Unkeyed input with the input clock (see RunLoop.apply): the run's event time the
    # clock has vouched for (None until then, and always with keyed input), and the
    # arrivals waiting for it, oldest first: (clock, the run's latest end as of then).
    confirmed_end_ns: int | None = None
    candidates: list[tuple[int, int]] = field(default_factory=list)
    # A settled run's summary as its state stands (RunLoop `summary_at_settle`), else None:
    # its finalization then reads no state unless a loop fired (its record's timeline).
    summary: dict[str, Any] | None = None

    def settled(self) -> bool:
        """The root span ended and nothing waits (no steps for release, no arrival for the
        input clock): unless another span comes, the run's next load finalizes it."""
        return self.root_end_ns is not None and self.pending == 0 and not self.candidates

    def vouch(self, clock_ns: int) -> int | None:
        """The input clock reached `clock_ns`: everything produced before then is ahead of
        the message or tick carrying it, so the event time of every arrival up to then is
        safe. Returns the oldest arrival it vouched for (None: none)."""
        if not self.candidates:
            return None
        vouched = [c for c in self.candidates if c[0] <= clock_ns]
        if not vouched:
            return None
        self.confirmed_end_ns = max(self.confirmed_end_ns or 0, *(end for _, end in vouched))
        self.candidates = [c for c in self.candidates if c[0] > clock_ns]
        return min(at for at, _ in vouched)

    def arrived(self, clock_ns: int, max_end_ns: int) -> None:
        """An arrival at `clock_ns` (sent at an input clock): its event time waits for the
        clock to pass it. At most MAX_CANDIDATES wait: past that the newest takes the last
        place (a later arrival vouches for an earlier one's end: it only waits longer)."""
        candidates = self.candidates
        if candidates and (candidates[-1][0] == clock_ns or len(candidates) >= MAX_CANDIDATES):
            candidates[-1] = (clock_ns, max_end_ns)
        else:
            candidates.append((clock_ns, max_end_ns))

    def refresh(self, state: RunState) -> None:
        """The fields taken from the run's state."""
        self.max_end_ns = state.max_end_ns
        self.root_end_ns = state.root_end_ns
        self.pending = len(state.pending)


class Sink(Protocol):
    """Where the loop's outputs go, in the order they are found."""

    def event(self, event: dict[str, Any]) -> None: ...
    def summary(self, summary: dict[str, Any]) -> None: ...
    def started(self) -> None: ...  # a new run
    def counted(self, duplicate_spans: int, late_spans: int) -> None: ...
    def after_finalize(self, spans: int) -> None: ...  # spans of a finished run: not fed
    def evicted_run(self) -> None: ...  # a run finalized early for capacity
    def held(self, call: HeldCall) -> None: ...  # a call an on-call hold decided (or should)
    def vouched(self, arrival_ns: int) -> None: ...  # the input clock passed this arrival
    def failed(self, run_id: str, exc: Exception) -> None: ...  # a due run's processing raised


class RunStore(Protocol):
    # `partition`: where the run's state and marker are (its input's partition)
    def load(self, run_id: str, partition: int) -> tuple[Envelope, RunState] | None: ...
    def load_envelope(self, run_id: str, partition: int) -> Envelope | None: ...  # no state
    def save(self, run_id: str, env: Envelope, state: RunState) -> None: ...
    # `state`: None when the run was finalized from its envelope's summary
    def finish(self, run_id: str, partition: int, now_ns: int, state: RunState | None) -> None: ...
    def is_finished(self, run_id: str, partition: int) -> bool: ...


class MemoryStore:
    """Run states in dicts (the replay). Finished runs: the latest `finished_memory` run
    ids, to count spans arriving after their run's end."""

    def __init__(self, finished_memory: int) -> None:
        self.states: dict[str, RunState] = {}
        self.envelopes: dict[str, Envelope] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.finished_memory = finished_memory

    def load(self, run_id: str, partition: int) -> tuple[Envelope, RunState] | None:
        state = self.states.get(run_id)
        return None if state is None else (self.envelopes[run_id], state)

    def load_envelope(self, run_id: str, partition: int) -> Envelope | None:
        return self.envelopes.get(run_id)

    def save(self, run_id: str, env: Envelope, state: RunState) -> None:
        self.states[run_id] = state
        self.envelopes[run_id] = env

    def finish(self, run_id: str, partition: int, now_ns: int, state: RunState | None) -> None:
        self.states.pop(run_id, None)
        self.envelopes.pop(run_id, None)
        self.finished[run_id] = None
        if len(self.finished) > self.finished_memory:
            self.finished.popitem(last=False)

    def is_finished(self, run_id: str, partition: int) -> bool:
        return run_id in self.finished


# What a deferred event keeps for its metrics (RunState.deferred, the summary's
# `deferred_events`): the loop metrics' labels and increments beside the run's slice.
DEFERRED_FIELDS = (
    "event_id",
    "shape",
    "severity",
    "tool_name",
    "tool_version",
    "wasted_steps",
    "wasted_tokens",
)


def labelled_event(finding: Finding, state: RunState, policy: Policy) -> dict[str, Any]:
    """The finding's `loop_detected` event. Run-level labels often arrive last (on the
    root or agent span, which ends after its children): an event that fires before the
    run's prompt_version is known goes out at once (`labels_pending: true`), and its loop
    metrics are deferred to the run's finalization, where the run summary lists it under
    the run's final prompt_version. Critical shapes are counted at once whatever their
    labels (a duplicated side effect pages now), as is an event beyond DEFERRED_CAP."""
    event = build_event(finding, state.run_id, policy)
    pending = event["prompt_version"] is None and event["severity"] != "critical"
    if pending and all(d[0] != event["event_id"] for d in state.deferred):  # (a re-fire)
        if len(state.deferred) < DEFERRED_CAP:
            state.deferred.append([event[k] for k in DEFERRED_FIELDS])
        else:
            pending = False
    event["labels_pending"] = pending
    return event


def with_deferred(summary: dict[str, Any], state: RunState) -> dict[str, Any]:
    """`summary` with the events that fired before the run's labels were known, for the
    drivers to count under its prompt_version (the run's final slice)."""
    summary["deferred_events"] = [
        dict(zip(DEFERRED_FIELDS, d, strict=True)) for d in state.deferred
    ]
    return summary


def loops_counted(
    events: list[dict[str, Any]], summaries: list[dict[str, Any]]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The loop events a sink counts now, each with where its run-level labels come from:
    an event under its own labels, unless they were pending when it fired; those are
    counted with their run's summary, under its labels (the run's final slice). Every
    driver's counting follows this one rule (the worker's counting.py, the replay's
    engine.py)."""
    now = [(event, event) for event in events if not event.get("labels_pending")]
    return now + [(d, s) for s in summaries for d in s.get("deferred_events", ())]


class RunLoop:
    """Per-run apply, release, deadline choice, finalization and event building over a
    `RunStore`. `release_timer`: schedule releases of buffered steps (the worker; the
    replay releases them on the run's next arrival or at its end). `tick_ns`: how long a
    release blocked by ordering waits before it is tried again. `summary_at_settle`: keep
    a settled run's summary in its envelope (the worker, whose states are decoded to be
    read: a finalization that decodes none costs a fifth of what one that does)."""

    def __init__(
        self,
        policy: Policy,
        store: RunStore,
        *,
        release_timer: bool,
        tick_ns: int = NS,
        links: TraceLinks | None = None,
        summary_at_settle: bool = False,
    ) -> None:
        self.policy = policy
        self.links = links  # LOOPWATCH_TRACE_URL: `trace_url` on events and summaries
        self.store = store
        self.release_timer = release_timer
        self.tick_ns = tick_ns
        self.summary_at_settle = summary_at_settle
        self.index = DeadlineIndex()
        # the on-call hold a tool call ran under with no guard decision (the worker's hold
        # book, streams/worker/state/holds.py); None: no holds are looked up
        self.held_by: Callable[[Step], str | None] | None = None
        self._lateness_ns = int(policy.allowed_lateness_seconds * NS)
        self._grace_ns = int(policy.finalize_grace_seconds * NS)
        self._idle_ns = int(policy.idle_timeout_seconds * NS)

    def event_of(self, finding: Finding, state: RunState) -> dict[str, Any]:
        event = labelled_event(finding, state, self.policy)
        return event if self.links is None else self.links.event(event)

    def deadline_for(self, env: Envelope) -> Deadline:
        seen = env.seen_ns
        release_at = None
        if self.release_timer and env.pending:
            # the lateness is the fallback for a clock that does not move; a candidate
            # arrival is vouched for by the first tick whose clock has passed it
            release_at = seen + self._lateness_ns
            if env.candidates:
                release_at = min(release_at, min(at for at, _ in env.candidates))
        # root ended: grace from the last arrival; else the idle timeout
        finalize_at = seen + (self._grace_ns if env.root_end_ns is not None else self._idle_ns)
        return Deadline(env.partition, seen, release_at, finalize_at)

    def apply(
        self,
        partition: int,
        run_id: str,
        batches: list[tuple[list[Step], int | None]],
        now_ns: int,
        sink: Sink,
        arrived: list[int] | None = None,
        clock_ns: int | None = None,
    ) -> None:
        """Steps of one run, from one or more deliveries in arrival order, each with the
        input clock it was sent at (None: the steps arrive in export order, as in a replay
        or on keyed input). Nothing is stored unless it succeeds.

        `arrived`: when each delivery arrived (default `now_ns`, the latest), for
        deliveries applied after they arrived; `clock_ns`: an input clock read after all
        of them, applied as a tick sent at it would be once they are in the state. The
        worker holds unkeyed arrivals until a clock passes them
        (streams/worker/agents/arrivals.py): each arrival is then taken as it would have
        been, and released by that clock, with one state write instead of two.

        Release at arrival: a run's spans on unkeyed input come from several input
        partitions, one possibly far behind, so a span with a late end time can arrive
        before earlier ones and its end time must not release them. The event time used
        is then only what the input clock vouches for: the run's latest end as of an
        earlier arrival (the candidate), once a message or tick sent at an input clock
        past that arrival comes in (everything produced before then has been forwarded,
        ahead of it). This holds when an exporter sends a trace's spans within
        `allowed_lateness` of their order, the assumption the replay makes about arrival
        order. Each arrival waits for the clock on its own (up to MAX_CANDIDATES at once):
        confirmation trails an arrival by about the input clock's lag, not by one lag for
        each arrival queued before it."""
        store = self.store
        loaded = store.load(run_id, partition)
        if loaded is None:
            if store.is_finished(run_id, partition):
                sink.after_finalize(sum(len(steps) for steps, _ in batches))
                return
            state = pipeline.new_state(run_id)
            env = Envelope(partition, now_ns, now_ns, 0, None, 0)
            sink.started()
        else:
            env, state = loaded
        policy = self.policy
        before_dup, before_late = state.duplicate_spans, state.late_spans
        findings = []
        held_by = self.held_by
        for i, (steps, sent_clock) in enumerate(batches):
            watermark = None  # the run's own latest end: arrivals are in export order
            if sent_clock is not None:
                if (arrival := env.vouch(sent_clock)) is not None:
                    sink.vouched(arrival)
                watermark = env.confirmed_end_ns or 0
            for step in steps:
                # a span the run has not seen yet, under a hold: counted for it, once
                ran_under = held_by(step) if held_by is not None and step.kind == TOOL else None
                counted = (ran_under is not None or step.denied_calls) and (
                    step.span_id not in state.dedup
                )
                findings.extend(pipeline.ingest(policy, state, step))
                if counted:
                    for call in holds.account(state.holds, step, ran_under):
                        sink.held(call)
            findings.extend(pipeline.release(policy, state, watermark))
            if sent_clock is not None:
                env.arrived(now_ns if arrived is None else arrived[i], state.max_end_ns)
        if clock_ns is not None:
            if (arrival := env.vouch(clock_ns)) is not None:
                sink.vouched(arrival)
            findings.extend(pipeline.release(policy, state, env.confirmed_end_ns or 0))
        for finding in findings:
            sink.event(self.event_of(finding, state))
        sink.counted(state.duplicate_spans - before_dup, state.late_spans - before_late)
        # (an arrival applied after it arrived, streams/worker/agents/arrivals.py, may be
        # older than one applied at once before it: the anchor never goes back)
        env.partition, env.seen_ns = partition, max(env.seen_ns, now_ns)
        self._save(run_id, env, state)
        self.index.set(run_id, self.deadline_for(env))

    def due(self, partition: int, now_ns: int, sink: Sink, limit: int | None = None) -> None:
        """Releases, finalizations and evictions of `partition` due by `now_ns`, the
        earliest `limit` runs of them (the rest stay due). A run whose processing raises
        goes to `sink.failed` and keeps its last saved state; it is tried again after the
        idle timeout, and the runs after it are handled as if it had not failed."""
        index = self.index
        for run_id in index.pop_due(partition, now_ns, limit):
            deadline = index.get(run_id)
            if deadline is None:
                continue
            try:
                self._due_run(run_id, deadline, partition, now_ns, sink)
            except Exception as exc:
                index.remove(run_id)  # (an eviction's mark too: it would be due at once)
                index.set(
                    run_id, Deadline(partition, deadline.seen_ns, None, now_ns + self._idle_ns)
                )
                sink.failed(run_id, exc)

    def _due_run(
        self, run_id: str, deadline: Deadline, partition: int, now_ns: int, sink: Sink
    ) -> None:
        index = self.index
        finalizing = deadline.evict or deadline.finalize_at <= now_ns
        try:
            kept = self._kept_summary(run_id, partition) if finalizing else None
            loaded = None if kept is not None else self.store.load(run_id, partition)
        except (DecodeError, ValueError, KeyError, TypeError):
            log.exception("runs table: unreadable state of run %s left alone", run_id)
            kept = loaded = None
        if kept is not None:
            self._finished(run_id, partition, kept, None, now_ns, sink)
        elif loaded is None:  # gone, or unreadable
            index.remove(run_id)
            return
        elif finalizing:
            self.finalize(run_id, partition, loaded[1], now_ns, sink)
        if finalizing:
            if deadline.evict:
                sink.evicted_run()
            return
        assert loaded is not None  # (a kept summary is only read to finalize)
        env, state = loaded
        # Release: past the run's last arrival the clock vouches for all of it, and the
        # run clock is its event time advanced by the time since that arrival. Before
        # it (a candidate's tick), what the clock vouches for, as a message would; the
        # last arrival becomes the next candidate.
        if (arrival := env.vouch(now_ns)) is not None:
            sink.vouched(arrival)
        if now_ns >= env.seen_ns:
            env.confirmed_end_ns = max(env.confirmed_end_ns or 0, state.max_end_ns)
            watermark = state.max_end_ns + (now_ns - env.seen_ns)
        else:
            watermark = env.confirmed_end_ns or 0
            if not env.candidates:
                env.arrived(env.seen_ns, state.max_end_ns)
        for finding in pipeline.release(self.policy, state, watermark):
            sink.event(self.event_of(finding, state))
        self._save(run_id, env, state)
        nxt = self.deadline_for(env)
        if nxt.release_at is not None and nxt.release_at <= now_ns:
            nxt.release_at = now_ns + self.tick_ns  # blocked by ordering: retry later
        index.set(run_id, nxt)

    def finalize(
        self, run_id: str, partition: int, state: RunState, now_ns: int, sink: Sink
    ) -> None:
        """Flush the run's buffer, then its summary; the run is finished."""
        findings, summary = pipeline.finalize(self.policy, state)
        for finding in findings:
            sink.event(self.event_of(finding, state))
        self._finished(run_id, partition, with_deferred(summary, state), state, now_ns, sink)

    def _finished(
        self,
        run_id: str,
        partition: int,
        summary: dict[str, Any],
        state: RunState | None,
        now_ns: int,
        sink: Sink,
    ) -> None:
        sink.summary(summary if self.links is None else self.links.summary(summary))
        self.store.finish(run_id, partition, now_ns, state)
        self.index.remove(run_id)

    def _save(self, run_id: str, env: Envelope, state: RunState) -> None:
        env.refresh(state)
        env.summary = None
        if self.summary_at_settle and env.settled():
            env.summary = with_deferred(pipeline.summarize(self.policy, state), state)
        self.store.save(run_id, env, state)

    def _kept_summary(self, run_id: str, partition: int) -> dict[str, Any] | None:
        """The summary a settled run's envelope keeps, when finalizing it needs no more:
        it has nothing to release, so finalizing its state gives this summary and no
        event, and no loop fired (a looping run's retained record keeps its timeline,
        taken from the state)."""
        if not self.summary_at_settle:
            return None
        env = self.store.load_envelope(run_id, partition)
        summary = None if env is None else env.summary
        return None if summary is None or summary.get("shapes") else summary

    def whole(self, run_id: str, steps: list[Step], sink: Sink) -> tuple[int, str]:
        """Every delivered span of a run at once (the replay, streams/replay/runs.py), in any
        order and with any duplication. In the order they ended, the run keeps its spans
        up to the first gap its deadline would not have waited for (longer than
        `finalize_grace_seconds` once the root ended, else `idle_timeout_seconds`): a
        stream would have finalized the run there, so the spans after the gap are counted
        as arriving after the run's end, not fed. The kept ones are fed in runtime order,
        so every finding sees the run's facts (task type, agent, labels) whichever span
        carries them, and the run is finalized. Returns (the gap that cut the run in ns,
        the setting that bounded it), or (0, "") when nothing was cut."""
        steps.sort(key=_EXPORT_ORDER)
        kept, gap, setting = len(steps), 0, ""
        root_ended = False
        for i in range(1, len(steps)):
            root_ended = root_ended or steps[i - 1].is_root
            limit = self._grace_ns if root_ended else self._idle_ns
            if steps[i].end_ns - steps[i - 1].end_ns > limit:
                kept, gap = i, steps[i].end_ns - steps[i - 1].end_ns
                setting = "finalize_grace_seconds" if root_ended else "idle_timeout_seconds"
                break
        policy = self.policy
        state = pipeline.new_state(run_id)
        sink.started()
        findings = []
        for step in pipeline.runtime_order(steps[:kept]):
            findings.extend(pipeline.ingest(policy, state, step))
        for finding in findings:
            sink.event(self.event_of(finding, state))
        sink.counted(state.duplicate_spans, state.late_spans)
        self.finalize(run_id, 0, state, state.max_end_ns, sink)
        if kept < len(steps):
            sink.after_finalize(len(steps) - kept)
        return gap, setting

    def close(self, run_ids: Iterable[str], now_ns: int, sink: Sink) -> None:
        """End of input: finalize these runs in this order, whatever their deadlines."""
        for run_id in run_ids:
            deadline = self.index.get(run_id)
            loaded = self.store.load(run_id, 0 if deadline is None else deadline.partition)
            if loaded is not None:
                env, state = loaded
                self.finalize(run_id, env.partition, state, now_ns, sink)
        self.index.clear()
