"""Version comparison statistics (detectors/compare.py) against values scipy 1.x and
statsmodels computed once (scipy.stats.fisher_exact, two-sided; statsmodels'
proportion_confint(method="wilson")), pinned here: neither is a dependency."""

from __future__ import annotations

import pytest

from detectors.compare import (
    BETTER,
    OVERALL,
    SAME,
    TOO_FEW,
    WORSE,
    Side,
    compare,
    fisher_exact,
    runs_needed,
    wilson,
)


@pytest.mark.parametrize(
    ("table", "p"),
    [
        ((8, 2, 1, 5), 0.034965034965034975),  # scipy's documentation example
        ((1, 9, 11, 3), 0.0027594561852200836),
        ((3, 1, 1, 3), 0.48571428571428565),  # Fisher's lady tasting tea
        ((12, 28, 3, 57), 0.0010543509617312137),
        ((5, 995, 15, 985), 0.04039420540480713),
        ((2, 38, 2, 58), 1.0),
        ((0, 50, 0, 50), 1.0),
    ],
)
def test_fisher_exact_matches_scipy(table: tuple[int, int, int, int], p: float) -> None:
    assert fisher_exact(*table) == pytest.approx(p, rel=1e-9)


@pytest.mark.parametrize(
    ("k", "n", "interval"),
    [
        (0, 10, (0.0, 0.27753279986288926)),
        (5, 10, (0.23659309051256394, 0.7634069094874361)),
        (3, 60, (0.017149502164395668, 0.1370051647634852)),
        (12, 40, (0.1807484522974653, 0.45430018818144946)),
        (1, 1, (0.2065493143772374, 1.0)),
    ],
)
def test_wilson_matches_statsmodels(k: int, n: int, interval: tuple[float, float]) -> None:
    assert wilson(k, n) == pytest.approx(interval, rel=1e-9, abs=1e-12)


def side(runs: int, shapes: dict[str, int]) -> Side:
    """`runs` finished runs, shapes[s] of them looping in shape s (one shape a run)."""
    s = Side()
    for shape, n in shapes.items():
        for _ in range(n):
            s.add_run([shape])
    for _ in range(runs - sum(shapes.values())):
        s.add_run([])
    return s


def test_a_candidate_that_loops_more_is_worse_overall_and_in_its_shape() -> None:
    baseline = side(60, {"retry_storm": 3})
    candidate = side(40, {"retry_storm": 12})
    overall, storm = compare(baseline, candidate)
    assert overall.shape == OVERALL and storm.shape == "retry_storm"
    assert overall.verdict == WORSE and storm.verdict == WORSE
    assert overall.baseline == (3, 60) and overall.candidate == (12, 40)
    assert overall.p_value == pytest.approx(0.0010543509617312137, rel=1e-9)
    assert overall.ratio == pytest.approx(0.3 / 0.05)
    assert overall.runs_needed is None


def test_better_same_and_too_few() -> None:
    assert compare(side(40, {"x": 12}), side(60, {"x": 3}))[0].verdict == BETTER
    same = compare(side(40, {"x": 2}), side(60, {"x": 2}))[0]
    assert same.verdict == SAME and same.runs_needed is not None and same.runs_needed > 60
    few = compare(side(10, {"x": 0}), side(10, {"x": 5}))[0]
    assert few.verdict == TOO_FEW and few.runs_needed == runs_needed(0.0, 0.5)


def test_a_run_counts_once_overall_and_once_per_shape() -> None:
    s = Side()
    s.add_run(["retry_storm", "retry_storm", "oscillation"])
    s.add_run([])
    assert (s.runs, s.looping, s.by_shape) == (2, 1, {"retry_storm": 1, "oscillation": 1})
    s.add_event({"shape": "duplicate_side_effect", "wasted_steps": 2, "wasted_tokens": 300})
    assert (s.wasted_steps, s.wasted_tokens, s.duplicate_side_effects) == (2, 300, 1)


def test_runs_needed_grows_as_the_difference_shrinks() -> None:
    assert runs_needed(0.05, 0.05) is None
    assert runs_needed(0.05, 0.30) < runs_needed(0.05, 0.10) < runs_needed(0.05, 0.07)
