"""End to end: OTLP records on Kafka -> `loopwatch worker` -> Prometheus rules -> Alertmanager
-> webhook (issue 4).

One stack, all real processes on 127.0.0.1 with free ports and temp dirs:

* the real local Kafka broker (``scripts/kafka.sh start``) and the real ``loopwatch worker``
  (`WorkerProc`: its own topics and app id, metrics on ``LOOPWATCH_METRICS_PORT``);
* a real Prometheus scraping the worker's ``/metrics`` as ``job="loopwatch"`` every 1 s and
  evaluating a **test copy** of ``alerts/rules/loopwatch.rules.yml`` every 1 s;
* a real Alertmanager with a test copy of ``alerts/alertmanager/alertmanager.yml``;
* a webhook receiver in the test (`WebhookSink`).

Test copies (written at test time, the repo files are not touched):

* rules: every ``for:`` divided by 60 (minutes -> seconds: LoopRateHigh page 5m -> 5s,
  the tickets 10m -> 10s, ...). Nothing else changes: the range windows ([5m], [1h],
  [10m]), thresholds and the 20-run volume floor are the production ones, and
  `scale_for_durations` fails if the copy differs from the original in anything but
  ``for``. DuplicateSideEffect has no ``for:``: it runs exactly as shipped.
* Alertmanager: the two receivers' webhook URLs keep their paths (``/loopwatch/pager``,
  ``/loopwatch/ticket``) on the sink's host:port; group_wait and group_interval are 1 s on
  every route. Routes, matchers, group_by, repeat intervals and inhibit rules are as shipped.

Two windows on the same stack, the clean one first (the loop window's fixture depends on
the clean window's, so they run in that order whatever tests are selected):

1. **clean**: the negative-control example files plus 32 synthetic clean runs of one
   prompt_version (enough for the 20-run volume floor, so "nothing fires" is not only the
   floor speaking). After the worker's /healthz shows every run finished with 0 events and
   Prometheus has scraped all of them, a bounded quiet period must see no alert in
   Prometheus in any state (pending included) and no webhook call.
2. **loops**: 32 runs of prompt_version ``e2e-loop-v1`` (26 with an identical_repetition
   loop on ``lookup_order``, 6 clean), fed a few at a time so the counters grow across
   scrapes, plus the ``duplicate_side_effect__refund_twice`` example. ``e2e-loop-v1`` is
   first seen after ``e2e-clean-v1`` in the same service and agent: it replaced it.
   Expected: in Prometheus DuplicateSideEffect (page), LoopRateHigh (page, the slice; then
   the two tickets) with the slice's shape / prompt_version / tool_name / tool_version
   labels, and LoopRateRegression (page) naming ``e2e-loop-v1`` and ``e2e-clean-v1``;
   through Alertmanager exactly ONE notification per group, all on the pager receiver,
   while the LoopRateHigh tickets (and, once the regression fires, the LoopRateHigh page)
   are inhibited; the regression's `query compare` annotation, run verbatim, shows the
   difference with its p-value.
3. **a clean rollout**: 24 clean runs of ``e2e-clean-v2``, which replaces ``e2e-loop-v1``:
   its regression ratio is recorded (0) and LoopRateRegression stays quiet for it.

The expected events (shapes and label values) come from `loopwatch replay`'s engine over
the same records (`replay_messages`), not from the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.parse
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from detectors.compare import fisher_exact
from detectors.policy import load_policy
from streams.spanpath.otlp import decode_proto
from tests.e2e.prom_support import (
    AM_CONFIG,
    RULES,
    Daemon,
    Notification,
    WebhookSink,
    alertmanager_test_config,
    duration_seconds,
    http_json,
    query_values,
    scale_for_durations,
    start_alertmanager,
    start_prometheus,
    wait_for,
)
from tests.otlp_build import EXAMPLES, encode_request, file_messages, replay_messages, trace_key
from tests.spankit import Run
from tests.support.kafka import require_broker
from tests.support.worker_proc import EXAMPLE_POLICY, FINGERPRINT_KEY, WorkerProc, write_policy

pytestmark = [pytest.mark.kafka, pytest.mark.prometheus]

CLEAN_PV = "e2e-clean-v1"
LOOP_PV = "e2e-loop-v1"
CLEAN_PV2 = "e2e-clean-v2"
GROUP_BY = ("alertname", "shape", "prompt_version", "tool_version")
SLICE = ("shape", "prompt_version", "tool_name", "tool_version")
REPO = Path(__file__).resolve().parents[2]
SIDE_EFFECT_SHAPES = {"duplicate_side_effect", "unsafe_side_effect_retry"}
QUIET_SECONDS = 8.0  # bounded wait for "nothing fires" (pending shows within 1-2 evaluations)
SETTLE_SECONDS = 4.0  # after the last expected alert: > group_wait + group_interval (1 s each)
TIMEOUT = 60.0

Record = tuple[bytes | None, bytes]


# ---------------------------------------------------------------------------------------
# scenario records


def clean_run(n: int, pv: str) -> Run:
    """A run that looks up three different orders and answers: no loop."""
    run = Run(trace=5000 + n, prompt_version=pv)
    for k in range(3):
        run.llm()
        run.tool("lookup_order", {"order_id": f"C-{n}-{k}"}, {"status": "shipped"})
    run.llm()
    run.root()
    return run


def looping_run(n: int, pv: str) -> Run:
    """A run that looks up the same order three times with the same result: one
    identical_repetition event (allowed_repeats 2) on lookup_order, tool_version 3.

    Its prompt_version is only on the root span, which ends last, after the agent went on
    for 10 s more: the loop fires before the run's labels are known (`labels_pending`),
    as with the GenAI `invoke_agent` root of real instrumentations. Its records (see
    `loop_batches`) put the root in a later export message."""
    run = Run(trace=5000 + n, prompt_version=pv).version_only_on_root()
    for _ in range(3):
        run.llm()
        run.tool("lookup_order", {"order_id": f"L-{n}"}, {"status": "pending"})
    run.llm()
    run.clock += 10 * 10**9
    run.llm()
    run.root()
    return run


def keyed(message: bytes) -> Record:
    """Keyed by trace id, as the kafkaexporter with partition_traces_by_id: the export
    batches of one run stay in order on one partition."""
    return (trace_key(message), message)


def example_records(name: str) -> list[Record]:
    return [keyed(m) for m in file_messages(EXAMPLES / name)]


def in_batches(records: list[Record], size: int) -> list[list[Record]]:
    return [records[i : i + size] for i in range(0, len(records), size)]


def clean_batches() -> list[list[Record]]:
    negatives = sorted(
        p.name for p in EXAMPLES.glob("negative__*") if p.suffix in (".pb", ".jsonl")
    )
    assert len(negatives) >= 8, negatives
    first = [r for name in negatives for r in example_records(name)]
    synthetic = [keyed(encode_request(clean_run(i, CLEAN_PV).spans)) for i in range(32)]
    return [first, *in_batches(synthetic, 3)]


def loop_batches() -> list[list[Record]]:
    runs = [
        clean_run(100 + i, LOOP_PV) if i % 5 == 2 and i < 30 else looping_run(100 + i, LOOP_PV)
        for i in range(32)
    ]
    assert sum(1 for i in range(32) if i % 5 == 2 and i < 30) == 6
    synthetic = []
    for r in runs:  # the root span ends last: exported in the next message
        synthetic.append(keyed(encode_request(r.spans[:-1])))
        synthetic.append(keyed(encode_request(r.spans[-1:])))
    batches = in_batches(synthetic, 6)
    batches[0] = example_records("duplicate_side_effect__refund_twice.pb") + batches[0]
    return batches


@dataclass
class Expected:
    events: list[dict[str, Any]]
    runs: list[dict[str, Any]]

    @property
    def slices(self) -> Counter[tuple[str, ...]]:
        """Events by slice; an event that fired before its run's labels were known
        (`labels_pending`) is in its run's final slice: the run summary's prompt_version."""
        return Counter(self.slice_of(e) for e in self.events)

    def slice_of(self, e: dict[str, Any]) -> tuple[str, ...]:
        final = {s["run_id"]: s["prompt_version"] for s in self.runs}

        def label(k: str) -> str:
            if k == "prompt_version" and e["labels_pending"]:
                return str(final[e["run_id"]])
            return str(e[k])

        return tuple(label(k) for k in SLICE)

    @property
    def runs_by_pv(self) -> Counter[str]:
        return Counter(s["prompt_version"] for s in self.runs)


def replay(batches: list[list[Record]]) -> Expected:
    messages = [value for batch in batches for _key, value in batch]
    events, runs = replay_messages(messages, load_policy(EXAMPLE_POLICY), FINGERPRINT_KEY.encode())
    return Expected(events, runs)


# ---------------------------------------------------------------------------------------
# the stack


@dataclass
class Stack:
    worker: WorkerProc
    prometheus: Daemon
    alertmanager: Daemon
    sink: WebhookSink
    for_changes: list[tuple[str, str, str]]
    am_config: dict[str, Any]
    produced_runs: int = 0
    produced_events: int = 0

    def health(self) -> dict[str, Any]:
        status, doc = self.worker.api("/healthz")
        assert status == 200, doc
        return doc

    def prom_alerts(self) -> list[dict[str, Any]]:
        return http_json(f"{self.prometheus.base}/api/v1/alerts")["data"]["alerts"]  # type: ignore[no-any-return]

    def am_alerts(self) -> list[dict[str, Any]]:
        return http_json(f"{self.alertmanager.base}/api/v2/alerts")  # type: ignore[no-any-return]

    def produce_spread(self, batches: list[list[Record]], pause: float) -> None:
        """One batch at a time, `pause` seconds apart: the counters then grow over several
        scrapes (a counter series is born at its first value, so what lands before its
        first scrape is invisible to rate()/increase())."""
        for i, batch in enumerate(batches):
            if i:
                time.sleep(pause)
            self.worker.produce(batch)

    def wait_processed(self, expected: Expected) -> dict[str, Any]:
        """The worker finished every produced run and emitted exactly the expected events,
        and Prometheus scraped the final run count."""
        self.produced_runs += len(expected.runs)
        self.produced_events += len(expected.events)
        runs, events = self.produced_runs, self.produced_events

        def done() -> dict[str, Any] | None:
            h = self.health()
            assert self.worker.alive(), self.worker.log_tail()
            return h if h["runs_finished"] >= runs and h["events"] >= events else None

        try:
            health = wait_for(done, TIMEOUT, f"worker /healthz: {runs} runs, {events} events")
        except BaseException:
            print(self.worker.log_tail(80))
            raise
        time.sleep(1.0)  # a late extra event or run would show up here
        health = self.health()
        assert (health["runs_finished"], health["events"]) == (runs, events), health
        assert health["dead_letters"] == 0, health
        wait_for(
            lambda: [v for _m, v in query_values(self.prometheus.base,
                                                 "sum(loopwatch_runs_finished_total)")
                     if v == runs],
            15, f"Prometheus scraping loopwatch_runs_finished_total == {runs}",
        )  # fmt: skip
        return health

    def diagnostics(self) -> str:
        return (
            f"prometheus alerts: {self.prom_alerts()}\n"
            f"alertmanager alerts: {[(a['labels'], a['status']) for a in self.am_alerts()]}\n"
            f"webhook calls: {[(c.path, c.payload.get('groupLabels')) for c in self.sink.calls]}"
        )


def stop_worker(worker: WorkerProc) -> None:
    """Kill the worker (always), then delete its topics. The topic deletion is best effort
    (retried once, then a warning): a broker restarted by a concurrent test must not turn
    a passed run into a teardown error."""
    if worker.proc is not None and worker.proc.poll() is None:
        worker.proc.kill()
        worker.proc.wait(10)
    for attempt in (1, 2):
        try:
            worker.cleanup()
            return
        except Exception as exc:  # KafkaException, TimeoutError, ...
            if attempt == 2:
                warnings.warn(f"topics of {worker.app_id} not deleted: {exc!r}", stacklevel=1)
            else:
                time.sleep(5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_broker()
    tmp = tmp_path_factory.mktemp("alerting-e2e")
    with contextlib.ExitStack() as cleanup:
        sink = WebhookSink()
        cleanup.callback(sink.close)

        am_file = tmp / "alertmanager.yml"
        am_config = alertmanager_test_config(AM_CONFIG, am_file, sink.base)
        alertmanager = start_alertmanager(tmp / "alertmanager", am_file)
        cleanup.callback(alertmanager.stop)

        workdir = tmp / "worker"
        workdir.mkdir()
        policy = write_policy(
            workdir / "policy.yaml",
            allowed_lateness_seconds=1,
            finalize_grace_seconds=1,
            idle_timeout_seconds=30,
        )
        worker = WorkerProc(workdir, policy, LOOPWATCH_METRICS_HOST="127.0.0.1")
        cleanup.callback(stop_worker, worker)
        worker.start()
        worker.wait_ready()

        # Prometheus only once /metrics answers: an early failed scrape would be up == 0
        rules = tmp / "loopwatch.rules.test-copy.yml"
        for_changes = scale_for_durations(RULES, rules)
        metrics_target = f"127.0.0.1:{worker.env['LOOPWATCH_METRICS_PORT']}"
        prometheus = start_prometheus(
            tmp / "prometheus",
            targets=[metrics_target],
            rule_files=[rules],
            alertmanagers=[alertmanager.base.removeprefix("http://")],
            features=["exemplar-storage"],
        )
        cleanup.callback(prometheus.stop)  # stopped first: no alert about the worker going

        st = Stack(worker, prometheus, alertmanager, sink, for_changes, am_config)
        wait_for(
            lambda: [v for _m, v in query_values(prometheus.base, 'up{job="loopwatch"}') if v == 1],
            20, "Prometheus scraping the worker (up == 1)",
        )  # fmt: skip

        def evaluated() -> bool:
            groups = http_json(f"{prometheus.base}/api/v1/rules")["data"]["groups"]
            rules_ = [r for g in groups for r in g["rules"]]
            return bool(rules_) and all(
                not r.get("lastEvaluation", "0001").startswith("0001") for r in rules_
            )

        wait_for(evaluated, 20, "every rule evaluated once")
        yield st
    # ExitStack: Prometheus, worker, Alertmanager, sink, in that order
    for daemon in (prometheus, alertmanager):
        assert not daemon.alive(), f"{daemon.name} still running"
    assert not worker.alive(), "worker still running"


# ---------------------------------------------------------------------------------------
# window 1: clean runs only


@dataclass
class CleanWindow:
    expected: Expected
    health: dict[str, Any]
    floor: dict[str, float]
    loop_rate: dict[str, float]
    alerts_seen: list[dict[str, Any]] = field(default_factory=list)
    am_alerts: list[dict[str, Any]] = field(default_factory=list)
    notifications: list[Notification] = field(default_factory=list)
    rule_errors: list[tuple[str, str]] = field(default_factory=list)
    quiet_seconds: float = 0.0


@pytest.fixture(scope="module")
def clean_window(stack: Stack) -> CleanWindow:
    batches = clean_batches()
    expected = replay(batches)
    assert expected.events == [], [e["shape"] for e in expected.events]
    assert expected.runs_by_pv[CLEAN_PV] == 32

    stack.produce_spread(batches, pause=0.6)
    health = stack.wait_processed(expected)

    base = stack.prometheus.base
    # the volume floor of LoopRateHigh is met for the clean prompt_version (so quiet means
    # "loop rate 0", not only "too few runs"), and its recorded loop rate is 0
    floor = dict(
        wait_for(
            lambda: [(m["prompt_version"], v) for m, v in query_values(
                base, f'prompt_version:loopwatch_runs_finished:increase5m{{prompt_version="{CLEAN_PV}"}} >= 20')],
            15, "the 20-run volume floor reached for the clean prompt_version",
        )
    )  # fmt: skip
    loop_rate = {
        m["prompt_version"]: v
        for m, v in query_values(base, "prompt_version:loopwatch_loop_rate:ratio_rate5m")
    }

    window = CleanWindow(expected, health, floor, loop_rate)
    start = time.monotonic()
    while time.monotonic() - start < QUIET_SECONDS:
        window.alerts_seen += stack.prom_alerts()
        time.sleep(0.5)
    window.quiet_seconds = time.monotonic() - start
    window.am_alerts = stack.am_alerts()
    window.notifications = stack.sink.calls
    groups = http_json(f"{base}/api/v1/rules")["data"]["groups"]
    window.rule_errors = [
        (r["name"], r.get("lastError", ""))
        for g in groups
        for r in g["rules"]
        if r["health"] != "ok"
    ]
    return window


def test_clean_runs_are_processed_and_scraped(clean_window: CleanWindow) -> None:
    w = clean_window
    assert w.health["runs_finished"] == len(w.expected.runs) >= 40
    assert w.health["events"] == 0
    assert w.floor[CLEAN_PV] >= 20
    # (the example prompt_versions arrive in one batch: their counters are born at their
    # final value, so rate() has no increase to see and they get no recorded loop rate)
    assert CLEAN_PV in w.loop_rate, w.loop_rate
    assert all(v == 0 for v in w.loop_rate.values()), w.loop_rate
    assert not w.rule_errors, w.rule_errors


def test_clean_runs_fire_nothing(clean_window: CleanWindow) -> None:
    w = clean_window
    assert w.quiet_seconds >= QUIET_SECONDS
    assert w.alerts_seen == [], "alerts (any state) in Prometheus during the clean window"
    assert w.am_alerts == [], "alerts in Alertmanager during the clean window"
    assert w.notifications == [], "webhook calls during the clean window"


# ---------------------------------------------------------------------------------------
# window 2: loops


@dataclass
class LoopWindow:
    expected: Expected
    dup_slices: set[tuple[str, ...]]
    rate_slices: set[tuple[str, ...]]
    firing: list[dict[str, Any]]
    am_alerts: list[dict[str, Any]]
    notifications: list[Notification]
    stack: Stack | None = None


def labels_of(alert: dict[str, Any], keys: tuple[str, ...] = SLICE) -> tuple[str, ...]:
    return tuple(alert["labels"].get(k, "") for k in keys)


@pytest.fixture(scope="module")
def loop_window(stack: Stack, clean_window: CleanWindow) -> LoopWindow:
    batches = loop_batches()
    expected = replay(batches)
    slices = expected.slices
    # what the rules must make of it: every side-effect slice pages; a slice pages on its
    # loop rate when its prompt_version has >= 20 runs and its events are > 10% of them
    dup_slices = {s for s in slices if s[0] in SIDE_EFFECT_SHAPES}
    rate_slices = {
        s for s, n in slices.items()
        if expected.runs_by_pv[s[1]] >= 20 and n / expected.runs_by_pv[s[1]] > 0.10
    }  # fmt: skip
    assert dup_slices == {("duplicate_side_effect", "support-v13", "issue_refund", "3")}
    assert rate_slices == {("identical_repetition", LOOP_PV, "lookup_order", "3")}
    assert slices[("identical_repetition", LOOP_PV, "lookup_order", "3")] == 26
    # the run's prompt_version is only on its root span, in the message after its loop
    # (`loop_batches`): the worker fires before it arrives and counts the loop under the
    # run's final slice; the replay, holding the run whole, labels the event at once
    loops = [e for e in expected.events if e["shape"] == "identical_repetition"]
    assert len(loops) == 26 and {e["prompt_version"] for e in loops} == {LOOP_PV}
    spans = [s for batch in batches for _key, value in batch for s in decode_proto(value)]
    labelled = {s.trace_id for s in spans if s.parent_span_id and "prompt.version" in s.resource}
    assert not {e["run_id"] for e in loops} & labelled

    stack.produce_spread(batches, pause=0.6)
    stack.wait_processed(expected)

    def firing() -> list[dict[str, Any]]:
        return [a for a in stack.prom_alerts() if a["state"] == "firing"]

    def wanted_firing() -> list[dict[str, Any]] | None:
        got = firing()
        names = Counter((a["labels"]["alertname"], a["labels"]["severity"],
                         a["labels"].get("scope", "")) for a in got)  # fmt: skip
        want = {("DuplicateSideEffect", "page", ""), ("LoopRateHigh", "page", "slice"),
                ("LoopRateHigh", "ticket", "slice"), ("LoopRateHigh", "ticket", "prompt_version"),
                ("LoopRateRegression", "page", "")}  # fmt: skip
        return got if set(names) >= want else None

    try:
        # the page (for 5s) first, then both tickets (for 10s) once the page is in AM
        wait_for(
            lambda: len([c for c in stack.sink.calls if c.path == "/loopwatch/pager"]) >= 2,
            TIMEOUT, "two pager notifications",
        )  # fmt: skip
        got = wait_for(
            wanted_firing,
            30,
            "DuplicateSideEffect, LoopRateHigh page + tickets, LoopRateRegression",
        )
        # the LoopRateHigh alerts reached Alertmanager and are held back there by the
        # inhibit rules (the tickets by the page, all three by the regression)
        wait_for(
            lambda: len([a for a in stack.am_alerts()
                         if a["labels"]["alertname"] == "LoopRateHigh"
                         and a["status"]["state"] == "suppressed"]) == 3,
            15, "three suppressed LoopRateHigh alerts in Alertmanager",
        )  # fmt: skip
    except BaseException:
        print(stack.diagnostics())
        raise
    time.sleep(SETTLE_SECONDS)  # a second notification for a group would arrive by now
    got = firing()
    return LoopWindow(
        expected, dup_slices, rate_slices, got, stack.am_alerts(), stack.sink.calls, stack
    )


def test_loop_alerts_fire_in_prometheus_with_slice_labels(loop_window: LoopWindow) -> None:
    w = loop_window
    by_kind: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for a in w.firing:
        key = (a["labels"]["alertname"], a["labels"]["severity"], a["labels"].get("scope", ""))
        by_kind.setdefault(key, []).append(a)
    # nothing else fires (no pipeline-health alert, no surge without last hour's history)
    assert set(by_kind) == {
        ("DuplicateSideEffect", "page", ""),
        ("LoopRateHigh", "page", "slice"),
        ("LoopRateHigh", "ticket", "slice"),
        ("LoopRateHigh", "ticket", "prompt_version"),
        ("LoopRateRegression", "page", ""),
    }, w.firing
    [regression] = by_kind[("LoopRateRegression", "page", "")]
    assert {k: regression["labels"][k] for k in ("kind", "version", "previous_version")} == {
        "kind": "prompt",
        "version": LOOP_PV,
        "previous_version": CLEAN_PV,
    }
    assert regression["labels"]["prompt_version"] == LOOP_PV  # what the inhibition matches
    assert float(regression["value"]) >= 2  # x its predecessor's loop rate

    assert {labels_of(a) for a in by_kind[("DuplicateSideEffect", "page", "")]} == w.dup_slices
    for kind in (("LoopRateHigh", "page", "slice"), ("LoopRateHigh", "ticket", "slice")):
        assert {labels_of(a) for a in by_kind[kind]} == w.rate_slices, kind
    [prompt_level] = by_kind[("LoopRateHigh", "ticket", "prompt_version")]
    assert prompt_level["labels"]["prompt_version"] == LOOP_PV
    assert "shape" not in prompt_level["labels"] and "tool_version" not in prompt_level["labels"]

    [page] = by_kind[("LoopRateHigh", "page", "slice")]
    assert float(page["value"]) > 0.10  # loop episodes per finished run, 5m
    assert page["annotations"]["summary"].startswith("identical_repetition loops in ")
    assert LOOP_PV in page["annotations"]["summary"]
    [dup] = by_kind[("DuplicateSideEffect", "page", "")]
    assert float(dup["value"]) >= 1
    assert "issue_refund" in dup["annotations"]["summary"]
    for a in w.firing:  # no per-instance/run labels leak into the slice alerts
        assert not {"instance", "job", "run_id", "trace_id"} & set(a["labels"]), a["labels"]


def test_one_grouped_notification_per_group_on_the_pager(
    loop_window: LoopWindow, stack: Stack
) -> None:
    w = loop_window
    assert tuple(stack.am_config["route"]["group_by"]) == GROUP_BY
    assert all(c.path == "/loopwatch/pager" for c in w.notifications), [
        (c.path, c.payload.get("groupLabels")) for c in w.notifications
    ]
    by_group: dict[tuple[str, ...], list[Notification]] = {}
    for c in w.notifications:
        by_group.setdefault(
            tuple(c.payload["groupLabels"].get(k, "") for k in GROUP_BY), []
        ).append(c)

    dup_groups = {("DuplicateSideEffect", s[0], s[1], s[3]) for s in w.dup_slices}
    page_groups = {("LoopRateHigh", s[0], s[1], s[3]) for s in w.rate_slices}
    regression_groups = {("LoopRateRegression", "", LOOP_PV, "")}
    # The slice's LoopRateHigh page (for 5m) fires before the regression (for 10m) and is
    # sent unless the regression fired within group_wait of it; after that it is inhibited.
    assert (
        dup_groups | regression_groups
        <= set(by_group)
        <= (dup_groups | regression_groups | page_groups)
    )
    for group, calls in by_group.items():
        assert len(calls) == 1, f"{group}: {len(calls)} notifications"
        payload = calls[0].payload
        assert payload["receiver"] == "loopwatch-pager"
        assert payload["status"] == "firing"
        assert payload["version"] == "4"
        # (a label the alert does not carry is no group label: the regression has no shape)
        assert payload["groupLabels"] == {k: v for k, v in zip(GROUP_BY, group, strict=True) if v}
        [alert] = payload["alerts"]
        assert alert["status"] == "firing"
        assert alert["labels"]["severity"] == "page"
        assert tuple(alert["labels"].get(k, "") for k in GROUP_BY) == group
        assert alert["labels"]["tool_name"] in {"issue_refund", "lookup_order", "unknown"}
        assert {"summary", "description", "query", "runbook", "dashboard"} <= set(
            alert["annotations"]
        )
        assert payload["commonLabels"]["alertname"] == group[0]
        assert payload.get("truncatedAlerts", 0) == 0


def test_loop_rate_alerts_are_inhibited_by_the_page_and_the_regression(
    loop_window: LoopWindow,
) -> None:
    w = loop_window
    tickets = [a for a in w.am_alerts if a["labels"]["severity"] == "ticket"]
    assert len(tickets) == 2, [a["labels"] for a in w.am_alerts]
    for a in tickets:
        assert a["labels"]["alertname"] == "LoopRateHigh"
        assert a["status"]["state"] == "suppressed", a
        assert a["status"]["inhibitedBy"], a
        assert a["receivers"][0]["name"] == "loopwatch-ticket"
    pages = {a["labels"]["alertname"]: a for a in w.am_alerts if a["labels"]["severity"] == "page"}
    assert set(pages) == {"DuplicateSideEffect", "LoopRateHigh", "LoopRateRegression"}
    assert pages["DuplicateSideEffect"]["status"]["state"] == "active"
    assert pages["LoopRateRegression"]["status"]["state"] == "active"
    high = pages["LoopRateHigh"]["status"]
    assert high["state"] == "suppressed" and high["inhibitedBy"], high
    assert not [c for c in w.notifications if c.path == "/loopwatch/ticket"]


def test_rules_copy_only_scales_for_durations(stack: Stack) -> None:
    """The documented rewrite: `for:` / 60 and nothing else (scale_for_durations also checks
    that the re-parsed copy equals the original without `for`)."""
    changes = stack.for_changes
    assert changes, "no for: rewritten"
    for name, old, new in changes:  # minutes become seconds, e.g. 5m -> 5s, 15m -> 15s
        assert duration_seconds(new) == max(1, round(duration_seconds(old) / 60)), (name, old)
    names = {name for name, _old, _new in changes}
    assert ("LoopRateHigh", "5m", "5s") in changes  # the page used above
    assert ("LoopRateHigh", "10m", "10s") in changes  # the two tickets
    assert "DuplicateSideEffect" not in names  # no for: it runs exactly as shipped
    route = stack.am_config["route"]
    original = yaml.safe_load(AM_CONFIG.read_text())
    assert route["group_wait"] == route["group_interval"] == "1s"
    assert len(route["routes"]) == len(original["route"]["routes"])
    for child, orig in zip(route["routes"], original["route"]["routes"], strict=True):
        assert child["group_wait"] == child["group_interval"] == "1s"
        rest = {k: v for k, v in child.items() if k not in ("group_wait", "group_interval")}
        assert rest == {k: v for k, v in orig.items() if k not in ("group_wait", "group_interval")}
    assert stack.am_config["inhibit_rules"] == original["inhibit_rules"]
    urls = {h["url"] for r in stack.am_config["receivers"] for h in r["webhook_configs"]}
    assert urls == {f"{stack.sink.base}/loopwatch/pager", f"{stack.sink.base}/loopwatch/ticket"}


# ---------------------------------------------------------------------------------------
# from the alert to the runs behind it, their evidence and the trace


def loopwatch(stack: Stack, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """The `loopwatch` command line against the worker's API, as on-call runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWATCH_")}
    env["LOOPWATCH_API"] = f"http://127.0.0.1:{stack.worker.web_port}"
    return subprocess.run(
        [sys.executable, "-m", "streams.cli", *argv],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_alerts_query_annotation_lists_the_runs_behind_it(loop_window: LoopWindow) -> None:
    """The firing alerts' `query` annotations, as Prometheus rendered them, run verbatim:
    they list the runs of their slice; `query run` on a printed prefix shows the run's
    steps, and for the duplicated refund its side-effect ledger."""
    stack = loop_window.stack
    assert stack is not None
    for alert in loop_window.firing:
        if alert["labels"].get("scope") == "prompt_version":
            continue
        if alert["labels"]["alertname"] == "LoopRateRegression":
            continue  # a comparison: test_the_regression_query_compares_both_versions
        command = alert["annotations"]["query"]
        argv = shlex.split(command)
        assert argv[:3] == ["loopwatch", "query", "loops"] and "--runs" in argv, command
        done = loopwatch(stack, [*argv[1:], "--limit", "50"])
        assert done.returncode == 0, done.stderr
        slice_ = labels_of(alert)
        expected = loop_window.expected
        want = {e["run_id"] for e in expected.events if expected.slice_of(e) == slice_}
        rows = [line.split() for line in done.stdout.splitlines()[2:-1]]
        printed = {row[2] for row in rows}
        assert want and all(any(r.startswith(p) for p in printed) for r in want), (
            command,
            done.stdout,
        )
    dup = next(e for e in loop_window.expected.events if e["shape"] == "duplicate_side_effect")
    shown = loopwatch(stack, ["query", "run", dup["run_id"][:12]])
    assert shown.returncode == 0, shown.stderr
    assert "status    finished" in shown.stdout and "last tool steps" in shown.stdout
    assert "side effects (" in shown.stdout and "issue_refund" in shown.stdout


def test_the_regression_query_compares_both_versions(loop_window: LoopWindow) -> None:
    """The regression's `query` annotation, as Prometheus rendered it, runs verbatim and
    shows e2e-loop-v1 against e2e-clean-v1 with Fisher's p-value and a WORSE verdict."""
    stack = loop_window.stack
    assert stack is not None
    [alert] = [a for a in loop_window.firing if a["labels"]["alertname"] == "LoopRateRegression"]
    command = alert["annotations"]["query"]
    argv = shlex.split(command)
    assert argv[:3] == ["loopwatch", "query", "compare"], command
    done = loopwatch(stack, argv[1:])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"prompt_version {LOOP_PV} against {CLEAN_PV} (--baseline)")
    looping = sum(
        1 for s in loop_window.expected.runs if s["prompt_version"] == LOOP_PV and s["shapes"]
    )
    runs = loop_window.expected.runs_by_pv[LOOP_PV]
    assert (looping, runs) == (26, 32)
    p = fisher_exact(looping, runs - looping, 0, 32)
    assert lines[-1] == (
        f"verdict: WORSE: {LOOP_PV} loops more than {CLEAN_PV} ({looping}/{runs} looping runs "
        f"against 0/32, p={p:.2g})"
    ), done.stdout
    assert any(line.startswith("identical_repetition ") and "worse" in line for line in lines)
    doc = json.loads(loopwatch(stack, [*argv[1:], "--json"]).stdout)
    assert doc["verdict"] == "worse" and doc["rows"][0]["p_value"] == pytest.approx(p)


@pytest.fixture(scope="module")
def clean_rollout(loop_window: LoopWindow) -> dict[str, Any]:
    """Window 3: e2e-clean-v2 replaces e2e-loop-v1 and loops less: no regression."""
    stack = loop_window.stack
    assert stack is not None
    runs = [keyed(encode_request(clean_run(200 + i, CLEAN_PV2).spans)) for i in range(24)]
    batches = in_batches(runs, 4)
    expected = replay(batches)
    assert expected.runs_by_pv[CLEAN_PV2] == 24 and expected.events == []
    stack.produce_spread(batches, pause=0.6)
    stack.wait_processed(expected)
    base = stack.prometheus.base
    ratio = wait_for(
        lambda: query_values(
            base, f'version:loopwatch_loop_rate_regression:ratio{{version="{CLEAN_PV2}"}}'
        ),
        20,
        f"the regression ratio of {CLEAN_PV2} recorded",
    )
    seen: list[dict[str, Any]] = []
    start = time.monotonic()
    while time.monotonic() - start < QUIET_SECONDS:
        seen += [
            a
            for a in stack.prom_alerts()
            if a["labels"]["alertname"] == "LoopRateRegression"
            and a["labels"].get("version") == CLEAN_PV2
        ]
        time.sleep(0.5)
    return {"ratio": ratio, "alerts": seen}


def test_a_version_that_loops_no_more_than_the_one_it_replaced_does_not_fire(
    clean_rollout: dict[str, Any],
) -> None:
    [(labels, value)] = clean_rollout["ratio"]
    assert labels["previous_version"] == LOOP_PV and value == 0
    assert clean_rollout["alerts"] == []


def test_the_loop_counter_carries_a_trace_of_its_latest_event_as_exemplar(
    loop_window: LoopWindow,
) -> None:
    stack = loop_window.stack
    assert stack is not None
    now = time.time()
    url = f"{stack.prometheus.base}/api/v1/query_exemplars?" + urllib.parse.urlencode(
        {"query": "loopwatch_loop_events_total", "start": now - 3600, "end": now + 60}
    )
    data = http_json(url)["data"]
    traces = {ex["labels"]["trace_id"] for series in data for ex in series.get("exemplars", [])}
    assert traces & {e["trace_id"] for e in loop_window.expected.events}, data


def test_tool_calls_under_a_hold_without_the_guard_raise_hold_not_enforced(
    loop_window: LoopWindow,
) -> None:
    """Issue 38: a hold on `get_export_status` (written to the worker's holds topic, as the
    API writes it), then an unguarded agent's calls of that tool: the worker counts them and
    the real Prometheus fires HoldNotEnforced with the tool's and version's labels."""
    from confluent_kafka import Producer

    from detectors.holds import Hold, Scope
    from tests.support.kafka import bootstrap

    stack = loop_window.stack
    assert stack is not None
    now = time.time_ns()
    hold = Hold("hold-e2e", Scope(tool="get_export_status"), "e2e", "e2e", now, now + 3600 * 10**9)
    producer = Producer({"bootstrap.servers": bootstrap()})
    producer.produce(
        stack.worker.topics["holds"], key=hold.id.encode(), value=json.dumps(hold.to_doc()).encode()
    )
    assert producer.flush(10) == 0
    wait_for(lambda: stack.worker.api("/holds")[1].get("holds"), 20, "the worker reading the hold")
    run = Run(trace=0xE2E38, prompt_version="e2e-held-v1")
    run.clock = run.start = time.time_ns() + 10**9  # the calls run now, under the hold
    for status in ("queued", "running"):
        run.tool("get_export_status", {"export_id": "x1"}, {"status": status})
    run.root()
    stack.worker.produce([keyed(encode_request(run.spans))])

    def firing() -> list[dict[str, Any]]:
        return [
            a
            for a in stack.prom_alerts()
            if a["labels"]["alertname"] == "HoldNotEnforced" and a["state"] == "firing"
        ]

    try:
        [alert] = wait_for(firing, TIMEOUT, "HoldNotEnforced firing in Prometheus")
    except BaseException:
        print(stack.diagnostics())
        raise
    assert alert["labels"]["tool_name"] == "get_export_status"
    assert alert["labels"]["prompt_version"] == "e2e-held-v1"
    assert alert["labels"]["severity"] == "page"


def test_finished_runs_stay_open_after_the_worker_restarts(loop_window: LoopWindow) -> None:
    """Last in this module: the worker restarts from its local state and changelogs."""
    stack = loop_window.stack
    assert stack is not None
    run_id = loop_window.expected.events[0]["run_id"]
    before = loopwatch(stack, ["query", "run", run_id, "--json"])
    assert before.returncode == 0, before.stderr
    assert stack.worker.stop() == 0
    stack.worker.start()
    stack.worker.wait_ready()
    after = loopwatch(stack, ["query", "run", run_id, "--json"])
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["summary"] == json.loads(before.stdout)["summary"]
