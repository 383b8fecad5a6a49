"""The worker and `loopwatch replay` agree on a shuffled delivery (issue 24).

The spans of the examples and of the framework fixtures (66 runs) are dealt into random
export batches of 1-40 spans in random order, about 30% of the batches sent twice, and
produced unkeyed (the kafkaexporter's default) to 4 input partitions: live, while the
worker runs, and as a backlog the worker finds when it starts (its partitions then read at
different lags). The worker's events (ids, shapes, trigger spans, counts, sequences) and
run outcomes must be those of `loopwatch replay` over the in-order files, and the replay
of the shuffled files must be the same.

The workers' policy adds stream timing only: finalization seconds, not minutes, after
the last span, and for the live delivery (paced over 4 s, so that the worker's ticks fall
inside a run's delivery) an allowed lateness longer than any run of the corpus (33 s),
with sequenced steps held for it too. The backlog needs neither: the input clock holds
every release until the records produced before it have been processed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from detectors.fingerprint import Fingerprinter
from detectors.policy import load_policy
from streams.replay.files import expand_paths
from streams.replay.runs import Replay, replay_files
from tests.integration.worker_support import Oracle, values
from tests.otlp_build import EXAMPLES, example_files, file_messages
from tests.support.deliveries import reshuffle, write_files
from tests.support.kafka import bootstrap, create_topics, require_broker
from tests.support.worker_proc import FINGERPRINT_KEY, WorkerProc, write_policy

pytestmark = pytest.mark.kafka

FRAMEWORKS = Path(__file__).resolve().parent.parent / "fixtures" / "frameworks"
_EVENT = ("event_id", "shape", "trigger_span_id", "count", "first_sequence", "last_sequence")


def corpus_files() -> list[Path]:
    return example_files() + sorted(FRAMEWORKS.glob("*.pb"))


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    require_broker()
    return Oracle.of([[m for f in corpus_files() for m in file_messages(f)]])


@pytest.fixture(scope="module")
def shuffled() -> list[bytes]:
    messages = [m for f in corpus_files() for m in file_messages(f)]
    return reshuffle(messages, random.Random(24), batch=(1, 40), dup_share=0.3)


def event_facts(events: list[dict[str, Any]]) -> set[tuple[Any, ...]]:
    return {tuple(e[k] for k in _EVENT) for e in events}


def diagnosis(worker: WorkerProc, health: dict[str, Any]) -> list[str]:
    """What tells a premature release's causes apart, for a failure message: the worker's
    counts of records it read again or left to be redone (its /healthz answer `health`),
    and its log's warnings."""
    counters = ("refetched_records", "records_read_before_rebalance", "publish_retries")
    text = worker.log_path.read_text(errors="replace") if worker.log_path.exists() else ""
    warned = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
    return [f"    worker {[(k, health.get(k)) for k in counters]}"] + [
        f"    log {line}" for line in warned[:10]
    ]


def run_worker(
    tmp_path: Path, records: list[bytes], want_events: int, *, backlog: bool
) -> tuple[list[Any], list[Any], list[str]]:
    timing: dict[str, float | bool] = {"finalize_grace_seconds": 2, "idle_timeout_seconds": 5}
    if not backlog:
        # produced while the worker runs, a run's spans can come after the input clock
        # vouched for an earlier arrival of the run: held for the lateness (event time),
        # sequenced steps too (a model turn between two sequenced steps has no number)
        timing["allowed_lateness_seconds"] = 60
        timing["release_on_sequence"] = False
    worker = WorkerProc(tmp_path, write_policy(tmp_path / "policy.yaml", **timing))
    try:
        if backlog:
            create_topics([worker.topics["input"]], 4)
            producer = Producer({"bootstrap.servers": bootstrap(), "log_level": 0})
            for value in records:
                producer.produce(worker.topics["input"], value=value)  # a random partition
            assert producer.flush(30) == 0
            worker.start()
            worker.wait_ready()
        else:
            worker.start()
            worker.wait_ready()
            worker.produce(paced(records, seconds=4.0))
        worker.wait_taken(len(records), timeout=120)
        events, summaries = stream_outputs(worker, want_events)
        return events, summaries, diagnosis(worker, worker.wait_ready())
    finally:
        worker.cleanup()


def paced(records: list[bytes], seconds: float) -> Iterator[tuple[None, bytes]]:
    """Unkeyed records spread over `seconds`: the worker's ticks (0.5 s) vouch for a run's
    early arrivals while its later spans are still to come."""
    for value in records:
        yield None, value
        time.sleep(seconds / len(records))


def stream_outputs(worker: WorkerProc, want: int) -> tuple[list[Any], list[Any]]:
    summaries = values(
        worker.read(
            "runs", until=lambda rs: len({r.key() for r in rs}) >= 66, timeout=90, settle=2.0
        )
    )
    # every run's events are out before its summary: once as many as the replay's are
    # read, a short settle shows any extra one
    events = values(worker.read("events", until=lambda rs: len(rs) >= want, settle=1.0))
    return events, summaries


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("shuffled")


def check(oracle: Oracle, events: list[Any], summaries: list[Any], why: list[str]) -> None:
    """The replay's events and outcomes, and no span taken after a later one was released:
    the input clock holds every release until all of a run's spans are in (the backlog:
    until the input is drained; live: the lateness outlasts every run), so a late span is
    a release the clock vouched for too early, even where it changed no event."""
    problems, differ = oracle.differences(events, summaries)
    facts, want = event_facts(events), event_facts(oracle.events)
    differ += sorted(_runs_of(facts ^ want, events, oracle) - set(differ))
    late = sorted({s["run_id"] for s in summaries if s.get("late_spans")})
    detail = [
        line
        for run_id in dict.fromkeys([*differ[:3], *late[:3]])
        for line in oracle.describe(run_id, events, summaries)
    ]
    assert not problems, "\n".join(problems + detail + why)
    assert facts == want, "\n".join(
        [f"events differ: {sorted(facts - want)} != {sorted(want - facts)}", *detail, *why]
    )
    assert not late, "\n".join([f"spans taken after a release in runs {late}", *detail, *why])


def _runs_of(facts: set[tuple[Any, ...]], events: list[Any], oracle: Oracle) -> set[str]:
    ids = {f[0] for f in facts}
    return {e["run_id"] for e in [*events, *oracle.events] if e["event_id"] in ids}


@pytest.mark.parametrize("backlog", [False, True], ids=["live", "backlog"])
def test_a_shuffled_unkeyed_delivery_gives_the_replays_events(
    oracle: Oracle, shuffled: list[bytes], workdirs: Path, backlog: bool
) -> None:
    assert len(oracle.summaries) == 66 and len(oracle.events) >= 45
    workdir = workdirs / ("backlog" if backlog else "live")
    workdir.mkdir()
    check(oracle, *run_worker(workdir, shuffled, len(oracle.events), backlog=backlog))


def test_two_workers_give_the_replays_events_and_vouch_for_each_others_partitions(
    oracle: Oracle, shuffled: list[bytes], tmp_path: Path
) -> None:
    """Two workers of one group, the shuffled delivery produced live: each ingests some
    input partitions and detects on some steps partitions, so a run's spans reach its
    detect through both workers' hops. Each worker's input clock takes the other's
    partitions from its marks (and the group's commits): the replay's events, and marks
    sent and read by both sides."""
    timing: dict[str, float | bool] = {
        "finalize_grace_seconds": 2,
        "idle_timeout_seconds": 5,
        "allowed_lateness_seconds": 60,
        "release_on_sequence": False,
    }
    first = WorkerProc(tmp_path / "w0", write_policy(tmp_path / "policy.yaml", **timing))
    second = first.sibling(tmp_path / "w1")
    workers = [first, second]
    try:
        create_topics([first.topics["input"]], 4)
        for worker in workers:
            worker.workdir.mkdir(parents=True)
            worker.start()
        for worker in workers:
            worker.wait_ready()
        deadline = time.monotonic() + 60  # both members of the group, each with partitions
        while not all(w.wait_ready().get("assigned_partitions") for w in workers):
            assert time.monotonic() < deadline, "the two workers never shared the partitions"
            time.sleep(0.5)
        first.produce(paced(shuffled, seconds=4.0))
        events, summaries = stream_outputs(first, len(oracle.events))
        health = [w.wait_ready() for w in workers]
        why = [line for w, h in zip(workers, health, strict=True) for line in diagnosis(w, h)]
        check(oracle, events, summaries, why)
        assert all(h["marks_sent"] > 0 for h in health), health
        assert all(h["marks_read"] > 0 for h in health), health
    finally:
        for worker in workers:
            worker.cleanup()


def test_the_replay_of_the_shuffled_files_is_the_replay_of_the_in_order_ones(
    oracle: Oracle, shuffled: list[bytes], tmp_path: Path
) -> None:
    rng = random.Random(5)
    write_files(tmp_path, shuffled, rng, n=3)
    events: list[dict[str, Any]] = []
    policy = load_policy(EXAMPLES / "loopwatch.yaml")
    replay = Replay(policy, Fingerprinter(FINGERPRINT_KEY.encode()), events.append)
    replay_files(replay, expand_paths([tmp_path], print), print)
    replay.close()
    assert sorted(events, key=lambda e: e["event_id"]) == sorted(
        oracle.events, key=lambda e: e["event_id"]
    )
