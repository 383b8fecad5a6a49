"""bench/__main__.py's PartialResults: what a `make bench` run measured survives its crash."""

from __future__ import annotations

import json
from pathlib import Path

from bench.__main__ import PartialResults


def test_each_part_is_on_disk_as_soon_as_it_is_measured(tmp_path: Path) -> None:
    """A run died in its two-worker round's cleanup 12 minutes in, and everything it had
    measured went with it: the results were written only at the end."""
    results: dict[str, object] = {"machine": "test"}
    partial = PartialResults(results, tmp_path / "results" / "bench-1.partial.json")
    partial.keep("replay", {"replay_spans_per_s": 1.0})
    partial.keep("e2e", {"one_worker": {"worker_spans_per_s": 2.0}})
    on_disk = json.loads((tmp_path / "results" / "bench-1.partial.json").read_text())
    assert on_disk == {
        "machine": "test",
        "replay": {"replay_spans_per_s": 1.0},
        "e2e": {"one_worker": {"worker_spans_per_s": 2.0}},
    }


def test_finish_writes_the_results_file_and_drops_the_partial_one(tmp_path: Path) -> None:
    partial = PartialResults({"machine": "test"}, tmp_path / "bench-1.partial.json")
    partial.keep("guard", {"before_tool_us": 3.0})
    final = partial.finish()
    assert final == tmp_path / "bench-1.json"
    assert json.loads(final.read_text())["guard"] == {"before_tool_us": 3.0}
    assert not (tmp_path / "bench-1.partial.json").exists()
