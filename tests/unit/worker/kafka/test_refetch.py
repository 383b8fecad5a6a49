"""OffsetGaps: which input offsets the stream skipped (streams/worker/kafka/refetch.py)."""

from __future__ import annotations

from streams.worker.kafka.refetch import OffsetGaps


def test_forward_jumps_are_gaps_and_redeliveries_are_not() -> None:
    gaps = OffsetGaps()
    assert gaps.observe("in", 0, 16) is None  # first record seen: nothing known before it
    assert gaps.observe("in", 0, 17) is None
    assert gaps.observe("in", 0, 18) is None
    assert gaps.observe("in", 0, 17) is None  # seek back after a rebalance: redelivery
    assert gaps.observe("in", 0, 18) is None
    assert gaps.observe("in", 0, 20) == (19, 20)  # 19 never reached the agent
    assert gaps.observe("in", 1, 5) is None  # partitions are independent
    assert gaps.observe("steps", 0, 30) is None  # and so are topics
    assert gaps.observe("in", 0, 24) == (21, 24)


def test_forget_after_a_rebalance() -> None:
    gaps = OffsetGaps()
    assert gaps.observe("in", 3, 24) is None
    gaps.forget()  # revoked: the next offset may be anything
    assert gaps.observe("in", 3, 40) is None
    assert gaps.observe("in", 3, 42) == (41, 42)


def test_the_first_record_after_an_assignment_is_checked_against_the_committed_offset() -> None:
    """faust lets one missing record at the head of a partition through its own check."""
    gaps = OffsetGaps()
    assert gaps.observe("in", 0, 41, committed=40) == (40, 41)  # 40 never reached the agent
    assert gaps.observe("in", 0, 42, committed=40) is None  # only the first record counts
    gaps.forget()
    assert gaps.observe("in", 0, 40, committed=40) is None  # redelivery from the commit
    gaps.forget()
    assert gaps.observe("in", 0, 7, committed=None) is None  # no commit yet: unknown
    assert gaps.observe("in", 1, 3, committed=5) is None  # behind the commit: a redelivery
