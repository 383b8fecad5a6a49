"""tests/support/worker_proc.py's free_port: the test workers' ports never repeat within a process."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import worker_proc


def test_free_port_never_hands_out_the_same_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel gave the same ephemeral port to two binds in a row (CI: a worker's web and
    metrics ports were equal and it exited 2); free_port asks again instead."""
    offered = iter([40_001, 40_001, 40_002])

    class FakeSocket:
        def __enter__(self) -> FakeSocket:
            return self

        def __exit__(self, *exc: Any) -> None:
            pass

        def bind(self, address: Any) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(worker_proc, "_HANDED_OUT", set(), raising=False)
    monkeypatch.setattr(worker_proc.socket, "socket", FakeSocket)
    assert [worker_proc.free_port(), worker_proc.free_port()] == [40_001, 40_002]


def test_cleanup_stops_every_sibling_before_deleting_the_shared_topics(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sibling still running when the topics were deleted recreated them (auto-create on
    its metadata requests), and the deletion's wait timed out: `make bench`'s two-worker
    round died in the first worker's cleanup."""

    class FakePopen:
        def __init__(self) -> None:
            self.returncode: int | None = None

        def poll(self) -> int | None:
            return self.returncode

        def kill(self) -> None:
            self.returncode = -9

        def wait(self, timeout: float) -> int | None:
            return self.returncode

    class FakeAdmin:
        def list_topics(self, timeout: float) -> Any:
            return type("Metadata", (), {"topics": dict.fromkeys(first.topics.values())})()

    first = worker_proc.WorkerProc(tmp_path / "w0", worker_proc.EXAMPLE_POLICY)
    second = first.sibling(tmp_path / "w1")
    unrelated = worker_proc.WorkerProc(tmp_path / "w2", worker_proc.EXAMPLE_POLICY)
    for worker in (first, second, unrelated):
        worker.proc = FakePopen()  # type: ignore[assignment]
    alive_at_delete: list[list[bool]] = []

    def delete_topics(names: list[str]) -> None:
        assert set(names) == set(first.topics.values())
        alive_at_delete.append([w.alive() for w in (first, second, unrelated)])

    monkeypatch.setattr(worker_proc, "admin_client", FakeAdmin)
    monkeypatch.setattr(worker_proc, "delete_topics", delete_topics)
    first.cleanup()
    assert alive_at_delete == [[False, False, True]]
    second.cleanup()  # after the first: nothing left running, the topics deleted again
    assert alive_at_delete[-1] == [False, False, True]
