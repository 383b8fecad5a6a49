"""`Parts`: what the worker's agents and timers share, made once by `Worker`
(streams/worker/service.py) and passed whole instead of a dozen arguments each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alerts.metrics import Metrics
    from streams.worker.agents.dead_letters import DeadLetters
    from streams.worker.agents.deadline_clock import DeadlineClock
    from streams.worker.agents.decode import InputDecoder
    from streams.worker.agents.driver import RunDriver
    from streams.worker.kafka.delivery import Publisher
    from streams.worker.kafka.skips import SkipGuard
    from streams.worker.state.store import Tables


@dataclass(slots=True)
class Parts:
    metrics: Metrics
    counters: dict[str, int]  # /healthz counters (streams/worker/service.py COUNTERS)
    tables: Tables
    driver: RunDriver  # the run loop over the tables' store
    clock: DeadlineClock
    publisher: Publisher
    dead_letters: DeadLetters
    skips: SkipGuard
    reader: InputDecoder
    topics: dict[str, Any]  # faust topics: steps, events, runs, dead
