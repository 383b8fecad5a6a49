"""glibc's allocator in the worker: one arena for every thread, and free heap pages handed
back as soon as the worker goes quiet (issue 39, docs/PERFORMANCE.md "One arena, and free
pages back when quiet").

Why: the worker's live memory is flat with history, but its RSS was not. Each thread that
allocates (the event loop, rocksdb's flush and compaction threads, librdkafka's) got a
glibc arena of its own, and each arena kept the pages a burst had freed until the next
`malloc_trim`, every 30 s: a reading landed anywhere on that saw-tooth (175 to 210 MiB at
the same history). One arena and a trim when the event loop goes idle leave a quiet
worker holding what it uses. On musl or macOS there is nothing to set or trim: the glibc
calls here are then no-ops.

The trim also empties CPython's type attribute cache (`sys._clear_type_cache`). In 3.11
that cache (4,096 entries, a slot chosen by the name's address) keeps a strong reference
to the name of each lookup it caches; a C extension that looks a method up by a name it
builds on each call (`PyObject_CallMethod(obj, "result")`, pyo3's `call_method0("...")`)
leaves a fresh copy of that name in a random slot, kept until another lookup lands there.
Those few thousand strings, each allocated during some burst and living on past it, kept
pymalloc's 16 KiB pools in use: the 64-byte class held the same 121k live blocks in 688
pools after 10k finished runs and 1,159 after 1M (docs/PERFORMANCE.md, "What pinned the
pools"). Clearing costs about 6 µs and does not invalidate the types' version tags."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS)
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


def limit_arenas(environ: Mapping[str, str] = os.environ, libc: Any = _LIBC) -> bool:
    """One malloc arena for every thread, unless ``MALLOC_ARENA_MAX`` is set (glibc read it
    at startup: the operator's value stands). Must run before the process starts a thread
    (the Kafka clients and rocksdb start theirs): an arena made before it stays, and the
    threads beyond the limit share the arenas there are. Returns whether the limit was
    set.

    Measured against the default (up to 8 arenas a core), 2 alternating pairs at 150k
    spans: the same throughput (unkeyed x0.98 and x1.12, keyed x1.04 and x1.00), peak RSS
    30 MiB lower unkeyed and 6 lower keyed."""
    if libc is None or "MALLOC_ARENA_MAX" in environ:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, 1))


def release_free_memory(libc: Any = _LIBC) -> None:
    """Drop the names the type attribute cache holds (module docstring), so the pools they
    pinned can empty, then hand glibc's free heap pages back to the OS (`malloc_trim(0)`
    madvises every whole free page of every arena, not only the heap's top)."""
    clear_type_cache = getattr(sys, "_clear_type_cache", None)  # CPython only
    if clear_type_cache is not None:
        clear_type_cache()
    if libc is not None:
        libc.malloc_trim(0)


def resident_bytes() -> int:
    """The process's resident set (`/proc/self/statm`), 0 where there is none to read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class QuietTrim:
    """When to hand free pages back: at the first check that finds the event loop quiet
    after it was busy, at a quiet check that finds the resident set `slack` bytes above
    what the last trim left, and at least every `period` seconds whatever it does (under a
    steady load it is never quiet). `check()` runs on the event loop's thread, whose CPU
    time `cpu` measures: quiet is under `quiet_share` of the interval since the last check.
    A worker at a low, steady rate stays quiet and is trimmed every `period` only.

    The resident check is for memory other threads freed while the event loop rested:
    rocksdb flushes its memtables and compacts in threads of its own, after the load that
    filled them, and what they free stayed resident until the next periodic trim (at one
    checkpoint of a memory round, after 100k runs: 167 MiB anonymous, 126 after a trim;
    docs/PERFORMANCE.md, stop 68). A trim that hands nothing back (the growth is live, or
    file-backed) sets the new level: one trim per `slack` of growth at most."""

    def __init__(
        self,
        release: Callable[[], None] = release_free_memory,
        *,
        period: float = 30.0,
        quiet_share: float = 0.05,
        slack: int = 8 << 20,
        cpu: Callable[[], float] = time.thread_time,
        clock: Callable[[], float] = time.monotonic,
        resident: Callable[[], int] = resident_bytes,
    ) -> None:
        self.release = release
        self.period = period
        self.quiet_share = quiet_share
        self.slack = slack
        self.cpu = cpu
        self.clock = clock
        self.resident = resident
        self.checked_at = clock()
        self.cpu_at = cpu()
        self.trimmed_at = self.checked_at
        self.resident_at = resident()
        self.busy_since_trim = False

    def check(self) -> bool:
        """Trim if due; returns whether it did."""
        now, cpu = self.clock(), self.cpu()
        busy = cpu - self.cpu_at > self.quiet_share * max(now - self.checked_at, 1e-9)
        self.checked_at, self.cpu_at = now, cpu
        quiet_after_work = not busy and self.busy_since_trim
        self.busy_since_trim = self.busy_since_trim or busy
        grown = not busy and self.resident() - self.resident_at > self.slack
        if not (quiet_after_work or grown) and now - self.trimmed_at < self.period:
            return False
        self.release()
        # the trim's own CPU is not work: the next interval starts after it
        self.trimmed_at = self.checked_at = self.clock()
        self.cpu_at, self.busy_since_trim = self.cpu(), False
        self.resident_at = self.resident()
        return True
