"""`loopwatch query versions` and `loopwatch query compare` against a canned API whose
answers are the API's own (streams/worker/api/versions.py over the tables as the worker
writes them, tests/unit/worker/state/test_versions.py)."""

from __future__ import annotations

import pytest

from streams.worker.api.versions import answer_compare, merged_history, parse_compare, versions_rows
from tests.unit.cli import test_query
from tests.unit.cli.test_query import Api, run
from tests.unit.worker.state.test_versions import COVERED, Worker, rollout, summary

api = test_query.api  # the canned API fixture


def compare_doc(new_loops: int = 12) -> dict:
    w = Worker()
    rollout(w, old=60, old_loops=1, new=40, new_loops=new_loops)
    w.finish(summary("support-v2", start=2000, shapes=("duplicate_side_effect",)))
    return answer_compare(parse_compare({"prompt_version": "support-v2"}), [w.share()], COVERED)


def test_compare_prints_both_versions_the_shapes_the_cost_and_a_verdict(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes["/compare"] = (200, compare_doc())
    rc, lines, err = run(capsys, "compare", "--prompt-version", "support-v2")
    assert (rc, err) == (0, "")
    [(path, query, _h)] = api.requests
    assert path == "/compare" and query == {"prompt_version": ["support-v2"], "since": ["24h"]}
    assert lines[0] == (
        "prompt_version support-v2 against support-v1 (the version it replaced), "
        "finished runs in the last 24h"
    )
    assert lines[2:9] == [
        "shape                  support-v1 looping runs  support-v2 looping runs     ratio        p  verdict",  # noqa: E501
        "---------------------  -----------------------  -------------------------  ------  -------  --------------------------------------------------------------------------------",  # noqa: E501
        "(any shape)            1/60 1.7% [0.3%-8.9%]    13/41 31.7% [19.6%-47.0%]  x19.02  2.1e-05  worse",  # noqa: E501
        "duplicate_side_effect  0/60 0.0% [0.0%-6.0%]    1/41 2.4% [0.4%-12.6%]          -     0.41  no evidence of a difference (a difference this size needs about 314 runs a side)",  # noqa: E501
        "identical_repetition   1/60 1.7% [0.3%-8.9%]    12/41 29.3% [17.6%-44.5%]  x17.56    6e-05  worse",  # noqa: E501
        "retry_storm            0/60 0.0% [0.0%-6.0%]    12/41 29.3% [17.6%-44.5%]       -  6.6e-06  worse",  # noqa: E501
        "",
    ]
    assert lines[9:14] == [
        "cost                    support-v1  support-v2",
        "----------------------  ----------  ----------",
        "wasted steps per run          0.03        0.88",
        "wasted tokens per run         1.67       87.80",
        "duplicate side effects           0           1",
    ]
    assert lines[-1] == (
        "verdict: WORSE: support-v2 loops more than support-v1 (13/41 looping runs against "
        "1/60, p=2.1e-05); 1 run(s) of support-v2 duplicated a side effect"
    )


def test_compare_with_a_baseline_sends_it_and_too_few_runs_say_how_many(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    w = Worker()
    rollout(w, old=10, old_loops=1, new=10, new_loops=4)
    doc = answer_compare(
        parse_compare({"prompt_version": "support-v2", "baseline": "support-v1"}),
        [w.share()],
        COVERED,
    )
    api.routes["/compare"] = (200, doc)
    rc, lines, _ = run(
        capsys,
        "compare",
        "--prompt-version",
        "support-v2",
        "--baseline",
        "support-v1",
        "--since",
        "6h",
        "--alpha",
        "0.01",
        "--min-runs",
        "20",
    )
    [(_path, query, _h)] = api.requests
    assert query == {
        "prompt_version": ["support-v2"],
        "baseline": ["support-v1"],
        "since": ["6h"],
        "alpha": ["0.01"],
        "min_runs": ["20"],
    }
    assert rc == 0 and "(--baseline)" in lines[0]
    assert lines[-1] == (
        "verdict: not enough runs to tell (4/10 looping runs against 1/10, p=0.3; a verdict "
        "needs 30 a side, a difference this size about 29)"
    )


def test_compare_a_tool_version(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    api.routes["/compare"] = (200, compare_doc())
    rc, _lines, _ = run(capsys, "compare", "--tool", "search", "--tool-version", "2")
    [(_path, query, _h)] = api.requests
    assert rc == 0 and query == {"tool_name": ["search"], "tool_version": ["2"], "since": ["24h"]}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare"], "what to compare"),
        (["compare", "--tool", "t"], "what to compare"),
        (["compare", "--prompt-version", "a", "--tool", "t", "--tool-version", "1"], "one thing"),
        (["compare", "--prompt-version", "a", "--baseline", "a"], "the candidate itself"),
        (["compare", "--prompt-version", "a", "--shape", "retry_storm"], "drop --shape"),
        (["versions", "--tool", "t"], "--service and --agent only"),
        (["loops", "--baseline", "a"], "are for `loopwatch query compare`"),
    ],
)
def test_what_cannot_be_asked_is_one_line_before_any_request(
    api: Api, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    rc, lines, err = run(capsys, *argv)
    assert rc == 2 and lines == [] and message in err and err.count("\n") == 1
    assert api.requests == []


def test_an_unknown_version_is_the_api_s_404_line(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes["/compare"] = (404, {"error": "no finished run of prompt_version v9 is known"})
    rc, lines, err = run(capsys, "compare", "--prompt-version", "v9")
    assert (rc, lines) == (2, [])
    assert err == "loopwatch: error: no finished run of prompt_version v9 is known (HTTP 404)\n"


def test_versions_table(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    w = Worker()
    rollout(w, old=3, old_loops=1, new=2, new_loops=0)
    w.finish(summary("support-v2", start=1500, tools=(("lookup_order", "3"),)))
    rows = versions_rows(merged_history([w.share()]), 0)
    api.routes["/versions"] = (200, {"since": "7d", "where": {}, "rows": rows})
    rc, lines, _ = run(capsys, "versions", "--service", "support-bot")
    [(path, query, _h)] = api.requests
    assert path == "/versions" and query == {"since": ["7d"], "service_name": ["support-bot"]}
    assert rc == 0
    assert lines == [
        "kind    service      agent    tool          version     replaced    first seen        last seen         runs",  # noqa: E501
        "------  -----------  -------  ------------  ----------  ----------  ----------------  ----------------  ----",  # noqa: E501
        "prompt  support-bot  support  -             support-v1  (first)     2026-09-21 14:13  2026-09-21 14:13     3",  # noqa: E501
        "prompt  support-bot  support  -             support-v2  support-v1  2026-09-21 14:30  2026-09-21 14:38     3",  # noqa: E501
        "tool    support-bot  support  lookup_order  3           (first)     2026-09-21 14:38  2026-09-21 14:38     1",  # noqa: E501
        "3 versions seen in the last 7d; runs: finished since first seen; replaced: the version "
        "first seen just before",
    ]
