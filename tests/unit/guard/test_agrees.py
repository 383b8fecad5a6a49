"""Guard and platform agree (issue 37): for every run of the repository's corpora (the
examples, the framework recordings, the near-duplicate corpus with its traps), the guard in
observe mode, fed the run's calls in runtime order (each call proposed before its outcome
is known, then its outcome recorded), decides at exactly the call of the platform's trigger
span, first episode per shape, with the same event id.

Where it cannot, the shape needs what the guard does not have before the call:
- FUTURE_SHAPES at a tool call: the call's own outcome (argument churn over differing
  arguments, near-duplicates whose results bring nothing new): a new action has no outcome
  to assume, so the guard judges it after the fact, as the platform does;
- findings triggered by a step that is not a tool call (a model turn's tokens, a plan, a
  handoff): the guard decides before tool calls only.
The test names each such finding, counts them, and fails on any other disagreement,
including a guard decision the platform never made (a false denial).
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from loopwatch_guard import ALLOW, Guard
from loopwatch_guard.guard import _OUTCOME

from detectors.fingerprint import Fingerprinter
from detectors.model import AGENT, OTHER, TOOL, Step
from detectors.pipeline import finalize, ingest, new_state, runtime_order
from detectors.policy import Policy, load_policy, policy_from_mapping
from detectors.recovery import event_id
from streams.replay.files import iter_batches
from streams.spanpath.normalize import STEP_ERRORS, Normalizer
from streams.spanpath.spans import SpanRecord
from tests import near_duplicate_corpus
from tests.paths import REPO

ROOT = REPO
KEY = b"guard-agrees"
EXAMPLE_POLICY = load_policy(ROOT / "examples" / "loopwatch.yaml")
# A tool-triggered finding the guard cannot decide before the call (module doc).
FUTURE_SHAPES = {("argument_churn", "argument_churn"), ("argument_churn", "near_duplicate")}
_BLANK = Step("r", "t", "s", None, TOOL, 0, 0)


def _files(folder: Path) -> list[SpanRecord]:
    spans: list[SpanRecord] = []
    errors: list[Exception] = []
    for path in sorted(folder.iterdir()):
        if path.name.endswith((".pb", ".jsonl", ".pb.gz")):
            for _source, batch in iter_batches([path], errors.append):
                assert isinstance(batch, list)
                spans.extend(batch)
    assert errors == []
    return spans


def _runs(spans: list[SpanRecord], policy: Policy) -> dict[str, list[Step]]:
    normalizer = Normalizer(policy, Fingerprinter(KEY))
    runs: dict[str, list[Step]] = {}
    seen: set[tuple[str, str]] = set()
    for span in spans:
        try:
            step = normalizer.step(span)
        except STEP_ERRORS:
            continue
        if (step.run_id, step.span_id) not in seen:
            seen.add((step.run_id, step.span_id))
            runs.setdefault(step.run_id, []).append(step)
    return {run: runtime_order(steps) for run, steps in runs.items()}


def _platform(policy: Policy, run_id: str, steps: list[Step]) -> dict[str, tuple[Any, ...]]:
    """The platform's first finding per shape: (trigger span, event id, kind, detector)."""
    state = new_state(run_id)
    findings = []
    for step in steps:
        findings += ingest(policy, state, copy.copy(step))
    findings += finalize(policy, state)[0]
    first: dict[str, tuple[Any, ...]] = {}
    for f in findings:
        first.setdefault(
            f.shape,
            (f.trigger.span_id, event_id(run_id, f.shape, f.key), f.trigger.kind, f.detector),
        )
    return first


def _guard(guard: Guard, run_id: str, steps: list[Step]) -> dict[str, tuple[str, str | None]]:
    """The guard's first decision other than allow per shape: (the call's span, event id)."""
    # the integration passes the run's labels when it opens the run
    task_type = next((s.task_type for s in steps if s.task_type), None)
    run = guard.run(run_id, task_type=task_type)
    first: dict[str, tuple[str, str | None]] = {}
    for step in steps:
        if step.kind in (AGENT, OTHER) or step.is_root:
            continue  # containers: termination evidence, not actions
        if step.kind == TOOL:
            proposed = copy.copy(step)
            for name in _OUTCOME:  # before dispatch: no outcome yet
                setattr(proposed, name, getattr(_BLANK, name))
            decision = run.propose(proposed)
            if decision.action != ALLOW and decision.shape is not None:
                first.setdefault(decision.shape, (step.span_id, decision.event_id))
        run.record(copy.copy(step))
    return first


def _compare(spans: list[SpanRecord], policy: Policy) -> Counter[str]:
    guard = Guard(policy, fingerprint_key=KEY)
    tally: Counter[str] = Counter()
    for run_id, steps in _runs(spans, policy).items():
        platform = _platform(policy, run_id, steps)
        decided = _guard(guard, run_id, steps)
        for shape, (span_id, eid, kind, detector) in platform.items():
            if decided.get(shape) == (span_id, eid):
                tally[f"agree {shape}"] += 1
            elif kind != TOOL:
                tally[f"not a tool call: {shape} at a {kind} step"] += 1
            elif (shape, detector) in FUTURE_SHAPES and shape not in decided:
                tally[f"needs the call's own outcome: {shape} ({detector})"] += 1
            else:
                tally[
                    f"DISAGREE {shape}: platform {span_id} {eid}, guard {decided.get(shape)}"
                ] += 1
        for shape in decided.keys() - platform.keys():
            tally[f"DISAGREE guard only {shape} at {decided[shape]}"] += 1
    return tally


CORPORA = {
    "examples": (lambda: _files(ROOT / "examples"), EXAMPLE_POLICY),
    "frameworks": (lambda: _files(ROOT / "tests" / "fixtures" / "frameworks"), EXAMPLE_POLICY),
    "near-duplicates": (
        lambda: [
            s
            for case in near_duplicate_corpus.corpus() + near_duplicate_corpus.traps()
            for s in case.spans
        ],
        policy_from_mapping({}),
    ),
}


@pytest.mark.parametrize("name", list(CORPORA))
def test_guard_decides_at_the_platforms_trigger_with_its_event_id(name: str) -> None:
    spans, policy = CORPORA[name]
    tally = _compare(spans(), policy)
    disagreements = sorted(k for k in tally if k.startswith("DISAGREE"))
    assert disagreements == [], disagreements
    agreed = sum(v for k, v in tally.items() if k.startswith("agree"))
    assert agreed > 0, tally  # the corpus has loops the guard can stop


def test_every_shape_the_guard_can_stop_is_covered() -> None:
    """Across the corpora, each shape a tool call triggers before its outcome matters is
    agreed on at least once (a shape silently never decided would pass the test above)."""
    tally: Counter[str] = Counter()
    for spans, policy in CORPORA.values():
        tally.update(_compare(spans(), policy))
    agreed = {k.removeprefix("agree ") for k in tally if k.startswith("agree ")}
    assert agreed >= {
        "identical_repetition",
        "goal_already_satisfied",
        "oscillation",
        "retry_storm",
        "context_collapse",
        "budget_exhausted",
        "duplicate_side_effect",
        "unsafe_side_effect_retry",
    }, tally


def test_the_comparison_fails_when_the_guard_decides_a_call_late() -> None:
    """The oracle can fail: a guard that only denies the call after the platform's
    trigger (allowed_repeats one higher) disagrees on the examples."""
    looser = Guard(policy_from_mapping({"defaults": {"allowed_repeats": 3}}), fingerprint_key=KEY)
    runs = _runs(_files(ROOT / "examples"), EXAMPLE_POLICY)
    mismatched = 0
    for run_id, steps in runs.items():
        platform = _platform(EXAMPLE_POLICY, run_id, steps)
        decided = _guard(looser, run_id, steps)
        if "identical_repetition" in platform:
            mismatched += (
                decided.get("identical_repetition") != platform["identical_repetition"][:2]
            )
    assert mismatched > 0


def test_a_trial_on_a_clone_leaves_the_runs_state_as_it_was() -> None:
    """The guard predicts on `RunState.clone()`: the clone starts equal, and whatever the
    detectors do to it (every shape fires somewhere in the examples) the run's own state is
    unchanged."""
    import json

    from detectors.pipeline import feed

    clones = 0
    for run_id, steps in _runs(_files(ROOT / "examples"), EXAMPLE_POLICY).items():
        state = new_state(run_id)
        for i, step in enumerate(steps):
            if step.kind in (AGENT, OTHER) or step.is_root:
                continue
            before = json.dumps(state.to_dict(), sort_keys=True)
            twin = state.clone()
            assert json.dumps(twin.to_dict(), sort_keys=True) == before
            for later in steps[i : i + 6]:  # the detectors change the twin's lists and maps
                if later.kind not in (AGENT, OTHER) and not later.is_root:
                    feed(EXAMPLE_POLICY, twin, copy.copy(later))
            assert json.dumps(state.to_dict(), sort_keys=True) == before
            feed(EXAMPLE_POLICY, state, copy.copy(step))
            clones += 1
    assert clones > 100
