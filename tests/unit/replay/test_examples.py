"""The example corpus (real opentelemetry-sdk output) against its oracle, examples/expected.json,
which the generator wrote from the scenario definitions, not from any detector.

Also the delivery-invariance property: random batching, shuffled batch order and duplicated
records give the same set of events as the file order."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detectors.fingerprint import Fingerprinter
from detectors.policy import Policy, load_policy
from streams.replay.engine import Engine
from streams.replay.files import iter_batches
from streams.spanpath.spans import SpanRecord
from tests.paths import REPO

ROOT = REPO
EXAMPLES = ROOT / "examples"
EXPECTED = json.loads((EXAMPLES / "expected.json").read_text())["files"]
POLICY = load_policy(EXAMPLES / "loopwatch.yaml")


def batches_of(path: Path) -> list[list[SpanRecord]]:
    errors: list[Exception] = []
    batches = [spans for _source, spans in iter_batches([path], errors.append)]
    assert errors == []
    return batches


def run(batches: list[list[SpanRecord]], policy: Policy = POLICY):
    events, runs = [], []
    engine = Engine(policy, Fingerprinter(b"example-key"), events.append, runs.append)
    for batch in batches:
        engine.feed(batch)
    engine.close()
    return events, runs


def test_every_example_file_has_an_oracle():
    files = sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".pb", ".jsonl"))
    assert files and files == sorted(EXPECTED)
    shapes_covered = {f["shape"] for e in EXPECTED.values() for f in e["findings"]}
    from alerts.events import SHAPES

    assert shapes_covered == set(SHAPES)  # a finding for every shape
    assert sum(1 for name in EXPECTED if name.startswith("negative__")) >= 8


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_matches_its_oracle(name):
    expected = EXPECTED[name]
    events, runs = run(batches_of(EXAMPLES / name))
    got = sorted((e["run_id"], e["shape"], e["trigger_span_id"]) for e in events)
    want = sorted(
        (f["run_trace_id"], f["shape"], f["trigger_span_id"]) for f in expected["findings"]
    )
    assert got == want
    assert len(runs) == expected["runs"]
    assert sum(r["duplicate_spans"] for r in runs) == expected["duplicate_spans"]
    assert sum(r["parallel_duplicate_calls"] for r in runs) == expected["parallel_duplicate_calls"]
    assert all(r["outcome"] == "complete" for r in runs)
    by_trigger = {f["trigger_span_id"]: f for f in expected["findings"]}
    from alerts.events import EVENT_FIELDS

    for event in events:
        assert tuple(event) == EVENT_FIELDS  # the schema's fields, in its order
        call = by_trigger[event["trigger_span_id"]].get("trigger_call_id")
        if call:
            assert call in event["call_ids"]


def test_seed_scenarios_score_fields():
    _, runs = run(batches_of(EXAMPLES / "identical_repetition__lookup_order.pb"))
    (summary,) = runs
    assert summary["termination_reason"] == "loop_guard"
    assert (
        summary["stalled_repeat"],
        summary["guard_fired"],
        summary["guard_before_dispatch"],
    ) == (True, True, False)
    _, runs = run(batches_of(EXAMPLES / "negative__export_polling.pb"))
    assert runs[0]["stalled_repeat"] is False and runs[0]["progress_observed"] is True
    _, runs = run(batches_of(EXAMPLES / "negative__pagination.pb"))
    assert runs[0]["distinct_actions"] == 1 and runs[0]["progress_observed"] is True
    _, runs = run(batches_of(EXAMPLES / "identical_repetition__get_order_404.jsonl"))
    assert runs[0]["termination_reason"] == "turn_limit"


# ---------------------------------------------------------------- delivery invariance

ALL_SPANS = [
    span for name in sorted(EXPECTED) for batch in batches_of(EXAMPLES / name) for span in batch
]
# Within these bounds no span is late and no run finalizes before its last span: the
# property is that delivery (batching, order, duplicates) then cannot change the events.
PATIENT = load_policy(EXAMPLES / "loopwatch.yaml")
PATIENT = dataclasses.replace(
    PATIENT,
    allowed_lateness_seconds=1e6,
    finalize_grace_seconds=1e6,
    idle_timeout_seconds=1e7,
    release_on_sequence=False,
)
BASELINE = {e["event_id"]: e for e in run([ALL_SPANS], PATIENT)[0]}


def test_baseline_has_events_of_every_expected_file():
    want = sum(len(e["findings"]) for e in EXPECTED.values())
    assert len(BASELINE) == want


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), batch_size=st.integers(1, 40), dup_share=st.floats(0, 0.5))
def test_batching_shuffling_and_duplicates_do_not_change_events(seed, batch_size, dup_share):
    rng = random.Random(seed)
    spans = list(ALL_SPANS)
    rng.shuffle(spans)
    batches = [spans[i : i + batch_size] for i in range(0, len(spans), batch_size)]
    batches += [b for b in batches if rng.random() < dup_share]
    rng.shuffle(batches)
    events, runs = run(batches, PATIENT)
    assert {e["event_id"] for e in events} == set(BASELINE)
    for event in events:
        assert event == BASELINE[event["event_id"]]
    assert len(runs) == sum(e["runs"] for e in EXPECTED.values())


def test_replaying_the_whole_directory_out_of_time_order_finds_every_expected_event(capsys):
    # Files are read in name order, not time order: runs of older files must not be
    # finalized early because newer spans already moved the watermark.
    from streams.cli.main import main

    assert main(["replay", "--config", str(EXAMPLES / "loopwatch.yaml"), str(EXAMPLES)]) == 0
    out = capsys.readouterr()
    events = [json.loads(line) for line in out.out.splitlines()]
    got = sorted((e["run_id"], e["shape"], e["trigger_span_id"]) for e in events)
    want = sorted(
        (f["run_trace_id"], f["shape"], f["trigger_span_id"])
        for e in EXPECTED.values()
        for f in e["findings"]
    )
    assert got == want
    assert "after-finalize 0" in out.err and "incomplete_trace" not in out.err
