"""The similarity sketches' error (detectors.sketch.py states the figures this
measures): on random sets of known overlap, short and long, and as decisions at the
thresholds on every pair of calls (and model turns) of the labeled corpus, estimated
against exactly computed. `python -m tests.unit.detectors.test_sketch_error` prints the table."""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import combinations
from typing import Any

from detectors.policy import Policy
from detectors.similarity import similarity
from detectors.sketch import Sketcher, call_view, features
from tests.near_duplicate_corpus import Case, corpus, traps

KEY = b"sketch-error-key"
SHORT = (2, 3, 4, 6, 8, 10)
LONG = (50, 200, 1000)


def _pair(rng: random.Random, n: int) -> tuple[set[bytes], set[bytes]]:
    """Two sets of n features whose overlap is uniform in 0.1-0.95."""
    j = rng.uniform(0.1, 0.95)
    shared = round(2 * n * j / (1 + j))
    common = {b"s%d" % rng.getrandbits(48) for _ in range(shared)}
    a = common | {b"a%d" % rng.getrandbits(48) for _ in range(n - shared)}
    b = common | {b"b%d" % rng.getrandbits(48) for _ in range(n - shared)}
    return a, b


def errors(n: int, pairs: int = 1000, seed: int = 36) -> list[float]:
    """|estimate - exact overlap| of `pairs` random pairs of n-feature sets, sorted."""
    rng = random.Random(seed * 7919 + n)
    sketcher = Sketcher(KEY)
    out = []
    for _ in range(pairs):
        a, b = _pair(rng, n)
        exact = len(a & b) / len(a | b)
        estimate = similarity(sketcher.of_features(a), sketcher.of_features(b))
        assert estimate is not None
        out.append(abs(estimate - exact))
    return sorted(out)


def _exact(a: set[bytes], b: set[bytes]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def corpus_pairs(cases: list[Case]) -> Iterator[tuple[str, set[bytes], set[bytes], float]]:
    """(what, features, features, threshold) of every pair the near-duplicate detectors
    could compare: two calls of one tool in a run (arguments; results without items), two
    model turns of a run (outputs; observations)."""
    policy = Policy()
    sim = policy.similarity
    for case in cases:
        calls = case.agent.calls
        for (name, args, result), (other, args2, result2) in combinations(calls, 2):
            if name != other:
                continue
            yield (
                "arguments",
                call_view(args, None, sim)[0],
                call_view(args2, None, sim)[0],
                sim.argument_similarity,
            )
            if len(Sketcher(KEY).items(result)) < 2 and len(Sketcher(KEY).items(result2)) < 2:
                yield ("results", features(result), features(result2), sim.result_similarity)
        for (out, seen), (out2, seen2) in combinations(case.agent.turns, 2):
            yield ("turn outputs", features(out), features(out2), sim.argument_similarity)
            yield ("observations", features(seen), features(seen2), sim.result_similarity)


def decisions(keys: int = 4) -> dict[str, list[int]]:
    """Per kind of pair: [pairs, decisions the estimate got wrong], over `keys` keys."""
    cases = corpus() + traps()
    table: dict[str, list[int]] = {}
    for k in range(keys):
        sketcher = Sketcher(KEY + bytes([k]))
        for what, a, b, threshold in corpus_pairs(cases):
            estimate = similarity(sketcher.of_features(a), sketcher.of_features(b))
            row = table.setdefault(what, [0, 0])
            row[0] += 1
            row[1] += (estimate is not None and estimate >= threshold) != (
                _exact(a, b) >= threshold
            )
    return table


def test_short_sets_are_compared_exactly() -> None:
    """Fewer than 16 features a side: the sketch is the whole set, the estimate exact."""
    for n in SHORT:
        assert max(errors(n)) == 0.0, n


def test_long_sets_have_the_stated_error() -> None:
    for n, bound in zip(LONG, (0.05, 0.06, 0.065), strict=True):
        errs = errors(n)
        mean = sum(errs) / len(errs)
        assert 0.02 < mean < bound, (n, mean)  # an estimate, not exact: and not worse
        assert errs[int(0.99 * len(errs))] < 0.2, n


def test_decisions_at_the_thresholds_on_the_corpus() -> None:
    """Under each of four keys, every pair of the corpus lands on the side of the
    threshold its exact overlap is on: less than 1% wrong, per kind of pair."""
    table = decisions()
    assert set(table) == {"arguments", "results", "turn outputs", "observations"}
    for what, (pairs, wrong) in table.items():
        assert pairs > 200, what
        assert wrong / pairs < 0.01, (what, pairs, wrong)


def test_an_empty_sketch_equals_only_another() -> None:
    sketcher = Sketcher(KEY)
    empty, some = sketcher.of_features(set()), sketcher.of_features({b"x"})
    assert empty == "" and similarity(empty, empty) == 1.0
    assert similarity(empty, some) == 0.0 and similarity(None, some) is None


def main() -> None:
    rows: list[tuple[Any, ...]] = []
    for n in (*SHORT, 20, *LONG):
        errs = errors(n)
        rows.append((n, sum(errs) / len(errs), errs[int(0.9 * len(errs))], errs[-10]))
    print("features  mean|err|  p90    p99")
    for n, mean, p90, p99 in rows:
        print(f"{n:8d}  {mean:.3f}      {p90:.3f}  {p99:.3f}")
    for what, (pairs, wrong) in decisions().items():
        print(f"{what}: {wrong} of {pairs} decisions wrong ({wrong / pairs:.2%})")


if __name__ == "__main__":
    main()
