"""Message formats of the worker's internal topic (``loopwatch-steps``): steps messages and
timer ticks, and where a run's messages go.

* a steps message keyed by run id (``LOOPWATCH_STEPS_GROUPING=run``): compact JSON of
  ``[step.to_list(), ...]``;
* a partition-grouped steps message (no key, the default): ``[[run_id, [step, ...]], ...]``,
  on the partition the run id hashes to (`key_partition`);
* a tick: a JSON object ``{"tick": sent_ns, "clock": clock_ns}`` (steps messages are arrays);
* the header ``loopwatch-input-clock`` on a steps message: the input clock it was sent at.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from detectors.model import Step

# Steps messages are split to stay under this (the producer refuses requests over 1 MB;
# a record of many small spans encodes to more steps JSON than its own protobuf).
MAX_STEPS_MESSAGE_BYTES = 512 * 1024
TICK_VALUE_PREFIX = b"{"  # steps messages are JSON arrays, ticks JSON objects
CLOCK_HEADER = "loopwatch-input-clock"  # on steps messages: the input clock at send time


def encode_tick(sent_ns: int, clock_ns: int) -> bytes:
    """A tick: its send time and the deadline clock (wall or input clock) at that time."""
    return json.dumps({"tick": sent_ns, "clock": clock_ns}).encode()


def tick_clock(value: bytes) -> int | None:
    """The deadline clock a tick carries; None for a tick without one (older workers)."""
    clock = json.loads(value).get("clock")
    return clock if isinstance(clock, int) and not isinstance(clock, bool) else None


def sent_clock(message: Any) -> int | None:
    """The input clock a steps message was sent at (its CLOCK_HEADER); None without one."""
    headers = getattr(message, "headers", None) or ()
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in pairs:
        if name == CLOCK_HEADER and value:
            try:
                return int(bytes(value))
            except ValueError:
                return None
    return None


def encode_steps(steps: Iterable[Step]) -> bytes:
    """The internal topic's value: compact JSON of ``[step.to_list(), ...]``."""
    return to_json([s.to_list() for s in steps])


def decode_steps(value: bytes) -> list[Step]:
    data = json.loads(value)
    if not isinstance(data, list):
        raise ValueError("steps message is not a JSON array")
    return [Step.from_list(item) for item in data]


def encode_run_groups(groups: Iterable[tuple[str, list[Step]]]) -> bytes:
    """A partition-grouped steps message (no key): ``[[run_id, [step, ...]], ...]``."""
    return json.dumps(
        [[run_id, [s.to_list() for s in steps]] for run_id, steps in groups],
        separators=(",", ":"),
    ).encode("utf-8")


def decode_run_groups(value: bytes) -> list[tuple[str, list[Step]]]:
    data = json.loads(value)
    if not isinstance(data, list):
        raise ValueError("steps message is not a JSON array")
    out = []
    for run_id, steps in data:
        if not isinstance(run_id, str) or not isinstance(steps, list):
            raise ValueError("grouped steps message: expected [run_id, [steps]] pairs")
        out.append((run_id, [Step.from_list(item) for item in steps]))
    return out


def encode_first_steps(groups: list[tuple[str, list[Step]]]) -> bytes:
    """A run-keyed steps message of the one run in `groups` (for `split_to_fit`)."""
    return encode_steps(groups[0][1])


def split_to_fit(
    groups: list[tuple[str, list[Step]]],
    encode: Callable[[list[tuple[str, list[Step]]]], bytes],
    limit: int,
) -> list[bytes]:
    """`encode(groups)` as one value, or as several (groups, then a run's steps, halved in
    order) when it is over `limit` bytes. A single step is never split."""
    value = encode(groups)
    if len(value) <= limit or (len(groups) == 1 and len(groups[0][1]) <= 1):
        return [value]
    if len(groups) > 1:
        mid = len(groups) // 2
        return split_to_fit(groups[:mid], encode, limit) + split_to_fit(groups[mid:], encode, limit)
    run_id, steps = groups[0]
    mid = len(steps) // 2
    return split_to_fit([(run_id, steps[:mid])], encode, limit) + split_to_fit(
        [(run_id, steps[mid:])], encode, limit
    )


def key_partition(key: bytes, partitions: int) -> int:
    """The partition the Kafka Java client / aiokafka default partitioner (and so faust's
    table router) gives `key`: murmur2, positive, modulo the partition count."""
    from aiokafka.partitioner import murmur2

    return int(murmur2(key) & 0x7FFFFFFF) % partitions


def to_json(value: Any) -> bytes:
    """Compact JSON bytes (events, summaries, steps)."""
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def key_text(key: Any) -> str:
    """A record or table key as text."""
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key).decode("utf-8", "replace")
    return str(key)
