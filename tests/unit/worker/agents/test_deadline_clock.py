"""The deadline clock's fallback to the wall clock (streams/worker/agents/deadline_clock.py):
only after the input probe has gone unanswered for INPUT_PROBE_STALE_NS since it was first
asked, never because the worker took long to start. faust starts its timers (the probe's)
only once table recovery is done: a recovery longer than the staleness put the backlog
after it on the wall clock, so every arrival of it was vouched for at once."""

from __future__ import annotations

import pytest

from detectors.model import NS
from streams.worker.agents import deadline_clock
from streams.worker.agents.deadline_clock import INPUT_PROBE_STALE_NS, DeadlineClock
from streams.worker.kafka.input_clock import InputClock

START = 1_800_000_000 * NS


class FakeTime:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = START
        monkeypatch.setattr(deadline_clock.time, "time_ns", lambda: self.now)

    def pass_seconds(self, seconds: float) -> None:
        self.now += int(seconds * NS)


class Probe:
    """Answers with these offsets, or not at all (None)."""

    def __init__(self, answer: tuple[dict[int, int], dict[int, int]] | None) -> None:
        self.answer = answer

    def read(self) -> tuple[dict[int, int], dict[int, int]] | None:
        return self.answer


def clock(probe: Probe) -> DeadlineClock:
    return DeadlineClock(InputClock(START), max_lag_seconds=900, probe=lambda: probe)


def test_a_long_start_holds_deadlines_until_the_probe_was_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeTime(monkeypatch)
    deadlines = clock(Probe(None))
    fake.pass_seconds(INPUT_PROBE_STALE_NS / NS + 60)  # table recovery, timers not started
    assert deadlines.now_ns() == START  # nothing produced since the start is vouched for


async def test_a_probe_unanswered_since_it_was_first_asked_gives_the_wall_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeTime(monkeypatch)
    deadlines = clock(Probe(None))
    fake.pass_seconds(120)  # a long start
    await deadlines.advance()
    asked = fake.now
    fake.pass_seconds(INPUT_PROBE_STALE_NS / NS - 1)
    assert deadlines.now_ns() == START  # still waiting for the broker to say
    fake.pass_seconds(2)
    assert deadlines.now_ns() == fake.now > asked  # a broker that cannot say: wall clock


async def test_an_answering_probe_holds_deadlines_to_the_groups_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeTime(monkeypatch)
    probe = Probe(({0: 10, 1: 5}, {0: 0, 1: 0}))  # a backlog the group has not read
    deadlines = clock(probe)
    fake.pass_seconds(120)
    await deadlines.advance()
    fake.pass_seconds(INPUT_PROBE_STALE_NS / NS + 5)
    await deadlines.advance()
    assert deadlines.now_ns() == START
    probe.answer = ({0: 10, 1: 5}, {0: 10, 1: 5})  # the group is through it
    fake.pass_seconds(1)
    await deadlines.advance()
    asked = fake.now
    fake.pass_seconds(0.5)
    assert deadlines.now_ns() == asked  # up to the snapshot the progress passed
