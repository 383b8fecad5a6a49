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
