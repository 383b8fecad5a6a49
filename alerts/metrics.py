"""Prometheus metrics for loopwatch: one factory, one injected registry, bounded labels.

Everything the worker exports is defined here, in :class:`Metrics`. Tests create it over
a fresh ``CollectorRegistry``; the worker creates one instance and serves its registry on
``LOOPWATCH_METRICS_PORT`` (default 9464) at ``/metrics``.

Label cardinality is bounded twice: no metric has a run/trace/span id label, and every
labelled call goes through :class:`LabelLimiter`, which admits at most ``label_cap``
distinct values per label name and folds the rest into ``other`` (counted in
``loopwatch_label_overflow_total{label}``). ``None`` and empty values become ``unknown``.
The limiter is shared by all metrics, so a value admitted for ``prompt_version`` on the
loop-event counter is admitted on the run counter too: the loop-rate division in the rule
file always joins like with like.

Alert rules (``alerts/rules/loopwatch.rules.yml``) and the Grafana dashboard depend on the
metric and label names below; rename only together with them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from detectors.model import GUARD_IGNORED

__all__ = [
    "DEFAULT_LABEL_CAP",
    "DEFAULT_METRICS_PORT",
    "LATENCY_BUCKETS",
    "OTHER",
    "RUN_STEPS_BUCKETS",
    "UNKNOWN",
    "LabelLimiter",
    "Metrics",
]

PREFIX = "loopwatch_"
VERSION_LABELS = ("kind", "service_name", "agent_name", "tool_name", "version")
DEFAULT_LABEL_CAP = 50
DEFAULT_METRICS_PORT = 9464
UNKNOWN = "unknown"
OTHER = "other"
_VERSION_SERIES_KEPT = 10_000  # version slices whose series observe_version_run keeps at hand

#: processing latency buckets, seconds (explicit: the p99 panel and any SLO depend on them)
# finer where the stages of a second's detection latency fall
STAGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: steps per finished run (the "p99 steps per run" platform alarm of the seed)
RUN_STEPS_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 15, 20, 30, 40, 60, 80, 120, 200, 400)

#: labels whose value space is bounded by the infrastructure, not by the data: a higher
#: default cap so that e.g. partition 57 of a 64-partition topic keeps its own lag series.
_INFRA_CAPS: Mapping[str, int] = {"partition": 1024, "topic": 64}


class LabelLimiter:
    """Per-label cap on distinct label values.

    ``value(label, raw)`` returns the string to use as the label value: ``unknown`` for
    ``None``/empty, the value itself while fewer than the cap of distinct values have been
    seen for that label name, and ``other`` afterwards (each fold increments the overflow
    counter for that label). ``unknown`` and ``other`` are always admitted and do not use
    up the cap. Values once admitted stay admitted, so a series never changes identity.
    """

    def __init__(
        self,
        cap: int = DEFAULT_LABEL_CAP,
        overflow: Counter | None = None,
        caps: Mapping[str, int] | None = None,
    ) -> None:
        if cap < 1:
            raise ValueError(f"label_cap must be >= 1, got {cap!r}")
        self.cap = cap
        self.caps = dict(caps or {})
        self._overflow = overflow
        self._seen: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def cap_for(self, label: str) -> int:
        return self.caps.get(label, self.cap)

    def value(self, label: str, raw: object) -> str:
        if raw is None:
            return UNKNOWN
        text = raw if isinstance(raw, str) else str(raw)
        if text == "" or text in (UNKNOWN, OTHER):
            return text or UNKNOWN
        with self._lock:
            seen = self._seen.setdefault(label, set())
            if text in seen:
                return text
            if len(seen) < self.cap_for(label):
                seen.add(text)
                return text
        if self._overflow is not None:
            self._overflow.labels(label=label).inc()
        return OTHER

    def labels(self, **raw: object) -> dict[str, str]:
        return {name: self.value(name, v) for name, v in raw.items()}

    def seen(self, label: str) -> frozenset[str]:
        with self._lock:
            return frozenset(self._seen.get(label, ()))


def _non_negative(value: Any) -> float:
    """A count from an event field; missing, malformed or negative counts add nothing."""
    if value is None or isinstance(value, bool):
        return 0.0
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if number > 0 else 0.0


class Metrics:
    """All loopwatch metrics over one registry.

    Labelled metrics must be updated through the methods (``observe_event``,
    ``observe_run``, ``record_consumed``, ``dead_letter``, ...) or :meth:`labels`, so that
    the label cap applies. Unlabelled health metrics are plain attributes:
    ``spans_consumed``, ``duplicate_spans``, ``late_spans``, ``spans_after_finalize``,
    ``active_runs``,
    ``processing_latency``, ``last_processed_timestamp``.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        label_cap: int = DEFAULT_LABEL_CAP,
    ) -> None:
        if registry is None:
            # Production default: a private registry with the process/platform/GC
            # collectors, served by ``serve()``. Tests inject a bare registry.
            registry = CollectorRegistry(auto_describe=True)
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                registry.register(collector)
        self.registry = registry
        r = registry

        # -- cardinality guard -------------------------------------------------------
        self.label_overflow = Counter(
            PREFIX + "label_overflow_total",
            "Label values folded into 'other' because the label reached its distinct-value cap.",
            ["label"],
            registry=r,
        )
        self.limiter = LabelLimiter(
            label_cap,
            self.label_overflow,
            caps={k: max(v, label_cap) for k, v in _INFRA_CAPS.items()},
        )

        # -- agent health: loops and runs -------------------------------------------
        self.loop_events = Counter(
            PREFIX + "loop_events_total",
            "loop_detected events emitted, by loop shape, event severity and versions.",
            ["shape", "severity", "prompt_version", "tool_name", "tool_version"],
            registry=r,
        )
        self.guard_ignored = Counter(
            PREFIX + "guard_ignored_total",
            "Tool calls the in-process guard denied (enforced) that ran anyway: guard_ignored "
            "events. Not loops: the integration did not act on the guard's decision.",
            ["prompt_version", "tool_name", "tool_version"],
            registry=r,
        )
        self.hold_violations = Counter(
            PREFIX + "hold_violations_total",
            "Tool calls that ran under an active hold of the on-call without a guard "
            "decision on them: a hold nothing enforces (loopwatch hold add).",
            ["tool_name", "prompt_version"],
            registry=r,
        )
        self.wasted_steps = Counter(
            PREFIX + "wasted_steps_total",
            "Steps spent inside loop episodes after the first repeat.",
            ["shape", "prompt_version", "tool_name"],
            registry=r,
        )
        self.wasted_tokens = Counter(
            PREFIX + "wasted_tokens_total",
            "Tokens spent inside loop episodes after the first repeat.",
            ["shape", "prompt_version", "tool_name"],
            registry=r,
        )
        self.runs_finished = Counter(
            PREFIX + "runs_finished_total",
            "Finished runs (run summaries emitted): the denominator of every loop rate.",
            ["outcome", "termination_reason", "prompt_version"],
            registry=r,
        )
        self.runs_with_loops = Counter(
            PREFIX + "runs_with_loops_total",
            "Finished runs whose summary lists at least one loop shape.",
            ["prompt_version"],
            registry=r,
        )
        # -- versions: what each version's runs did, and which version it replaced
        # (detectors/versions.py; the LoopRateRegression rule joins these three)
        self.version_runs = Counter(
            PREFIX + "version_runs_total",
            "Finished runs per version: of a prompt_version (kind=prompt, tool_name unknown) "
            "or of a tool's version the run called (kind=tool).",
            list(VERSION_LABELS),
            registry=r,
        )
        self.version_looping_runs = Counter(
            PREFIX + "version_looping_runs_total",
            "Finished runs per version whose summary lists at least one loop shape.",
            list(VERSION_LABELS),
            registry=r,
        )
        self._version_children: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self.version_info = Gauge(
            PREFIX + "version_info",
            "The latest 5 versions of each service, agent and tool this worker's partitions "
            "saw finish a run, each labelled with the version first seen just before it in its service, agent and "
            "tool (previous_version; none for the first); the value is when that previous "
            "version was first seen (unix seconds; 0 for none), so that where workers "
            "disagree the rules pick the latest predecessor (topk).",
            [*VERSION_LABELS, "previous_version"],
            registry=r,
        )
        self.run_steps = Histogram(
            PREFIX + "run_steps",
            "Steps per finished run.",
            ["prompt_version"],
            buckets=RUN_STEPS_BUCKETS,
            registry=r,
        )

        # -- pipeline health ---------------------------------------------------------
        self.records_consumed = Counter(
            PREFIX + "records_consumed_total",
            "Input records (OTLP export batches) processed, by topic.",
            ["topic"],
            registry=r,
        )
        self.spans_consumed = Counter(
            PREFIX + "spans_consumed_total",
            "Spans decoded from input records.",
            registry=r,
        )
        self.duplicate_spans = Counter(
            PREFIX + "duplicate_spans_total",
            "Spans dropped as telemetry duplicates (same trace_id, span_id and content).",
            registry=r,
        )
        self.late_spans = Counter(
            PREFIX + "late_spans_total",
            "Spans that arrived behind steps of their run already released (out of order "
            "beyond allowed_lateness_seconds): still fed to the detectors, as late_spans in "
            "run summaries.",
            registry=r,
        )
        self.spans_after_finalize = Counter(
            PREFIX + "spans_after_finalize_total",
            "Spans that arrived after their run was finished or evicted: counted, not fed.",
            registry=r,
        )
        self.dead_letters = Counter(
            PREFIX + "dead_letters_total",
            "Records sent to the dead-letter topic, by reason.",
            ["reason"],
            registry=r,
        )
        self.publish_retries = Counter(
            PREFIX + "publish_retries_total",
            "Outputs sent again after a failed delivery, by stage (ingest: an input record's "
            "steps; detect: an event or run summary). Delayed, not lost.",
            ["stage"],
            registry=r,
        )
        self.decode_errors = Counter(
            PREFIX + "decode_errors_total",
            "Records or spans that could not be decoded, by reason.",
            ["reason"],
            registry=r,
        )
        self.run_errors = Counter(
            PREFIX + "run_errors_total",
            "Runs whose release, finalization or eviction at their deadline raised: each keeps "
            "its last saved state and is tried again after the idle timeout (the worker's log "
            "has the run id and the traceback). A failed arrival is dead-lettered instead.",
            registry=r,
        )
        self.active_runs = Gauge(
            PREFIX + "active_runs",
            "Runs currently held in detector state.",
            registry=r,
        )
        self.evicted_runs = Counter(
            PREFIX + "evicted_runs_total",
            "Runs dropped from detector state without a normal finish, by reason.",
            ["reason"],
            registry=r,
        )
        self.stage_seconds = Histogram(
            PREFIX + "stage_seconds",
            "Where detection latency goes, by stage (docs/PERFORMANCE.md): ingest (an input "
            "record's timestamp to its steps sent), input_clock (unkeyed input: a run's "
            "arrival at detect to the input clock vouching for it), tick (a tick sent to "
            "handled), batch (one detect batch: detection and its outputs delivered), flush "
            "(a state flush holding the detect agent).",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.processing_latency = Histogram(
            PREFIX + "processing_latency_seconds",
            "Wall-clock seconds to process one input record (decode, dedup, detect, emit).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.consumer_lag = Gauge(
            PREFIX + "consumer_lag",
            "Records between the partition high watermark and this worker's position.",
            ["topic", "partition"],
            registry=r,
        )
        self.input_clock_lag = Gauge(
            PREFIX + "input_clock_lag_seconds",
            "Seconds the input clock (unkeyed input: the group has processed every input "
            "record older than it) trails the wall clock; run deadlines are held by it.",
            registry=r,
        )
        self.broker_connected = Gauge(
            PREFIX + "broker_connected",
            "Broker connectivity as this worker sees it: 1 connected, 0.5 degraded (some "
            "requests failing), 0 disconnected (its metadata probe gets no answer).",
            registry=r,
        )
        self.broker_failed_requests = Counter(
            PREFIX + "broker_failed_requests_total",
            "Requests to the broker that failed, by source (probe: the worker's metadata "
            "probe; library: a connection error the Kafka client logged; delivery: an output "
            "not delivered).",
            ["source"],
            registry=r,
        )
        self.ready = Gauge(
            PREFIX + "ready",
            "1 when /healthz answers ready (HTTP 200), 0 when not ready (HTTP 503).",
            registry=r,
        )
        self.last_processed_timestamp = Gauge(
            PREFIX + "last_processed_timestamp_seconds",
            "Unix time at which this worker last finished processing an input record.",
            registry=r,
        )

    # -- generic -----------------------------------------------------------------------
    def labels(self, metric: Any, **raw: object) -> Any:
        """``metric.labels(...)`` with every value passed through the label cap."""
        return metric.labels(**self.limiter.labels(**raw))

    # -- agent health ------------------------------------------------------------------
    def observe_event(self, event: Mapping[str, Any]) -> None:
        """Count one ``loop_detected`` event (contracts §6)."""
        lim = self.limiter.value
        shape = lim("shape", event.get("shape"))
        prompt_version = lim("prompt_version", event.get("prompt_version"))
        tool_name = lim("tool_name", event.get("tool_name"))
        # The latest event's trace as an OpenMetrics exemplar: a dashboard's data link goes
        # from the counter to that trace (Prometheus keeps it with exemplar storage on).
        trace_id = event.get("trace_id")
        exemplar = None  # (an exemplar's labels hold 128 characters at most)
        if isinstance(trace_id, str) and 0 < len(trace_id) <= 64:
            exemplar = {"trace_id": trace_id}
        if event.get("shape") == GUARD_IGNORED:  # the guard checked, not a loop: own counter
            self.guard_ignored.labels(
                prompt_version=prompt_version,
                tool_name=tool_name,
                tool_version=lim("tool_version", event.get("tool_version")),
            ).inc(exemplar=exemplar)
            return
        self.loop_events.labels(
            shape=shape,
            severity=lim("severity", event.get("severity")),
            prompt_version=prompt_version,
            tool_name=tool_name,
            tool_version=lim("tool_version", event.get("tool_version")),
        ).inc(exemplar=exemplar)
        self.wasted_steps.labels(
            shape=shape, prompt_version=prompt_version, tool_name=tool_name
        ).inc(_non_negative(event.get("wasted_steps")))
        self.wasted_tokens.labels(
            shape=shape, prompt_version=prompt_version, tool_name=tool_name
        ).inc(_non_negative(event.get("wasted_tokens")))

    def observe_hold_violation(self, tool_name: Any, prompt_version: Any) -> None:
        lim = self.limiter.value
        self.hold_violations.labels(
            tool_name=lim("tool_name", tool_name),
            prompt_version=lim("prompt_version", prompt_version),
        ).inc()

    def _version(self, kind: str, version: Any) -> str:
        # the same limiter values as the other metrics' version labels, so rules join
        return self.limiter.value("prompt_version" if kind == "prompt" else "tool_version", version)

    def _version_labels(self, labels: list[Any]) -> dict[str, str]:
        kind, service, agent, tool, version = labels
        lim = self.limiter.value
        return {
            "kind": kind,
            "service_name": lim("service_name", service),
            "agent_name": lim("agent_name", agent),
            "tool_name": lim("tool_name", tool or None),
            "version": self._version(kind, version),
        }

    def observe_version_run(self, labels: list[Any], looping: bool) -> None:
        """One finished run on one version slice ([kind, service, agent, tool, version])."""
        key = tuple(labels)
        children = self._version_children.get(key)
        if children is None:
            named = self._version_labels(labels)
            children = (
                self.version_runs.labels(**named),
                self.version_looping_runs.labels(**named),
            )
            # Admitted values stay admitted (LabelLimiter), so their series are kept: every
            # finished run looked them up again (1.6% of an unkeyed worker's CPU). A value
            # folded into `other` is looked up, and its fold counted, each time.
            if OTHER not in named.values() and len(self._version_children) < _VERSION_SERIES_KEPT:
                self._version_children[key] = children
        runs, looping_runs = children
        runs.inc()
        # touched, so that "0 looping runs" is a sample, not an absence
        looping_runs.inc(1 if looping else 0)

    def set_version_history(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Replace version_info by `rows` (detectors.versions.History.rows())."""
        self.version_info.clear()
        for row in rows:
            kind = row["kind"]
            named = self._version_labels(
                [kind, row["service_name"], row["agent_name"], row["tool_name"], row["version"]]
            )
            previous = row.get("previous")
            before = "none" if previous is None else self._version(kind, previous)
            first_ns = row.get("previous_first_ns") or 0
            self.version_info.labels(**named, previous_version=before).set(first_ns / 1e9)

    def observe_run(self, summary: Mapping[str, Any]) -> None:
        """Count one finished run from its run summary (contracts §6)."""
        lim = self.limiter.value
        prompt_version = lim("prompt_version", summary.get("prompt_version"))
        self.runs_finished.labels(
            outcome=lim("outcome", summary.get("outcome")),
            termination_reason=lim("termination_reason", summary.get("termination_reason")),
            prompt_version=prompt_version,
        ).inc()
        # Touch the series so that "0 runs with loops" is a sample, not an absence.
        with_loops = self.runs_with_loops.labels(prompt_version=prompt_version)
        if summary.get("shapes"):
            with_loops.inc()
        else:
            with_loops.inc(0)
        steps = summary.get("steps")
        if steps is not None and not isinstance(steps, bool):
            with contextlib.suppress(TypeError, ValueError):
                self.run_steps.labels(prompt_version=prompt_version).observe(float(steps))

    # -- pipeline health ---------------------------------------------------------------
    def record_consumed(
        self,
        topic: str,
        spans: int = 0,
        latency_seconds: float | None = None,
        now: float | None = None,
    ) -> None:
        """One input record processed: count it, its spans, its latency, and mark the time."""
        self.records_consumed.labels(topic=self.limiter.value("topic", topic)).inc()
        if spans > 0:
            self.spans_consumed.inc(spans)
        if latency_seconds is not None and latency_seconds >= 0:
            self.processing_latency.observe(latency_seconds)
        self.last_processed_timestamp.set(time.time() if now is None else now)

    def dead_letter(self, reason: str | None) -> None:
        self.dead_letters.labels(reason=self.limiter.value("reason", reason)).inc()

    def decode_error(self, reason: str | None) -> None:
        self.decode_errors.labels(reason=self.limiter.value("reason", reason)).inc()

    def run_evicted(self, reason: str | None) -> None:
        self.evicted_runs.labels(reason=self.limiter.value("reason", reason)).inc()

    def set_consumer_lag(self, topic: str, partition: int | str, lag: float) -> None:
        self.labels(self.consumer_lag, topic=topic, partition=partition).set(lag)

    def forget_consumer_lag(self, topic: str, partition: int | str) -> None:
        """Drop the lag series of a partition this worker no longer owns (rebalance)."""
        labels = self.limiter.labels(topic=topic, partition=partition)
        with contextlib.suppress(KeyError):
            self.consumer_lag.remove(labels["topic"], labels["partition"])

    # -- exposition --------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (for a faust web view)."""
        return generate_latest(self.registry)

    def serve(self, port: int | None = None, addr: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` on ``port`` (default ``$LOOPWATCH_METRICS_PORT`` or 9464)."""
        if port is None:
            port = int(os.environ.get("LOOPWATCH_METRICS_PORT", DEFAULT_METRICS_PORT))
        return start_http_server(port, addr=addr, registry=self.registry)
