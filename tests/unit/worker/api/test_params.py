"""The on-call API's parameters are one contract (streams/worker/api/params.py): `loopwatch query`
rejects before any request exactly what the worker's API would answer 400 for, each naming
the parameter its own way. They were two parsers with two rules (the CLI refused a bare
number of seconds the API took, and spelled its errors differently)."""

from __future__ import annotations

import pytest

from detectors.errors import LoopwatchError
from streams.cli import query
from streams.worker.api import answers as api

BAD_SINCE = ["5x", "0h", "0", "1.5h", "h", "-1h", "1w", "400d", "367d", "", "abc", "1h ago"]
GOOD_SINCE = [
    ("90s", "90s", 90),
    ("600", "600", 600),
    ("007d", "7d", 604800),
    ("24h", "24h", 86400),
]
BAD_BY = ["", "shape,", "colour", "shape,shape", "shape,,tool_version", "run_id"]


@pytest.mark.parametrize("text", BAD_SINCE)
def test_both_ends_reject_the_same_windows(text: str) -> None:
    with pytest.raises(LoopwatchError, match=r"^--since ") as cli:
        query.parse_since(text)
    with pytest.raises(api.BadRequest, match=r"^since ") as server:
        api.parse_since(text)
    assert str(cli.value).removeprefix("--since") == str(server.value).removeprefix("since")


@pytest.mark.parametrize(("text", "canonical", "seconds"), GOOD_SINCE)
def test_both_ends_read_a_window_alike(text: str, canonical: str, seconds: int) -> None:
    assert query.parse_since(text) == canonical
    assert api.parse_since(text) == (canonical, seconds)


@pytest.mark.parametrize("text", BAD_BY)
def test_both_ends_reject_the_same_labels(text: str) -> None:
    with pytest.raises(LoopwatchError) as cli:
        query.parse_by(text)
    with pytest.raises(api.BadRequest) as server:
        api.parse_by(text)
    assert str(cli.value).removeprefix("--by") == str(server.value).removeprefix("by")


def test_both_ends_read_labels_alike() -> None:
    assert query.parse_by(" tool_version, shape") == api.parse_by(" tool_version, shape")
    assert api.parse_by(None) == query.parse_by("shape,prompt_version,tool_version")
