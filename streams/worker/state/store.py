"""The worker's state store: what the `runs`, `finished`, `retained` and `episodes` tables
hold, and how.

A `runs` value is an envelope: a small JSON header (the run loop's `Envelope`: what the
deadline index needs) and the run's state (streams/worker/state/codec.py),
``<header JSON>\\n<RunState>``, so that rebuilding the deadline index after a rebalance
parses only the headers. A `finished` value is ``[finished_ns, partition]``. Tables are
plain key/value mappings here (a dict in tests, a faust table in the service).
`TableStore` is the run loop's store (streams/runloop/loop.py) over these tables; the
`retained` table's records (finished runs kept for on-call) are
streams/worker/state/retained.py, the `episodes` table's (loop episodes by time)
streams/worker/state/episodes.py. Every write of a batch is staged and applied together.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from detectors.state import RunState
from detectors.versions import Seen, Slice
from streams.runloop.loop import Envelope
from streams.worker.state import retained as retained_records
from streams.worker.state.codec import decode_state, encode_state
from streams.worker.state.episodes import key_ns as episode_key_ns

ENVELOPE_VERSION = 1

Table = MutableMapping[bytes, bytes]
# (table, partition, after this key or from the first, at most n) -> items in key order,
# read as they are iterated: a sweep holds one record at a time, not a slice of them (a
# slice of 5,000 retained records was a burst that grew with the history kept)
Scan = Callable[[Table, int, bytes | None, int], Iterable[tuple[bytes, bytes]]]
Read = Callable[[Table, int, bytes], bytes | None]  # (table, partition, key) -> value


def read_mapping(table: Table, partition: int, key: bytes) -> bytes | None:
    """`Read` of a plain mapping (tests, the memory store): every partition's keys in one."""
    return table.get(key)


def scan_mapping(
    table: Table, partition: int, after: bytes | None, limit: int
) -> list[tuple[bytes, bytes]]:
    """`Scan` over a plain mapping (tests, the memory store): every key, whatever its
    partition (the records say theirs)."""
    keys = sorted(k for k in table if after is None or k > after)[:limit]
    return [(k, table[k]) for k in keys]


def encode_header(env: Envelope) -> bytes:
    header: dict[str, Any] = {
        "v": ENVELOPE_VERSION,
        "p": env.partition,
        "seen": env.seen_ns,
        "first": env.first_ns,
        "max_end": env.max_end_ns,
        "root_end": env.root_end_ns,
        "pending": env.pending,
        "confirmed": env.confirmed_end_ns,
        "cand": env.candidates,
    }
    if env.summary is not None:  # (a reader from before it ignores the key)
        header["sum"] = env.summary
    return json.dumps(header, separators=(",", ":")).encode("utf-8")


def encode_envelope(state: RunState, env: Envelope) -> bytes:
    """`env` (its state-derived fields refreshed from `state`) + the encoded state."""
    env.refresh(state)
    return encode_header(env) + b"\n" + encode_state(state)


def decode_header(raw: bytes) -> Envelope:
    head, _, _ = bytes(raw).partition(b"\n")
    h = json.loads(head)
    if h.get("v") != ENVELOPE_VERSION:
        raise ValueError(f"run envelope version {h.get('v')!r} is not {ENVELOPE_VERSION}")
    cand = h.get("cand")  # these two are absent in envelopes written before them
    if cand and not isinstance(cand[0], list):
        cand = [cand]  # one [clock, end] pair: written before several could wait
    return Envelope(
        h["p"],
        h["seen"],
        h["first"],
        h["max_end"],
        h["root_end"],
        h["pending"],
        h.get("confirmed"),
        [(c[0], c[1]) for c in cand or ()],
        h.get("sum"),
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


# The tables a flush writes, in its order: the counts first, then the state whose fired
# markers stop the counted outputs from coming again (streams/worker/agents/checkpoint.py).
COUNT_TABLES = ("loop_counts", "run_counts", "version_counts", "hold_counts")
VALUE_TABLES = ("runs", "finished", "retained", "episodes")

Row = tuple[str, int, bytes, bytes | None]  # (table, partition, key, value or None = delete)
Rows = list[tuple[bytes, bytes | None]]  # (key, value or None = delete) of one partition


def put_rows(target: Table, rows: Rows) -> None:
    """Rows into a plain mapping (a dict, a faust Table in its partition's event, the memory
    store's dict): a value is set, None deletes."""
    for key, value in rows:
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value


@dataclass(slots=True)
class Writes:
    """Every table write staged since the last flush, in one buffer.

    `values`: table -> key -> (partition, value; None deletes), the last one wins. `counts`:
    windowed table -> (partition, label key) -> {contribution id: n}; `sightings`:
    (partition, version slice) -> {contribution id: Seen}. Counts are added once
    (streams/worker/state/window_keys.py): a contribution staged twice is one."""

    values: dict[str, dict[bytes, tuple[int, bytes | None]]] = field(default_factory=dict)
    counts: dict[str, dict[tuple[int, str], dict[int, int]]] = field(default_factory=dict)
    sightings: dict[tuple[int, Slice], dict[int, Seen]] = field(default_factory=dict)

    def put(self, table: str, partition: int, key: bytes, value: bytes | None) -> None:
        self.values.setdefault(table, {})[key] = (partition, value)

    def get(self, table: str, key: bytes) -> tuple[int, bytes | None] | None:
        staged = self.values.get(table)
        return None if staged is None else staged.get(key)

    def staged(self, table: str) -> int:
        return len(self.values.get(table, ()))

    def count(self, table: str, partition: int, label_key: str, cid: int, n: int = 1) -> None:
        self.counts.setdefault(table, {}).setdefault((partition, label_key), {})[cid] = n

    def sight(self, partition: int, key: Slice, cid: int, seen: Seen) -> None:
        self.sightings.setdefault((partition, key), {})[cid] = seen

    def rows(self) -> list[Row]:
        """The value writes, table by table in VALUE_TABLES order."""
        return [
            (table, p, k, v)
            for table in VALUE_TABLES
            for k, (p, v) in self.values.get(table, {}).items()
        ]

    def by_partition(self) -> list[tuple[str, int, Rows]]:
        """The value writes as (table, partition, [(key, value)]), tables in VALUE_TABLES
        order."""
        out = []
        for table in VALUE_TABLES:
            parts: dict[int, Rows] = {}
            for key, (partition, value) in self.values.get(table, {}).items():
                parts.setdefault(partition, []).append((key, value))
            out += [(table, partition, rows) for partition, rows in sorted(parts.items())]
        return out

    def __bool__(self) -> bool:
        return bool(self.values or self.counts or self.sightings)

    def clear(self) -> None:
        self.values.clear()
        self.counts.clear()
        self.sightings.clear()


def _expiry(raw: bytes | None) -> int | None:
    """A retained record's expiry (None: no record, or not one)."""
    if raw is None:
        return None
    try:
        return retained_records.header(raw)[0]
    except ValueError:
        return None


class TableStore:
    """The run loop's store over the `runs` and `finished` tables (`bind` them before use).

    Writes stay pending (`writes`, one buffer for every table, the counts' too) until the
    caller has published the outputs they belong to (`take_writes`): a state whose fired
    markers are in the changelog never belongs to an event that was not delivered. Reads
    see pending writes first. Decoded states of recently touched runs that still await
    spans or a release are kept (write-through: the table always has the same state
    encoded; not a settled run's, see `save`), which saves the decode on a run's next
    message; the cache is
    cleared on every rebalance, and an entry is taken out while its run is processed, so a
    failure never leaves a half-updated state cached."""

    def __init__(self, cache_size: int = 10_000) -> None:
        self.runs: Table = {}
        self.finished: Table = {}
        self.retained: Table = {}
        self.episodes: Table = {}
        self.scan: Scan = scan_mapping
        self.read: Read = read_mapping
        self.cache: OrderedDict[str, tuple[Envelope, RunState]] = OrderedDict()
        self.cache_size = cache_size
        self.writes = Writes()
        # states of runs finished in this batch (not those finished from their summary)
        self.finishing: dict[str, RunState] = {}
        self.sweep_after: dict[int, bytes | None] = {}  # partition -> key the sweep is past
        self.finished_after: dict[int, bytes | None] = {}  # ... the markers' sweep
        self.retained_indexed: set[int] = set()  # partitions whose records are all indexed
        # what the sweeps go through: the assigned partitions (the worker's rebuild) and
        # any this store has set a finished marker or a retained record in since
        self.sweep_partitions: set[int] = set()
        self.state_writes = 0
        self.state_write_bytes = 0

    def bind(
        self,
        runs: Table,
        finished: Table,
        retained: Table | None = None,
        episodes: Table | None = None,
    ) -> None:
        self.runs, self.finished = runs, finished
        if retained is not None:
            self.retained = retained
        if episodes is not None:
            self.episodes = episodes

    def _read(self, table: str, source: Table, partition: int, key: bytes) -> bytes | None:
        staged = self.writes.get(table, key)
        return staged[1] if staged is not None else self.read(source, partition, key)

    def load(self, run_id: str, partition: int) -> tuple[Envelope, RunState] | None:
        cached = self.cache.pop(run_id, None)
        if cached is not None:
            return cached
        raw = self._read("runs", self.runs, partition, run_id.encode("utf-8"))
        return None if raw is None else decode_envelope(raw)

    def load_envelope(self, run_id: str, partition: int) -> Envelope | None:
        """The run's envelope without decoding its state (a cached run's as cached)."""
        cached = self.cache.get(run_id)
        if cached is not None:
            return cached[0]
        raw = self._read("runs", self.runs, partition, run_id.encode("utf-8"))
        return None if raw is None else decode_header(raw)

    def save(self, run_id: str, env: Envelope, state: RunState) -> None:
        self.writes.put("runs", env.partition, run_id.encode("utf-8"), encode_envelope(state, env))
        # A settled run (Envelope.settled) is loaded once more, by the tick that finalizes
        # it after the grace: holding its decoded state until then would save one decode
        # and cost its memory for the grace (keyed input, 150k spans: peak RSS 178 MiB
        # against 252 with every state cached, same throughput; docs/PERFORMANCE.md).
        if self.cache_size > 0 and not env.settled():
            self.cache[run_id] = (env, state)
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)

    def finish(self, run_id: str, partition: int, now_ns: int, state: RunState | None) -> None:
        key = run_id.encode("utf-8")
        if state is not None:
            self.finishing[run_id] = state
        self.writes.put("runs", partition, key, None)
        self.writes.put("finished", partition, key, encode_finished(now_ns, partition))
        self.sweep_partitions.add(partition)

    def is_finished(self, run_id: str, partition: int) -> bool:
        key = run_id.encode("utf-8")
        return self._read("finished", self.finished, partition, key) is not None

    def sweep_finished(self, partition: int, cutoff_ns: int, limit: int) -> int:
        """Delete the markers set at or before `cutoff_ns` among the next `limit` of
        `partition` (`_sweep`). The markers live in the table only: an index of them in
        memory grew with the finish rate times the TTL (360k markers, 65 MiB, at 100 runs
        a second and the default hour)."""

        def expired(raw: bytes) -> tuple[int, bool]:
            finished_ns, owner = decode_finished(raw)
            return owner, finished_ns <= cutoff_ns

        return self._sweep(
            "finished", self.finished, self.finished_after, partition, limit, expired
        )

    def load_retained(self, partition: int, key: bytes) -> bytes | None:
        return self._read("retained", self.retained, partition, key)

    def put_retained(
        self, partition: int, key: bytes, value: bytes | None, *, was: bytes | None
    ) -> None:
        """Write (None: delete) a retained record over `was` (what `load_retained` gave the
        caller for it), and move its entry in the expiry index when its expiry changes."""
        before, after = _expiry(was), _expiry(value)
        if before != after:
            if before is not None:
                self.writes.put(
                    "retained", partition, retained_records.index_key(before, key), None
                )
            if after is not None:
                index = retained_records.index_key(after, key)
                self.writes.put(
                    "retained", partition, index, retained_records.index_value(partition)
                )
        self.writes.put("retained", partition, key, value)
        self.sweep_partitions.add(partition)

    def put_episode(self, partition: int, key: bytes, value: bytes) -> None:
        self.writes.put("episodes", partition, key, value)

    def sweep_episodes(self, partition: int, cutoff_ns: int, limit: int) -> int:
        """Delete `partition`'s episodes detected before `cutoff_ns`: its oldest keys, up to
        the first one that is not (keys start with the time). Returns how many."""
        deleted = 0
        for key, _raw in self.scan(self.episodes, partition, None, limit):
            if episode_key_ns(key) >= cutoff_ns:
                break
            if self.writes.get("episodes", key) is None:
                self.writes.put("episodes", partition, key, None)
                deleted += 1
        return deleted

    def sweep_retained(self, partition: int, now_ns: int, limit: int) -> int:
        """Delete `partition`'s expired retained records: the next `limit` entries of the
        expiry index, up to the first one not yet due, and the records they point to (a
        record whose expiry moved has an entry of its own). A partition not yet marked
        indexed first gets one pass over its records (`_index_retained`). The cursor
        (`sweep_after`) stays set while the slice was full. Returns how many it deleted."""
        if not self._retained_indexed(partition):
            return self._index_retained(partition, now_ns, limit)
        deleted = read = 0
        last, due = None, True
        after = self.sweep_after.get(partition) or retained_records.INDEX
        for key, raw in self.scan(self.retained, partition, after, limit):
            read, last = read + 1, key
            try:
                expires_ns, record, owner = retained_records.index_entry(key, raw)
            except ValueError:
                continue
            if expires_ns > now_ns:
                due = False
                break
            if owner != partition or self.writes.get("retained", key) is not None:
                continue
            self.writes.put("retained", partition, key, None)
            current = self._read("retained", self.retained, partition, record)
            if current is not None and self.writes.get("retained", record) is None:
                try:
                    expires, _finished, owner = retained_records.header(current)
                except ValueError:
                    continue
                if expires <= now_ns and owner == partition:
                    self.writes.put("retained", partition, record, None)
                    deleted += 1
        self.sweep_after[partition] = last if due and read == limit else None
        return deleted

    def _retained_indexed(self, partition: int) -> bool:
        if partition in self.retained_indexed:
            return True
        marker = retained_records.indexed_key(partition)
        if self._read("retained", self.retained, partition, marker):
            self.retained_indexed.add(partition)
            return True
        return False

    def _index_retained(self, partition: int, now_ns: int, limit: int) -> int:
        """A slice of one pass over `partition`'s records (those written before the expiry
        index, or a table restored without it): the expired ones are deleted, the others
        get their index entry. At the pass's end the partition is marked indexed, and only
        the index is read from then on (a partition with no record is not marked: its pass
        reads nothing). Returns how many it deleted."""
        deleted = read = 0
        start = last = self.sweep_after.get(partition)
        for key, raw in self.scan(self.retained, partition, start, limit):
            if not retained_records.is_record_key(key):
                break  # past the records: the index and the marks sort after them
            read, last = read + 1, key
            try:
                expires_ns, _finished, owner = retained_records.header(raw)
            except ValueError:
                continue
            if owner != partition or self.writes.get("retained", key) is not None:
                continue
            if expires_ns <= now_ns:
                self.writes.put("retained", partition, key, None)
                deleted += 1
                continue
            index = retained_records.index_key(expires_ns, key)
            if self._read("retained", self.retained, partition, index) is None:
                self.writes.put(
                    "retained", partition, index, retained_records.index_value(partition)
                )
        if read == limit:
            self.sweep_after[partition] = last
        else:
            self.sweep_after[partition] = None
            if read or start is not None:
                # records were read: the mark spares the next worker the pass (a partition
                # with none is not written to: an idle worker writes nothing)
                mark = retained_records.indexed_key(partition)
                self.writes.put("retained", partition, mark, b"1")
            self.retained_indexed.add(partition)
        return deleted

    def _sweep(
        self,
        name: str,
        table: Table,
        cursors: dict[int, bytes | None],
        partition: int,
        limit: int,
        expired: Callable[[bytes], tuple[int, bool]],
    ) -> int:
        """Delete the records `expired` says are `partition`'s and past their time among
        the next `limit` of the partition, in key order from where the last sweep stopped
        (`cursors`; past the end it starts again). Unreadable records and records with a
        staged write are left. Returns how many it deleted."""
        deleted = read = 0
        last: bytes | None = None
        for key, raw in self.scan(table, partition, cursors.get(partition), limit):
            read, last = read + 1, key
            try:
                owner, past = expired(raw)
            except (ValueError, TypeError):
                continue
            if owner == partition and past and self.writes.get(name, key) is None:
                self.writes.put(name, partition, key, None)
                deleted += 1
        cursors[partition] = last if read == limit else None
        return deleted

    def take_writes(self) -> Writes:
        """The pending writes, and forget them: the caller applies them (after the outputs
        were acknowledged; streams/worker/agents/checkpoint.py)."""
        writes = self.writes
        runs = writes.values.get("runs", {})
        self.state_writes += len(runs)
        self.state_write_bytes += sum(len(v) for _p, v in runs.values() if v)
        self.writes = Writes()
        self.finishing.clear()
        return writes

    def discard_writes(self) -> None:
        """The outputs could not be published: drop the batch's writes and every cached
        state (the tables still hold the states before the batch)."""
        self.writes.clear()
        self.finishing.clear()
        self.cache.clear()

    def apply_writes(self) -> int:
        """take_writes + apply of the value writes, for plain mappings (tests, tools)."""
        parts = self.take_writes().by_partition()
        for table, _p, rows in parts:
            put_rows(getattr(self, table), rows)  # VALUE_TABLES are this store's attributes
        return sum(len(rows) for _t, _p, rows in parts)


@runtime_checkable
class Windowed(Protocol):
    """A windowed count table of the service (faust_app.CurrentWindow): the current
    window's value of a key in a partition, and items as rows of it for `Tables.writer`
    (`raw`: the faust table they go to)."""

    raw: Any

    def read(self, partition: int, key: str) -> Any: ...
    def rows(self, partition: int, items: list[tuple[str, Any]]) -> Rows: ...


def _no_event(event: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


@dataclass(slots=True)
class Tables:
    """The worker's tables, by the names COUNT_TABLES, VALUE_TABLES and `versions` give them
    (`named`): `runs` and `finished` (see above), the retained runs, the episodes, the
    versions, and the windowed counters behind /loops, /runs, /compare and /hold-counts
    (`read(partition, key)` of the current window and `rows(partition, items)` of it for
    `writer`, `items()` of every window; in tests a plain dict, ``get`` and ``[key] =
    value``). `in_event(event)`: a context in which writes go to `event`'s partition (faust
    picks a table write's partition from the current event; plain mappings need
    nothing)."""

    runs: Table
    finished: Table
    loop_counts: Any
    run_counts: Any
    in_event: Callable[[Any], contextlib.AbstractContextManager[None]] = _no_event
    retained: Table = field(default_factory=dict)
    episodes: Table = field(default_factory=dict)
    scan: Scan | None = None  # a partition's items in key order (None: plain mappings)
    read: Read | None = None  # a key of a partition (None: plain mappings)
    count: Callable[[Any], int] = len  # a table's keys (rocksdb: its estimate, no read)
    # which version replaced which, and the windowed counts of each version's runs
    # (streams/worker/agents/counting.py, detectors/versions.py)
    versions: Table = field(default_factory=dict)
    version_counts: Any = field(default_factory=dict)
    # what each on-call hold did (detectors/holds.py HOLD_MEASURES), windowed
    hold_counts: Any = field(default_factory=dict)
    # writes the value tables' rows in bulk and waits for their changelog
    # (faust_internals.ChangelogWriter); None: row by row, in the rows' event
    writer: Any = None

    async def write(self, parts: list[tuple[str, int, Rows]], routing: Any) -> None:
        """Write (table name, partition, rows) with `writer`, or row by row, each partition's
        rows in `routing[partition]`'s event."""
        if self.writer is not None:
            await self.writer.write([(self.named(name), p, rows) for name, p, rows in parts])
            return
        for name, partition, rows in parts:
            with self.in_event(routing[partition]):
                put_rows(self.named(name), rows)

    def read_count(self, name: str, partition: int, key: str) -> Any:
        """A windowed count table's value of `key` in the current window, in `partition`."""
        table = self.named(name)
        return table.read(partition, key) if isinstance(table, Windowed) else table.get(key)

    async def write_counts(
        self,
        counts: list[tuple[str, int, list[tuple[str, Any]]]],
        values: list[tuple[str, int, Rows]],
        routing: Any,
    ) -> None:
        """Windowed counts (table name, partition, [(key, value)]) into the current window,
        with value-table rows that go with them (the versions' sightings): the `Windowed`
        tables' as rows, with `writer` in one bulk write, which waits for their changelog
        (one round trip to the broker); a plain mapping's one by one in
        `routing[partition]`'s event."""
        bulk = []
        for name, partition, items in counts:
            table = self.named(name)
            if isinstance(table, Windowed) and self.writer is not None:
                bulk.append((table.raw, partition, table.rows(partition, items)))
                continue
            with self.in_event(routing[partition]):
                for key, value in items:
                    table[key] = value
        if self.writer is None:
            await self.write(values, routing)
            return
        bulk += [(self.named(name), partition, rows) for name, partition, rows in values]
        if bulk:
            await self.writer.write(bulk)

    def read_value(self, table: Table, partition: int, key: bytes) -> bytes | None:
        return (self.read or read_mapping)(table, partition, key)

    def named(self, name: str) -> Any:
        if name not in (*COUNT_TABLES, *VALUE_TABLES, "versions"):
            raise KeyError(name)
        return getattr(self, name)
