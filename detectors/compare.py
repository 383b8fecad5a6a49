"""Version against version: is a candidate's loop rate different from its baseline's?

Each side is a set of finished runs; a run either looped (at all, or in one shape) or did
not: two proportions. Loops are rare, so the counts are small (3 of 40 against 1 of 60),
where the normal approximation of a two-proportion z-test is poor: the difference is
tested with **Fisher's exact test** (two-sided, as scipy.stats.fisher_exact computes it),
and each rate carries a **Wilson score interval** (95 %), which stays inside [0, 1] and
keeps its coverage at 0 and at small n, unlike the Wald interval.

The verdict at level `alpha`: `worse` / `better` when p < alpha (the direction of the
rates), `no evidence of a difference` otherwise, and `not enough runs` when either side
has fewer than `min_runs` finished runs; then `runs_needed` estimates the runs per side at
which a difference of the observed size would show (80 % power, normal approximation:
a planning figure, not a test). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Z95 = 1.959963984540054  # the 97.5th percentile of the standard normal
Z80 = 0.8416212335729143  # the 80th percentile (power)
WORSE, BETTER, SAME, TOO_FEW = "worse", "better", "no evidence of a difference", "not enough runs"
OVERALL = "(any shape)"


def _log_choose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p-value of Fisher's exact test for [[a, b], [c, d]]: the probability,
    under the hypergeometric law with the table's margins, of a table at most as likely as
    this one (scipy's definition, with its relative tolerance of 1e-7)."""
    if min(a, b, c, d) < 0:
        raise ValueError("counts must be non-negative")
    row1, col1, n = a + b, a + c, a + b + c + d
    lo, hi = max(0, col1 - (n - row1)), min(row1, col1)
    if lo == hi:
        return 1.0
    base = _log_choose(n, col1)

    def log_pmf(x: int) -> float:
        return _log_choose(row1, x) + _log_choose(n - row1, col1 - x) - base

    observed = log_pmf(a)
    cutoff = observed + math.log1p(1e-7)
    p = sum(math.exp(lp) for lp in map(log_pmf, range(lo, hi + 1)) if lp <= cutoff)
    return min(1.0, p)


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials ((0, 1) for n = 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def runs_needed(p1: float, p2: float) -> int | None:
    """Runs per side for a two-sided test at 5 % to show p1 against p2 with 80 % power
    (normal approximation); None when the rates are equal."""
    if p1 == p2:
        return None
    variance = p1 * (1 - p1) + p2 * (1 - p2)
    return math.ceil((Z95 + Z80) ** 2 * variance / (p1 - p2) ** 2)


@dataclass
class Side:
    """One side's finished runs: how many, which looped (per shape), what the loops cost."""

    runs: int = 0
    looping: int = 0
    by_shape: dict[str, int] = field(default_factory=dict)  # shape -> runs with that shape
    wasted_steps: int = 0
    wasted_tokens: int = 0
    duplicate_side_effects: int = 0  # duplicate_side_effect events
    wasted_cost: float | None = None  # money, where the policy prices models (else None)

    def add_run(self, shapes: Iterable[str]) -> None:
        self.runs += 1
        distinct = set(shapes)
        if distinct:
            self.looping += 1
        for shape in distinct:
            self.by_shape[shape] = self.by_shape.get(shape, 0) + 1

    def add_summary(self, summary: Mapping[str, Any]) -> None:
        """A finished run from its summary: its shapes, and its wasted money where the
        policy prices models."""
        self.add_run(summary.get("shapes") or ())
        value = summary.get("wasted_cost")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self.wasted_cost = (self.wasted_cost or 0.0) + float(value)

    def add_event(self, event: Mapping[str, Any]) -> None:
        self.wasted_steps += int(event.get("wasted_steps") or 0)
        self.wasted_tokens += int(event.get("wasted_tokens") or 0)
        if event.get("shape") == "duplicate_side_effect":
            self.duplicate_side_effects += 1

    def count(self, shape: str) -> int:
        return self.looping if shape == OVERALL else self.by_shape.get(shape, 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "looping": self.looping,
            "wasted_steps": self.wasted_steps,
            "wasted_tokens": self.wasted_tokens,
            "duplicate_side_effects": self.duplicate_side_effects,
            **({} if self.wasted_cost is None else {"wasted_cost": round(self.wasted_cost, 6)}),
        }


@dataclass(frozen=True)
class Row:
    shape: str
    baseline: tuple[int, int]  # (looping runs, finished runs)
    candidate: tuple[int, int]
    baseline_interval: tuple[float, float]
    candidate_interval: tuple[float, float]
    ratio: float | None  # candidate rate / baseline rate (None: baseline rate 0)
    p_value: float
    verdict: str
    runs_needed: int | None

    @property
    def baseline_rate(self) -> float:
        return self.baseline[0] / self.baseline[1] if self.baseline[1] else 0.0

    @property
    def candidate_rate(self) -> float:
        return self.candidate[0] / self.candidate[1] if self.candidate[1] else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "baseline": {
                "looping": self.baseline[0],
                "runs": self.baseline[1],
                "rate": self.baseline_rate,
                "interval": list(self.baseline_interval),
            },
            "candidate": {
                "looping": self.candidate[0],
                "runs": self.candidate[1],
                "rate": self.candidate_rate,
                "interval": list(self.candidate_interval),
            },
            "ratio": self.ratio,
            "p_value": self.p_value,
            "verdict": self.verdict,
            "runs_needed": self.runs_needed,
        }


def compare_row(shape: str, baseline: Side, candidate: Side, alpha: float, min_runs: int) -> Row:
    k0, n0 = baseline.count(shape), baseline.runs
    k1, n1 = candidate.count(shape), candidate.runs
    p0 = k0 / n0 if n0 else 0.0
    p1 = k1 / n1 if n1 else 0.0
    p_value = fisher_exact(k1, n1 - k1, k0, n0 - k0)
    if min(n0, n1) < min_runs:
        verdict = TOO_FEW
    elif p_value < alpha:
        verdict = WORSE if p1 > p0 else BETTER
    else:
        verdict = SAME
    needed = runs_needed(p0, p1) if verdict in (TOO_FEW, SAME) else None
    return Row(
        shape,
        (k0, n0),
        (k1, n1),
        wilson(k0, n0),
        wilson(k1, n1),
        (p1 / p0) if p0 else None,
        p_value,
        verdict,
        needed,
    )


def compare(
    baseline: Side, candidate: Side, *, alpha: float = 0.05, min_runs: int = 30
) -> list[Row]:
    """The overall row first, then one row per shape seen on either side (by name)."""
    shapes = sorted(set(baseline.by_shape) | set(candidate.by_shape))
    return [compare_row(s, baseline, candidate, alpha, min_runs) for s in (OVERALL, *shapes)]


TEST = "fisher_exact_two_sided"


def document(
    rows: list[Row], baseline: Side, candidate: Side, *, alpha: float, min_runs: int
) -> dict[str, Any]:
    """A comparison as JSON (the gate's --json, GET /compare): the sides, the rows, and the
    overall verdict."""
    return {
        "test": TEST,
        "alpha": alpha,
        "min_runs": min_runs,
        "baseline": baseline.as_dict(),
        "candidate": candidate.as_dict(),
        "rows": [row.as_dict() for row in rows],
        "verdict": rows[0].verdict if rows else TOO_FEW,
    }
