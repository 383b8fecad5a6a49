"""Message formats of the worker's internal topic (``loopwatch-steps``): steps messages and
timer ticks, and where a run's messages go.

* a steps message keyed by run id (``LOOPWATCH_STEPS_GROUPING=run``): the steps of one run;
* a partition-grouped steps message (no key, the default): ``[(run_id, [step, ...]), ...]``,
  on the partition the run id hashes to (`key_partition`);
* a tick: a JSON object ``{"tick": sent_ns, "clock": clock_ns}``;
* a mark: a JSON object ``{"mark": sent_ns, "delivered": {"<input partition>": offset}}``,
  the input offsets below which the sending worker's ingest has delivered every record's
  steps, for the other workers' input clocks (streams/worker/kafka/input_clock.py);
* the header ``loopwatch-input-clock`` on a steps message: the input clock it was sent at.

Steps are written as ``0x01`` + Python's `marshal` (format version 4, stable since Python
3.4) of tuples of the steps' fields in STEP_FIELDS order: a third smaller than the JSON
lists of earlier versions and about twice as fast both ways (the hop's encode and decode
were 13% of the worker's time). The decoder checks the structure and types it gets back.
A value starting with ``[`` is the JSON of earlier versions (still read: messages in flight
across an upgrade). marshal is safe to read here only because the steps topic is the
worker's own: it is not a format for untrusted input.
"""

from __future__ import annotations

import json
import marshal
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

from detectors.model import STEP_FIELDS, Step, step_values

# Steps messages are split to stay under this (the producer refuses requests over 1 MB;
# a record of many small spans may encode to more steps bytes than its own protobuf).
MAX_STEPS_MESSAGE_BYTES = 512 * 1024
TICK_VALUE_PREFIX = b"{"  # ticks are JSON objects
STEPS_FORMAT = b"\x01"  # steps messages: marshal of field tuples
_JSON_STEPS = b"["  # steps messages of earlier versions: JSON arrays
_MARSHAL_VERSION = 4
CLOCK_HEADER = "loopwatch-input-clock"  # on steps messages: the input clock at send time


def encode_tick(sent_ns: int, clock_ns: int) -> bytes:
    """A tick: its send time and the deadline clock (wall or input clock) at that time."""
    return json.dumps({"tick": sent_ns, "clock": clock_ns}).encode()


MARK_VALUE_PREFIX = b'{"mark"'


def encode_mark(sent_ns: int, delivered: Mapping[int, int]) -> bytes:
    """A mark: this worker's delivered input offsets, by input partition."""
    return json.dumps(
        {"mark": sent_ns, "delivered": {str(p): o for p, o in sorted(delivered.items())}}
    ).encode()


def mark_offsets(value: bytes) -> dict[int, int]:
    """The delivered offsets a mark carries; ValueError for a malformed one."""
    body = json.loads(value)
    delivered = body.get("delivered") if isinstance(body, dict) else None
    if not isinstance(delivered, dict):
        raise ValueError("a mark without its delivered offsets")
    out: dict[int, int] = {}
    for p, offset in delivered.items():
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"a mark's offset for partition {p!r} is not an offset: {offset!r}")
        out[int(p)] = offset
    return out


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
    """A run-keyed steps message: the steps of one run."""
    return STEPS_FORMAT + marshal.dumps(list(map(step_values, steps)), _MARSHAL_VERSION)


def decode_steps(value: bytes) -> list[Step]:
    value = bytes(value)
    if value[:1] == _JSON_STEPS:
        data = json.loads(value)
        if not isinstance(data, list):
            raise ValueError("steps message is not a JSON array")
        return [Step.from_list(item) for item in data]
    return _steps(_unmarshal(value))


def encode_run_groups(groups: Iterable[tuple[str, list[Step]]]) -> bytes:
    """A partition-grouped steps message (no key): ``[(run_id, [step, ...]), ...]``."""
    return STEPS_FORMAT + marshal.dumps(
        [(run_id, list(map(step_values, steps))) for run_id, steps in groups], _MARSHAL_VERSION
    )


def decode_run_groups(value: bytes) -> list[tuple[str, list[Step]]]:
    value = bytes(value)
    if value[:1] == _JSON_STEPS:
        data = json.loads(value)
        if not isinstance(data, list):
            raise ValueError("steps message is not a JSON array")
        out = []
        for run_id, steps in data:
            if not isinstance(run_id, str) or not isinstance(steps, list):
                raise ValueError("grouped steps message: expected [run_id, [steps]] pairs")
            out.append((run_id, [Step.from_list(item) for item in steps]))
        return out
    return [(run_id, _make(items)) for run_id, items in _groups(_unmarshal(value))]


class PackedSteps:
    """A run's steps while detect holds them for the input clock
    (streams/worker/agents/arrivals.py): the marshal of their checked field tuples, about
    200 bytes a step where the Step objects take 800 (docs/PERFORMANCE.md, stop 62). A
    burst of held Steps left the allocator's pages behind it."""

    __slots__ = ("data", "count")

    def __init__(self, items: list[tuple[Any, ...]]) -> None:
        self.data = marshal.dumps(items, _MARSHAL_VERSION)
        self.count = len(items)

    @classmethod
    def of(cls, steps: Iterable[Step]) -> PackedSteps:
        return cls(list(map(step_values, steps)))

    def __len__(self) -> int:
        return self.count

    def unpack(self) -> list[Step]:
        return _make(marshal.loads(self.data))


def packed_run_steps(key: Any, value: bytes) -> list[tuple[str, PackedSteps]]:
    """A steps message's runs (of a run-keyed one, the run of `key`), each with its steps
    checked as `decode_steps` and `decode_run_groups` check them, and packed."""
    value = bytes(value)
    if value[:1] == _JSON_STEPS:  # earlier versions: decoded, then packed
        parts = decode_run_groups(value) if key is None else [(key_text(key), decode_steps(value))]
        return [(run_id, PackedSteps.of(steps)) for run_id, steps in parts]
    data = _unmarshal(value)
    if key is not None:
        _check(data)
        return [(key_text(key), PackedSteps(data))]
    return [(run_id, PackedSteps(items)) for run_id, items in _groups(data)]


def _groups(data: list[Any]) -> list[tuple[str, list[Any]]]:
    """The (run_id, steps) pairs of a grouped message, each checked."""
    groups = []
    for group in data:
        if type(group) is not tuple or len(group) != 2 or type(group[0]) is not str:
            raise ValueError("grouped steps message: expected (run_id, [steps]) pairs")
        _check(group[1])
        groups.append((group[0], group[1]))
    return groups


def _unmarshal(value: bytes) -> list[Any]:
    if value[:1] != STEPS_FORMAT:
        raise ValueError(f"steps message: unknown format byte {value[:1]!r}")
    try:
        data = marshal.loads(value[1:])
    except (EOFError, ValueError, TypeError) as exc:
        raise ValueError(f"steps message: unreadable ({exc})") from None
    if type(data) is not list:
        raise ValueError("steps message is not a list")
    return data


_N_FIELDS = len(STEP_FIELDS)
# Steps written by the previous release lack the fields added since (they take their
# defaults): a rolling upgrade reads them.
_N_OLDEST = STEP_FIELDS.index("identity_fp") + 1
_TUPLES = tuple(STEP_FIELDS.index(name) for name in ("item_fps", "denied_calls"))
_TYPES = frozenset({str, int, float, bool, type(None), tuple})  # tuple: item_fps, denied_calls


def _steps(items: Any) -> list[Step]:
    """Steps from field tuples, each checked."""
    _check(items)
    return _make(items)


def _make(items: list[Any]) -> list[Step]:
    return [Step(*values) for values in items]


def _check(items: Any) -> None:
    """Field tuples of steps: scalars, and item_fps a tuple of strings."""
    if type(items) is not list:
        raise ValueError("steps message: steps are not a list")
    for values in items:
        if (
            type(values) is not tuple
            or not _N_OLDEST <= len(values) <= _N_FIELDS
            or not _TYPES.issuperset(map(type, values))
        ):
            raise ValueError("steps message: a step is not a tuple of its fields")
        for at in _TUPLES:
            if at < len(values):
                fps = values[at]
                if type(fps) is not tuple or (fps and not all(type(f) is str for f in fps)):
                    raise ValueError(f"steps message: {STEP_FIELDS[at]} is not a tuple of strings")


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


def _murmur2() -> Callable[[bytes], int]:
    """loopwatch_native's murmur2 when the native path is active (the same hash: 0.16 µs
    for a 32-byte run id against 11.7 in Python, and ingest hashes every run of every
    export request), else aiokafka's."""
    from streams.spanpath import native

    found = getattr(native.EXT, "murmur2", None)
    if found is not None:
        return cast(Callable[[bytes], int], found)
    from aiokafka.partitioner import murmur2

    return cast(Callable[[bytes], int], murmur2)


murmur2 = _murmur2()


def key_partition(key: bytes, partitions: int) -> int:
    """The partition the Kafka Java client / aiokafka default partitioner (and so faust's
    table router) gives `key`: murmur2, positive, modulo the partition count."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def to_json(value: Any) -> bytes:
    """Compact JSON bytes (events, summaries)."""
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def key_text(key: Any) -> str:
    """A record or table key as text."""
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key).decode("utf-8", "replace")
    return str(key)
