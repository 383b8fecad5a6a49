"""The column writer of the `runs` table's state format (streams/worker/state/codec.py); its reader
is streams/worker/state/unpacking.py.

The state is written as columns: lists of like values (the dedup map's keys, the window's
times, ...); records (window entries, detector map values, buffered steps) are transposed
into columns. Each column takes the smallest exact encoding for what it holds, named by one
character of `kinds`:

    b h i q   ints as int8 / int16 / int32 / int64
    r         span ids of the dedup map (written first) as their index there
    x         equal-width lower-case hex strings (span ids, digests) as raw bytes
              (item: byte width): half the size, and one C call each way
    s S       other strings: references into the string pool (S: all new, no references)
    n f z     all None / all False / bools, one byte each
    l         lists: their lengths (item: one int when all equal), then their concatenated
              items (one more column)
    o         some None: a bit mask item, then the other values (one more column)
    j         anything else, as the JSON item itself

so a value the compact kinds cannot hold exactly still round-trips (as JSON): the kinds only
decide the size. Rows of records are 't' (items n, m, then the columns) or 'j'. A single
record (streak, last key) is JSON with its list fields as columns.
"""

from __future__ import annotations

import json
import struct
import zlib
from functools import lru_cache
from itertools import chain
from typing import Any, NamedTuple, cast

from streams.spanpath import native

FORMAT_PACKED = 2

_HEAD = struct.Struct("<BII")  # format, crc32, len(J)
_INTS = (("b", 1 << 7), ("h", 1 << 15), ("i", 1 << 31), ("q", 1 << 63))  # (code, bound)
_INT_SIZE = {"b": 1, "h": 2, "i": 4, "q": 8, "B": 1, "H": 2, "I": 4}
_HEX_DIGITS = frozenset("0123456789abcdef")
_JSON = json.JSONEncoder(separators=(",", ":"))  # ASCII: lone surrogates survive
_NATIVE_WRITER = getattr(native.EXT, "StateWriter", None)
_INT_T, _STR_T, _BOOL_T, _LIST_T, _NONE_T = {int}, {str}, {bool}, {list}, {type(None)}


class Layout(NamedTuple):
    """Which columns of an m-long record are written together (each index exactly once)."""

    width: int
    groups: tuple[tuple[int, ...], ...]


def new_writer() -> ColumnWriter:
    """The writer encode_state uses: loopwatch_native.StateWriter (the same methods and
    bytes, compiled: tests/unit/native/test_packing.py) when the native path is active,
    else `ColumnWriter`, the reference."""
    if _NATIVE_WRITER is None:
        return ColumnWriter()
    return cast(ColumnWriter, _NATIVE_WRITER(_JSON.encode))


class ColumnWriter:
    __slots__ = ("kinds", "items", "data", "strs", "refs", "ids")

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.items: list[Any] = []
        self.data: list[bytes] = []
        self.strs: dict[str, int] = {}  # string pool: entry -> index, in first-seen order
        self.refs: list[int] = []
        self.ids: dict[str, int] = {}  # the dedup map's span ids, see _strs

    def item(self, value: Any) -> None:
        self.items.append(value)

    def set_ids(self, keys: list[str]) -> None:
        """Later span id columns refer to these (the dedup map's keys, in order)."""
        self.ids = dict(zip(keys, range(len(keys)), strict=True))

    def finish(self) -> bytes:
        text = _JSON.encode(["".join(self.kinds), list(self.strs), len(self.refs), *self.items])
        j = text.encode("ascii")
        body = b"".join([j, _pack_refs(self.refs, len(self.strs)), *self.data])
        return _HEAD.pack(FORMAT_PACKED, zlib.crc32(body), len(j)) + body

    # -- columns: a list of values whose length the reader knows from elsewhere

    def column(self, values: list[Any]) -> None:
        types = set(map(type, values))
        if types == _STR_T:
            self._strs(values)
            return
        if types == _INT_T:
            lo, hi = min(values), max(values)
            for code, bound in _INTS:
                if -bound <= lo and hi < bound:
                    self.kinds.append(code)
                    self.data.append(_struct(len(values), code).pack(*values))
                    return
        elif types == _BOOL_T:
            if any(values):
                self.kinds.append("z")
                self.data.append(bytes(values))
            else:
                self.kinds.append("f")
            return
        elif types == _NONE_T or not types:
            self.kinds.append("n")  # (an empty column writes nothing)
            return
        elif types == _LIST_T:
            self.kinds.append("l")
            lengths = list(map(len, values))
            self.items.append(lengths[0] if lengths.count(lengths[0]) == len(lengths) else lengths)
            self.column(list(chain.from_iterable(values)))
            return
        elif len(types) == 2 and type(None) in types:
            self.kinds.append("o")
            self.items.append(sum(1 << i for i, v in enumerate(values) if v is None))
            self.column([v for v in values if v is not None])
            return
        self.kinds.append("j")  # floats, mixed types, ints wider than int64: JSON, exact
        self.items.append(values)

    def _strs(self, values: list[str]) -> None:
        if self.ids:  # span ids already in the dedup map: a one-byte index each
            found = list(map(self.ids.get, values))
            if None not in found:
                self.kinds.append("r")
                self.data.append(_pack_refs(found, len(self.ids)))
                return
        width = len(values[0])
        if width and width % 2 == 0 and _HEX_DIGITS.issuperset(values[0]):
            # One space between values: the round trip through bytes then proves that every
            # value is exactly `width` lower-case hex digits (fromhex skips the spaces, hex()
            # puts them back every width/2 bytes).
            joined = " ".join(values)
            try:
                raw = bytes.fromhex(joined)
            except ValueError:
                raw = b""
            if raw and raw.hex(" ", width // 2) == joined:
                self.kinds.append("x")
                self.items.append(width // 2)
                self.data.append(raw)
                return
        pool = self.strs
        start = len(pool)
        indexes = [pool.setdefault(v, len(pool)) for v in values]
        if len(pool) - start == len(values):
            self.kinds.append("S")  # all new and distinct: the reader knows which
        else:
            self.kinds.append("s")
            self.refs.extend(indexes)

    # -- composite values

    def bigint(self, value: int) -> None:
        """A non-negative int (bloom filter bits) as raw little-endian bytes."""
        if type(value) is int and value >= 0:
            size = (value.bit_length() + 7) // 8
            self.items.append(size)
            self.data.append(value.to_bytes(size, "little"))
        else:
            self.items.append(-1)
            self.items.append(value)

    def rows(self, rows: list[Any], layout: Layout | None = None) -> None:
        """Records (lists of one length m) as columns; anything else as JSON. `layout` joins
        columns of like values into one (fewer, longer columns: the per-column cost is
        Python's, the per-value cost C's); it applies when the records are m long."""
        m = len(rows[0]) if rows and type(rows[0]) is list else 0
        if not rows:
            self.kinds.append("t")
            self.items.append(0)
        elif m and set(map(type, rows)) == _LIST_T and set(map(len, rows)) == {m}:
            self.kinds.append("t")
            self.items.append(len(rows))
            self.items.append(m)
            columns = list(zip(*rows, strict=True))
            if layout is None or layout.width != m:
                for values in columns:
                    self.column(list(values))
            else:
                for group in layout.groups:
                    self.column(list(chain.from_iterable(map(columns.__getitem__, group))))
        else:
            self.kinds.append("j")
            self.items.append(rows)

    def record(self, record: list[Any] | None) -> None:
        """One record (streak, last key): JSON, but its list fields (span and call ids) as
        columns. A column per scalar would cost more time than it saves bytes."""
        if type(record) is not list:
            self.items.append(record)  # None (or anything else: JSON)
            return
        lists = [i for i, v in enumerate(record) if type(v) is list]
        self.items.append([len(v) if type(v) is list else v for v in record])
        self.items.append(lists)
        for i in lists:
            self.column(record[i])

    def mapping(self, mapping: dict[str, Any], layout: Layout | None = None) -> None:
        self.items.append(len(mapping))
        if mapping:
            self.column(list(mapping))
            self.rows(list(mapping.values()), layout)


def _ref_code(pool_size: int) -> str:
    return "B" if pool_size <= 1 << 8 else "H" if pool_size <= 1 << 16 else "I"


def _pack_refs(refs: list[Any], pool_size: int) -> bytes:
    return _struct(len(refs), _ref_code(pool_size)).pack(*refs)


@lru_cache(maxsize=1024)
def _struct(n: int, code: str) -> struct.Struct:
    return struct.Struct(f"<{n}{code}")
