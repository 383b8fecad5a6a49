"""Broker connectivity as a state the worker knows: connected, degraded, disconnected.

The issue (16): during a 60 s broker outage the worker wrote ~4,900 log lines, nearly all
aiokafka's "Unable connect to node" / "Unable to update metadata" errors and faust's
"Timer ... is overlapping" warnings, and /healthz still said ok.

`BrokerLink` keeps the state from two kinds of observation:

* the probe (`probe_result`): a metadata request of a client that never joins the group,
  every ``BROKER_PROBE_SECONDS`` (`MetadataProbe`, or the input clock's offsets probe when
  there is one: it asks the same broker every tick). A failed probe means disconnected;
* failures seen elsewhere (`failure`): the library loggers' connection errors (folded by
  `FoldRepeats`), failed deliveries. With the probe answering, a failure in the last
  ``DEGRADED_SECONDS`` means degraded.

It logs one line per change of state (what failed, since when), and while not connected
one reminder per ``reminder_seconds`` with the counts: failed requests, and each folded
library message with how often it was seen. The gauge ``loopwatch_broker_connected``
(1 connected, 0.5 degraded, 0 disconnected) and the counter
``loopwatch_broker_failed_requests_total{source}`` export the same.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alerts.metrics import Metrics

log = logging.getLogger(__name__)

CONNECTED = "connected"
DEGRADED = "degraded"
DISCONNECTED = "disconnected"
GAUGE = {CONNECTED: 1.0, DEGRADED: 0.5, DISCONNECTED: 0.0}

BROKER_PROBE_SECONDS = 2.0
DEGRADED_SECONDS = 30.0  # a failure this recent, with the probe answering: degraded
REMINDER_SECONDS = 60.0

# (label, logger name prefix, message pattern, a failed connection?): library log records
# that repeat for as long as the broker is unreachable. They are counted into the broker
# summary instead of being written one by one; the first of each kind after a quiet spell
# is still written. Connection failures also count as failed requests (and make the state
# degraded while the probe answers); the others (a coordinator not yet available while a
# new group forms, a produce retried on a moved leader, a slow timer) are counted only.
FOLDED: tuple[tuple[str, str, re.Pattern[str], bool], ...] = (
    (
        "aiokafka: unable to connect to node",
        "aiokafka",
        re.compile(r"^Unable connect to node"),
        True,
    ),
    (
        "aiokafka: unable to update metadata",
        "aiokafka",
        re.compile(r"^Unable to update metadata"),
        True,
    ),
    (
        "aiokafka: unable to request metadata",
        "aiokafka",
        re.compile(r"^Unable to request metadata"),
        True,
    ),
    ("aiokafka: failed fetch", "aiokafka", re.compile(r"^Failed fetch messages"), True),
    ("aiokafka: coordinator", "aiokafka", re.compile(r"(?i)coordinator"), False),
    ("aiokafka: heartbeat", "aiokafka", re.compile(r"(?i)heartbeat"), False),
    ("aiokafka: commit failed", "aiokafka", re.compile(r"(?i)commit.*fail|fail.*commit"), False),
    ("aiokafka: produce error", "aiokafka", re.compile(r"(?i)produce"), False),
    ("faust/mode: timer overlapping", "mode", re.compile(r"^Timer .* is overlapping"), False),
    ("faust/mode: timer overlapping", "faust", re.compile(r"^Timer .* is overlapping"), False),
    (
        "loopwatch: input clock offsets unavailable",
        "loopwatch",
        re.compile(r"^input clock: "),
        False,
    ),
)


def _at(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(wall)) + "Z"


class BrokerLink:
    """The broker state of one worker. `metrics`: a `Metrics` (or None in tests);
    `clock`: monotonic seconds; `wall`: wall-clock seconds (log lines say when)."""

    def __init__(
        self,
        metrics: Metrics | None = None,
        *,
        reminder_seconds: float = REMINDER_SECONDS,
        degraded_seconds: float = DEGRADED_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.reminder_seconds = reminder_seconds
        self.degraded_seconds = degraded_seconds
        self.clock = clock
        self.wall = wall
        self.state = CONNECTED
        self.since = clock()
        self.since_wall = wall()
        self.probe_ok = True
        self.probe_error = ""
        self.last_failure: float | None = None
        self.last_failure_what = ""
        self.failed_requests = 0  # since the worker started
        self.folded: Counter[str] = Counter()  # since the last summary line
        self.folded_total = 0
        self.episode_failures = 0  # failed requests since the state left connected
        self.episode = 0  # times the state came back to connected
        self.left_connected = self.since  # when the state last left connected
        self._last_reminder = self.since
        if metrics is not None:
            metrics.broker_connected.set(GAUGE[CONNECTED])

    # -------------------------------------------------------------- observations

    def probe_result(self, ok: bool, error: str = "") -> None:
        """The probe's answer: ok, or the error that made it fail."""
        self.probe_ok = ok
        if not ok:
            self.probe_error = error or "no answer"
            self.failure("probe", self.probe_error)
        self.evaluate()

    def failure(self, source: str, what: str) -> None:
        """A request to the broker failed (`source`: probe, library, delivery)."""
        self.last_failure = self.clock()
        self.last_failure_what = f"{source}: {what}"
        self.failed_requests += 1
        self.episode_failures += 1
        if self.metrics is not None:
            self.metrics.broker_failed_requests.labels(source=source).inc()

    def folded_record(self, label: str, record: logging.LogRecord, failed: bool) -> None:
        self.folded[label] += 1
        self.folded_total += 1
        if failed:
            with contextlib.suppress(Exception):  # a record whose arguments do not format
                self.failure("library", record.getMessage()[:200])

    # -------------------------------------------------------------- state

    def evaluate(self) -> str:
        """Update the state from what was observed; log a change, or a due reminder."""
        now = self.clock()
        if not self.probe_ok:
            state = DISCONNECTED
        elif self.last_failure is not None and now - self.last_failure < self.degraded_seconds:
            state = DEGRADED
        else:
            state = CONNECTED
        if state != self.state:
            self._change(state, now)
        elif state != CONNECTED and now - self._last_reminder >= self.reminder_seconds:
            self._remind(now)
        return state

    def seconds_in_state(self) -> float:
        return max(0.0, self.clock() - self.since)

    def disconnected_for(self) -> float:
        """Seconds the broker has been unreachable (0 when the probe answers)."""
        return self.seconds_in_state() if self.state == DISCONNECTED else 0.0

    def _counts(self) -> str:
        parts = [f"{self.episode_failures} failed requests"]
        if self.folded:
            folded = ", ".join(f"{label} x{n}" for label, n in self.folded.most_common())
            parts.append(f"folded log lines: {folded}")
        return "; ".join(parts)

    def _change(self, state: str, now: float) -> None:
        old, old_since = self.state, self.since
        lasted = now - old_since
        self.state, self.since, self.since_wall = state, now, self.wall()
        self._last_reminder = now
        if self.metrics is not None:
            self.metrics.broker_connected.set(GAUGE[state])
        if old == CONNECTED:
            self.left_connected = now
        if state == CONNECTED:
            log.warning(
                "broker: connected again at %s, after %.0f s not connected (the last %.0f s "
                "%s; %s)",
                _at(self.since_wall),
                now - self.left_connected,
                lasted,
                old,
                self._counts(),
            )
            self.episode_failures = 0
            self.episode += 1
            self.folded.clear()
        elif state == DISCONNECTED:
            log.warning(
                "broker: disconnected since %s (%s); reading, publishing and committing wait; "
                "library connection errors are counted in a summary every %.0f s",
                _at(self.since_wall),
                self.probe_error or self.last_failure_what,
                self.reminder_seconds,
            )
        else:
            log.warning(
                "broker: degraded since %s (%s)%s",
                _at(self.since_wall),
                self.last_failure_what,
                f", after {lasted:.0f} s disconnected" if old == DISCONNECTED else "",
            )

    def _remind(self, now: float) -> None:
        self._last_reminder = now
        log.warning(
            "broker: still %s since %s (%.0f s): %s",
            self.state,
            _at(self.since_wall),
            now - self.since,
            self._counts(),
        )
        self.folded.clear()

    def snapshot(self) -> dict[str, Any]:
        """The /healthz view."""
        return {
            "state": self.state,
            "since": round(self.since_wall, 3),
            "seconds": round(self.seconds_in_state(), 1),
            "failed_requests": self.failed_requests,
            "folded_log_lines": self.folded_total,
            "last_failure": self.last_failure_what or None,
        }


class FoldRepeats(logging.Filter):
    """A handler filter: library records of the `FOLDED` kinds are counted into `link`
    (and its summary lines) instead of being written, except the first of each kind while
    the broker is connected and the first of each kind of each outage (from the state
    leaving connected to it coming back), so that what failed first is in the log as the
    library said it."""

    def __init__(self, link: BrokerLink) -> None:
        super().__init__()
        self.link = link
        self._written: dict[str, int] = {}  # label -> the link's episode it was written in

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        for label, prefix, pattern, failed in FOLDED:
            if name.startswith(prefix) and isinstance(record.msg, str):
                if pattern.search(record.msg) is None:
                    continue
                self.link.folded_record(label, record, failed)
                episode = self.link.episode
                if self._written.get(label) == episode:
                    return False
                self._written[label] = episode
                return True
        return True

    def install(self) -> None:
        """On every handler of the root logger (where the library loggers propagate)."""
        for handler in logging.getLogger().handlers:
            if self not in handler.filters:
                handler.addFilter(self)


class MetadataProbe:
    """Asks the broker for a topic's metadata with a consumer that never joins a group
    (confluent-kafka, blocking: run it in an executor). `read()` -> None when answered,
    else the error text. The client is closed and rebuilt after an error."""

    def __init__(self, bootstrap: str, topic: str, timeout: float = 5.0) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.timeout = timeout
        self._consumer: Any = None

    def read(self) -> str | None:
        from confluent_kafka import Consumer, KafkaException

        try:
            if self._consumer is None:
                self._consumer = Consumer(
                    {
                        "bootstrap.servers": self.bootstrap,
                        "group.id": "loopwatch-broker-probe",
                        "enable.auto.commit": False,
                        "log_level": 0,
                    }
                )
            md = self._consumer.list_topics(self.topic, timeout=self.timeout)
            if not md.brokers:
                raise KafkaException("no broker in the metadata")
            return None
        except (KafkaException, RuntimeError) as exc:
            self.close()
            return str(exc) or type(exc).__name__

    def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                consumer.close()
