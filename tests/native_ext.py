"""The extension itself, for the differential tests: imported directly (not through
streams.spanpath.native), so CI's fallback pass (LOOPWATCH_NATIVE=0, LOOPWATCH_REQUIRE_NATIVE=1) still
compares both implementations. Skipped only on a fallback-only installation; with
LOOPWATCH_REQUIRE_NATIVE=1 a missing extension fails the tests instead."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

EXT: ModuleType | None
try:
    import loopwatch_native as EXT
except ImportError:  # pragma: no cover - the fallback-only installation
    EXT = None

requires_native = pytest.mark.skipif(
    EXT is None and os.environ.get("LOOPWATCH_REQUIRE_NATIVE") != "1",
    reason="loopwatch_native is not built",
)
