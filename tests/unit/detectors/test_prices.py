"""Money where the policy prices models (`prices:`, detectors/prices.py): a run's cost and
wasted money in its summary, a version's in `query compare`, the gate's cost table. No
prices, no money anywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.corpus import export_messages
from detectors.errors import ConfigError
from detectors.policy import policy_from_mapping
from detectors.prices import Price, price_of
from detectors.versions import run_measures, side_of
from streams.cli.main import main
from streams.replay.files import write_pb
from tests.otlp_build import encode_request, replay_messages
from tests.paths import REPO
from tests.spankit import Run, example_policy

PRICES = {"gpt-4o": {"input": 2.5, "output": 10.0}, "claude-*": {"input": 3.0, "output": 15.0}}


def test_a_model_is_priced_by_its_name_then_its_longest_prefix() -> None:
    prices = {
        "gpt-4o": Price(2.5, 10),
        "gpt-4o*": Price(9, 9),
        "claude-*": Price(3, 15),
        "claude-opus-*": Price(15, 75),
    }
    assert price_of(prices, "gpt-4o") == Price(2.5, 10)
    assert price_of(prices, "gpt-4o-2024-08-06") == Price(9, 9)
    assert price_of(prices, "claude-opus-4-1") == Price(15, 75)
    assert price_of(prices, "claude-sonnet-4") == Price(3, 15)
    assert price_of(prices, "llama-3") is None and price_of(prices, None) is None
    assert Price(2.5, 10).cost(1_000_000, 100_000) == pytest.approx(3.5)


@pytest.mark.parametrize(
    ("prices", "message"),
    [
        ({"gpt-4o": {"input": 1}}, "prices.gpt-4o.output"),
        ({"gpt-4o": {"input": 1, "output": "ten"}}, "prices.gpt-4o.output"),
        ({"*": {"input": 1, "output": 1}}, "a model name"),
        ({"gpt-4o": [1, 2]}, "prices.gpt-4o"),
    ],
)
def test_bad_prices_name_the_key(prices: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        policy_from_mapping({"prices": prices})


def looping_run(trace: int, model: str | None) -> Run:
    run = Run(trace=trace)
    for _ in range(4):  # the same lookup four times: identical_repetition
        run.llm(1000, 100, model=model)
        run.tool("lookup_order", {"order_id": "A7"}, {"status": "pending"})
    run.llm(1000, 200, model="unpriced-model")  # priced nowhere: tokens, no money
    run.root()
    return run


def test_a_summary_has_the_runs_cost_and_its_wasted_money_at_the_runs_price() -> None:
    run = looping_run(1, "gpt-4o-mini")
    policy = example_policy(prices={"gpt-4o*": {"input": 0.15, "output": 0.6}})
    events, (summary,) = replay_messages([encode_request(run.spans)], policy)
    assert events and summary["shapes"] == ["identical_repetition"]
    cost = 4 * (1000 * 0.15 + 100 * 0.6) / 1e6  # the four priced turns
    assert summary["cost"] == pytest.approx(cost)
    assert summary["wasted_tokens"] > 0
    per_token = cost / (4 * 1100)
    assert summary["wasted_cost"] == pytest.approx(summary["wasted_tokens"] * per_token, abs=1e-6)
    # the same run without prices: no money keys at all
    _events, (plain,) = replay_messages([encode_request(run.spans)], example_policy())
    assert "cost" not in plain and "wasted_cost" not in plain
    assert {k: v for k, v in summary.items() if k not in ("cost", "wasted_cost")} == plain


def test_a_version_side_carries_money_only_where_runs_were_priced() -> None:
    priced = run_measures({"shapes": ["retry_storm"], "wasted_tokens": 10, "wasted_cost": 0.25})
    clean = run_measures({"shapes": [], "wasted_cost": 0.0})
    side = side_of({k: priced.get(k, 0) + clean.get(k, 0) for k in {*priced, *clean}})
    assert side.runs == 2 and side.wasted_cost == pytest.approx(0.25)
    assert side_of(run_measures({"shapes": []})).wasted_cost is None
    assert "wasted_cost" not in side_of(run_measures({"shapes": []})).as_dict()


def test_the_gate_prices_wasted_tokens_when_the_policy_has_prices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = yaml.safe_load((REPO / "examples" / "loopwatch.yaml").read_text())
    raw["prices"] = PRICES  # the bench corpus's model turns are gpt-4o
    priced = tmp_path / "priced.yaml"
    priced.write_text(yaml.safe_dump(raw))
    base, cand = tmp_path / "base.pb", tmp_path / "cand.pb"
    write_pb(base, list(export_messages(3000, seed=3, loop_share=0.04)))
    write_pb(cand, list(export_messages(3000, seed=4, loop_share=0.30)))

    def gate(config: Path | str, *extra: str) -> str:
        main(["gate", "--config", str(config), *extra, "--baseline", str(base), "--", str(cand)])
        return capsys.readouterr().out

    out = gate(priced)
    [money] = [line for line in out.splitlines() if line.startswith("wasted money per run")]
    cells = money.split()[-2:]
    assert all(c.startswith("$") for c in cells) and float(cells[1][1:]) > float(cells[0][1:])
    doc = json.loads(gate(priced, "--json"))
    assert doc["candidate"]["wasted_cost"] > doc["baseline"]["wasted_cost"] > 0
    plain = gate(REPO / "examples" / "loopwatch.yaml")
    assert "wasted money" not in plain and "wasted tokens per run" in plain
