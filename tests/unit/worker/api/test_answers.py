"""Pure parts of the worker's API and outputs: query parameters, windowed sums, bearer
token, dead letters."""

from __future__ import annotations

import hashlib
import json

import pytest

from streams.worker.agents.dead_letters import dead_letter_key, dead_letter_record
from streams.worker.api.answers import (
    BadRequest,
    check_bearer,
    merge_rows,
    parse_by,
    parse_since,
    sum_windows,
)
from streams.worker.api.params import LOOP_LABELS, RUN_LABELS
from streams.worker.state.window_keys import aggregate_key


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1h", 3600), ("90s", 90), ("15m", 900), ("1d", 86400), ("24h", 86400), ("600", 600)],
)
def test_parse_since(text: str, seconds: int) -> None:
    assert parse_since(text) == (text, seconds)


def test_parse_since_default_and_long_windows() -> None:
    assert parse_since(None) == ("1h", 3600)
    assert parse_since("7d")[1] == 7 * 86400  # accepted; the counters keep 24 h


@pytest.mark.parametrize("text", ["abc", "-1h", "0h", "0", "1w", "1.5h", "", "h", "1h ago", "367d"])
def test_parse_since_rejects(text: str) -> None:
    with pytest.raises(BadRequest, match="since"):
        parse_since(text)


def test_parse_by() -> None:
    assert parse_by(None) == ["shape", "prompt_version", "tool_version"]
    assert parse_by("tool_name") == ["tool_name"]
    assert parse_by("shape") == ["shape"]
    assert parse_by("tool_version, shape") == ["tool_version", "shape"]
    for bad in ("", "shape,", "colour", "shape,shape", "shape,,tool_version"):
        with pytest.raises(BadRequest):
            parse_by(bad)


def test_sum_windows_filters_by_label_and_reads_counts_from_before_tool_name() -> None:
    now = 10_000.0
    raw = items(
        (("retry_storm", "v2", "search_kb", None, "bot", "support"), 0, now, 4),
        (("retry_storm", "v3", "search_kb", "2", "bot", "billing"), 0, now, 1),
        (("identical_repetition", None, "lookup_order", "3", "bot", None), 0, now, 2),
        (("retry_storm", "v2", None), 0, now, 7),  # a key written before tool etc. were labels
    )
    assert sum_windows(
        raw, LOOP_LABELS, ["prompt_version"], 3600, now, "events", {"shape": "retry_storm"}
    ) == [
        {"prompt_version": "v2", "events": 11},
        {"prompt_version": "v3", "events": 1},
    ]
    assert sum_windows(
        raw, LOOP_LABELS, ["tool_name"], 3600, now, "events", {"tool_version": "unknown"}
    ) == [
        {"tool_name": None, "events": 7},
        {"tool_name": "search_kb", "events": 4},
    ]
    assert sum_windows(
        raw, LOOP_LABELS, ["agent_name"], 3600, now, "events", {"service_name": "bot"}
    ) == [
        {"agent_name": "support", "events": 4},
        {"agent_name": None, "events": 2},
        {"agent_name": "billing", "events": 1},
    ]
    unknown_prompt = {"prompt_version": "unknown", "tool_name": "lookup_order"}
    assert sum_windows(raw, LOOP_LABELS, ["shape"], 3600, now, "events", unknown_prompt) == [
        {"shape": "identical_repetition", "events": 2}
    ]


def test_label_filters_are_checked() -> None:
    from streams.worker.api.answers import parse_filters

    assert parse_filters({"shape": " retry_storm ", "tool_name": "lookup_order", "x": "y"}) == {
        "shape": "retry_storm",
        "tool_name": "lookup_order",
    }
    with pytest.raises(BadRequest, match="shape: unknown shape 'spin'"):
        parse_filters({"shape": "spin"})
    with pytest.raises(BadRequest, match="prompt_version ' ': expected a value of 1 to 256"):
        parse_filters({"prompt_version": " "})


def items(*rows: tuple[tuple[object, ...], int, float, int]) -> list[tuple[object, int]]:
    """(labels, partition, window end, count) -> raw windowed-table items."""
    return [((aggregate_key(labels, p), (end - 60, end)), n) for labels, p, end, n in rows]


def test_sum_windows_groups_and_filters_by_time() -> None:
    now = 10_000.0
    raw = items(
        (("identical_repetition", "v1", "lookup_order", "3", "bot", "support"), 0, now, 2),
        # another partition, same labels
        (("identical_repetition", "v1", "lookup_order", "3", "bot", "support"), 1, now - 120, 1),
        (("retry_storm", "v2", "search_kb", None, "bot", None), 0, now - 30, 4),
        (("identical_repetition", "v1", "lookup_order", "3", "bot", "support"), 0, now - 7200, 50),
    )
    rows = sum_windows(raw, LOOP_LABELS, ["shape"], 3600, now, "events")
    assert rows == [
        {"shape": "retry_storm", "events": 4},
        {"shape": "identical_repetition", "events": 3},
    ]
    rows = sum_windows(raw, LOOP_LABELS, list(LOOP_LABELS), 3600, now, "events")
    assert {
        "shape": "retry_storm",
        "prompt_version": "v2",
        "tool_name": "search_kb",
        "tool_version": None,
        "service_name": "bot",
        "agent_name": None,
        "events": 4,
    } in rows
    assert (
        sum(r["events"] for r in sum_windows(raw, LOOP_LABELS, ["shape"], 86400, now, "events"))
        == 57
    )
    # JSON-list keys (how the rocksdb store gives them back) read the same
    as_lists = [([k[0], list(k[1])], v) for k, v in raw]
    assert sum_windows(as_lists, LOOP_LABELS, ["shape"], 3600, now, "events") == sum_windows(
        raw, LOOP_LABELS, ["shape"], 3600, now, "events"
    )


def test_merge_rows_sums_answers_of_several_workers() -> None:
    by = ["prompt_version", "outcome", "termination_reason"]
    rows = [
        {
            "prompt_version": "v1",
            "outcome": "complete",
            "termination_reason": "final_answer",
            "runs": 3,
        },
        {
            "prompt_version": "v1",
            "outcome": "complete",
            "termination_reason": "final_answer",
            "runs": 2,
        },
        {
            "prompt_version": None,
            "outcome": "incomplete_trace",
            "termination_reason": "unknown",
            "runs": 1,
        },
    ]
    merged = merge_rows(rows, by, "runs")
    assert merged[0]["runs"] == 5 and len(merged) == 2
    assert tuple(by) == RUN_LABELS


def test_bearer_token() -> None:
    assert check_bearer(None, None) and check_bearer("anything", None)
    assert check_bearer("Bearer t0k", "t0k")
    assert not check_bearer(None, "t0k")
    assert not check_bearer("Bearer wrong", "t0k")
    assert not check_bearer("t0k", "t0k")
    assert not check_bearer("Basic t0k", "t0k")


def test_dead_letter_carries_a_digest_not_the_payload() -> None:
    payload = b'{"resourceSpans": "customer@example.com"'
    value, headers = dead_letter_record(
        payload,
        reason="decode_error",
        error="otlp/2@17: invalid JSON at line 1",
        topic="otlp",
        partition=2,
        offset=17,
        capture_payload=False,
    )
    h = dict(headers)
    assert h["reason"] == b"decode_error" and h["source_topic"] == b"otlp"
    assert h["source_partition"] == b"2" and h["source_offset"] == b"17"
    assert h["error"] == b"otlp/2@17: invalid JSON at line 1"
    assert b"customer" not in value and all(b"customer" not in v for v in h.values())
    body = json.loads(value)
    assert body["payload_sha256"] == hashlib.sha256(payload).hexdigest()
    assert body["payload_length"] == len(payload)

    value, headers = dead_letter_record(
        payload,
        reason="decode_error",
        error="x",
        topic="t",
        partition=0,
        offset=0,
        capture_payload=True,
    )
    assert value == payload and dict(headers)["payload_captured"] == b"true"
    value, _ = dead_letter_record(
        None,
        reason="decode_error",
        error="x",
        topic="t",
        partition=0,
        offset=0,
        capture_payload=False,
    )
    assert json.loads(value)["payload_length"] == 0


def test_dead_letter_key_keeps_trace_ids_and_digests_anything_else() -> None:
    trace_key = b"0af7651916cd43dd8448eb211c80319c"
    assert dead_letter_key(trace_key, capture_payload=False) == trace_key
    assert dead_letter_key(None, capture_payload=False) is None
    secret = b"customer@example.com"
    digested = dead_letter_key(secret, capture_payload=False)
    assert digested == hashlib.sha256(secret).hexdigest().encode()
    assert digested == dead_letter_key(secret, capture_payload=False)  # same partition
    assert (
        dead_letter_key(b"0AF7651916CD43DD8448EB211C80319C", False)
        != b"0AF7651916CD43DD8448EB211C80319C"
    )
    assert dead_letter_key(secret, capture_payload=True) == secret  # the operator opted in


def test_an_answer_says_the_window_it_covers() -> None:
    from streams.worker.api.answers import window

    day = 86400
    assert window("1h", 3600, day) == ({"since": "1h", "covers": "1h", "kept": "24h"}, 3600)
    assert window("7d", 7 * day, day) == ({"since": "7d", "covers": "24h", "kept": "24h"}, day)
    assert window("86400", day, day)[0]["covers"] == "86400"  # as asked: all of it


def test_durations_read_as_people_write_them() -> None:
    from streams.worker.api.params import duration_text

    assert [duration_text(s) for s in (86400, 7 * 86400, 3600, 5400, 90, 61)] == [
        "24h",
        "7d",
        "1h",
        "90m",
        "90s",
        "61s",
    ]


def test_a_prefix_is_eight_to_64_hex_characters() -> None:
    from streams.worker.api.answers import parse_prefix

    assert parse_prefix(" 773FD730e9 ") == "773fd730e9"
    for bad in (None, "", "773fd73", "773fd730-x", "g" * 8, "a" * 65):
        with pytest.raises(BadRequest, match="expected 8 to 64 hex characters"):
            parse_prefix(bad)


def test_find_runs_in_flight_and_kept_by_prefix() -> None:
    from streams.worker.api.answers import MAX_MATCHES, find_runs, merge_matches
    from streams.worker.state.retained import encode

    def scan(table: dict[bytes, bytes], partition: int, prefix: bytes, limit: int) -> list:
        return sorted((k, v) for k, v in table.items() if k.startswith(prefix))[:limit]

    runs = {b"773fd730aa": b"state", b"11111111bb": b"state"}
    kept = {
        b"773fd730cc": encode(
            {"summary": {"outcome": "complete", "shapes": ["retry_storm"]}}, 0, 9, 5
        ),
        b"773fd730aa": encode({"events": []}, 0, 9, 0),  # in flight, with events: in flight
    }
    got = find_runs("773fd730", [0, 1], runs, kept, scan)
    assert got == [
        {"run_id": "773fd730aa", "status": "in progress"},
        {
            "run_id": "773fd730cc",
            "status": "finished",
            "finished_at_ns": 5,
            "outcome": "complete",
            "shapes": ["retry_storm"],
        },
    ]
    assert find_runs("773fd730", [0], runs, None, scan) == [got[0]]
    many = merge_matches([[{"run_id": f"{i:08x}"} for i in range(30)], got])
    assert len(many) == MAX_MATCHES and many[0]["run_id"] == "00000000"


def test_a_slice_says_how_many_runs_looped_and_when() -> None:
    from streams.worker.api.answers import add_spread, merge_rows
    from streams.worker.state import episodes

    def ep(at: int, run: str, shape: str = "retry_storm") -> tuple[bytes, bytes]:
        event = {"event_id": f"e{at}", "run_id": run, "shape": shape, "prompt_version": "v1"}
        return episodes.key(event, at), episodes.encode(event)

    table = dict(
        [ep(10, "r1"), ep(20, "r1"), ep(30, "r2"), ep(40, "r3", "oscillation"), ep(5, "r9")]
    )

    def newest(t: dict[bytes, bytes], partition: int) -> list[tuple[bytes, bytes]]:
        return sorted(t.items(), reverse=True)

    rows = [{"shape": "retry_storm", "events": 3}, {"shape": "oscillation", "events": 1}]
    assert add_spread(rows, ["shape"], [0], table, newest, 10, {})
    assert rows == [
        {"shape": "retry_storm", "events": 3, "looping_runs": 2, "first_ns": 10, "last_ns": 30},
        {"shape": "oscillation", "events": 1, "looping_runs": 1, "first_ns": 40, "last_ns": 40},
    ]
    assert not add_spread([dict(r) for r in rows], ["shape"], [0], table, newest, 0, {}, cap=2)
    other = [{"shape": "retry_storm", "events": 2, "looping_runs": 1, "first_ns": 7, "last_ns": 8}]
    merged = merge_rows(rows + other, ["shape"], "events")
    assert merged[0] == {
        "shape": "retry_storm",
        "events": 5,
        "looping_runs": 3,
        "first_ns": 7,
        "last_ns": 30,
    }
