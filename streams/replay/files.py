"""The Collector fileexporter formats: reading export files into payloads and span batches,
and writing them (for `loopwatch replay` / `loopwatch produce`, the examples and tests).

- `*.json` / `*.jsonl`: OTLP JSON, one export message per line (blank lines skipped); a file
  holding one pretty-printed multi-line document is accepted too.
- `*.pb` / `*.binpb`: OTLP protobuf messages, each prefixed by its length (4 bytes, big-endian).
- any of these with `.gz`: gzip-compressed, read as a stream.
- a directory: every file with one of those suffixes below it, recursively, in sorted path
  order; other files are ignored.

Source labels name the file and the position: `dir/traces.pb#3` (the 3rd message, counted
from 1) or `dir/traces.jsonl:12` (line 12); a whole-file JSON document is just `dir/x.json`.
"""

from __future__ import annotations

import gzip
import json
import os
import stat
import struct
import zlib
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, Protocol

from streams.errors import DecodeError
from streams.spanpath import SpanPath, StepBatch
from streams.spanpath.otlp import OTLP_JSON, OTLP_PROTO, decode_record
from streams.spanpath.spans import SpanRecord

__all__ = [
    "SUFFIXES",
    "Payload",
    "file_encoding",
    "iter_batches",
    "iter_payloads",
    "write_jsonl",
    "write_pb",
]

Encoding = Literal["otlp_proto", "otlp_json"]

# suffix (before an optional .gz) -> encoding
SUFFIXES: dict[str, Encoding] = {
    ".json": OTLP_JSON,
    ".jsonl": OTLP_JSON,
    ".pb": OTLP_PROTO,
    ".binpb": OTLP_PROTO,
}

_PREFIX = struct.Struct(">I")
_CHUNK = 16 << 20  # read large messages in pieces: a bogus length must not allocate it all
_GZIP_ERRORS = (OSError, EOFError, zlib.error)  # BadGzipFile is an OSError


class _Reader(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...
    def __iter__(self) -> Iterator[bytes]: ...


class _Writer(Protocol):
    def write(self, data: bytes, /) -> int: ...


@dataclass(frozen=True, slots=True)
class Payload:
    """One export message as found in a file: what `decode_record` takes."""

    source: str
    encoding: Encoding
    data: bytes


def file_encoding(path: str | Path) -> tuple[Encoding, bool] | None:
    """(encoding, gzipped) from a file name, or None when the suffix is not an export format."""
    name = os.path.basename(str(path)).lower()
    gz = name.endswith(".gz")
    if gz:
        name = name[:-3]
    enc = SUFFIXES.get(os.path.splitext(name)[1])
    return None if enc is None else (enc, gz)


# ---------------------------------------------------------------------------------------
# Finding the files
# ---------------------------------------------------------------------------------------


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _files(path: Path) -> Iterator[Path | DecodeError]:
    """The export files a path names, in order; path-level problems come out as errors."""
    try:
        st = path.stat()
    except FileNotFoundError:
        yield DecodeError(f"{path}: no such file or directory")
        return
    except OSError as e:
        yield DecodeError(f"{path}: cannot access: {_why(e)}")
        return
    if not stat.S_ISDIR(st.st_mode):
        if file_encoding(path) is None:
            kinds = ", ".join(sorted(SUFFIXES))
            yield DecodeError(f"{path}: not an export file (expected {kinds}, optionally .gz)")
        else:
            yield path
        return
    found: list[tuple[tuple[str, ...], Path]] = []
    problems: list[OSError] = []
    for root, dirs, names in os.walk(path, onerror=problems.append):
        dirs.sort()
        for name in names:
            if file_encoding(name) is not None:
                full = Path(root, name)
                found.append((full.relative_to(path).parts, full))
    for err in problems:
        yield DecodeError(f"{err.filename or path}: cannot list directory: {_why(err)}")
    if not found and not problems:
        kinds = ", ".join(sorted(SUFFIXES))
        yield DecodeError(f"{path}: no export files in this directory ({kinds}, optionally .gz)")
    for _parts, full in sorted(found):
        yield full


def expand_paths(
    paths: Iterable[str | Path], on_error: Callable[[DecodeError], None]
) -> list[Path]:
    """The export files that command-line paths name (directories recursively, sorted);
    a path that is missing, unreadable or holds no export file goes to `on_error`."""
    files: list[Path] = []
    for p in paths:
        for item in _files(Path(p)):
            if isinstance(item, DecodeError):
                on_error(item)
            else:
                files.append(item)
    return files


# ---------------------------------------------------------------------------------------
# Reading one file
# ---------------------------------------------------------------------------------------


def _read(f: _Reader, n: int) -> bytes:
    if n <= _CHUNK:
        return f.read(n)
    parts = []
    left = n
    while left:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _pb_payloads(f: _Reader, label: str, size: int | None) -> Iterator[Payload]:
    """Length-prefixed messages. `size` is the file size when not compressed (else None)."""
    where = "offset" if size is not None else "decompressed offset"
    index = 0
    offset = 0
    while True:
        head = f.read(4)
        if not head:
            return
        index += 1
        at = f"{label}: message {index} at {where} {offset}"
        if len(head) < 4:
            raise DecodeError(f"{at}: truncated length prefix ({len(head)} of 4 bytes)")
        (n,) = _PREFIX.unpack(head)
        if size is not None and offset + 4 + n > size:
            raise DecodeError(
                f"{at}: length {n} runs past the end of the file ({size - offset - 4} bytes left)"
            )
        data = _read(f, n)
        if len(data) < n:
            raise DecodeError(f"{at}: length {n} but only {len(data)} bytes remain")
        yield Payload(f"{label}#{index}", OTLP_PROTO, data)
        offset += 4 + n


def _parses(text: bytes) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _json_payloads(f: _Reader, label: str) -> Iterator[Payload]:
    """One document per line; or, when the first line is not a document, the whole file."""
    lineno = 0
    first = b""
    for raw in f:
        lineno += 1
        if raw.strip():
            first = raw
            break
    if not first:
        return
    first_line = lineno
    if not first.rstrip().endswith(b"}") or not _parses(first):
        # A pretty-printed document (its first line is "{" or similar), or a JSON Lines
        # file whose first line is broken. Keep the leading blank lines so that the
        # decoder's line numbers are the file's.
        whole = b"\n" * (first_line - 1) + first + f.read()
        lines = whole.split(b"\n")
        second = next((x for x in lines[first_line:] if x.strip()), None)
        if _parses(whole) or second is None or not _parses(second):
            yield Payload(label, OTLP_JSON, whole)
            return
        for i, line in enumerate(lines[first_line - 1 :], start=first_line):
            if line.strip():
                yield Payload(f"{label}:{i}", OTLP_JSON, line.rstrip(b"\r"))
        return
    yield Payload(f"{label}:{first_line}", OTLP_JSON, first.rstrip(b"\r\n"))
    for raw in f:
        lineno += 1
        if raw.strip():
            yield Payload(f"{label}:{lineno}", OTLP_JSON, raw.rstrip(b"\r\n"))


def _file_payloads(path: Path, on_read: Callable[[int], object] | None = None) -> Iterator[Payload]:
    """The file's messages; `on_read(n)` before each one is yielded: the bytes of the file
    (compressed, for .gz) read so far."""
    kind = file_encoding(path)
    if kind is None:  # only reachable through an explicit non-export path
        raise DecodeError(f"{path}: not an export file")
    encoding, gz = kind
    label = str(path)
    try:
        raw: IO[bytes] = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise DecodeError(f"{label}: cannot read: {_why(e)}") from None
    pos = "start of file"
    try:
        size = None if gz else os.fstat(raw.fileno()).st_size
        f: _Reader = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
        it = _pb_payloads(f, label, size) if encoding == OTLP_PROTO else _json_payloads(f, label)
        while True:
            try:
                payload = next(it)
            except StopIteration:
                return
            except _GZIP_ERRORS as e:
                if not gz:
                    raise DecodeError(f"{label}: cannot read after {pos}: {_why_any(e)}") from None
                raise DecodeError(
                    f"{label}: corrupt gzip data after {pos}: {_why_any(e)}"
                ) from None
            pos = payload.source
            if on_read is not None:
                on_read(raw.tell())
            yield payload
    finally:
        raw.close()


def _why_any(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e)
    return text if text and len(text) <= 120 else type(e).__name__


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def iter_payloads(paths: Iterable[str | Path]) -> Iterator[Payload]:
    """Every export message under `paths`, in order. Raises DecodeError at the first problem
    (missing path, unreadable file, broken framing, corrupt gzip)."""
    for p in paths:
        for item in _files(Path(p)):
            if isinstance(item, DecodeError):
                raise item
            yield from _file_payloads(item)


def iter_batches(
    paths: Iterable[str | Path],
    on_error: Callable[[DecodeError], None],
    span_path: SpanPath | None = None,
    on_read: Callable[[int], object] | None = None,
) -> Generator[tuple[str, list[SpanRecord] | StepBatch], None, None]:
    """(source, spans) for every export message under `paths`; with a `span_path`
    (streams/spanpath/entry.py) each message's steps instead (natively when it can, never
    decoded into Python objects then). `on_read(n)`: n bytes of the current file are read
    (compressed, for .gz), before each message (a progress display).

    Problems are reported through `on_error` and reading goes on: an undecodable message
    is skipped; a file whose framing or compression is broken is abandoned at that point
    (what came before it is kept) and the next file is read; a missing path is skipped.
    """
    for p in paths:
        for item in _files(Path(p)):
            if isinstance(item, DecodeError):
                on_error(item)
                continue
            payloads = _file_payloads(item, on_read)
            while True:
                try:
                    payload = next(payloads)
                except StopIteration:
                    break
                except DecodeError as e:
                    on_error(e)
                    break
                try:
                    if span_path is not None:
                        batch = span_path.message(payload.data, payload.encoding, payload.source)
                        yield payload.source, batch
                        continue
                    spans = decode_record(payload.data, payload.encoding, payload.source)
                except DecodeError as e:
                    on_error(e)
                    continue
                yield payload.source, spans


@contextmanager
def _writer(path: str | Path) -> Iterator[_Writer]:
    p = Path(path)
    with open(p, "wb") as raw:
        if p.name.lower().endswith(".gz"):
            # mtime=0 and no name in the header: the same input writes the same bytes
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                yield gz
        else:
            yield raw


def write_pb(path: str | Path, messages: Iterable[bytes]) -> int:
    """Write serialized export messages, each prefixed by its 4-byte big-endian length
    (gzip when the name ends in .gz). Returns the number of messages written."""
    n = 0
    with _writer(path) as f:
        for m in messages:
            if len(m) > 0xFFFFFFFF:
                raise ValueError(f"message {n + 1} is too large for a 4-byte length prefix")
            f.write(_PREFIX.pack(len(m)))
            f.write(m)
            n += 1
    return n


def write_jsonl(path: str | Path, messages: Iterable[bytes | str]) -> int:
    """Write OTLP JSON export messages one per line (a multi-line document is compacted).
    Gzip when the name ends in .gz. Returns the number of messages written."""
    n = 0
    with _writer(path) as f:
        for m in messages:
            data = (m.encode("utf-8") if isinstance(m, str) else bytes(m)).strip()
            if b"\n" in data or b"\r" in data:
                doc = json.loads(data)
                data = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            f.write(data)
            f.write(b"\n")
            n += 1
    return n
