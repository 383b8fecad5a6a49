"""`loopwatch query` against a tiny local HTTP server serving canned on-call API answers."""

from __future__ import annotations

import json
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from streams.cli.main import main

LOOPS = {
    "by": ["shape", "prompt_version", "tool_version"],
    "since": "1h",
    "rows": [
        {"shape": "retry_storm", "prompt_version": "support-v12", "tool_version": "2", "events": 4},
        {
            "shape": "identical_repetition",
            "prompt_version": "support-v12",
            "tool_version": "3",
            "events": 1200,
        },
        {
            "shape": "oscillation",
            "prompt_version": "support-v11",
            "tool_version": None,
            "events": 4,
        },
    ],
}

RUNS = {
    "since": "24h",
    "rows": [
        {
            "prompt_version": "support-v12",
            "outcome": "complete",
            "termination_reason": "loop_guard",
            "runs": 7,
        },
        {
            "prompt_version": "support-v12",
            "outcome": "complete",
            "termination_reason": "final_answer",
            "runs": 1520,
        },
        {
            "prompt_version": "support-v11",
            "outcome": "incomplete_trace",
            "termination_reason": "unknown",
            "runs": 7,
        },
    ],
}

RUN_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
FP = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
OUT = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

RUN = {
    "run_id": RUN_ID,
    "found": True,
    "finished": False,
    "state": {"steps": 3, "tokens": 1234, "agent": "support", "shapes": ["identical_repetition"]},
    "steps": [
        {
            "position": 2,
            "span_id": "00f067aa0ba902b8",
            "tool_name": "lookup_order",
            "action_fp": FP,
            "outcome_digest": OUT,
            "error_code": "not_found",
        },
        {
            "position": 1,
            "span_id": "00f067aa0ba902b7",
            "tool_name": "lookup_order",
            "action_fp": FP,
            "outcome_digest": OUT,
            "error_code": None,
        },
        {
            "position": 3,
            "span_id": "00f067aa0ba902b9",
            "tool_name": "lookup_order",
            "action_fp": FP,
            "outcome_digest": OUT,
            "error_code": "not_found",
        },
    ],
    "findings": [
        {
            "shape": "identical_repetition",
            "severity": "warning",
            "tool_name": "lookup_order",
            "count": 3,
            "first_sequence": 1,
            "last_sequence": 3,
            "trigger_span_id": "00f067aa0ba902b9",
            "evidence": {"fingerprint": FP},
        }
    ],
}


class Api:
    """Canned answers by path; records every request it gets."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, Any]] = {
            "/loops": (200, LOOPS),
            "/runs": (200, RUNS),
            f"/runs/{RUN_ID}": (200, RUN),
        }
        self.requests: list[tuple[str, dict[str, list[str]], dict[str, str]]] = []
        self.url = ""


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    state = Api()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            parts = urllib.parse.urlsplit(self.path)
            state.requests.append(
                (parts.path, urllib.parse.parse_qs(parts.query), dict(self.headers.items()))
            )
            status, doc = state.routes.get(parts.path, (404, {"error": "no such endpoint"}))
            body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.delenv("LOOPWATCH_API_TOKEN", raising=False)
    monkeypatch.setenv("LOOPWATCH_API", state.url)
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    rc = main(["query", *argv])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_loops_table(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines, err = run(capsys, "loops")
    assert (rc, err) == (0, "")
    assert lines == [
        "shape                 prompt_version  tool_version  events",
        "--------------------  --------------  ------------  ------",
        "identical_repetition  support-v12     3              1,200",
        "oscillation           support-v11     -                  4",
        "retry_storm           support-v12     2                  4",
        "1,208 loop events in the last 1h",
    ]
    [(path, query, _headers)] = api.requests
    assert path == "/loops"
    assert query == {"by": ["shape,prompt_version,tool_version"], "since": ["1h"]}


def test_loops_by_and_since_are_sent(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    api.routes["/loops"] = (
        200,
        {"by": ["tool_version"], "since": "7d", "rows": [{"tool_version": "3", "events": 2}]},
    )
    rc, lines, _ = run(capsys, "loops", "--by", " tool_version ", "--since", "7d")
    assert rc == 0
    assert lines == [
        "tool_version  events",
        "------------  ------",
        "3                  2",
        "2 loop events in the last 7d",
    ]
    assert api.requests[0][1] == {"by": ["tool_version"], "since": ["7d"]}


def test_a_window_longer_than_the_counters_keep_says_so(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes["/loops"] = (
        200,
        {
            "by": ["shape"],
            "since": "7d",
            "covers": "24h",
            "kept": "24h",
            "rows": [{"shape": "retry_storm", "events": 4}],
        },
    )
    rc, lines, _ = run(capsys, "loops", "--by", "shape", "--since", "7d")
    assert rc == 0
    assert lines[-1] == "4 loop events in the last 24h (asked for 7d; the counters keep 24h)"
    api.routes["/runs"] = (200, {"since": "7d", "covers": "24h", "kept": "24h", "rows": []})
    rc, lines, _ = run(capsys, "runs", "--since", "7d")
    assert lines == ["no finished runs in the last 24h (asked for 7d; the counters keep 24h)"]


def test_loops_of_one_slice_send_the_label_filters(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes["/loops"] = (
        200,
        {"by": ["tool_version"], "since": "1h", "rows": [{"tool_version": "3", "events": 5}]},
    )
    rc, lines, _ = run(
        capsys,
        "loops",
        "--by",
        "tool_version",
        "--shape",
        "retry_storm",
        "--prompt-version",
        "support-v12",
        "--tool",
        "lookup_order",
        "--service",
        "support-bot",
        "--agent",
        "refunds",
    )
    assert rc == 0
    assert lines[-1] == (
        "5 loop events in the last 1h where shape=retry_storm, prompt_version=support-v12, "
        "tool_name=lookup_order, service_name=support-bot, agent_name=refunds"
    )
    assert api.requests[0][1] == {
        "by": ["tool_version"],
        "since": ["1h"],
        "shape": ["retry_storm"],
        "prompt_version": ["support-v12"],
        "tool_name": ["lookup_order"],
        "service_name": ["support-bot"],
        "agent_name": ["refunds"],
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("loops", "--shape", "spinning"), "--shape: unknown shape 'spinning'; shapes: "),
        (("runs", "--tool", "x"), "`loopwatch query runs` takes no label filter"),
    ],
)
def test_bad_label_filters_are_one_line_before_any_request(
    api: Api, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    rc, _lines, err = run(capsys, *argv)
    assert rc == 2 and message in err and api.requests == []


def test_the_runs_behind_a_slice_newest_first(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    other = RUN_ID[:14] + "ff" + RUN_ID[16:]  # shares 14 characters with RUN_ID
    rows = [
        {
            "detected_ns": 1_796_300_060_000_000_000,
            "run_id": other,
            "trace_id": other,
            "shape": "retry_storm",
            "tool_name": "get_export_status",
            "tool_version": "3",
            "count": 4,
            "wasted_steps": 3,
            "wasted_tokens": 1200,
            "run_status": "in progress",
            "trace_url": f"https://tempo.example/trace/{other}",
            "event_id": "e2",
        },
        {
            "detected_ns": 1_796_300_000_000_000_000,
            "run_id": RUN_ID,
            "trace_id": RUN_ID,
            "shape": "retry_storm",
            "tool_name": "get_export_status",
            "count": 3,
            "wasted_steps": 2,
            "wasted_tokens": 0,
            "run_status": "finished",
            "outcome": "complete",
            "termination_reason": "turn_limit",
            "event_id": "e1",
        },
    ]
    api.routes["/episodes"] = (
        200,
        {"where": {"shape": "retry_storm"}, "since": "1h", "covers": "1h", "rows": rows},
    )
    rc, lines, _ = run(capsys, "loops", "--shape", "retry_storm", "--runs", "--limit", "5")
    assert rc == 0
    assert lines[0].split() == [
        "detected",
        "run",
        "shape",
        "tool",
        "count",
        "wasted_steps",
        "wasted_tokens",
        "run_status",
        "trace",
    ]
    first, second = lines[2].split(), lines[3].split()
    assert first[2] == other[:15] and second[2] == RUN_ID[:15]  # unique in the output
    assert first[-1] == f"https://tempo.example/trace/{other}" and second[-1] == RUN_ID
    assert "complete/turn_limit" in second and "get_export_status@3" in first
    assert lines[-1] == (
        "2 latest loop episodes of 2 runs in the last 1h where shape=retry_storm; "
        "`loopwatch query run RUN` shows one"
    )
    assert api.requests[0][:2] == (
        "/episodes",
        {"since": ["1h"], "limit": ["5"], "shape": ["retry_storm"]},
    )


def test_a_slice_row_says_how_many_runs_looped_and_when(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes["/loops"] = (
        200,
        {
            "by": ["shape"],
            "since": "1h",
            "rows": [
                {
                    "shape": "retry_storm",
                    "events": 12,
                    "looping_runs": 9,
                    "first_ns": 1_796_300_000_000_000_000,
                    "last_ns": 1_796_303_000_000_000_000,
                },
            ],
        },
    )
    rc, lines, _ = run(capsys, "loops", "--by", "shape")
    assert rc == 0
    assert lines[:3] == [
        "shape        events  runs  first_seen      last_seen",
        "-----------  ------  ----  --------------  --------------",
        "retry_storm      12     9  12-03 12:13:20  12-03 13:03:20",
    ]


def test_loops_empty(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    api.routes["/loops"] = (200, {"by": ["shape"], "since": "30m", "rows": []})
    rc, lines, _ = run(capsys, "loops", "--by", "shape", "--since", "30m")
    assert (rc, lines) == (0, ["no loop events in the last 30m"])


def test_runs_table(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines, err = run(capsys, "runs", "--since", "24h")
    assert (rc, err) == (0, "")
    assert lines == [
        "prompt_version  outcome           termination_reason   runs",
        "--------------  ----------------  ------------------  -----",
        "support-v12     complete          final_answer        1,520",
        "support-v11     incomplete_trace  unknown                 7",
        "support-v12     complete          loop_guard              7",
        "1,534 runs finished in the last 24h",
    ]
    assert api.requests[0][:2] == ("/runs", {"since": ["24h"]})


def test_run_detail(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines, err = run(capsys, "run", RUN_ID)
    assert (rc, err) == (0, "")
    assert lines == [
        f"run       {RUN_ID}",
        "status    in progress",
        "state",
        "  agent   support",
        '  shapes  ["identical_repetition"]',
        "  steps   3",
        "  tokens  1,234",
        "steps (3)",
        "  position  span_id           tool_name     action_fp      outcome_digest  error_code",
        "  --------  ----------------  ------------  -------------  --------------  ----------",
        "         1  00f067aa0ba902b7  lookup_order  9f86d081884c…  e3b0c44298fc…   -",
        "         2  00f067aa0ba902b8  lookup_order  9f86d081884c…  e3b0c44298fc…   not_found",
        "         3  00f067aa0ba902b9  lookup_order  9f86d081884c…  e3b0c44298fc…   not_found",
        "findings (1)",
        "  shape                 severity  tool_name     count  first_sequence  last_sequence"
        "  trigger_span_id",
        "  --------------------  --------  ------------  -----  --------------  -------------"
        "  ----------------",
        "  identical_repetition  warning   lookup_order      3               1              3"
        "  00f067aa0ba902b9",
    ]
    assert api.requests[0][0] == f"/runs/{RUN_ID}"


def test_run_detail_shows_the_whole_trace_link(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "https://grafana.example/explore?left=" + "x" * 80 + "&trace=" + RUN_ID
    api.routes[f"/runs/{RUN_ID}"] = (200, {**RUN, "trace_url": url})
    rc, lines, _ = run(capsys, "run", RUN_ID)
    assert rc == 0
    assert lines[2] == f"trace     {url}"


FINISHED = {
    "run_id": RUN_ID,
    "found": True,
    "finished": True,
    "finished_at_ns": 1_796_300_000_000_000_000,
    "kept_until_ns": 1_796_904_800_000_000_000,
    "summary": {
        "run_id": RUN_ID,
        "outcome": "complete",
        "termination_reason": "final_answer",
        "termination_evidence": "default",
        "prompt_version": "support-v12",
        "shapes": ["identical_repetition"],
        "steps": 5,
        "tool_calls": 4,
    },
    "events": [
        {
            "detected_at": "2026-12-03T12:00:00.000000Z",
            "shape": "identical_repetition",
            "severity": "warning",
            "tool_name": "lookup_order",
            "count": 3,
            "wasted_steps": 1,
            "wasted_tokens": 0,
            "recommended_action": "inject_attempt_history",
            "trigger_span_id": "00f067aa0ba902b9",
        }
    ],
    "timeline": RUN["steps"],
    "retention": {"looping_hours": 168, "clean_hours": 24},
}


def test_a_finished_run_shows_its_summary_events_and_last_steps(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes[f"/runs/{RUN_ID}"] = (200, FINISHED)
    rc, lines, err = run(capsys, "run", RUN_ID)
    assert (rc, err) == (0, "")
    assert lines[:3] == [
        f"run       {RUN_ID}",
        "status    finished (kept until 2026-12-10 12:13 UTC)",
        "summary",
    ]
    assert "  outcome               complete" in lines
    assert '  shapes                ["identical_repetition"]' in lines
    assert lines.index("loop events (1)") < lines.index("last tool steps (3)")
    steps = lines[lines.index("last tool steps (3)") + 3 :]
    assert [line.split()[0] for line in steps] == ["1", "2", "3"]


def test_a_finished_run_shows_whether_a_refund_went_out_before_its_loop(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = [
        {
            "tool": "issue_refund",
            "span_id": "00f067aa0ba902b1",
            "end_ns": 1_796_300_000_000_000_000,
            "business": "5e884898da28",
            "idempotency_key": "new",
            "outcome": "ok",
            "reconciled": False,
            "committed_before_first_loop": True,
        },
        {
            "tool": "issue_refund",
            "span_id": "00f067aa0ba902b5",
            "end_ns": 1_796_300_060_000_000_000,
            "business": "5e884898da28",
            "idempotency_key": "missing",
            "outcome": "ok",
            "reconciled": False,
            "committed_before_first_loop": False,
        },
    ]
    api.routes[f"/runs/{RUN_ID}"] = (200, {**FINISHED, "side_effects": calls})
    rc, lines, _ = run(capsys, "run", RUN_ID)
    assert rc == 0
    at = lines.index("side effects (2): 1 committed before the first loop event")
    assert lines[at + 1].split() == [
        "at",
        "tool",
        "business",
        "idempotency_key",
        "outcome",
        "reconciled",
        "committed_before_first_loop",
        "span_id",
    ]
    assert lines[at + 3].split()[:7] == [
        "12:13:20",
        "issue_refund",
        "5e884898da28",
        "new",
        "ok",
        "no",
        "yes",
    ]


def test_a_run_neither_in_flight_nor_kept_names_the_retention(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes[f"/runs/{RUN_ID}"] = (
        200,
        {
            "run_id": RUN_ID,
            "found": False,
            "finished": False,
            "steps": [],
            "findings": [],
            "retention": {"looping_hours": 168, "clean_hours": 24},
        },
    )
    api.routes["/find"] = (200, {"run": RUN_ID, "matches": []})
    rc, lines, err = run(capsys, "run", RUN_ID)
    assert rc == 2 and lines == []
    assert err.strip() == (
        f"loopwatch: error: run {RUN_ID} not found: not in flight, and not among the runs "
        "finished in the last 7d (runs without loops: 24h; LOOPWATCH_RUN_RETENTION_HOURS)"
    )


MISS = {"found": False, "finished": False, "retention": {"looping_hours": 168, "clean_hours": 24}}


def test_a_run_id_prefix_as_the_tables_print_it_finds_the_run(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes[f"/runs/{RUN_ID[:12]}"] = (200, {"run_id": RUN_ID[:12], **MISS})
    api.routes["/find"] = (
        200,
        {"run": RUN_ID[:12], "matches": [{"run_id": RUN_ID, "status": "finished"}]},
    )
    api.routes[f"/runs/{RUN_ID}"] = (200, FINISHED)
    rc, lines, err = run(capsys, "run", RUN_ID[:12])
    assert (rc, err) == (0, "") and lines[0] == f"run       {RUN_ID}"
    assert [r[0] for r in api.requests] == [f"/runs/{RUN_ID[:12]}", "/find", f"/runs/{RUN_ID}"]
    assert api.requests[1][1] == {"run": [RUN_ID[:12]]}


def test_an_ambiguous_prefix_lists_the_candidates(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes["/runs/4bf92f35"] = (200, {"run_id": "4bf92f35", **MISS})
    other = "4bf92f35" + "0" * 24
    api.routes["/find"] = (
        200,
        {
            "matches": [
                {"run_id": RUN_ID, "status": "finished", "shapes": ["retry_storm"]},
                {"run_id": other, "status": "in progress"},
            ]
        },
    )
    rc, lines, err = run(capsys, "run", "4bf92f35")
    assert rc == 2 and lines == []
    assert err.strip() == (
        f"loopwatch: error: 2 runs start with 4bf92f35: {RUN_ID} (finished, retry_storm); "
        f"{other} (in progress); give more characters"
    )


def test_no_run_with_the_prefix_names_the_retention(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes["/runs/deadbeef00"] = (200, {"run_id": "deadbeef00", **MISS})
    api.routes["/find"] = (200, {"matches": [], **MISS})
    rc, _lines, err = run(capsys, "run", "deadbeef00")
    assert rc == 2 and "run deadbeef00 not found: not in flight, and not among the runs" in err


def test_an_id_that_is_no_prefix_is_not_searched(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api.routes["/runs/conv-7"] = (200, {"run_id": "conv-7", **MISS})
    rc, _lines, err = run(capsys, "run", "conv-7")
    assert rc == 2 and "run conv-7 not found" in err
    assert [r[0] for r in api.requests] == ["/runs/conv-7"]


def test_run_id_is_quoted(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    api.routes["/runs/conv%2F7%20a"] = (200, {**RUN, "run_id": "conv/7 a", "finished": True})
    rc, lines, _ = run(capsys, "run", "conv/7 a")
    assert rc == 0
    assert lines[:2] == ["run       conv/7 a", "status    finished"]
    assert api.requests[0][0] == "/runs/conv%2F7%20a"


@pytest.mark.parametrize(
    ("argv", "doc"),
    [(["loops"], LOOPS), (["runs"], RUNS), (["run", RUN_ID], RUN)],
)
def test_json_output(
    api: Api, capsys: pytest.CaptureFixture[str], argv: list[str], doc: Any
) -> None:
    rc = main(["query", *argv, "--json"])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    assert json.loads(out) == doc
    assert out.endswith("\n")


def test_run_not_found(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines, err = run(capsys, "run", "nope")
    assert (rc, lines) == (2, [])
    assert err == "loopwatch: error: run nope not found (finished runs are in loop_runs)\n"


def test_run_found_false_is_not_found(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    api.routes["/runs/gone"] = (200, {"run_id": "gone", "found": False})
    rc, _, err = run(capsys, "run", "gone")
    assert rc == 2
    assert err == "loopwatch: error: run gone not found (finished runs are in loop_runs)\n"


def test_http_400_shows_server_message(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    api.routes["/loops"] = (400, {"error": "since: at most 7d of history is kept"})
    rc, lines, err = run(capsys, "loops", "--since", "30d")
    assert (rc, lines) == (2, [])
    assert err == "loopwatch: error: since: at most 7d of history is kept (HTTP 400)\n"


def test_http_401_hints_at_the_token(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    api.routes["/runs"] = (401, {"error": "missing bearer token"})
    rc, _, err = run(capsys, "runs")
    assert rc == 2
    assert err == (
        "loopwatch: error: the on-call API refused /runs: missing bearer token"
        " (HTTP 401; set LOOPWATCH_API_TOKEN)\n"
    )


def test_http_500(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    api.routes["/runs"] = (500, b"Internal Server Error\nTraceback (most recent call last): ...")
    rc, _, err = run(capsys, "runs")
    assert rc == 2
    assert err == (
        f"loopwatch: error: the on-call API at {api.url} failed on /runs:"
        " Internal Server Error (HTTP 500)\n"
    )


def test_invalid_json_answer(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    api.routes["/runs"] = (200, b"<html>not json</html>")
    rc, _, err = run(capsys, "runs")
    assert rc == 2
    assert err == (
        f"loopwatch: error: the on-call API at {api.url} answered /runs with invalid JSON\n"
    )


def test_token_header(
    api: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run(capsys, "runs")
    assert "Authorization" not in api.requests[-1][2]
    monkeypatch.setenv("LOOPWATCH_API_TOKEN", "s3cret-token")
    rc, _, _ = run(capsys, "runs")
    assert rc == 0
    assert api.requests[-1][2]["Authorization"] == "Bearer s3cret-token"


def test_url_flag_beats_environment(
    api: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOPWATCH_API", f"http://127.0.0.1:{unused_port()}")
    rc, lines, _ = run(capsys, "runs", "--url", api.url + "/")
    assert rc == 0 and lines[0].startswith("prompt_version")


def test_connection_refused(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{unused_port()}"
    rc, lines, err = run(capsys, "loops", "--url", url)
    assert (rc, lines) == (2, [])
    assert err == (
        f"loopwatch: error: cannot reach the on-call API at {url}: is `loopwatch worker` running?\n"
    )


@pytest.mark.parametrize("since", ["5x", "0h", "1.5h", "h", "-1h", "1w", "400d", ""])
def test_bad_since_rejected_before_any_request(
    api: Api, capsys: pytest.CaptureFixture[str], since: str
) -> None:
    rc, lines, err = run(capsys, "loops", f"--since={since}")
    assert (rc, lines) == (2, [])
    assert err.startswith(f"loopwatch: error: --since {since!r}: ")
    assert err.count("\n") == 1
    assert api.requests == []


@pytest.mark.parametrize(
    ("by", "message"),
    [
        (
            "shape,foo",
            "--by: unknown label 'foo'; labels: shape, prompt_version, tool_name, tool_version, service_name, agent_name",
        ),
        (
            "run_id",
            "--by: unknown label 'run_id'; labels: shape, prompt_version, tool_name, tool_version, service_name, agent_name",
        ),
        ("shape,shape", "--by: label 'shape' given twice"),
        ("shape,,tool_version", "--by 'shape,,tool_version': expected comma-separated labels"),
        ("", "--by '': expected comma-separated labels"),
    ],
)
def test_bad_by_rejected_before_any_request(
    api: Api, capsys: pytest.CaptureFixture[str], by: str, message: str
) -> None:
    rc, lines, err = run(capsys, "loops", f"--by={by}")
    assert (rc, lines) == (2, [])
    assert err.startswith(f"loopwatch: error: {message}")
    assert api.requests == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run"], "`loopwatch query run` needs a RUN_ID"),
        (["runs", "abc"], "`loopwatch query runs` takes no RUN_ID (did you mean `run`?)"),
        (["runs", "--url", "ftp://example.org"], "on-call API URL 'ftp://example.org'"),
    ],
)
def test_bad_arguments(
    api: Api, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert err.startswith(f"loopwatch: error: {message}")
    assert api.requests == []
