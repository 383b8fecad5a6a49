"""The worker's allocator settings (streams/worker/allocator.py): when memory is handed back,
and one arena for every thread, checked on this machine's glibc."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from streams.worker import allocator
from streams.worker.allocator import QuietTrim, limit_arenas

REPO = Path(__file__).resolve().parents[3]


class Clocks:
    """A wall clock, the event loop's CPU time and the resident set, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 10.0
        self.rss = 150 << 20

    def second(self, busy: float) -> None:
        """One second passes, `busy` of it on the event loop's CPU."""
        self.now += 1.0
        self.cpu += busy


def trimmer(clocks: Clocks, *, hands_back: bool = True) -> tuple[QuietTrim, list[float]]:
    """A trim whose release records its time and, if `hands_back`, takes the resident set
    back down to its start (the growth was free pages; otherwise it is live)."""
    done: list[float] = []

    def release() -> None:
        done.append(clocks.now)
        if hands_back:
            clocks.rss = min(clocks.rss, 150 << 20)

    trim = QuietTrim(
        release, cpu=lambda: clocks.cpu, clock=lambda: clocks.now, resident=lambda: clocks.rss
    )
    return trim, done


def test_the_first_quiet_second_after_work_trims_once() -> None:
    clocks = Clocks()
    trim, done = trimmer(clocks)
    for _ in range(3):
        clocks.second(busy=0.8)
        assert not trim.check()
    clocks.second(busy=0.01)
    assert trim.check()
    for _ in range(10):  # quiet on: nothing new to hand back
        clocks.second(busy=0.01)
        assert not trim.check()
    assert done == [104.0]


def test_a_steady_load_is_trimmed_every_period() -> None:
    clocks = Clocks()
    trim, done = trimmer(clocks)
    for _ in range(95):
        clocks.second(busy=0.9)
        trim.check()
    assert done == [130.0, 160.0, 190.0]


def test_a_low_steady_rate_counts_as_quiet() -> None:
    clocks = Clocks()
    trim, done = trimmer(clocks)
    for _ in range(65):
        clocks.second(busy=0.02)  # under 5% of each second
        trim.check()
    assert done == [130.0, 160.0]


def test_memory_other_threads_freed_while_the_loop_rests_is_trimmed_once() -> None:
    """rocksdb flushes and compacts in threads of its own after a load: the event loop
    stays quiet while the heap's free pages grow."""
    clocks = Clocks()
    trim, done = trimmer(clocks)
    clocks.second(busy=0.01)
    assert not trim.check()
    clocks.rss += 6 << 20  # under the slack: left for the periodic trim
    clocks.second(busy=0.01)
    assert not trim.check()
    clocks.rss += 4 << 20
    clocks.second(busy=0.01)
    assert trim.check()
    for _ in range(5):  # handed back: nothing more to do until it grows again
        clocks.second(busy=0.01)
        assert not trim.check()
    assert done == [103.0]


def test_memory_that_grows_under_load_waits_for_a_quiet_second() -> None:
    clocks = Clocks()
    trim, done = trimmer(clocks)
    for _ in range(3):
        clocks.rss += 20 << 20
        clocks.second(busy=0.9)
        assert not trim.check()
    clocks.second(busy=0.01)
    assert trim.check()
    assert done == [104.0]


def test_live_memory_above_the_last_trim_does_not_trim_again() -> None:
    """A trim that cannot hand anything back (the memory is in use) sets the new level."""
    clocks = Clocks()
    trim, done = trimmer(clocks, hands_back=False)
    clocks.rss += 20 << 20
    for _ in range(10):
        clocks.second(busy=0.01)
        trim.check()
    assert done == [101.0]


def test_resident_bytes_reads_this_process() -> None:
    assert allocator.resident_bytes() > 1 << 20


def test_the_trims_own_cpu_is_not_counted_as_work() -> None:
    clocks = Clocks()
    calls: list[float] = []

    def slow_release() -> None:
        calls.append(clocks.now)
        clocks.cpu += 0.5  # a trim that took half a second of CPU

    trim = QuietTrim(slow_release, cpu=lambda: clocks.cpu, clock=lambda: clocks.now)
    clocks.second(busy=0.9)
    trim.check()
    clocks.second(busy=0.0)
    assert trim.check()
    clocks.second(busy=0.0)
    assert not trim.check()  # the trim's own half second did not make the loop busy
    assert calls == [102.0]


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


def test_limit_arenas_sets_one_arena() -> None:
    libc = FakeLibc()
    assert limit_arenas({}, libc)
    assert libc.calls == [(allocator.M_ARENA_MAX, 1)]


def test_an_operators_malloc_arena_max_stands() -> None:
    libc = FakeLibc()
    assert not limit_arenas({"MALLOC_ARENA_MAX": "4"}, libc)
    assert libc.calls == []


def test_without_glibc_nothing_is_set_or_trimmed() -> None:
    assert not limit_arenas({}, None)
    allocator.release_free_memory(None)  # no libc: returns, does not raise


def test_release_drops_the_names_the_type_cache_holds() -> None:
    """A name built at run time, as a C extension's `PyObject_CallMethod(obj, "name")` or
    pyo3's `call_method0("name")` builds it, is kept by CPython 3.11's type attribute cache
    once looked up; a pymalloc pool holding it cannot be handed back (allocator's
    docstring). The trim drops it."""

    class Probe:
        value = 1

    name = "".join(["val", "ue"])  # a fresh str, not the interned constant
    base = sys.getrefcount(name)
    getattr(Probe(), name)
    if sys.getrefcount(name) == base:
        pytest.skip("this interpreter's type cache keeps no reference to the name")
    allocator.release_free_memory(None)
    assert sys.getrefcount(name) == base


_ARENAS = textwrap.dedent(
    """
    import ctypes, sys, tempfile, threading
    from streams.worker.allocator import limit_arenas
    if sys.argv[1] == "limit":
        assert limit_arenas({})
    def churn():
        for _ in range(200):
            blocks = [bytearray(4096) for _ in range(64)]
            del blocks
    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as out:
        fp = libc.fopen(out.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        print(open(out.name).read().count("<heap nr="))
    """
)


def _arenas(mode: str) -> int:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _ARENAS, mode],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(allocator._LIBC is None, reason="not glibc: there is no arena to limit")
def test_threads_share_one_arena_after_limit_arenas() -> None:
    assert _arenas("default") > 1  # each allocating thread got an arena of its own
    assert _arenas("limit") == 1
