"""The input clock's bookkeeping (streams/worker/kafka/input_clock.py): snapshots of the
input's end offsets, released by the group's commits or this worker's deliveries."""

from __future__ import annotations

from streams.worker.kafka.input_clock import InputClock


def test_the_clock_advances_only_past_fully_committed_snapshots() -> None:
    clock = InputClock(start_ns=100)
    assert clock.observe(200, {0: 10, 1: 0}, {0: 5, 1: 0}) == 100  # behind on 0
    assert clock.observe(300, {0: 12, 1: 3}, {0: 10, 1: 2}) == 200  # 200's ends reached
    assert clock.behind == 1
    assert clock.observe(400, {0: 12, 1: 3}, {0: 12, 1: 2}) == 200  # partition 1 short
    assert clock.observe(500, {0: 12, 1: 3}, {0: 12, 1: 3}) == 500  # caught up
    assert clock.behind == 0
    assert clock.observe(50, {0: 12}, {0: 12}) == 500  # never goes back


def test_a_commit_once_seen_stays_promised() -> None:
    """Committed offsets only say what was processed: a later probe that reads a lower one
    (or none) takes nothing back."""
    clock = InputClock(start_ns=0)
    assert clock.observe(10, {0: 5}, {0: 5}) == 10
    assert clock.observe(20, {0: 5}, {0: 2}) == 20


def test_this_workers_deliveries_release_a_snapshot_before_the_group_commits() -> None:
    clock = InputClock(start_ns=0)
    clock.observe(100, {0: 10, 1: 4}, {0: 6, 1: 4})  # partition 0: 6 committed, 10 in it
    assert clock.now_ns == 0 and clock.behind == 1
    assert clock.delivered(0, 6, 8) is False  # 8 of 10: not yet
    assert clock.delivered(0, 8, 10) is True  # every record that existed at 100
    assert clock.now_ns == 100 and clock.behind == 0
    assert clock.delivered(0, 10, 11) is False  # nothing waiting: no advance to report


def test_a_delivery_after_a_gap_promises_nothing() -> None:
    """A record whose steps were never delivered (its acknowledgement failed) lies before
    the next delivery: that delivery is not taken until the group's commits reach it."""
    clock = InputClock(start_ns=0)
    clock.observe(100, {0: 10}, {0: 5})
    assert clock.delivered(0, 6, 10) is False  # record 5 missing
    assert clock.now_ns == 0
    clock.observe(200, {0: 10}, {0: 6})  # another worker processed 5 meanwhile
    assert clock.now_ns == 0  # the delivery before was refused, not kept
    assert clock.delivered(0, 6, 10) is True
    assert clock.now_ns == 200


def test_a_delivery_starting_at_the_committed_offset_is_taken_after_an_assignment() -> None:
    """A partition assigned to this worker resumes at the group's committed offset: its
    first delivery starts there and joins the commits' promise."""
    clock = InputClock(start_ns=0)
    clock.observe(100, {0: 50, 1: 0}, {0: 40, 1: 0})
    assert clock.delivered(0, 40, 45) is False
    assert clock.delivered(0, 45, 50) is True
    assert clock.now_ns == 100


def test_an_old_delivery_does_not_move_progress_back() -> None:
    clock = InputClock(start_ns=0)
    clock.observe(100, {0: 10}, {0: 0})
    assert clock.delivered(0, 0, 10) is True
    assert clock.delivered(0, 0, 4) is False  # a late ack of older records
    clock.observe(200, {0: 10}, {0: 0})
    assert clock.now_ns == 200


def test_another_workers_mark_releases_the_partitions_it_covers() -> None:
    """A mark is a prefix the other worker vouches for: no contiguity with this worker's
    knowledge is needed, and a lower mark takes nothing back."""
    clock = InputClock(start_ns=0)
    clock.observe(100, {0: 10, 1: 20}, {0: 0, 1: 0})
    assert clock.delivered(0, 0, 10) is False  # partition 1 is the other worker's
    assert clock.marked({1: 20}) is True
    assert clock.now_ns == 100
    clock.observe(200, {0: 10, 1: 25}, {0: 0, 1: 0})
    assert clock.marked({1: 22}) is False
    assert clock.marked({1: 19}) is False  # an older mark, read after a newer one
    assert clock.marked({1: 25}) is True and clock.now_ns == 200
    assert clock.own_deliveries() == {0: 10}  # what this worker's marks say: its own only
