"""Counting what the detect agent published: the Prometheus metrics and the worker's
counters as the outputs are delivered, and the windowed count tables the on-call API sums
(one write per label group and partition, not per event or run), staged with the batch's
state and written by the checkpoint before it (streams/worker/agents/checkpoint.py).

Every counted thing has an id (an event's, a run's, a held call's): a batch redone after a
crash that left its counts written and its states not brings the same ids again, and the
count records refuse them (streams/worker/state/window_keys.py `added_once`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from detectors.holds import DENIED, EXECUTED, RUNS, HeldCall
from detectors.versions import LOOPING, History, Slice, run_measures, seen_of, slices_of
from streams.runloop.loop import loops_counted
from streams.worker.agents.driver import Outputs
from streams.worker.state import versions as version_records
from streams.worker.state.store import COUNT_TABLES, Rows, Tables, Writes
from streams.worker.state.window_keys import added_once, aggregate_key, contribution_id, last_ids

if TYPE_CHECKING:
    from alerts.metrics import Metrics

VERSION_INFO_LATEST = 5  # versions per service, agent and tool in loopwatch_version_info


class Counting:
    def __init__(self, metrics: Metrics, counters: dict[str, int], tables: Tables) -> None:
        self.metrics = metrics
        self.counters = counters
        self.tables = tables
        self.known_versions: set[Slice] = set()  # the slices version_info was built with
        # partition -> ids the last writes before this assignment added (`recover`)
        self.done: dict[int, set[int]] = {}

    def stage(self, outputs: list[tuple[int, Outputs]], writes: Writes) -> None:
        """Observe delivered `outputs` in the metrics and stage their windowed counts in
        `writes` (the batch's one buffer, written by the checkpoint)."""
        m = self.metrics

        def count_loop(partition: int, ev: dict[str, Any], run: dict[str, Any]) -> None:
            """`run`: where the run-level labels come from (the event, or for an event that
            fired before they were known, the run's summary)."""
            prompt_version = run.get("prompt_version")
            m.observe_event({**ev, "prompt_version": prompt_version})
            labels = (
                ev["shape"],
                prompt_version,
                ev.get("tool_name"),
                ev["tool_version"],
                run.get("service_name"),
                run.get("agent_name"),
            )
            cid = contribution_id("event", ev["event_id"])
            writes.count("loop_counts", partition, aggregate_key(labels, partition), cid)

        def count_held(partition: int, call: HeldCall) -> None:
            """A call an on-call hold decided on (or should have): `loopwatch query holds`."""
            measures = [DENIED if call.denied else EXECUTED]
            if call.first_in_run:
                measures.append(RUNS)
            if not call.denied:
                m.observe_hold_violation(call.tool, call.prompt_version)
            cid = contribution_id("held", call.call_id)
            for measure in measures:
                label_key = aggregate_key((call.hold_id, measure), partition)
                writes.count("hold_counts", partition, label_key, cid)

        for partition, out in outputs:
            self.counters["events"] += len(out.events)
            for ev, run in loops_counted(out.events, out.summaries):
                count_loop(partition, ev, run)
            for summary in out.summaries:
                m.observe_run(summary)
                labels = (
                    summary["prompt_version"],
                    summary["outcome"],
                    summary["termination_reason"],
                )
                cid = contribution_id("run", summary["run_id"])
                writes.count("run_counts", partition, aggregate_key(labels, partition), cid)
                self.counters["runs_finished"] += 1
                self.count_versions(partition, summary, cid, writes)
            if out.duplicate_spans:
                m.duplicate_spans.inc(out.duplicate_spans)
            if out.late_spans:
                m.late_spans.inc(out.late_spans)
            if out.spans_after_finalize:
                m.spans_after_finalize.inc(out.spans_after_finalize)
            for _ in range(out.evicted):
                m.run_evicted("capacity")
            if out.failures:
                m.run_errors.inc(len(out.failures))
            for call in out.held_calls:
                count_held(partition, call)

    async def write(self, writes: Writes, events_of: dict[int, Any]) -> None:
        """Write the staged counts and sightings (`events_of[partition]` routes a
        partition's table writes), each added once, and wait until they are in the
        changelog. Raises what the tables raise."""
        tables = self.tables
        counts = []
        for name, groups in writes.counts.items():
            by_partition: dict[int, list[tuple[str, Any]]] = {}
            for (partition, label_key), adds in groups.items():
                done = self.done.get(partition, ())
                old = tables.read_count(name, partition, label_key)
                value = added_once(old, adds, done)
                by_partition.setdefault(partition, []).append((label_key, value))
            counts += [(name, p, items) for p, items in sorted(by_partition.items())]
        seen: dict[int, Rows] = {}
        for (partition, key), sightings in writes.sightings.items():
            raw_key = version_records.version_key(key, partition)
            done = self.done.get(partition, ())
            old = tables.read_value(tables.versions, partition, raw_key)
            merged = version_records.merged(old, sightings, done)
            seen.setdefault(partition, []).append((raw_key, merged))
        versions = [("versions", p, rows) for p, rows in sorted(seen.items())]
        await tables.write_counts(counts, versions, events_of)
        if any(key not in self.known_versions for _p, key in writes.sightings):
            self.export_version_history()

    def recover(self, partitions: set[int]) -> None:
        """After an assignment: the ids each partition's last count writes added, refused
        once more (a batch whose counts were written before a crash, and whose states
        were not, is processed again now and lands in the window of now)."""
        tables = self.tables
        self.done = version_records.last_ids(tables.versions.items(), partitions)
        for name in COUNT_TABLES:
            for p, ids in last_ids(tables.named(name).items(), partitions).items():
                self.done[p] |= ids

    def count_versions(
        self, partition: int, summary: dict[str, Any], cid: int, writes: Writes
    ) -> None:
        """A finished run on each of its version slices: its measures (windowed) and its
        sighting (the versions table)."""
        slices = slices_of(summary)
        if not slices:
            return
        measures = run_measures(summary)
        sighting = seen_of(summary)
        for key in slices:
            labels = key.labels()
            self.metrics.observe_version_run(labels, LOOPING in measures)
            for name, n in measures.items():
                label_key = aggregate_key([*labels, name], partition)
                writes.count("version_counts", partition, label_key, cid, n)
            writes.sight(partition, key, cid, sighting)  # merged() copies, never changes it

    def export_version_history(self) -> None:
        """loopwatch_version_info from this worker's partitions' records: rebuilt when a
        slice appears that it was not built with (new versions are rare). The latest few
        versions of each service, agent and tool: the rules compare a rollout with the one
        before; older ones only add series."""
        history: History = version_records.history_of(self.tables.versions.items())
        self.known_versions = set(history.seen)
        self.metrics.set_version_history(history.rows(latest=VERSION_INFO_LATEST))
