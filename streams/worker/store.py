"""The worker's state store: what the `runs` and `finished` tables hold, and how.

A `runs` value is an envelope: a small JSON header (what the deadline index needs) and the
run's state (streams/worker/codec.py), ``<header JSON>\\n<RunState>``, so that rebuilding
the deadline index after a rebalance parses only the headers. A `finished` value is
``[finished_ns, partition]``. Tables are plain key/value mappings here (a dict in tests,
a faust table in the service).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from detectors.state import RunState
from streams.worker.codec import decode_state, encode_state

ENVELOPE_VERSION = 1

Table = MutableMapping[bytes, bytes]


@dataclass(slots=True)
class Envelope:
    """A `runs` table value: a small header (what the deadline index needs) + the state."""

    partition: int
    seen_ns: int  # wall time the run's latest span arrived (its clock's anchor)
    first_ns: int  # wall time the run's first span arrived
    max_end_ns: int
    root_end_ns: int | None
    pending: int
    # Unkeyed input with the input clock (`RunDriver.process_run`): the run's event time
    # the clock has vouched for (None until then, and always with keyed input), and the
    # arrival waiting for it: (wall time, the run's latest end as of then).
    confirmed_end_ns: int | None = None
    candidate: tuple[int, int] | None = None

    def vouch(self, clock_ns: int) -> None:
        """The input clock reached `clock_ns`: everything produced before then is ahead of
        the message or tick carrying it, so the candidate arrival's event time is safe."""
        if self.candidate is not None and clock_ns >= self.candidate[0]:
            self.confirmed_end_ns = max(self.confirmed_end_ns or 0, self.candidate[1])
            self.candidate = None

    def header(self) -> bytes:
        return json.dumps(
            {
                "v": ENVELOPE_VERSION,
                "p": self.partition,
                "seen": self.seen_ns,
                "first": self.first_ns,
                "max_end": self.max_end_ns,
                "root_end": self.root_end_ns,
                "pending": self.pending,
                "confirmed": self.confirmed_end_ns,
                "cand": self.candidate,
            },
            separators=(",", ":"),
        ).encode("utf-8")


def encode_envelope(state: RunState, env: Envelope) -> bytes:
    """`env` (its state-derived fields refreshed from `state`) + the encoded state."""
    env.max_end_ns = state.max_end_ns
    env.root_end_ns = state.root_end_ns
    env.pending = len(state.pending)
    return env.header() + b"\n" + encode_state(state)


def decode_header(raw: bytes) -> Envelope:
    head, _, _ = bytes(raw).partition(b"\n")
    h = json.loads(head)
    if h.get("v") != ENVELOPE_VERSION:
        raise ValueError(f"run envelope version {h.get('v')!r} is not {ENVELOPE_VERSION}")
    candidate = h.get("cand")  # these two are absent in envelopes written before them
    return Envelope(
        h["p"],
        h["seen"],
        h["first"],
        h["max_end"],
        h["root_end"],
        h["pending"],
        h.get("confirmed"),
        (candidate[0], candidate[1]) if candidate else None,
    )


def decode_envelope(raw: bytes) -> tuple[Envelope, RunState]:
    raw = bytes(raw)
    env = decode_header(raw)
    _, _, body = raw.partition(b"\n")
    return env, decode_state(body)


def encode_finished(finished_ns: int, partition: int) -> bytes:
    return json.dumps([finished_ns, partition]).encode("utf-8")


def decode_finished(raw: bytes) -> tuple[int, int]:
    finished_ns, partition = json.loads(raw)
    return int(finished_ns), int(partition)


def _no_event(event: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


@dataclass(slots=True)
class Tables:
    """The worker's tables: `runs` and `finished` (see above), and the windowed counters
    behind /loops and /runs (``counts[key] += n``). `in_event(event)`: a context in which
    writes go to `event`'s partition (faust picks a table write's partition from the
    current event; plain mappings need nothing)."""

    runs: Table
    finished: Table
    loop_counts: Any
    run_counts: Any
    in_event: Callable[[Any], contextlib.AbstractContextManager[None]] = _no_event
