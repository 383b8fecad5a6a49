"""Two layouts no profile names, recorded with the OpenTelemetry SDK
(tests/fixtures/unnamed/record.py), replayed with a policy that names no profile:

- tool calls under camelCase keys (`<x>.toolCall.toolName`, `<x>.toolName`, `toolCallId`,
  `args` / `arguments`, `result` / `output`) are read by the generic fallback;
- the agent's step limit inside a JSON value (a positional-argument object, an input's kwargs)
  is the run's declared limit: a run cut at it ends `turn_limit` (evidence `inferred`),
  although the framework then asked the model for a final answer.

Every expectation comes from the fixture's facts (what the scripted agent did) and the
documented rules: identical_repetition fires at the 3rd identical call (allowed_repeats 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from detectors.policy import policy_from_mapping
from streams.cli.main import main
from streams.replay.files import iter_payloads
from tests.otlp_build import replay_messages
from tests.paths import FIXTURES as ALL_FIXTURES

FIXTURES = ALL_FIXTURES / "unnamed"
POLICY = {"tools": {"lookup_order": {"identity": ["order_id"]}}}
NAMES = sorted(p.name.split(".")[0] for p in FIXTURES.glob("*.pb"))
# where each layout declares its limit, as `inspect` names it
LIMIT_FROM = {"camel": "acme.agent.argument.1:maxSteps", "kwargs": "input.value:kwargs.max_steps"}


def facts(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.facts.json").read_text(encoding="utf-8"))


def replay(name: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    messages = [p.data for p in iter_payloads([FIXTURES / f"{name}.pb"])]
    events, summaries = replay_messages(messages, policy_from_mapping(POLICY))
    (summary,) = summaries
    return events, summary


def test_both_layouts_and_every_scenario_are_recorded() -> None:
    assert (
        sorted(f"{layout}__{s}" for layout in LIMIT_FROM for s in ("clean", "limit_cut", "loop"))
        == NAMES
    )


@pytest.mark.parametrize("name", NAMES)
def test_every_tool_call_is_a_step(name: str) -> None:
    want = facts(name)
    _events, summary = replay(name)
    assert summary["tool_calls"] == len(want["tool_calls"]), summary
    assert summary["steps"] == len(want["tool_calls"]) + want["model_turns"], summary
    assert summary["tokens"] == 120 * want["model_turns"], summary  # 100 in, 20 out a turn


@pytest.mark.parametrize("layout", sorted(LIMIT_FROM))
def test_the_loop_is_found_at_its_trigger(layout: str) -> None:
    want = facts(f"{layout}__loop")
    events, _summary = replay(f"{layout}__loop")
    assert [(e["shape"], e["tool_name"]) for e in events] == [
        ("identical_repetition", "lookup_order")
    ]
    assert events[0]["trigger_span_id"] == want["tool_calls"][2]["span_id"]


@pytest.mark.parametrize("layout", sorted(LIMIT_FROM))
def test_the_run_cut_at_its_limit_ended_at_it(layout: str) -> None:
    name = f"{layout}__limit_cut"
    assert facts(name)["ended_by"] == "step limit"
    events, summary = replay(name)
    assert events == []  # four different orders: legitimate work
    assert (summary["termination_reason"], summary["termination_evidence"]) == (
        "turn_limit",
        "inferred",
    )


@pytest.mark.parametrize("layout", sorted(LIMIT_FROM))
def test_the_clean_run_is_silent(layout: str) -> None:
    events, summary = replay(f"{layout}__clean")
    assert events == []
    assert summary["termination_reason"] == "final_answer"


@pytest.mark.parametrize("layout", sorted(LIMIT_FROM))
def test_inspect_labels_the_tool_keys_and_says_where_the_limit_was_read(
    layout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    name = f"{layout}__limit_cut"
    assert main(["inspect", "--config", str(policy), str(FIXTURES / f"{name}.pb")]) == 0
    lines = capsys.readouterr().out.splitlines()
    tools = [line for line in lines if " tool " in line]
    assert len(tools) == len(facts(name)["tool_calls"]), lines
    assert all("/generic-fallback]" in line and "name=lookup_order" in line for line in tools)
    assert all("call_id=call_" in line for line in tools)
    (root,) = [line for line in lines if " agent " in line]
    assert f"limit=4  limit_counts=llm  limit_from={LIMIT_FROM[layout]}" in root, root
