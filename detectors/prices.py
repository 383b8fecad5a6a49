"""What a model's tokens cost: the policy's `prices:` table, per million input and output
tokens, by model name. Pure: no I/O.

    prices:
      gpt-4o: {input: 2.50, output: 10.00}
      claude-sonnet-4*: {input: 3.00, output: 15.00}   # a trailing * matches a prefix

A model turn's tokens are priced by the model it names (the `model` field: the response's
model, else the request's); an exact name first, then the longest matching prefix. A run's
wasted money is its wasted tokens at the run's own average price per priced token (loop
episodes count tokens, not which turn spent them), so a run that mixes models is priced
at its mix. No `prices:`, no money anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config_reader import ConfigReader, join

PER = 1_000_000  # prices are per million tokens


@dataclass(frozen=True, slots=True)
class Price:
    input: float  # per million input tokens
    output: float  # per million output tokens

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input + output_tokens * self.output) / PER


def read_prices(r: ConfigReader, raw: Any, path: str = "prices") -> dict[str, Price]:
    table = r.mapping(raw, path, None)
    out = {}
    for model, value in table.items():
        where = join(path, str(model))
        if not isinstance(model, str) or not model.strip() or model.strip() == "*":
            raise r.fail(where, "a model name (a trailing * matches a prefix)", model)
        m = r.mapping(value, where, {"input", "output"})
        for key in ("input", "output"):
            if key not in m:
                raise r.fail(join(where, key), "a price per million tokens", None)
        out[model.strip()] = Price(
            r.number(m["input"], join(where, "input")), r.number(m["output"], join(where, "output"))
        )
    return out


def price_of(prices: Mapping[str, Price], model: str | None) -> Price | None:
    """The price of `model`: its exact entry, else the longest `prefix*` entry it starts with."""
    if not prices or not model:
        return None
    exact = prices.get(model)
    if exact is not None:
        return exact
    best: tuple[int, Price] | None = None
    for name, price in prices.items():
        prefix = name.endswith("*") and model.startswith(name[:-1])
        if prefix and (best is None or len(name) > best[0]):
            best = (len(name), price)
    return best[1] if best else None


def wasted_cost(wasted_tokens: int, cost: float, priced_tokens: int) -> float:
    """Wasted tokens at the run's average price per priced token."""
    return wasted_tokens * cost / priced_tokens if priced_tokens else 0.0
