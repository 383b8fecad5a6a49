"""A comparison (detectors/compare.py `document`) as the tables the gate and
`query compare` print: looping runs per shape on each side with the verdict, then what the
loops cost per run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streams.cli.render import Block, table


def _rate(side: Mapping[str, Any]) -> str:
    k, n = side["looping"], side["runs"]
    low, high = side["interval"]
    return f"{k}/{n} {side['rate']:.1%} [{low:.1%}-{high:.1%}]"


def _per_run(total: int, runs: int) -> str:
    return f"{total / runs:,.2f}" if runs else "-"


def _money(total: float | None, runs: int) -> str:
    return f"${total / runs:,.4f}" if total is not None and runs else "-"


def comparison_blocks(
    doc: Mapping[str, Any], baseline_name: str = "baseline", candidate_name: str = "candidate"
) -> list[Block]:
    cells = []
    for row in doc["rows"]:
        verdict = row["verdict"]
        if row.get("runs_needed") is not None:
            verdict += f" (a difference this size needs about {row['runs_needed']:,} runs a side)"
        cells.append(
            [
                row["shape"],
                _rate(row["baseline"]),
                _rate(row["candidate"]),
                "-" if row["ratio"] is None else f"x{row['ratio']:.2f}",
                f"{row['p_value']:.2g}",
                verdict,
            ]
        )
    headers = [
        "shape",
        f"{baseline_name} looping runs",
        f"{candidate_name} looping runs",
        "ratio",
        "p",
        "verdict",
    ]
    base, cand = doc["baseline"], doc["candidate"]
    costs = [
        [
            "wasted steps per run",
            _per_run(base["wasted_steps"], base["runs"]),
            _per_run(cand["wasted_steps"], cand["runs"]),
        ],
        [
            "wasted tokens per run",
            _per_run(base["wasted_tokens"], base["runs"]),
            _per_run(cand["wasted_tokens"], cand["runs"]),
        ],
        [
            "duplicate side effects",
            str(base["duplicate_side_effects"]),
            str(cand["duplicate_side_effects"]),
        ],
    ]
    if "wasted_cost" in base or "wasted_cost" in cand:  # the policy prices models
        costs.insert(
            2,
            [
                "wasted money per run",
                _money(base.get("wasted_cost"), base["runs"]),
                _money(cand.get("wasted_cost"), cand["runs"]),
            ],
        )
    return [
        table(headers, cells, {3, 4}),
        "",
        table(["cost", baseline_name, candidate_name], costs, {1, 2}),
        "",
        f"Fisher's exact test (two-sided) at alpha {doc['alpha']:g}; rates with 95% Wilson "
        f"intervals; a verdict needs {doc['min_runs']} finished runs a side",
    ]
