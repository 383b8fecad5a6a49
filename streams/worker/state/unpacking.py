"""The column reader of the `runs` table's state format: `ColumnReader`, the inverse of
`ColumnWriter` in streams/worker/state/packing.py (the format and its column kinds are described
there). Anything that does not add up (checksum, lengths, kinds, references) raises
DecodeError.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from streams.errors import DecodeError
from streams.worker.state.packing import _HEAD, _INT_SIZE, Layout, _ref_code, _struct


class ColumnReader:
    __slots__ = (
        "kinds",
        "k",
        "items",
        "i",
        "data",
        "off",
        "strs",
        "refs",
        "ref_at",
        "fresh",
        "ids",
    )

    def __init__(self, data: bytes) -> None:
        if len(data) < _HEAD.size:
            raise DecodeError(f"run state: truncated packed value ({len(data)} bytes)")
        _fmt, crc, j_len = _HEAD.unpack_from(data)
        body = data[_HEAD.size :]
        if zlib.crc32(body) != crc:
            raise DecodeError(
                f"run state: checksum mismatch, corrupt or truncated value ({len(data)} bytes)"
            )
        if j_len > len(body):
            raise DecodeError(f"run state: header length {j_len} past the end ({len(data)} bytes)")
        head = json.loads(body[:j_len])
        if not isinstance(head, list) or len(head) < 3:
            raise DecodeError("run state: packed header is not [kinds, strings, n_refs, ...]")
        kinds, strs, n_refs = head[:3]
        if not isinstance(kinds, str) or not isinstance(strs, list) or type(n_refs) is not int:
            raise DecodeError("run state: packed header has the wrong types")
        self.kinds: str = kinds
        self.k = 0
        self.items: list[Any] = head[3:]
        self.i = 0
        self.data = body
        self.off = j_len
        self.strs: list[Any] = strs
        code = _ref_code(len(strs))
        self.refs = _struct(n_refs, code).unpack(self.take(n_refs * _INT_SIZE[code]))
        self.ref_at = 0
        self.fresh = 0  # string pool entries used so far (they are numbered in first use)
        self.ids: list[str] = []  # the dedup map's span ids, once read

    def take(self, size: int) -> bytes:
        end = self.off + size
        if size < 0 or end > len(self.data):
            raise DecodeError(
                f"run state: truncated column data (need {size} bytes at {self.off}, "
                f"have {len(self.data) - self.off})"
            )
        chunk = self.data[self.off : end]
        self.off = end
        return chunk

    def kind(self) -> str:
        kind = self.kinds[self.k]
        self.k += 1
        return kind

    def item(self) -> Any:
        value = self.items[self.i]
        self.i += 1
        return value

    def count(self) -> int:
        n = self.item()
        if type(n) is not int or n < 0:
            raise DecodeError(f"run state: bad count {n!r}")
        return n

    def sized_item(self, n: int) -> list[Any]:
        value = self.item()
        if not isinstance(value, list) or len(value) != n:
            raise DecodeError(f"run state: expected a list of {n} values")
        return value

    def done(self) -> None:
        left = (len(self.kinds) - self.k, len(self.items) - self.i, len(self.data) - self.off)
        if any(left):
            raise DecodeError(f"run state: trailing data (kinds, items, bytes) {left}")
        if self.ref_at != len(self.refs):
            raise DecodeError("run state: unused string pool references")

    # -- columns

    def column(self, n: int) -> list[Any]:
        kind = self.kinds[self.k]
        self.k += 1
        if kind in _INT_SIZE:
            return list(_struct(n, kind).unpack(self.take(n * _INT_SIZE[kind])))
        if kind == "r":
            code = _ref_code(len(self.ids))
            indexes = _struct(n, code).unpack(self.take(n * _INT_SIZE[code]))
            return list(map(self.ids.__getitem__, indexes))  # IndexError if bad
        if kind == "x":
            width = self.count()
            if n == 0:
                return []
            if width == 0:
                raise DecodeError("run state: hex column of width 0")
            return self.take(n * width).hex(" ", width).split(" ")
        if kind == "s" or kind == "S":
            return self._strings(n, kind == "S")
        if kind == "n":
            return [None] * n
        if kind == "f":
            return [False] * n
        if kind == "z":
            return list(map(bool, self.take(n)))
        if kind == "l":
            return self._lists(n)
        if kind == "o":
            return self._optional(n)
        if kind == "j":
            return self.sized_item(n)
        raise DecodeError(f"run state: unknown column kind {kind!r}")

    def _strings(self, n: int, fresh: bool) -> list[Any]:
        if fresh:  # the next n pool entries, first used here
            start = self.fresh
            self.fresh = start + n
            values = self.strs[start : start + n]
        else:
            at = self.ref_at
            indexes = self.refs[at : at + n]
            self.ref_at = at + n
            if len(indexes) < n:
                raise DecodeError("run state: string pool references run out")
            values = list(map(self.strs.__getitem__, indexes))  # IndexError if bad
            if indexes:
                self.fresh = max(self.fresh, max(indexes) + 1)
        if len(values) != n:
            raise DecodeError("run state: string pool entries run out")
        return values

    def _lists(self, n: int) -> list[Any]:
        lengths = self.item()
        if type(lengths) is int:
            lengths = [lengths] * n
        if not isinstance(lengths, list) or len(lengths) != n:
            raise DecodeError("run state: list lengths do not match their column")
        if any(type(m) is not int or m < 0 for m in lengths):
            raise DecodeError("run state: bad list lengths")
        flat = self.column(sum(lengths))
        out, at = [], 0
        for m in lengths:
            out.append(flat[at : at + m])
            at += m
        return out

    def _optional(self, n: int) -> list[Any]:
        mask = self.count()
        if mask >> n:
            raise DecodeError("run state: None mask wider than its column")
        present = iter(self.column(n - mask.bit_count()))
        return [None if mask >> i & 1 else next(present) for i in range(n)]

    # -- composite values

    def bigint(self) -> int:
        size = self.item()
        if size == -1:
            value: int = self.item()
            return value
        if type(size) is not int or size < 0:
            raise DecodeError(f"run state: bad integer size {size!r}")
        return int.from_bytes(self.take(size), "little")

    def rows(self, layout: Layout | tuple[Layout, ...] | None = None) -> list[Any]:
        """Records written by ColumnWriter.rows; `layout` may name several (the layouts
        of a record's successive widths): the one as wide as the records applies."""
        kind = self.kind()
        if kind == "j":
            value = self.item()
            if not isinstance(value, list):
                raise DecodeError("run state: rows are not a list")
            return value
        if kind != "t":
            raise DecodeError(f"run state: unknown rows kind {kind!r}")
        n = self.count()
        if n == 0:
            return []
        m = self.count()
        if isinstance(layout, tuple) and not isinstance(layout, Layout):
            layout = next((x for x in layout if x.width == m), None)
        if layout is None or layout.width != m:
            columns = [self.column(n) for _ in range(m)]
        else:
            columns = [[]] * m
            for group in layout.groups:
                values = self.column(n * len(group))
                for j, i in enumerate(group):
                    columns[i] = values[j * n : (j + 1) * n]
        return list(map(list, zip(*columns, strict=True)))

    def record(self) -> Any:
        record = self.item()
        if type(record) is not list:
            return record
        for i in self.item():
            n = record[i]
            if type(n) is not int or n < 0:
                raise DecodeError(f"run state: bad list length {n!r} in a record")
            record[i] = self.column(n)
        return record

    def mapping(self, layout: Layout | None = None) -> dict[str, Any]:
        n = self.count()
        if n == 0:
            return {}
        keys = self.column(n)
        values = self.rows(layout)
        if len(values) != n:
            raise DecodeError("run state: map keys and values differ in number")
        return dict(zip(keys, values, strict=True))
