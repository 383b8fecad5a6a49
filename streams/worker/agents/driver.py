"""`RunDriver`: the detect agent's logic over the `runs` and `finished` tables, no faust, no
broker: the shared run loop (streams/runloop/loop.py) over a `TableStore`, with the worker's
clock passed in, a release timer, evictions past LOOPWATCH_MAX_ACTIVE_RUNS and the finished
markers' TTL.

Table writes stay pending until the caller has published the batch's outputs
(`take_writes`): a state whose fired markers reached the changelog never belongs to an
event that was not delivered.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from alerts.trace_links import TraceLinks
from detectors.holds import HeldCall
from detectors.model import NS, Step
from detectors.policy import Policy
from detectors.state import RunState
from streams.runloop.deadlines import DeadlineIndex
from streams.runloop.loop import Envelope, RunLoop
from streams.worker.agents.arrivals import Arrival, Arrivals
from streams.worker.agents.messages import key_text
from streams.worker.state import episodes as episode_records
from streams.worker.state import retained as retained_records
from streams.worker.state.retained import Retention
from streams.worker.state.store import Table, TableStore, Writes, decode_header

log = logging.getLogger(__name__)

# Expired finished-run markers, retained records and episodes are deleted a slice at a time,
# per partition: a pass starts every SWEEP_SECONDS and reads SWEEP_BATCH records a tick
# until it is through, so a record outlives its TTL or retention by at most a pass. The
# markers' pass reads every marker (as many as the TTL holds); the retained records' and
# the episodes' read in expiry order and stop at the first one not due (the retained
# table's expiry index: a record is kept a day or a week, so every record was millions).
SWEEP_SECONDS = 60
SWEEP_NS = SWEEP_SECONDS * NS
SWEEP_BATCH = 5_000
# A tick handles at most this many due runs of its partition; the rest stay due and the
# next tick takes them. A burst of finishing runs (a backlog after downtime) then costs the
# outputs, states and changelog records of this many at once, not of the whole burst: the
# worker's memory after its largest batch (docs/PERFORMANCE.md "Worker memory by holder").
TICK_MAX_RUNS = 1_000
# Unkeyed arrivals wait in memory for the input clock at most this long (by the wall clock;
# LOOPWATCH_ARRIVAL_HOLD_MS), and at most this many steps in all; past either they wait for
# it in the run's state, as they did before (streams/worker/agents/arrivals.py). Held steps
# are packed (messages.PackedSteps), about 200 bytes each: 50,000 are 10 MB.
ARRIVAL_HOLD_SECONDS = 2.0
ARRIVAL_MAX_STEPS = 50_000

__all__ = ["Outputs", "RunDriver"]


@dataclass(slots=True)
class Outputs:
    """What one run's steps or one tick produced (the run loop's sink)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)
    evicted: int = 0
    spans_after_finalize: int = 0  # of runs already finished: counted, not fed
    late_spans: int = 0  # behind released steps of their run (out of order): still fed
    duplicate_spans: int = 0
    held_calls: list[HeldCall] = field(default_factory=list)  # calls an on-call hold decided
    vouched_arrivals: list[int] = field(default_factory=list)  # the input clock passed them
    failures: list[tuple[str, Exception]] = field(default_factory=list)  # due runs that raised

    def event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def summary(self, summary: dict[str, Any]) -> None:
        self.summaries.append(summary)

    def started(self) -> None:
        pass

    def counted(self, duplicate_spans: int, late_spans: int) -> None:
        self.duplicate_spans += duplicate_spans
        self.late_spans += late_spans

    def after_finalize(self, spans: int) -> None:
        self.spans_after_finalize += spans

    def evicted_run(self) -> None:
        self.evicted += 1

    def vouched(self, arrival_ns: int) -> None:
        self.vouched_arrivals.append(arrival_ns)

    def held(self, call: HeldCall) -> None:
        self.held_calls.append(call)

    def failed(self, run_id: str, exc: Exception) -> None:
        self.failures.append((run_id, exc))


class RunDriver:
    """The run loop with the worker's store and schedules. Clock values are passed in."""

    def __init__(
        self,
        policy: Policy,
        *,
        finished_ttl_seconds: float = 3600.0,
        max_active_runs: int = 200_000,
        tick_seconds: float = 1.0,
        cache_size: int = 10_000,
        arrival_hold_seconds: float = ARRIVAL_HOLD_SECONDS,
        links: TraceLinks | None = None,
        retention: Retention | None = None,
    ) -> None:
        self.policy = policy
        self.store = TableStore(cache_size)
        self.retention = retention  # None: finished runs are not kept (the retained table)
        # the tools whose calls go in the side-effect ledger: none, no pass over the steps
        self.ledger_tools = policy.reconcile_tools | {
            name for name, contract in policy.tools.items() if contract.side_effect
        }
        self.swept_at: dict[int, int] = {}  # partition -> when its last sweep pass started
        self.sweeping: set[int] = set()  # partitions with a sweep pass under way
        self.loop = RunLoop(
            policy,
            self.store,
            release_timer=True,
            tick_ns=int(tick_seconds * NS),
            links=links,
            summary_at_settle=True,
        )
        self.max_active_runs = max_active_runs
        self.finished_ttl_ns = int(finished_ttl_seconds * NS)
        self.arrivals = Arrivals(int(arrival_hold_seconds * NS), ARRIVAL_MAX_STEPS)

    @property
    def index(self) -> DeadlineIndex:
        return self.loop.index

    @property
    def cache(self) -> OrderedDict[str, tuple[Envelope, RunState]]:
        return self.store.cache

    @property
    def state_writes(self) -> int:
        return self.store.state_writes

    # ------------------------------------------------------------------ scheduling

    def rebuild(
        self,
        runs: Iterable[tuple[bytes, bytes]],
        partitions: set[int] | None,
        now_ns: int,
    ) -> None:
        """Rebuild the in-memory indexes from the tables (after partition assignment).

        Downtime does not count against a run: its clock restarts at `now_ns`, so a worker
        catching up a backlog does not finalize runs whose spans are still queued.
        """
        index = self.loop.index
        index.clear()
        self.arrivals.clear()  # unacknowledged: processed again from the committed offsets
        # Writes staged before the rebalance go: detect drops their records unacknowledged
        # (streams/worker/agents/detect.py), so they are processed again from the tables' state.
        self.store.discard_writes()
        for key, raw in runs:
            try:
                env = decode_header(raw)
            except (ValueError, KeyError, TypeError):
                log.warning("runs table: unreadable entry for %r skipped", key_text(key))
                continue
            if partitions is not None and env.partition not in partitions:
                continue
            env.seen_ns = max(env.seen_ns, now_ns)
            index.set(key_text(key), self.loop.deadline_for(env))
        if partitions is not None:  # every assigned partition may hold markers and records
            self.store.sweep_partitions = set(partitions)
            self.sweeping.clear()
            self.store.sweep_after.clear()
            self.store.finished_after.clear()
            self.store.retained_indexed.clear()  # read again from the tables' marks

    def due_partitions(self, now_ns: int, wall_ns: int | None = None) -> set[int]:
        """Partitions with work for a tick at clock `now_ns`: due runs, held arrivals the
        clock has passed or held too long (by the wall clock, `wall_ns`), or a sweep
        (finished markers past their TTL, expired retained records and episodes) due."""
        index = self.loop.index
        index.mark_evictions(self.max_active_runs, now_ns)
        due = set()
        for p in index.partitions():
            at = index.next_due(p)
            if at is not None and at <= now_ns:
                due.add(p)
        swept_at = self.swept_at
        due.update(
            p for p in self.store.sweep_partitions if now_ns - swept_at.get(p, 0) >= SWEEP_NS
        )
        due.update(self.sweeping)  # a pass under way
        due.update(self.arrivals.due(now_ns, now_ns if wall_ns is None else wall_ns))
        return due

    # ------------------------------------------------------------------ processing

    def bind(
        self,
        runs: Table,
        finished: Table,
        retained: Table | None = None,
        episodes: Table | None = None,
    ) -> None:
        """The tables the store reads (once: the worker's, or a test's dicts)."""
        self.store.bind(runs, finished, retained, episodes)

    def process_run(
        self,
        partition: int,
        run_id: str,
        batches: list[tuple[list[Step], int | None]],
        now_ns: int,
        arrived: list[int] | None = None,
        clock_ns: int | None = None,
    ) -> Outputs:
        """Steps of one run, from one or more messages in arrival order, each with the
        input clock it was sent at (RunLoop.apply, as are `arrived` and `clock_ns`); one
        state write, pending until `take_writes`."""
        out = Outputs()
        self.loop.apply(partition, run_id, batches, now_ns, out, arrived, clock_ns)
        calls = (
            retained_records.ledger_calls((s for steps, _ in batches for s in steps), self.policy)
            if self.retention is not None and self.ledger_tools
            else []
        )
        self.retain(partition, out, now_ns, {run_id: calls} if calls else None)
        return out

    def apply_arrivals(
        self, partition: int, wall_ns: int, tick_ns: int | None = None
    ) -> list[tuple[list[Arrival], Outputs | Exception]]:
        """The held arrivals of the partition's runs that its input clock has passed, or
        held too long (streams/worker/agents/arrivals.py), and before a tick at `tick_ns`
        those of the runs it will release, finalize or evict: each run's, all of them at
        once, taken as they would have been on arrival and then released by the clock,
        as a tick sent at it would. Each with its outputs, or the exception its run's
        processing raised (nothing of it is stored)."""
        clock = self.arrivals.clocks.get(partition)
        must = None
        if tick_ns is not None:
            index = self.loop.index

            def must(run_id: str) -> bool:
                deadline = index.get(run_id)
                return deadline is not None and deadline.due <= tick_ns

        done: list[tuple[list[Arrival], Outputs | Exception]] = []
        for held in self.arrivals.take(partition, wall_ns, must):
            batches: list[tuple[list[Step], int | None]] = [
                (a.steps.unpack(), a.sent_clock) for a in held
            ]
            try:
                out = self.process_run(
                    partition,
                    held[0].run_id,
                    batches,
                    held[-1].at_ns,
                    [a.at_ns for a in held],
                    clock,
                )
            except Exception as exc:
                done.append((held, exc))
                continue
            done.append((held, out))
        return done

    def tick(self, partition: int, now_ns: int) -> Outputs:
        """Due releases, finalizations and evictions of one partition, and (once every
        SWEEP_SECONDS) a slice of its expired finished markers, retained records and
        episodes."""
        out = Outputs()
        self.loop.due(partition, now_ns, out, TICK_MAX_RUNS)
        self.retain(partition, out, now_ns)
        passing = partition in self.sweeping
        if passing or now_ns - self.swept_at.get(partition, 0) >= SWEEP_NS:
            if not passing:
                self.swept_at[partition] = now_ns  # a pass over the partition starts
            if self.sweep(partition, now_ns):
                self.sweeping.add(partition)
            else:
                self.sweeping.discard(partition)
        return out

    def sweep(self, partition: int, now_ns: int) -> bool:
        """A slice of the partition's expired finished markers, retained records and
        episodes. True while the pass has more to read: it goes on at the next tick, so
        that a pass over the partition starts every SWEEP_SECONDS and keeps pace with any
        finish rate (one slice a minute fell behind at 83 finishes a second a partition)."""
        store = self.store
        store.sweep_finished(partition, now_ns - self.finished_ttl_ns, SWEEP_BATCH)
        more = store.finished_after.get(partition) is not None
        if self.retention is not None:
            store.sweep_retained(partition, now_ns, SWEEP_BATCH)
            cutoff = now_ns - self.retention.looping_ns
            episodes = store.sweep_episodes(partition, cutoff, SWEEP_BATCH)
            more = more or store.sweep_after.get(partition) is not None
            more = more or episodes == SWEEP_BATCH
        return more

    def retain(
        self,
        partition: int,
        out: Outputs,
        now_ns: int,
        calls: dict[str, list[dict[str, Any]]] | None = None,
    ) -> None:
        """Keep what on-call may ask about these runs later: the events of a run that
        looped as they fire, its side-effect calls, and its summary (and step timeline)
        when it finishes."""
        retention = self.retention
        if retention is None or not (out.events or out.summaries or calls):
            return
        events: dict[str, list[dict[str, Any]]] = {}
        for event in out.events:
            events.setdefault(event["run_id"], []).append(event)
        summaries = {s["run_id"]: s for s in out.summaries}
        store = self.store
        for run_id in {**events, **summaries, **(calls or {})}:
            key = run_id.encode("utf-8")
            raw = store.load_retained(partition, key)
            body = retained_records.decode(raw) if raw is not None else {}
            if run_id in events:
                for event in retained_records.add_events(body, events[run_id], now_ns):
                    store.put_episode(
                        partition,
                        episode_records.key(event, now_ns),
                        episode_records.encode(event),
                    )
            if calls and run_id in calls:
                retained_records.add_calls(body, calls[run_id])
            summary = summaries.get(run_id)
            if summary is None:
                # in flight: kept at least as long as a looping run; a call that came after
                # the run finished (counted, not fed) keeps the finished record's times
                expires, finished = now_ns + retention.looping_ns, 0
                if raw is not None:
                    kept_until, finished_ns, _p = retained_records.header(raw)
                    if finished_ns:
                        expires, finished = kept_until, finished_ns
                store.put_retained(
                    partition,
                    key,
                    retained_records.encode(body, partition, expires, finished),
                    was=raw,
                )
                continue
            retained_records.finish(body, summary, store.finishing.get(run_id))
            if summary.get("prompt_version") is not None:
                # events that fired before the run's prompt_version was known: their
                # episodes get it, so a slice's --runs lists them
                for kept in body.get("events", []):
                    if kept.get("prompt_version") is None and kept.get("listed_ns"):
                        kept["prompt_version"] = summary["prompt_version"]
                        event = {**kept, "run_id": run_id}
                        store.put_episode(
                            partition,
                            episode_records.key(event, kept["listed_ns"]),
                            episode_records.encode(event),
                        )
            keep = retention.looping_ns if summary.get("shapes") else retention.clean_ns
            if keep <= 0:
                store.put_retained(partition, key, None, was=raw)
                continue
            store.put_retained(
                partition,
                key,
                retained_records.encode(body, partition, now_ns + keep, now_ns),
                was=raw,
            )

    def take_writes(self) -> Writes:
        return self.store.take_writes()

    def discard_writes(self) -> None:
        self.store.discard_writes()

    def apply_writes(self) -> int:
        """take_writes + apply, for plain mappings (tests, tools)."""
        return self.store.apply_writes()
