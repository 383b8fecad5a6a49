"""Near-duplicate loops in the worker (issue 36): the labeled corpus
(tests/near_duplicate_corpus.py: its loops, a sample of its progress cases, and every trap of
distinct records that look alike) streamed through `loopwatch worker` on the real broker
gives the replay's events, id for id: every loop found, every trap silent, as in replay."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from detectors.policy import load_policy
from tests.near_duplicate_corpus import Case, corpus, traps
from tests.otlp_build import encode_request, replay_messages
from tests.support.kafka import require_broker
from tests.support.worker_proc import FINGERPRINT_KEY, WorkerProc, write_policy

pytestmark = pytest.mark.kafka

NEAR = ("near_duplicate", "near_duplicate_turns")


def _cases() -> list[Case]:
    every = corpus()
    rng = random.Random(36)
    loops = [c for c in every if c.loop]
    progress = rng.sample([c for c in every if not c.loop], 24)
    return loops + progress + traps()


def _messages(cases: list[Case]) -> list[bytes]:
    """Each run in two exports, the second half first (delivery is unordered)."""
    out = []
    for case in cases:
        half = len(case.spans) // 2
        out += [encode_request(case.spans[half:]), encode_request(case.spans[:half])]
    return out


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_broker()
    workdir = tmp_path_factory.mktemp("near-duplicates")
    policy = write_policy(
        workdir / "policy.yaml",
        allowed_lateness_seconds=60,
        finalize_grace_seconds=2,
        idle_timeout_seconds=5,
    )
    cases = _cases()
    messages = _messages(cases)
    events, _ = replay_messages(messages, load_policy(policy), FINGERPRINT_KEY.encode())
    worker = WorkerProc(workdir, policy)
    try:
        worker.start()
        worker.wait_ready()
        worker.produce((None, m) for m in messages)
        want = {e["event_id"] for e in events}
        records = worker.read(
            "events",
            until=lambda rs: {json.loads(r.value())["event_id"] for r in rs} >= want,
            timeout=90,
            settle=2.0,
        )
        yield {
            "cases": cases,
            "replay": events,
            "stream": [json.loads(r.value()) for r in records],
        }
    finally:
        worker.cleanup()


def _by_run(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        runs.setdefault(e["trace_id"], []).append(e)
    return runs


def test_the_replay_finds_every_loop_and_no_trap(streamed: dict[str, Any]) -> None:
    runs = _by_run(streamed["replay"])
    for case in streamed["cases"]:
        found = runs.get(case.spans[0].trace_id, [])
        near = [e for e in found if e["detector"] in NEAR]
        assert bool(near) is case.loop, (case.name, found)
        if not case.loop:
            assert {e["shape"] for e in found} <= {"budget_exhausted"}, (case.name, found)


def test_the_worker_gives_the_replays_events(streamed: dict[str, Any]) -> None:
    def ids(events: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
        return {(e["event_id"], e["shape"], e["detector"]) for e in events}

    assert ids(streamed["stream"]) == ids(streamed["replay"])
