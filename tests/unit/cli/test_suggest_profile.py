"""`loopwatch inspect --suggest-profile`: a starter profile read off spans no profile
recognized. Two invented layouts (no framework's names: a scope, span names and keys made
up here) whose tool calls nothing reads before; the suggested profile, used as written,
makes their loops visible."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from streams.cli.main import main
from streams.replay.files import write_pb
from streams.spanpath.spans import STATUS_OK, SpanRecord
from tests.otlp_build import encode_request
from tests.paths import REPO

MS = 1_000_000
BASE = 1_790_000_000 * 1_000_000_000


def run_spans(
    trace: int, scope: str, model: dict[str, Any], tool: Any, calls: int
) -> list[SpanRecord]:
    """A root, then `calls` times a model turn and the same tool call (a loop)."""
    trace_id = f"{trace:032x}"
    root_id = f"{trace:04x}{0:012x}"
    resource = {"service.name": "invented-agent"}
    spans: list[SpanRecord] = []
    clock = BASE + trace * 10_000 * MS
    start = clock
    for i in range(calls):
        for name, attrs in (("think", model), tool(i)):
            clock += 20 * MS
            spans.append(
                SpanRecord(
                    trace_id,
                    f"{trace:04x}{len(spans) + 1:012x}",
                    root_id,
                    name,
                    1,
                    clock,
                    clock + 10 * MS,
                    STATUS_OK,
                    "",
                    attrs,
                    resource,
                    [],
                    scope,
                )
            )
            clock += 10 * MS
    spans.append(
        SpanRecord(
            trace_id,
            root_id,
            None,
            "session",
            1,
            start,
            clock + 5 * MS,
            STATUS_OK,
            "",
            {"agent": "helper"},
            resource,
            [],
            scope,
        )
    )
    return spans


def keyed_layout(i: int) -> tuple[str, dict[str, Any]]:
    return "act", {
        "zz.tool": "lookup_order",
        "zz.tool.input": json.dumps({"order_id": "A1"}),
        "zz.tool.output": json.dumps({"status": "shipped"}),
        "zz.tool.callId": f"call-{i}",
    }


def named_layout(i: int) -> tuple[str, dict[str, Any]]:
    return "invoke:lookup_order", {
        "payload.arguments": json.dumps({"order_id": "A1"}),
        "payload.result": json.dumps({"status": "shipped"}),
    }


LAYOUTS = {
    "keyed": (
        "zz.agentkit",
        {"zz.usage.prompt_tokens": 120, "zz.usage.completion_tokens": 30},
        keyed_layout,
    ),
    "named": ("qq-runtime", {"qq.tokens.input": 80, "qq.tokens.output": 20}, named_layout),
}


@pytest.fixture(params=sorted(LAYOUTS))
def export(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    scope, model, tool = LAYOUTS[request.param]
    spans = run_spans(7, scope, model, tool, 4) + run_spans(8, scope, model, tool, 1)
    path = tmp_path / f"{request.param}.pb"
    write_pb(path, [encode_request(spans)])
    return path


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def policy_file(tmp_path: Path, profiles: dict[str, Any] | None = None) -> str:
    raw = {"tools": {"lookup_order": {"identity": ["order_id"]}}}
    if profiles:
        raw["profiles"] = profiles
    path = tmp_path / ("policy-suggested.yaml" if profiles else "policy.yaml")
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_suggested_profile_makes_an_invented_layouts_loops_visible(
    export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = policy_file(tmp_path)
    rc, out, _ = cli(capsys, "replay", "--config", plain, str(export))
    assert rc == 0 and out == ""  # before: no tool call seen, no loop
    rc, out, _ = cli(capsys, "inspect", "--config", plain, str(export))
    assert " tool " not in out

    rc, suggestion, err = cli(
        capsys, "inspect", "--config", plain, "--suggest-profile", str(export)
    )
    assert rc == 0, err
    assert suggestion.startswith("# A starter profile read off")
    profiles = yaml.safe_load(suggestion)["profiles"]
    [(name, body)] = profiles.items()
    assert name.endswith("_suggested") and body["extends"] == "generic"
    assert "A1" not in suggestion and "shipped" not in suggestion  # keys and names, never values

    with_profile = policy_file(tmp_path, profiles)
    rc, out, _ = cli(capsys, "inspect", "--config", with_profile, str(export))
    tool_lines = [line for line in out.splitlines() if " tool " in line]
    assert len(tool_lines) == 5 and all(f"[{name}/" in line for line in tool_lines)
    assert all("name=lookup_order" in line and "action_fp=" in line for line in tool_lines)
    assert sum(" llm " in line for line in out.splitlines()) == 5
    rc, out, _ = cli(capsys, "replay", "--config", with_profile, str(export))
    events = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and {(e["shape"], e["tool_name"], e["run_id"][-1]) for e in events} == {
        ("identical_repetition", "lookup_order", "7")
    }


def test_nothing_to_read_off_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spans = run_spans(9, "ww", {"ww.note": "x"}, lambda i: ("step", {"ww.what": "y"}), 2)
    path = tmp_path / "opaque.pb"
    write_pb(path, [encode_request(spans)])
    rc, out, err = cli(
        capsys, "inspect", "--config", policy_file(tmp_path), "--suggest-profile", str(path)
    )
    assert rc == 1 and out == ""
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "loopwatch: nothing to suggest from 4 unrecognized spans: no attribute holds a tool"
        )
    )


def test_wrapper_spans_alone_suggest_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """The example's LangChain chain spans ("agent", "tools") are wrappers: no tool is named
    on them, so nothing is suggested (exit 1), and a fully read export suggests nothing
    either (exit 0)."""
    policy = str(REPO / "examples" / "loopwatch.yaml")
    clean = str(REPO / "examples" / "negative__clean_run.jsonl")
    rc, out, err = cli(capsys, "inspect", "--config", policy, "--suggest-profile", clean)
    assert (rc, out) == (1, "") and "nothing to suggest from 7 unrecognized spans" in err
    pb = str(REPO / "examples" / "identical_repetition__lookup_order.pb")
    rc, out, err = cli(capsys, "inspect", "--config", policy, "--suggest-profile", pb)
    assert (rc, out) == (0, "") and err.startswith("loopwatch: nothing to suggest: every one of")
