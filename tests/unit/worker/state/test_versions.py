"""Which version replaced which (detectors/versions.py), the versions table's records
(streams/worker/state/versions.py) and the answers of GET /versions and GET /compare
(streams/worker/api/versions.py), without faust: each worker's share is built the way the
worker's counting writes its tables."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from detectors.compare import BETTER, OVERALL, SAME, TOO_FEW, WORSE, fisher_exact
from detectors.versions import (
    PROMPT,
    TOOL,
    History,
    Seen,
    Slice,
    run_measures,
    seen_of,
    side_of,
    slices_of,
)
from streams.worker.api.answers import BadRequest
from streams.worker.api.versions import (
    NotFound,
    answer_compare,
    local_share,
    merged_history,
    parse_compare,
    versions_rows,
)
from streams.worker.state import versions as records
from streams.worker.state.window_keys import added_once, aggregate_key, contribution_id

NS = 10**9
T0 = 1_790_000_000 * NS
COVERED = {"since": "24h", "covers": "24h", "kept": "24h"}


RUN_IDS = itertools.count()


def summary(
    prompt: str | None,
    *,
    start: int = 0,
    shapes: tuple[str, ...] = (),
    tools: tuple[tuple[str, str], ...] = (),
    service: str = "support-bot",
    agent: str = "support",
    wasted: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    return {
        "run_id": f"run-{next(RUN_IDS)}",
        "prompt_version": prompt,
        "service_name": service,
        "agent_name": agent,
        "shapes": list(shapes),
        "tool_versions": [list(t) for t in tools],
        "wasted_steps": wasted[0],
        "wasted_tokens": wasted[1],
        "start_time_unix_nano": T0 + start * NS,
        "end_time_unix_nano": T0 + (start + 5) * NS,
    }


class Worker:
    """One worker's tables, written as streams/worker/agents/counting.py writes them."""

    def __init__(self) -> None:
        self.versions: dict[bytes, bytes] = {}
        self.counts: dict[tuple[str, tuple[float, float]], Any] = {}

    def finish(self, s: dict[str, Any], partition: int = 0, window_end: float = 0.0) -> None:
        end = window_end or time.time()
        cid = contribution_id("run", s["run_id"])
        for key in slices_of(s):
            raw = records.version_key(key, partition)
            self.versions[raw] = records.merged(self.versions.get(raw), {cid: seen_of(s)})
            for name, n in run_measures(s).items():
                label_key = aggregate_key([*key.labels(), name], partition)
                window = (label_key, (end - 60, end))
                self.counts[window] = added_once(self.counts.get(window), {cid: n})

    def share(self, seconds: int = 86400) -> dict[str, Any]:
        return local_share(self.versions.items(), self.counts.items(), seconds, time.time())


def rollout(worker: Worker, old: int, old_loops: int, new: int, new_loops: int) -> None:
    """support-v1's runs, then support-v2's (which starts later)."""
    for i in range(old):
        shapes = ("identical_repetition",) if i < old_loops else ()
        wasted = (2, 100) if shapes else (0, 0)
        worker.finish(summary("support-v1", start=i, shapes=shapes, wasted=wasted))
    for i in range(new):
        shapes = ("identical_repetition", "retry_storm") if i < new_loops else ()
        wasted = (3, 300) if shapes else (0, 0)
        worker.finish(summary("support-v2", start=1000 + i, shapes=shapes, wasted=wasted))


# ---------------------------------------------------------------- what a run counts on


def test_a_run_counts_on_its_prompt_version_and_each_tool_version_once() -> None:
    s = summary("v7", tools=(("lookup_order", "3"), ("issue_refund", "1"), ("lookup_order", "3")))
    assert slices_of(s) == [
        Slice(PROMPT, "support-bot", "support", "", "v7"),
        Slice(TOOL, "support-bot", "support", "lookup_order", "3"),
        Slice(TOOL, "support-bot", "support", "issue_refund", "1"),
    ]
    assert slices_of(summary(None)) == []  # no versions: nothing to compare
    assert slices_of({**summary(""), "tool_versions": [["t", ""]]}) == []


def test_run_measures() -> None:
    clean = run_measures(summary("v1"))
    assert clean == {"runs": 1}
    looped = run_measures(
        summary("v1", shapes=("retry_storm", "duplicate_side_effect"), wasted=(4, 900))
    )
    assert looped == {
        "runs": 1,
        "looping": 1,
        "shape:duplicate_side_effect": 1,
        "shape:retry_storm": 1,
        "wasted_steps": 4,
        "wasted_tokens": 900,
    }
    side = side_of({k: v * 3 for k, v in looped.items()})
    assert (side.runs, side.looping, side.wasted_steps, side.wasted_tokens) == (3, 3, 12, 2700)
    assert side.by_shape == {"duplicate_side_effect": 3, "retry_storm": 3}
    assert side.duplicate_side_effects == 3


# ---------------------------------------------------------------- history


def test_versions_are_ordered_by_first_sighting_and_replace_the_one_before() -> None:
    history = History()
    group = (PROMPT, "s", "a", "")
    for version, first in (("v3", 30), ("v1", 10), ("v2", 20), ("v2b", 20)):
        history.add(Slice(*group, version), Seen(first, first + 5, 1))
    history.add(Slice(PROMPT, "other", "a", "", "v9"), Seen(15, 16, 1))  # another service
    assert [k.version for k in history.ordered(group)] == ["v1", "v2", "v2b", "v3"]
    assert history.previous(Slice(*group, "v3")).version == "v2b"  # a tie: by name
    assert history.previous(Slice(*group, "v1")) is None
    assert history.previous(Slice(PROMPT, "other", "a", "", "v9")) is None
    rows = {(r["service_name"], r["version"]): r["previous"] for r in history.rows()}
    assert rows == {
        ("other", "v9"): None,
        ("s", "v1"): None,
        ("s", "v2"): "v1",
        ("s", "v2b"): "v2",
        ("s", "v3"): "v2b",
    }


def test_the_metric_keeps_each_groups_latest_versions_with_their_predecessors() -> None:
    history = History()
    for n in range(8):
        history.add(Slice(PROMPT, "s", "a", "", f"v{n}"), Seen(n * 10, n * 10 + 5, 1))
    history.add(Slice(TOOL, "s", "a", "t", "1"), Seen(0, 1, 1))
    rows = history.rows(latest=3)
    assert [(r["version"], r["previous"], r["previous_first_ns"]) for r in rows] == [
        ("v5", "v4", 40),
        ("v6", "v5", 50),
        ("v7", "v6", 60),
        ("1", None, None),
    ]


def test_records_merge_across_partitions_and_workers_and_bad_ones_are_skipped() -> None:
    a, b = Worker(), Worker()
    a.finish(summary("v1", start=100), partition=0)
    a.finish(summary("v1", start=50), partition=1)
    b.finish(summary("v1", start=300), partition=2)
    a.versions[b"not json"] = b"[1,2,3]"
    a.versions[records.version_key(Slice(PROMPT, "s", "a", "", "vx"), 0)] = b"{broken"
    history = merged_history([a.share(), b.share()])
    (key,) = history.seen
    seen = history.seen[key]
    assert (seen.first_ns, seen.last_ns, seen.runs) == (T0 + 50 * NS, T0 + 305 * NS, 3)


def test_versions_rows_since_and_filters() -> None:
    history = History()
    history.add(Slice(PROMPT, "s", "a", "", "old"), Seen(10, 20, 4))
    history.add(Slice(PROMPT, "s", "a", "", "new"), Seen(30, 40, 2))
    history.add(Slice(PROMPT, "t", "a", "", "x"), Seen(30, 40, 2))
    rows = versions_rows(history, cutoff_ns=25)
    assert [(r["version"], r["previous"]) for r in rows] == [("new", "old"), ("x", None)]
    assert [r["version"] for r in versions_rows(history, 0, service="t")] == ["x"]


# ---------------------------------------------------------------- compare


def test_a_version_that_loops_more_than_the_one_it_replaced_is_worse() -> None:
    w = Worker()
    rollout(w, old=60, old_loops=1, new=40, new_loops=12)
    doc = answer_compare(parse_compare({"prompt_version": "support-v2"}), [w.share()], COVERED)
    assert doc["baseline"]["version"] == "support-v1" and doc["baseline"]["chosen"] == "previous"
    assert doc["baseline"]["first_ns"] < doc["candidate"]["first_ns"]
    overall = doc["rows"][0]
    assert overall["shape"] == OVERALL and doc["verdict"] == WORSE == overall["verdict"]
    assert (overall["baseline"]["looping"], overall["baseline"]["runs"]) == (1, 60)
    assert (overall["candidate"]["looping"], overall["candidate"]["runs"]) == (12, 40)
    assert overall["p_value"] == pytest.approx(fisher_exact(12, 28, 1, 59))
    by_shape = {r["shape"]: r for r in doc["rows"]}
    assert by_shape["retry_storm"]["baseline"]["looping"] == 0
    assert by_shape["retry_storm"]["verdict"] == WORSE
    assert doc["candidate"]["wasted_steps"] == 36 and doc["baseline"]["wasted_tokens"] == 100
    assert doc["since"] == "24h" and doc["test"] == "fisher_exact_two_sided"


@pytest.mark.parametrize(
    ("old", "old_loops", "new", "new_loops", "verdict"),
    [(60, 6, 60, 7, SAME), (60, 20, 60, 2, BETTER), (10, 1, 10, 5, TOO_FEW)],
)
def test_verdicts(old: int, old_loops: int, new: int, new_loops: int, verdict: str) -> None:
    w = Worker()
    rollout(w, old, old_loops, new, new_loops)
    doc = answer_compare(parse_compare({"prompt_version": "support-v2"}), [w.share()], COVERED)
    assert doc["verdict"] == verdict


def test_shares_of_two_workers_add_up_to_one_answer() -> None:
    one, a, b = Worker(), Worker(), Worker()
    rollout(one, old=60, old_loops=1, new=40, new_loops=12)
    # the same runs, split over two workers' partitions
    for i in range(60):
        shapes = ("identical_repetition",) if i < 1 else ()
        (a if i % 2 else b).finish(
            summary("support-v1", start=i, shapes=shapes, wasted=(2, 100) if shapes else (0, 0)),
            partition=i % 4,
        )
    for i in range(40):
        shapes = ("identical_repetition", "retry_storm") if i < 12 else ()
        (a if i % 3 else b).finish(
            summary(
                "support-v2", start=1000 + i, shapes=shapes, wasted=(3, 300) if shapes else (0, 0)
            ),
            partition=i % 4,
        )
    ask = parse_compare({"prompt_version": "support-v2"})
    split = answer_compare(ask, [a.share(), b.share()], COVERED)
    whole = answer_compare(ask, [one.share()], COVERED)
    assert split == whole


def test_a_tool_version_is_compared_with_the_tool_version_before_it() -> None:
    w = Worker()
    for i in range(40):
        shapes = ("retry_storm",) if i < 2 else ()
        w.finish(summary("p", start=i, shapes=shapes, tools=(("search", "1"), ("refund", "4"))))
    for i in range(40):
        shapes = ("retry_storm",) if i < 15 else ()
        w.finish(summary("p", start=100 + i, shapes=shapes, tools=(("search", "2"),)))
    doc = answer_compare(
        parse_compare({"tool_name": "search", "tool_version": "2"}), [w.share()], COVERED
    )
    assert doc["kind"] == "tool" and doc["tool_name"] == "search"
    assert doc["baseline"]["version"] == "1" and doc["verdict"] == WORSE
    assert (doc["baseline"]["runs"], doc["candidate"]["runs"]) == (40, 40)


def test_a_given_baseline_and_like_with_like_groups() -> None:
    w = Worker()
    rollout(w, old=40, old_loops=1, new=40, new_loops=2)
    # another service runs support-v2 too, after a version of its own
    for i in range(30):
        w.finish(summary("support-v0", start=i, service="other", shapes=("retry_storm",)))
        w.finish(summary("support-v2", start=500 + i, service="other"))
    with pytest.raises(BadRequest, match="replaced different versions"):
        answer_compare(parse_compare({"prompt_version": "support-v2"}), [w.share()], COVERED)
    doc = answer_compare(
        parse_compare({"prompt_version": "support-v2", "service_name": "support-bot"}),
        [w.share()],
        COVERED,
    )
    assert doc["baseline"]["version"] == "support-v1" and doc["candidate"]["runs"] == 40
    # --baseline support-v0: only the service where both ran
    doc = answer_compare(
        parse_compare({"prompt_version": "support-v2", "baseline": "support-v0"}),
        [w.share()],
        COVERED,
    )
    assert doc["baseline"]["chosen"] == "given" and doc["candidate"]["runs"] == 30
    assert doc["verdict"] == BETTER


@pytest.mark.parametrize(
    ("query", "error", "match"),
    [
        ({"prompt_version": "support-v9"}, NotFound, "no finished run of prompt_version"),
        ({"prompt_version": "support-v1"}, NotFound, "first version seen"),
        ({"prompt_version": "support-v2", "baseline": "nope"}, NotFound, "baseline|nope"),
        ({"prompt_version": "support-v2", "baseline": "support-v2"}, BadRequest, "itself"),
        ({}, BadRequest, "what to compare"),
        ({"tool_name": "t"}, BadRequest, "what to compare"),
        ({"prompt_version": "a", "tool_name": "t", "tool_version": "1"}, BadRequest, "one thing"),
        ({"prompt_version": "support-v2", "alpha": "2"}, BadRequest, "alpha"),
        ({"prompt_version": "support-v2", "min_runs": "x"}, BadRequest, "min_runs"),
    ],
)
def test_what_cannot_be_compared_says_why(
    query: dict[str, str], error: type[Exception], match: str
) -> None:
    w = Worker()
    rollout(w, old=40, old_loops=1, new=40, new_loops=2)
    with pytest.raises(error, match=match):
        answer_compare(parse_compare(query), [w.share()], COVERED)


def test_a_baseline_with_no_runs_in_the_window_is_not_compared() -> None:
    w = Worker()
    now = time.time()
    for i in range(40):  # support-v1 ran two days ago: its counts are out of the window
        w.finish(summary("support-v1", start=i), window_end=now - 2 * 86400)
    for i in range(40):
        w.finish(summary("support-v2", start=1000 + i), window_end=now)
    with pytest.raises(NotFound, match="no finished run of support-v1 in the last 24h"):
        answer_compare(parse_compare({"prompt_version": "support-v2"}), [w.share()], COVERED)
