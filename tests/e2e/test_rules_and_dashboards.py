"""Rules, Alertmanager config and the Grafana dashboard against the real Prometheus tools.

Needs promtool, prometheus, amtool and alertmanager (Debian: prometheus,
prometheus-alertmanager; `scripts/install-tools.sh` installs them). A missing binary is a
failure, never a skip.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

from alerts.metrics import Metrics
from tests.e2e.prom_support import binary, http_json, query, stop_process, wait_for
from tests.support.worker_proc import free_port

pytestmark = pytest.mark.prometheus

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "rules" / "loopwatch.rules.yml"
RULE_TESTS = REPO / "alerts" / "rules" / "loopwatch.rules.test.yml"
AM_CONFIG = REPO / "alerts" / "alertmanager" / "alertmanager.yml"
DASHBOARD = REPO / "alerts" / "grafana" / "dashboards" / "loopwatch.json"
DATASOURCES = REPO / "alerts" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"

MAIN_PANEL = "Loop rate by prompt_version"

# Grafana's template variables, as an instant/range query over a short test window sees them
TEMPLATE_VARS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "5m",
    "$prompt_version": ".*",
    "$shape": ".*",
}


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def load_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_targets() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                out.append((inner, target))
    return out


def substitute(expr: str) -> str:
    # longest names first: $__rate_interval before $__range etc.
    for name in sorted(TEMPLATE_VARS, key=len, reverse=True):
        expr = expr.replace(name, TEMPLATE_VARS[name])
    assert "$" not in expr, f"unsubstituted template variable in {expr!r}"
    return expr


# ---------------------------------------------------------------------------------------
# promtool


def test_promtool_check_rules() -> None:
    res = run([binary("promtool"), "check", "rules", str(RULES)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_promtool_test_rules() -> None:
    res = run([binary("promtool"), "test", "rules", str(RULE_TESTS)], cwd=RULE_TESTS.parent)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_every_alert_has_a_firing_and_a_quiet_promtool_case() -> None:
    alerts = {rule["alert"] for rule in load_rules() if "alert" in rule}
    assert {
        "LoopRateHigh",
        "DuplicateSideEffect",
        "LoopRateSurge",
        "LoopwatchPipelineStalled",
        "LoopwatchDeadLetters",
        "LoopwatchIncompleteTraces",
    } <= alerts
    fires: set[str] = set()
    quiet: set[str] = set()
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
            for alert in case.get("exp_alerts") or []:
                # exact expectations: labels and every annotation
                assert alert["exp_labels"]["severity"] in {"page", "ticket"}
                assert set(alert["exp_annotations"]) >= {"summary", "description", "query"}
    assert alerts - fires == set(), "alerts without a firing test"
    assert alerts - quiet == set(), "alerts without a quiet test"


def test_alert_rules_carry_severity_and_on_call_annotations() -> None:
    for rule in load_rules():
        if "alert" not in rule:
            continue
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"page", "ticket"}, name
        ann = rule["annotations"]
        for key in ("summary", "description", "query", "runbook", "dashboard"):
            assert ann.get(key), f"{name}: missing annotation {key}"
        assert ann["query"].startswith("loopwatch query "), name
        assert ann["dashboard"].startswith("/d/loopwatch/"), name
    severities = {r["alert"]: r["labels"]["severity"] for r in load_rules() if "alert" in r}
    assert severities["DuplicateSideEffect"] == "page"
    assert severities["LoopwatchIncompleteTraces"] == "ticket"


# ---------------------------------------------------------------------------------------
# Alertmanager


def test_amtool_check_config() -> None:
    res = run([binary("amtool"), "check-config", str(AM_CONFIG)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (
            ["alertname=DuplicateSideEffect", "severity=page", "shape=duplicate_side_effect"],
            "loopwatch-pager",
        ),
        (
            [
                "alertname=LoopRateHigh",
                "severity=page",
                "shape=retry_storm",
                "prompt_version=v1",
                "tool_version=3",
            ],
            "loopwatch-pager",
        ),
        (
            [
                "alertname=LoopRateHigh",
                "severity=ticket",
                "shape=retry_storm",
                "prompt_version=v1",
                "tool_version=3",
            ],
            "loopwatch-ticket",
        ),
        (["alertname=LoopwatchPipelineStalled", "severity=page"], "loopwatch-pager"),
        (["alertname=LoopwatchIncompleteTraces", "severity=ticket"], "loopwatch-ticket"),
        (["alertname=SomethingElse"], "loopwatch-ticket"),
    ],
)
def test_amtool_routes(labels: list[str], receiver: str) -> None:
    res = run(
        [
            binary("amtool"),
            "config",
            "routes",
            "test",
            f"--config.file={AM_CONFIG}",
            f"--verify.receivers={receiver}",
            *labels,
        ]
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == receiver


def test_alertmanager_groups_by_slice() -> None:
    route = yaml.safe_load(AM_CONFIG.read_text())["route"]
    assert route["group_by"] == ["alertname", "shape", "prompt_version", "tool_version"]


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    exe = binary("alertmanager", "prometheus-alertmanager")
    port = free_port()
    log = (tmp_path / "alertmanager.log").open("wb")
    proc = subprocess.Popen(
        [exe, f"--config.file={AM_CONFIG}", f"--storage.path={tmp_path / 'am'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
         "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: urllib.request.urlopen(f"{base}/-/ready", timeout=1).status == 200,
            30,
            "alertmanager /-/ready",
        )
        yield base
    finally:
        stop_process(proc)
        log.close()


def _alert(name: str, **labels: str) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {
        "labels": {"alertname": name, **labels},
        "annotations": {"summary": name},
        "startsAt": now.isoformat(),
        "endsAt": (now + timedelta(hours=1)).isoformat(),
    }


def _states(base: str) -> dict[str, str]:
    """alert key -> active | suppressed (only our keys)."""
    out = {}
    for a in http_json(f"{base}/api/v2/alerts"):
        key = a["labels"].get("key")
        if key:
            out[key] = a["status"]["state"]
    return out


def wait_states(base: str, expected: dict[str, str], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    got: dict[str, str] = {}
    while time.monotonic() < deadline:
        got = _states(base)
        if got == expected:
            return
        time.sleep(0.25)
    assert got == expected, "alert states after inhibition"


def test_alertmanager_inhibition(alertmanager: str) -> None:
    slice_v1 = {
        "shape": "retry_storm",
        "prompt_version": "v1",
        "tool_name": "get_status",
        "tool_version": "3",
    }
    alerts = [
        _alert("LoopRateHigh", key="page-v1", severity="page", scope="slice", **slice_v1),
        _alert("LoopRateHigh", key="ticket-v1", severity="ticket", scope="slice", **slice_v1),
        _alert("LoopRateSurge", key="surge-v1", severity="ticket", scope="slice", **slice_v1),
        _alert("LoopRateHigh", key="prompt-v1", severity="ticket", scope="prompt_version",
               prompt_version="v1"),
        _alert("LoopRateHigh", key="prompt-v2", severity="ticket", scope="prompt_version",
               prompt_version="v2"),
        _alert("LoopRateHigh", key="ticket-v3", severity="ticket", scope="slice",
               shape="oscillation", prompt_version="v3", tool_name="lookup_order",
               tool_version="1"),
        _alert("DuplicateSideEffect", key="dup", severity="page", shape="duplicate_side_effect",
               prompt_version="v1", tool_name="issue_refund", tool_version="2"),
    ]  # fmt: skip
    http_json(f"{alertmanager}/api/v2/alerts", alerts)
    expected = {
        "page-v1": "active",
        "ticket-v1": "suppressed",  # the page of the same slice
        "surge-v1": "suppressed",  # the page of the same slice
        "prompt-v1": "suppressed",  # a slice of v1 explains it
        "prompt-v2": "active",  # nothing explains it
        "ticket-v3": "active",  # no page for that slice
        "dup": "active",
    }
    wait_states(alertmanager, expected)

    # a version worse than the one it replaced explains the plain loop-rate alerts of
    # that version: a prompt_version's, or a tool version's (never a side-effect page)
    http_json(
        f"{alertmanager}/api/v2/alerts",
        [_alert("LoopRateRegression", key="regress-v2", severity="page", kind="prompt",
                version="v2", prompt_version="v2", previous_version="v1", tool_name="unknown"),
         _alert("LoopRateRegression", key="regress-tool", severity="page", kind="tool",
                tool_name="lookup_order", version="1", tool_version="1", previous_version="0")],
    )  # fmt: skip
    expected |= {
        "prompt-v2": "suppressed",
        "ticket-v3": "suppressed",
        "regress-v2": "active",
        "regress-tool": "active",
    }
    wait_states(alertmanager, expected)

    # a stalled pipeline holds back every loop-rate alert, never a side-effect page
    http_json(
        f"{alertmanager}/api/v2/alerts",
        [_alert("LoopwatchPipelineStalled", key="stall", severity="page", job="loopwatch",
                instance="w1:9464", topic="otlp_spans")],
    )  # fmt: skip
    expected = {k: "suppressed" for k in expected} | {"dup": "active", "stall": "active"}
    wait_states(alertmanager, expected)


# ---------------------------------------------------------------------------------------
# Grafana dashboard and provisioning


def test_dashboard_is_a_provisionable_grafana_dashboard() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 38
    assert dash["uid"] == "loopwatch"  # the alert annotations link to /d/loopwatch/
    ds_uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"prompt_version", "shape"} <= set(variables)
    for v in variables.values():
        assert v["datasource"]["uid"] == ds_uid
        assert re.fullmatch(r"label_values\(\w+, *\w+\)", v["definition"]), v["definition"]

    # the loop panels show the counters' exemplars, linked to the trace by the datasource
    loop_series = [
        t for p in dash["panels"] if p["type"] == "timeseries" for t in p["targets"]
        if "loopwatch_loop_events_total" in t["expr"]
    ]  # fmt: skip
    assert loop_series and all(t.get("exemplar") is True for t in loop_series)
    [prom] = [
        d for d in yaml.safe_load(DATASOURCES.read_text())["datasources"] if d["uid"] == ds_uid
    ]
    [link] = prom["jsonData"]["exemplarTraceIdDestinations"]
    assert link["name"] == "trace_id" and "${__value.raw}" in link["url"].replace("$$", "$")

    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    titles = {p["title"] for p in dash["panels"]}
    for wanted in [MAIN_PANEL, "Loop rate by shape", "Loop rate by tool and tool_version",
                   "Top looping tools (range)", "Wasted steps by shape",
                   "Wasted tokens by shape and tool", "Runs finished by termination reason",
                   "Consumed per second", "Dead letters, decode errors, publish retries, failed runs",
                   "Late, after-finalize and duplicate spans", "Active and evicted runs",
                   "Consumer lag",
                   "Processing latency"]:  # fmt: skip
        assert wanted in titles, wanted

    # no two panels overlap on the 24-column grid
    cells: dict[tuple[int, int], str] = {}
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]

    targets = dashboard_targets()
    assert len(targets) >= 20
    for panel, target in targets:
        assert panel["datasource"]["uid"] == ds_uid, panel["title"]
        assert target["datasource"]["uid"] == ds_uid, panel["title"]
        assert target["expr"].strip(), panel["title"]
    # the loop-rate panels honour both template variables
    main = next(t for p, t in targets if p["title"] == MAIN_PANEL)
    assert "$prompt_version" in main["expr"] and "$shape" in main["expr"]


# ---------------------------------------------------------------------------------------
# A real Prometheus: rules loaded, scraping alerts.metrics.Metrics


class FakeWorker:
    """A prometheus_client HTTP server exposing Metrics fed like the worker would feed it."""

    def __init__(self) -> None:
        self.metrics = Metrics(CollectorRegistry(), label_cap=50)
        self.port = free_port()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, daemon=True)
        self.server, self.server_thread = start_http_server(
            self.port, addr="127.0.0.1", registry=self.metrics.registry
        )

    def _feed(self) -> None:
        m = self.metrics
        i = 0
        while not self._stop.is_set():
            i += 1
            pv = "support-v12" if i % 2 else "support-v13"
            m.observe_run(
                {"outcome": "complete" if i % 7 else "incomplete_trace",
                 "termination_reason": "final_answer" if i % 5 else "turn_limit",
                 "prompt_version": pv, "steps": 3 + i % 11,
                 "shapes": ["identical_repetition"] if i % 3 == 0 else []}
            )  # fmt: skip
            if i % 3 == 0:
                m.observe_event(
                    {"shape": ["identical_repetition", "retry_storm", "oscillation"][(i // 3) % 3],
                     "severity": "warning", "prompt_version": pv,
                     "tool_name": ["lookup_order", "get_export_status"][i % 2],
                     "tool_version": "3", "wasted_steps": 2, "wasted_tokens": 800}
                )  # fmt: skip
            if i % 10 == 0:
                m.observe_event(
                    {"shape": "duplicate_side_effect", "severity": "critical",
                     "prompt_version": pv, "tool_name": "issue_refund", "tool_version": "2",
                     "wasted_steps": 1, "wasted_tokens": 300}
                )  # fmt: skip
            m.record_consumed("otlp_spans", spans=40 + i % 30, latency_seconds=0.002 * (i % 20))
            m.duplicate_spans.inc(i % 2)
            m.late_spans.inc(i % 3 == 0)
            m.spans_after_finalize.inc(i % 4 == 0)
            m.active_runs.set(10 + i % 5)
            m.set_consumer_lag("otlp_spans", i % 4, 100 - i % 50)
            if i % 25 == 0:
                m.dead_letter("decode_error")
                m.decode_error("truncated_protobuf")
                m.run_evicted("idle_timeout")
            self._stop.wait(0.05)

    def start(self) -> FakeWorker:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exe = binary("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    worker = FakeWorker().start()
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "loopwatch",
             "static_configs": [{"targets": [f"127.0.0.1:{worker.port}"]}]}
        ],
    }  # fmt: skip
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_for(
                lambda: proc.poll() is None
                and urllib.request.urlopen(f"{base}/-/ready", timeout=1).status == 200,
                60, "prometheus /-/ready",
            )  # fmt: skip
        except BaseException:
            log.flush()
            print((tmp / "prometheus.log").read_text(errors="replace")[-4000:])
            raise
        yield base
    finally:
        stop_process(proc)
        log.close()
        worker.close()


def query_range(base: str, expr: str) -> dict[str, Any]:
    end = time.time()
    params = {"query": expr, "start": end - 30, "end": end, "step": "1s"}
    url = f"{base}/api/v1/query_range?" + urllib.parse.urlencode(params)
    try:
        return http_json(url)  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"{}") | {"status": "error", "http": exc.code}


def test_prometheus_executes_every_panel_and_rule(prometheus: str) -> None:
    targets = dashboard_targets()
    main = substitute(next(t["expr"] for p, t in targets if p["title"] == MAIN_PANEL))
    # enough scrapes for rate() over the loop-rate panel, and the recording rules evaluated
    wait_for(lambda: query(prometheus, main)["data"]["result"], 60,
             "a non-empty result from the main loop-rate panel")  # fmt: skip
    wait_for(
        lambda: query(prometheus, "shape_prompt_version_tool:loopwatch_loop_rate:ratio_rate5m")
        ["data"]["result"],
        30, "recorded slice loop rates",
    )  # fmt: skip

    failures = []
    for panel, target in targets:
        expr = substitute(target["expr"])
        res = query(prometheus, expr)
        if res.get("status") != "success":
            failures.append(f"panel {panel['title']!r}: {expr}\n  -> {res}")
        if target.get("range", True):
            res = query_range(prometheus, expr)
            if res.get("status") != "success":
                failures.append(f"panel {panel['title']!r} (range): {expr}\n  -> {res}")
    for rule in load_rules():
        name = rule.get("record") or rule.get("alert")
        res = query(prometheus, rule["expr"])
        if res.get("status") != "success":
            failures.append(f"rule {name}: {rule['expr']}\n  -> {res}")
    assert not failures, "\n".join(failures)

    result = query(prometheus, main)["data"]["result"]
    by_pv = {r["metric"]["prompt_version"]: float(r["value"][1]) for r in result}
    assert set(by_pv) == {"support-v12", "support-v13"}
    assert all(v > 0 for v in by_pv.values()), by_pv


def test_prometheus_rule_groups_evaluate_without_errors(prometheus: str) -> None:
    expected = {r.get("record") or r.get("alert") for r in load_rules()}

    def healthy() -> list[dict[str, Any]] | None:
        groups = http_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if not rules or any(r.get("lastEvaluation", "").startswith("0001") for r in rules):
            return None  # not evaluated yet
        return rules

    rules = wait_for(healthy, 30, "every rule evaluated once")
    assert {r["name"] for r in rules} == expected
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad


def test_template_variables_resolve(prometheus: str) -> None:
    dash = json.loads(DASHBOARD.read_text())
    for var in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((\w+), *(\w+)\)", var["definition"])
        assert m, var["definition"]
        metric, label = m.groups()
        url = f"{prometheus}/api/v1/label/{label}/values?" + urllib.parse.urlencode(
            {"match[]": metric}
        )
        values = wait_for(lambda url=url: http_json(url)["data"], 30, f"values of ${label}")
        assert values, var["name"]
    # the values the fake worker exposed
    pv_url = f"{prometheus}/api/v1/label/prompt_version/values?" + urllib.parse.urlencode(
        {"match[]": "loopwatch_runs_finished_total"}
    )
    assert set(http_json(pv_url)["data"]) == {"support-v12", "support-v13"}


def test_pipeline_panels_see_the_worker_metrics(prometheus: str) -> None:
    """Not only parse: the health metrics the worker exports reach the pipeline panels."""
    for expr in [
        "sum(rate(loopwatch_records_consumed_total[1m]))",
        "sum(rate(loopwatch_spans_consumed_total[1m]))",
        "sum(loopwatch_consumer_lag)",
        "histogram_quantile(0.99, sum by (le) (rate(loopwatch_processing_latency_seconds_bucket[1m])))",
        "loopwatch_last_processed_timestamp_seconds",
        "loopwatch_active_runs",
    ]:
        result = wait_for(lambda expr=expr: query(prometheus, expr)["data"]["result"], 30, expr)
        assert float(result[0]["value"][1]) > 0, expr
    up = query(prometheus, 'up{job="loopwatch"}')["data"]["result"]
    assert up and up[0]["value"][1] == "1"
    # the fake worker's first duplicate_side_effect event reaches the page alert
    alerts = wait_for(
        lambda: [a for a in http_json(f"{prometheus}/api/v1/alerts")["data"]["alerts"]
                 if a["labels"]["alertname"] == "DuplicateSideEffect"],
        30, "DuplicateSideEffect in /api/v1/alerts",
    )  # fmt: skip
    assert alerts[0]["labels"]["severity"] == "page"
    assert alerts[0]["labels"]["tool_name"] == "issue_refund"
