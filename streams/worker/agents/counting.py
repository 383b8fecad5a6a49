"""Counting what the detect agent published: the Prometheus metrics, the worker's counters,
and the windowed count tables the on-call API sums (one write per label group and
partition, not per event or run)."""

from __future__ import annotations

from typing import Any

from detectors.holds import DENIED, EXECUTED, RUNS, HeldCall
from detectors.versions import LOOPING, History, Seen, Slice, run_measures, seen_of, slices_of
from streams.worker.agents.checkpoint import write_error
from streams.worker.agents.driver import Outputs
from streams.worker.state import versions as version_records
from streams.worker.state.store import Tables
from streams.worker.state.window_keys import aggregate_key

VERSION_INFO_LATEST = 5  # versions per service, agent and tool in loopwatch_version_info


class Counting:
    def __init__(self, metrics: Any, counters: dict[str, int], tables: Tables) -> None:
        self.metrics = metrics
        self.counters = counters
        self.tables = tables
        self.known_versions: set[Slice] = set()  # the slices version_info was built with

    def count(self, outputs: list[tuple[int, Outputs]], events_of: dict[int, Any]) -> None:
        """Count delivered `outputs`; `events_of[partition]` routes a partition's table
        writes. Raises StateWriteError when a windowed counter cannot be written."""
        m = self.metrics
        loops: dict[tuple[int, str], int] = {}
        runs: dict[tuple[int, str], int] = {}
        version_counts: dict[tuple[int, str], int] = {}
        seen: dict[tuple[int, Slice], Seen] = {}
        held: dict[tuple[int, str], int] = {}

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
            group = (partition, aggregate_key(labels, partition))
            loops[group] = loops.get(group, 0) + 1

        def count_held(partition: int, call: HeldCall) -> None:
            """A call an on-call hold decided on (or should have): `loopwatch query holds`."""
            measures = [DENIED if call.denied else EXECUTED]
            if call.first_in_run:
                measures.append(RUNS)
            if not call.denied:
                m.observe_hold_violation(call.tool, call.prompt_version)
            for measure in measures:
                group = (partition, aggregate_key((call.hold_id, measure), partition))
                held[group] = held.get(group, 0) + 1

        for partition, out in outputs:
            for ev in out.events:
                self.counters["events"] += 1
                if not ev.get("labels_pending"):  # else with its run's summary, below
                    count_loop(partition, ev, ev)
            for summary in out.summaries:
                # loops that fired before the run's labels were known: the final slice
                for deferred in summary.get("deferred_events", ()):
                    count_loop(partition, deferred, summary)
                m.observe_run(summary)
                labels = (
                    summary["prompt_version"],
                    summary["outcome"],
                    summary["termination_reason"],
                )
                group = (partition, aggregate_key(labels, partition))
                runs[group] = runs.get(group, 0) + 1
                self.counters["runs_finished"] += 1
                self.count_versions(partition, summary, version_counts, seen)
            if out.duplicate_spans:
                m.duplicate_spans.inc(out.duplicate_spans)
            if out.late_spans:
                m.late_spans.inc(out.late_spans)
            if out.spans_after_finalize:
                m.spans_after_finalize.inc(out.spans_after_finalize)
            for _ in range(out.evicted):
                m.run_evicted("capacity")
            for call in out.held_calls:
                count_held(partition, call)
        tables = self.tables
        try:
            for table, groups in (
                (tables.loop_counts, loops),
                (tables.run_counts, runs),
                (tables.version_counts, version_counts),
                (tables.hold_counts, held),
            ):
                for (partition, label_key), n in groups.items():
                    with tables.in_event(events_of[partition]):
                        table[label_key] += n
            for (partition, key), record in seen.items():
                raw_key = version_records.version_key(key, partition)
                with tables.in_event(events_of[partition]):
                    old = tables.versions.get(raw_key)
                    tables.versions[raw_key] = version_records.merged(old, record)
        except Exception as exc:
            raise write_error(exc) from exc
        if any(key not in self.known_versions for _p, key in seen):
            self.export_version_history()

    def count_versions(
        self,
        partition: int,
        summary: dict[str, Any],
        counts: dict[tuple[int, str], int],
        seen: dict[tuple[int, Slice], Seen],
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
                group = (partition, aggregate_key([*labels, name], partition))
                counts[group] = counts.get(group, 0) + n
            have = seen.get((partition, key))
            if have is None:
                seen[(partition, key)] = Seen(sighting.first_ns, sighting.last_ns, 1)
            else:
                have.merge(sighting)

    def export_version_history(self) -> None:
        """loopwatch_version_info from this worker's partitions' records: rebuilt when a
        slice appears that it was not built with (new versions are rare). The latest few
        versions of each service, agent and tool: the rules compare a rollout with the one
        before; older ones only add series."""
        history: History = version_records.history_of(self.tables.versions.items())
        self.known_versions = set(history.seen)
        self.metrics.set_version_history(history.rows(latest=VERSION_INFO_LATEST))
