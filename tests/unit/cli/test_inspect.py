"""`loopwatch inspect`: what loopwatch recognizes in export files, without raw content."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

from streams.cli.main import main
from tests.otlp_build import encode_request
from tests.unit.spanpath.test_framework_profiles import BY_STEM, spans_of

LOOP = BY_STEM["vercel_ai__limit_loop__legacy"]


def _write_pb(path: Path, message: bytes) -> None:
    path.write_bytes(struct.pack(">I", len(message)) + message)


def test_inspect_lists_each_span_as_what_it_was_recognized(capsys):
    assert main(["inspect", str(LOOP.path)]) == 0
    out = capsys.readouterr().out
    tool_lines = [line for line in out.splitlines() if " tool " in line]
    assert len(tool_lines) == len(LOOP.facts["tool_calls"]) == 5
    for line, call in zip(
        sorted(tool_lines),
        sorted(LOOP.facts["tool_calls"], key=lambda c: c["span_id"]),
        strict=True,
    ):
        assert line.split()[0] == call["span_id"]
        assert "name=lookup_order" in line and "[vercel_ai_legacy/" in line
        assert "action_fp=" in line and "result_fp=" in line
    assert "0 not recognized" in out
    # names, codes and digests only: the arguments and results never appear
    assert "A12" not in out and "delivered" not in out


def renamed_run(prefix: str) -> list[Any]:
    """The same run with every ai.* key, name and scope spelled `prefix`.*."""
    return [
        replace(
            s,
            name=s.name.replace("ai.", f"{prefix}.", 1),
            scope_name=prefix,
            attributes={k.replace("ai.", f"{prefix}.", 1): v for k, v in s.attributes.items()},
        )
        for s in spans_of(LOOP)
    ]


def test_a_renamed_framework_is_read_by_the_generic_fallback(tmp_path, capsys):
    # no profile reads scope acme.*: the fallback reads its spans by what they carry
    path = tmp_path / "acme.pb"
    _write_pb(path, encode_request(renamed_run("acme")))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "11 spans, 1 agent, 5 llm, 5 tool" in out
    tools = [line for line in out.splitlines() if " tool " in line]
    assert len(tools) == 5 and all("[generic/generic-fallback]" in line for line in tools)
    assert all("name=lookup_order" in line for line in tools)


def test_inspect_shows_why_an_unknown_framework_gives_no_steps(tmp_path, capsys):
    # the same run with its tool keys renamed beyond recognition (its model turns still
    # carry a model key: the fallback reads those)
    spans = [
        replace(
            s,
            attributes={
                k.replace("toolCall.", "tc.").replace("usage.", "u."): v
                for k, v in s.attributes.items()
            },
        )
        for s in renamed_run("acme")
    ]
    path = tmp_path / "acme.pb"
    _write_pb(path, encode_request(spans))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "11 spans, 1 agent, 5 llm, 5 other" in out, out
    assert "6 recognized as steps, 5 not recognized" in out
    # the unrecognized spans, grouped by scope, name and attribute keys
    assert "[acme] acme.toolCall  keys:" in out and "acme.tc.name" in out


def test_inspect_json_lines(capsys):
    assert main(["inspect", "--json", str(LOOP.path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    run, tail = lines
    assert [s["kind"] for s in run["spans"]].count("tool") == 5
    assert tail["unrecognized"] == [] and tail["invalid"] == []


def test_inspect_missing_path_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.pb")]) == 2
    assert capsys.readouterr().err.startswith("loopwatch: error: ")
