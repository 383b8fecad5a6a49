"""Every alert's `query` annotation is a command that runs as written once Prometheus fills
in the alert's labels: it parses, passes loopwatch's checks, and asks the on-call API for
the alert's own slice (the label filters carry the labels)."""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import yaml

from streams.cli import query
from streams.cli.main import main
from tests.paths import REPO

RULES = REPO / "alerts" / "rules" / "loopwatch.rules.yml"
LABELS = {
    "shape": "retry_storm",
    "prompt_version": "support-v12",
    "tool_name": "get_export_status",
    "tool_version": "3",
    "instance": "worker-0:9464",
    "topic": "otlp_spans",
    "stage": "detect",
    "reason": "decode_error",
    "version": "support-v13",
    "previous_version": "support-v11",
    "service_name": "support-bot",
    "agent_name": "support",
}


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def render(template: str) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: LABELS[m.group(1)], template)


@pytest.mark.parametrize(
    "rule", alerts(), ids=[f"{r['alert']}-{i}" for i, r in enumerate(alerts())]
)
def test_the_query_annotation_runs_as_written(
    rule: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = shlex.split(render(rule["annotations"]["query"]))
    assert argv[:2] == ["loopwatch", "query"]
    asked: list[tuple[str, dict[str, str]]] = []

    def get(self: Any, path: str, params: Any = None) -> tuple[int, bytes, Any]:
        asked.append((path, dict(params or {})))
        if path == "/compare":
            side = {"runs": 0, "looping": 0, "wasted_steps": 0, "wasted_tokens": 0}
            side["duplicate_side_effects"] = 0
            doc = {"rows": [], "alpha": 0.05, "min_runs": 30, "kind": "prompt"}
            return 200, b"{}", {**doc, "baseline": {**side, "version": "b"}, "candidate": side}
        return 200, b"{}", {"rows": [], "by": [], "since": "1h"}

    monkeypatch.setattr(query.ApiClient, "get", get)
    assert main(argv[1:]) == 0, capsys.readouterr().err
    [(path, params)] = asked
    expr = rule["expr"]
    if "shape_prompt_version_tool:" in expr or "sum by (shape" in expr:
        # a slice's alert lists the runs behind its own slice
        assert path == "/episodes", rule["alert"]
        for label in ("shape", "prompt_version", "tool_name"):
            assert params[label] == LABELS[label], (rule["alert"], label)
    elif path == "/loops":  # the prompt-wide alert: its prompt_version broken down
        assert params["prompt_version"] == LABELS["prompt_version"]
    elif path == "/compare":  # a version against the one it replaced, where both ran
        assert params["baseline"] == LABELS["previous_version"], rule["alert"]
        assert LABELS["version"] in (params.get("prompt_version"), params.get("tool_version"))
        assert params["service_name"] == LABELS["service_name"]
        assert params["agent_name"] == LABELS["agent_name"]


def test_loop_alerts_ask_for_loops() -> None:
    loop_alerts = [
        r
        for r in alerts()
        if r["alert"] in {"LoopRateHigh", "LoopRateSurge", "DuplicateSideEffect"}
    ]
    assert loop_alerts
    for rule in loop_alerts:
        assert rule["annotations"]["query"].startswith("loopwatch query loops "), rule["alert"]


CONTAINED = [r for r in alerts() if "contain" in r["annotations"]]


@pytest.mark.parametrize(
    "rule", CONTAINED, ids=[f"{r['alert']}-{i}" for i, r in enumerate(CONTAINED)]
)
def test_the_contain_annotation_places_the_alerts_hold(
    rule: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 38: `contain` is `loopwatch hold add` with the alert's labels: it parses, passes
    the hold checks, and asks the API for a hold scoped by those labels."""
    from streams.cli.client import ApiClient

    argv = shlex.split(render(rule["annotations"]["contain"]))
    assert argv[:3] == ["loopwatch", "hold", "add"]
    sent: list[Any] = []

    def send(self: Any, method: str, path: str, params: Any = None, body: Any = None) -> Any:
        sent.append((method, path, body))
        hold = {"id": "hold-1", "by": body["by"], "expires_ns": 0}
        return 201, b"{}", {"hold": hold, "matches": "..."}

    monkeypatch.setattr(ApiClient, "send", send)
    assert main(argv[1:]) == 0, capsys.readouterr().err
    [(method, path, body)] = sent
    assert (method, path) == ("POST", "/holds")
    scope = {k: v for k, v in body["scope"].items() if v}
    labelled = {LABELS[k] for k in ("prompt_version", "tool_name", "version", "service_name")}
    assert set(scope.values()) <= labelled | {LABELS["agent_name"], LABELS["tool_version"]}
    assert scope and body["reason"]
