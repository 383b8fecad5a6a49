"""`loopwatch gate --baseline BASELINE... -- CANDIDATE...`: two recorded sets replayed with one
policy; a candidate that loops significantly more, or has a duplicate side effect, fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.corpus import export_messages
from streams.cli.main import main
from streams.replay.files import write_pb
from tests.paths import REPO

CONFIG = str(REPO / "examples" / "loopwatch.yaml")


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("sets")
    out = {}
    for name, seed, share in (("baseline", 3, 0.04), ("regressed", 4, 0.30), ("same", 5, 0.04)):
        write_pb(d / f"{name}.pb", list(export_messages(6000, seed=seed, loop_share=share)))
        out[name] = str(d / f"{name}.pb")
    return out


def gate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["gate", "--config", CONFIG, *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_a_regressed_candidate_fails(
    sets: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = gate(capsys, "--baseline", sets["baseline"], "--", sets["regressed"])
    assert rc == 1
    overall = next(line for line in out.splitlines() if line.startswith("(any shape)"))
    assert overall.split()[-1] == "worse"
    assert "gate: FAIL the candidate loops more: (any shape)" in out
    assert "Fisher's exact test (two-sided)" in out


def test_a_candidate_like_its_baseline_passes(
    sets: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = gate(capsys, "--baseline", sets["baseline"], "--", sets["same"])
    assert rc == 0
    assert "no evidence of a difference" in out and out.rstrip().endswith("gate: PASS")


def test_json_for_ci(sets: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = gate(capsys, "--json", "--baseline", sets["baseline"], "--", sets["regressed"])
    doc = json.loads(out)
    assert rc == 1 and doc["passed"] is False and doc["test"] == "fisher_exact_two_sided"
    overall = doc["rows"][0]
    assert overall["shape"] == "(any shape)" and overall["verdict"] == "worse"
    assert overall["candidate"]["rate"] > overall["baseline"]["rate"]
    assert 0 <= overall["p_value"] < 0.05
    assert doc["failures"][0].startswith("the candidate loops more")


def test_too_few_runs_say_so_and_a_flag_makes_it_fail(
    sets: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    examples = str(REPO / "examples")
    rc, out, _ = gate(capsys, "--baseline", sets["baseline"], "--min-runs", "50", "--", examples)
    assert "not enough runs" in out
    strict_rc, strict, _ = gate(
        capsys,
        "--fail-on-too-few",
        "--baseline",
        sets["baseline"],
        "--min-runs",
        "50",
        "--",
        examples,
    )
    assert strict_rc == 1 and "not enough runs to tell (--fail-on-too-few)" in strict
    # the examples' refund twice is a duplicate side effect: that fails whatever the rates
    assert rc == 1 and "the candidate has 1 duplicate side effect(s)" in out


def test_the_same_files_on_both_sides_are_an_error(
    sets: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = gate(capsys, "--baseline", sets["baseline"], "--", sets["baseline"])
    assert rc == 2 and out == ""
    assert err.strip().splitlines()[-1] == (
        "loopwatch: error: --baseline and the candidate are the same files: nothing to compare"
    )


def test_a_baseline_without_runs_is_an_error(
    sets: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"resourceSpans": []}\n')
    rc, _, err = gate(capsys, "--baseline", str(empty), "--", sets["same"])
    assert rc == 2 and "no runs: nothing to compare with" in err


@pytest.mark.parametrize("alpha", ["0", "1", "x"])
def test_a_bad_alpha_is_refused(sets: dict[str, str], alpha: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["gate", "--alpha", alpha, "--baseline", sets["baseline"], "--", sets["same"]])
    assert exc.value.code == 2
