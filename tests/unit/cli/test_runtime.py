"""streams/runtime.py: the collector settings of the long-running commands."""

from __future__ import annotations

import gc

from streams.runtime import GEN0_THRESHOLD, tune_gc


def test_tune_gc_freezes_startup_objects_and_collects_young_ones_less_often() -> None:
    threshold = gc.get_threshold()
    gc.unfreeze()  # an in-process CLI call of an earlier test may have tuned it already
    gc.set_threshold(700, 10, 10)  # CPython's defaults
    frozen = gc.get_freeze_count()
    try:
        tune_gc()
        assert gc.get_threshold()[0] == GEN0_THRESHOLD > 700
        assert gc.get_freeze_count() > frozen
        assert gc.isenabled()  # cycles are still collected
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
