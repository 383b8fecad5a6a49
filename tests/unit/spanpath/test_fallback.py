"""The generic fallback (streams/spanpath/fallback.py): spans in layouts no profile names,
read by what they carry. Three invented layouts (scopes, span names and namespaces made up
here, not recorded from any framework): before the fallback their tool calls are invisible
and their loops too; with it, every tool call and model turn is a step, `inspect` says
which spans the fallback read, and the loop is found. A profile's own rules still come
first, an explicit `kind: other` included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from detectors.fingerprint import Fingerprinter
from detectors.policy import policy_from_mapping
from streams.cli.main import main
from streams.replay.files import write_pb
from streams.spanpath import fallback
from streams.spanpath.normalize import Normalizer
from tests.otlp_build import encode_request
from tests.unit.cli.test_suggest_profile import run_spans

POLICY = {"tools": {"lookup_order": {"identity": ["order_id"]}}}
ARGS = json.dumps({"order_id": "A7"})
RESULT = json.dumps({"status": "pending"})


def genai_own_operations(i: int) -> tuple[str, dict[str, Any]]:
    """GenAI keys for the tool, the framework's own operation names and keys beside them."""
    return "acme.step.act", {
        "gen_ai.operation.name": "acme_invoke_tool",
        "gen_ai.tool.name": "lookup_order",
        "gen_ai.tool.input": ARGS,
        "gen_ai.tool.output": RESULT,
        "acme.step.index": i,
    }


def namespaced(i: int) -> tuple[str, dict[str, Any]]:
    """GenAI-style keys under another namespace."""
    return f"zz:call#{i}", {
        "zz.tool.name": "lookup_order",
        "zz.tool.input": ARGS,
        "zz.tool.output": RESULT,
        "zz.tool.call.id": f"c{i}",
    }


def json_input_output(i: int) -> tuple[str, dict[str, Any]]:
    """The content as JSON under plain `input` / `output`."""
    return "work", {"qq.tool_name": "lookup_order", "input": ARGS, "output": RESULT}


LAYOUTS = {
    "genai_own_operations": (
        "acme.flow",
        {
            "gen_ai.operation.name": "acme_think",
            "gen_ai.request.model": "m-1",
            "gen_ai.usage.input_tokens": 100,
            "gen_ai.usage.output_tokens": 20,
        },
        genai_own_operations,
    ),
    "namespaced": (
        "zz.kit",
        {
            "zz.request.model": "m-2",
            "zz.usage.prompt_tokens": 120,
            "zz.usage.completion_tokens": 30,
        },
        namespaced,
    ),
    "json_input_output": (
        "qq-runtime",
        {"qq.response.model": "m-3", "qq.finish_reason": "tool_calls"},
        json_input_output,
    ),
}


def spans_of(layout: str) -> list[Any]:
    scope, model, tool = LAYOUTS[layout]
    # run 7 calls the same lookup four times (a loop), run 8 once
    return run_spans(7, scope, model, tool, 4) + run_spans(8, scope, model, tool, 1)


def kinds(layout: str, *, with_fallback: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Steps by kind, as the Python span path reads the layout."""
    with monkeypatch.context() as m:
        if not with_fallback:
            m.setattr(fallback, "classify", lambda attrs: None)
        normalizer = Normalizer(policy_from_mapping(POLICY), Fingerprinter(b"k"))
        out: dict[str, int] = {}
        for span in spans_of(layout):
            step = normalizer.step(span)
            out[step.kind] = out.get(step.kind, 0) + 1
        return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_invented_layout_is_read_by_what_its_spans_carry(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = kinds(layout, with_fallback=False, monkeypatch=monkeypatch)
    after = kinds(layout, with_fallback=True, monkeypatch=monkeypatch)
    assert before.get("tool", 0) == 0 and before.get("llm", 0) == 0, before
    assert after == {"tool": 5, "llm": 5, "agent": 2}, after  # (the two roots: agents)

    export = tmp_path / f"{layout}.pb"
    write_pb(export, [encode_request(spans_of(layout))])
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    assert main(["inspect", "--config", str(policy), str(export)]) == 0
    lines = capsys.readouterr().out.splitlines()
    tools = [line for line in lines if " tool " in line]
    assert len(tools) == 5 and all("/generic-fallback]" in line for line in tools), lines
    assert all("name=lookup_order" in line and "action_fp=" in line for line in tools)
    assert all("/generic-fallback]" in line for line in lines if " llm " in line)

    assert main(["replay", "--config", str(policy), str(export)]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["shape"], e["tool_name"], e["run_id"][-1]) for e in events] == [
        ("identical_repetition", "lookup_order", "7")
    ]
    assert events[0]["evidence"].get("result_observed") is not False


def test_the_fallback_reads_a_model_turns_tokens_and_model() -> None:
    normalizer = Normalizer(policy_from_mapping(POLICY), Fingerprinter(b"k"))
    steps = [normalizer.step(s) for s in spans_of("namespaced")]
    turn = next(s for s in steps if s.kind == "llm")
    assert (turn.input_tokens, turn.output_tokens, turn.model) == (120, 30, "m-2")
    call = next(s for s in steps if s.kind == "tool")
    assert call.call_id == "c0" and call.result_fp is not None


@pytest.mark.parametrize(
    ("attrs", "kind"),
    [
        ({"zz.tool.name": "t", "zz.usage.input_tokens": 3}, "llm"),  # tokens: a model turn
        ({"zz.tool.name": ""}, None),  # an empty name is no name
        ({"zz.tool.name": 7}, None),  # nor a number
        ({"zz.tool": "t"}, None),  # a key that only starts like one
        ({"input": '{"q": 1}', "output": "[]"}, None),  # content without a tool name
        ({"tool.name": "t", "input": "plain text"}, "tool"),  # `input` not JSON: not read
    ],
)
def test_what_makes_a_span_a_step(attrs: dict[str, Any], kind: str | None) -> None:
    found = fallback.classify(attrs)
    assert (found[0] if found else None) == kind
    if attrs.get("input") == "plain text":
        assert found is not None and "arguments" not in found[1]


def test_an_explicit_kind_other_rule_keeps_the_fallback_away(tmp_path: Path) -> None:
    """A profile that says a span is no step (a wrapper around a model turn) is obeyed."""
    spans = spans_of("namespaced")
    profile = {
        "when": {"scope": ["zz.kit"]},
        "extends": "generic",
        "kinds": [{"kind": "other", "match": {"name": "think"}}],
    }
    policy = policy_from_mapping({**POLICY, "profiles": {"zz": profile}})
    normalizer = Normalizer(policy, Fingerprinter(b"k"))
    steps = [normalizer.step(s) for s in spans]
    assert sum(s.kind == "llm" for s in steps) == 0 and sum(s.kind == "tool" for s in steps) == 5


# ------------------------------------------------------------------ limits and loops at the end


def limited_run(trace: int, limit_attrs: dict[str, Any], turns: int, answer: bool) -> list[Any]:
    """A run of `turns` model turns, each followed by the same lookup with the same result,
    then (answer) a final model turn; the root declares `limit_attrs` and ends OK."""
    scope, model, tool = LAYOUTS["namespaced"]
    spans = run_spans(trace, scope, model, tool, turns)
    root = spans[-1]
    root.attributes.update(limit_attrs)
    if answer:
        last = spans[-2]
        spans.insert(
            -1,
            type(last)(
                last.trace_id,
                f"{trace:04x}{999:012x}",
                last.parent_span_id,
                "think",
                1,
                last.end_ns + 5_000_000,
                last.end_ns + 9_000_000,
                last.status_code,
                "",
                dict(model),
                last.resource,
                [],
                scope,
            ),
        )
        root.end_ns = max(root.end_ns, last.end_ns + 10_000_000)
    return spans


def summary_of(spans: list[Any]) -> dict[str, Any]:
    from tests.otlp_build import replay_messages

    _events, summaries = replay_messages([encode_request(spans)], policy_from_mapping(POLICY))
    (summary,) = summaries
    return summary


@pytest.mark.parametrize(
    "attrs",
    [
        {"acme.agent.max_steps": 4},
        {"zz.maxTurns": 4},
        {"max_iterations": 4},
        {"run.config.recursion_limit": 8},  # model turns and tool calls together
        {"qq.max_tool_calls": 4},
    ],
)
def test_a_run_that_reached_its_declared_limit_ended_at_it(attrs: dict[str, Any]) -> None:
    summary = summary_of(limited_run(31, attrs, turns=4, answer=True))
    assert (summary["termination_reason"], summary["termination_evidence"]) == (
        "turn_limit",
        "inferred",
    )
    assert summary["terminal_response"] is False


@pytest.mark.parametrize(
    "attrs",
    [
        {"acme.agent.max_steps": 10},  # not reached
        {"acme.agent.max_steps": "4"},  # not an integer
        {"acme.agent.max_steps": True},
        {"acme.agent.min_steps": 4},  # names no limit
        {},
    ],
)
def test_no_limit_reached_no_inferred_limit(attrs: dict[str, Any]) -> None:
    summary = summary_of(limited_run(32, attrs, turns=4, answer=True))
    assert summary["termination_reason"] == "final_answer"


def test_a_final_answer_after_the_loops_repeated_results_ended_in_the_loop() -> None:
    looped = summary_of(limited_run(33, {}, turns=4, answer=True))
    assert looped["shapes"] == ["identical_repetition"]
    assert looped["termination_reason"] == "final_answer" and looped["ended_in_loop"] is True
    assert looped["stalled_repeat"] is True and looped["terminal_response"] is False
    # one lookup and an answer: no loop, a terminal response
    clean = summary_of(limited_run(34, {}, turns=1, answer=True))
    assert clean["ended_in_loop"] is False and clean["terminal_response"] is True
