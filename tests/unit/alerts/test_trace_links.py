"""Trace links (LOOPWATCH_TRACE_URL): the template's checks, the links on events and run
summaries from both drivers, the settings' error, and the loop counter's exemplar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.openmetrics.exposition import generate_latest

from alerts.metrics import Metrics
from alerts.trace_links import TraceLinks
from detectors.errors import ConfigError
from streams.worker.settings import WorkerSettings
from tests.paths import REPO

GRAFANA = 'https://grafana.example/explore?left={"queries":[{"query":"{trace_id}"}]}&span={span_id}'


def test_placeholders_are_filled_and_other_braces_kept() -> None:
    links = TraceLinks.parse(GRAFANA)
    assert links is not None
    assert links.url("abc", "def") == (
        'https://grafana.example/explore?left={"queries":[{"query":"abc"}]}&span=def'
    )


def test_values_are_percent_encoded() -> None:
    links = TraceLinks.parse("https://langfuse.example/sessions/{run_id}")
    assert links is not None
    assert (
        links.url("t", None, "conv/7 a?b") == "https://langfuse.example/sessions/conv%2F7%20a%3Fb"
    )
    assert links.url(None) == "https://langfuse.example/sessions/"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("https://tempo.example/trace/{trace}", "unknown placeholder {trace}"),
        ("https://tempo.example/trace/", "no placeholder"),
        ("tempo.example/trace/{trace_id}", "expected an absolute URL"),
    ],
)
def test_an_unusable_template_is_one_line_naming_the_variable(template: str, message: str) -> None:
    with pytest.raises(
        ConfigError, match=f"^LOOPWATCH_TRACE_URL: .*{message.replace('{', '.').replace('}', '.')}"
    ):
        TraceLinks.parse(template)
    with pytest.raises(ConfigError, match="LOOPWATCH_TRACE_URL"):
        WorkerSettings.from_env({"LOOPWATCH_TRACE_URL": template})


def test_no_template_no_links() -> None:
    assert TraceLinks.parse("  ") is None
    assert WorkerSettings.from_env({}).trace_links is None
    assert WorkerSettings.from_env({"LOOPWATCH_TRACE_URL": GRAFANA}).trace_links == TraceLinks(
        GRAFANA
    )


def replay(tmp_path: Path, template: str | None) -> tuple[subprocess.CompletedProcess[str], Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWATCH_")}
    if template is not None:
        env["LOOPWATCH_TRACE_URL"] = template
    runs = tmp_path / "runs.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "streams.cli",
            "replay",
            "--runs",
            str(runs),
            str(REPO / "examples"),
        ],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, runs


def test_replay_events_and_summaries_carry_the_link(tmp_path: Path) -> None:
    proc, runs_file = replay(
        tmp_path, "https://tempo.example/trace/{trace_id}?span={span_id}&run={run_id}"
    )
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert events
    for event in events:
        assert event["trace_url"] == (
            f"https://tempo.example/trace/{event['trace_id']}?span={event['trigger_span_id']}"
            f"&run={event['run_id']}"
        )
    summaries = [json.loads(line) for line in runs_file.read_text().splitlines()]
    assert summaries
    for summary in summaries:
        assert summary["trace_url"] == (
            f"https://tempo.example/trace/{summary['trace_id']}?span=&run={summary['run_id']}"
        )


def test_without_the_setting_nothing_changes(tmp_path: Path) -> None:
    proc, runs_file = replay(tmp_path, None)
    assert proc.returncode == 0, proc.stderr
    assert "trace_url" not in proc.stdout and "trace_url" not in runs_file.read_text()


def test_a_bad_template_stops_the_replay_with_one_line(tmp_path: Path) -> None:
    proc, _ = replay(tmp_path, "https://tempo.example/{traceid}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "loopwatch: error: LOOPWATCH_TRACE_URL: unknown placeholder {traceid}; "
        "expected {trace_id}, {span_id}, {run_id}"
    )
    assert proc.stdout == ""


def test_the_loop_counter_carries_the_latest_events_trace_as_exemplar() -> None:
    metrics = Metrics()
    event = {
        "shape": "identical_repetition",
        "severity": "warning",
        "prompt_version": "v1",
        "tool_name": "lookup_order",
        "tool_version": "3",
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "wasted_steps": 1,
        "wasted_tokens": 10,
    }
    metrics.observe_event(event)
    metrics.observe_event({**event, "trace_id": "00f067aa0ba902b700f067aa0ba902b7"})
    text = generate_latest(metrics.registry).decode()
    [line] = [line for line in text.splitlines() if line.startswith("loopwatch_loop_events_total{")]
    assert '# {trace_id="00f067aa0ba902b700f067aa0ba902b7"} 1.0' in line
