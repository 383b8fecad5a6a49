"""The holds the on-call placed (detectors/holds.py), kept in a compacted topic of their own:
the durable state and the audit trail at once. Every worker reads the whole topic (one
partition, from the beginning, then tails it) into memory, so each answers with all of them,
after restarts and rebalances alike; placing and releasing writes a record (key: the hold
id; value: the hold as JSON, its release included) and waits for the broker to take it.

Plain confluent-kafka in a thread of its own: the holds are not partitioned with the runs
(faust tables are), and the set is small (a hold is a few hundred bytes; `MAX_HOLDS`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition

from detectors.holds import Call, Hold, HoldError, HoldIndex, Scope, hold_from
from detectors.model import NS, Step, denials
from streams.errors import BrokerError

log = logging.getLogger(__name__)
MAX_HOLDS = 10_000  # kept in memory, active or not (the oldest released go first)


class HoldBook:
    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        default_ttl_seconds: float,
        max_ttl_seconds: float,
        clock: Callable[[], int] = time.time_ns,
        side_effect: Callable[[str], bool] = lambda tool: False,
    ) -> None:
        self.side_effect = side_effect  # whether a tool's contract says side_effect: true
        self.bootstrap = bootstrap
        self.topic = topic
        self.default_ttl_seconds = default_ttl_seconds
        self.max_ttl_seconds = max_ttl_seconds
        self.clock = clock
        self._holds: dict[str, Hold] = {}
        self._index: HoldIndex | None = None  # over _holds; None: rebuild on next use
        self.version = 0  # changes with every change of the set (answers are cached by it)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.loaded = threading.Event()  # the topic was read up to its end once
        self.bad_records = 0
        self._thread: threading.Thread | None = None
        self._producer: Producer | None = None

    # ------------------------------------------------------------------ reading

    def start(self) -> None:
        self._thread = threading.Thread(target=self._tail, name="loopwatch-holds", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _tail(self) -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"loopwatch-holds-{os.getpid()}-{id(self):x}",
                "enable.auto.commit": False,
                "log_level": 0,
            }
        )
        try:
            consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
            end = None
            while not self._stop.is_set():
                if end is None:
                    try:
                        end = consumer.get_watermark_offsets(
                            TopicPartition(self.topic, 0), timeout=5
                        )[1]
                    except KafkaException:
                        end = None
                        time.sleep(1)
                        continue
                    if end == 0:
                        self.loaded.set()
                record = consumer.poll(0.5)
                if record is None:
                    continue
                if record.error():
                    continue
                self._apply(record.key(), record.value())
                offset = record.offset()
                if not self.loaded.is_set() and offset is not None and offset + 1 >= end:
                    self.loaded.set()
        finally:
            consumer.close()

    def _apply(self, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            self.bad_records += 1
            return
        hold_id = key.decode("utf-8", "replace")
        with self._lock:
            self._index = None
            self.version += 1
            if value is None:  # a tombstone: compaction may drop it; so do we
                self._holds.pop(hold_id, None)
                return
            try:
                hold = hold_from(json.loads(value))
            except (ValueError, HoldError):
                self.bad_records += 1
                log.warning("loopwatch: holds topic %s: skipped an unreadable record", self.topic)
                return
            self._holds[hold.id] = hold
            if len(self._holds) > MAX_HOLDS:
                now = self.clock()
                stale = [h.id for h in self._holds.values() if not h.active(now)]
                for old in stale[: len(self._holds) - MAX_HOLDS]:
                    del self._holds[old]

    # ------------------------------------------------------------------ answering

    def holds(self, include_inactive: bool = False) -> list[Hold]:
        now = self.clock()
        with self._lock:
            found = list(self._holds.values())
        if not include_inactive:
            found = [h for h in found if h.active(now)]
        return sorted(found, key=lambda h: (h.created_ns, h.id))

    def get(self, hold_id: str) -> Hold | None:
        with self._lock:
            return self._holds.get(hold_id)

    @staticmethod
    def etag(docs: list[dict[str, Any]]) -> str:
        body = json.dumps(docs, sort_keys=True, separators=(",", ":")).encode()
        return '"' + hashlib.sha256(body).hexdigest()[:24] + '"'

    def held_by(self, step: Step) -> str | None:
        """The hold a tool call ran under with no guard decision of its own (a hold nothing
        enforced): one active when the call started (placed before it, not yet released
        or expired then). The holds that name a call's labels (service, agent, prompt
        version, run), its tool or side effects are checked; a call a framework opened a
        span for and then let the guard deny (the denial on that span) ran under none."""
        index = self._current_index()
        if index.size == 0:
            return None
        start = step.start_ns

        def held_then(hold: Hold) -> bool:
            return hold.created_ns < start < hold.expires_ns and (
                hold.released_ns is None or start < hold.released_ns
            )

        call = Call(
            step.run_id,
            step.name,
            step.tool_version,
            step.service_name,
            step.agent_name,
            step.prompt_version,
            self.side_effect(step.name),
        )
        hold = index.find(call, held_then)
        if hold is None or any(d.call_id == step.call_id for d in denials(step)):
            return None
        return hold.id

    def _current_index(self) -> HoldIndex:
        """The index over every hold kept (rebuilt after a change)."""
        with self._lock:
            if self._index is None:
                self._index = HoldIndex(list(self._holds.values()))
            return self._index

    # ------------------------------------------------------------------ writing

    def place(self, scope: Scope, reason: str, by: str, ttl_seconds: float | None) -> Hold:
        if not reason.strip():
            raise HoldError("reason: say why the hold is placed (--reason)")
        ttl = self.default_ttl_seconds if ttl_seconds is None else ttl_seconds
        if ttl > self.max_ttl_seconds:
            raise HoldError(
                f"ttl: {ttl:g} s is over the policy's maximum of {self.max_ttl_seconds:g} s "
                "(holds.max_ttl)"
            )
        now = self.clock()
        hold = Hold(
            id="hold-" + os.urandom(5).hex(),
            scope=scope,
            reason=reason.strip()[:512],
            by=by.strip()[:128] or "unknown",
            created_ns=now,
            expires_ns=now + int(ttl * NS),
        )
        self._write(hold)
        return hold

    def release(self, hold_id: str, by: str) -> Hold:
        hold = self.get(hold_id)
        if hold is None:
            raise HoldError(f"no hold {hold_id!r} (`loopwatch hold list --all` lists them)")
        if hold.released_ns is not None:
            return hold  # released already: the record says by whom
        released = Hold(
            hold.id,
            hold.scope,
            hold.reason,
            hold.by,
            hold.created_ns,
            hold.expires_ns,
            released_ns=self.clock(),
            released_by=by.strip()[:128] or "unknown",
        )
        self._write(released)
        return released

    def _write(self, hold: Hold) -> None:
        if self._producer is None:
            self._producer = Producer(
                {"bootstrap.servers": self.bootstrap, "acks": "all", "log_level": 0}
            )
        failed: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                failed.append(str(err))

        value = json.dumps(hold.to_doc(), separators=(",", ":")).encode()
        self._producer.produce(
            self.topic, key=hold.id.encode(), value=value, partition=0, on_delivery=delivered
        )
        left = self._producer.flush(10)
        if left or failed:
            raise BrokerError(
                f"holds topic {self.topic}: the broker did not take the hold "
                f"({failed[0] if failed else 'no answer within 10 s'}): nothing was changed"
            )
        with self._lock:  # read your writes; the tail thread brings the same record
            self._holds[hold.id] = hold
            self._index = None
            self.version += 1
