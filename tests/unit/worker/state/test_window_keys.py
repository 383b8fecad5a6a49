"""The windowed count records (streams/worker/state/window_keys.py) and the version records
(streams/worker/state/versions.py): added once, read back as the API reads them."""

from __future__ import annotations

import json

import pytest

from detectors.versions import Seen
from streams.worker.state import versions as version_records
from streams.worker.state.window_keys import (
    added_once,
    aggregate_key,
    contribution_id,
    decode_count,
    iter_window_counts,
    last_ids,
)

A, B, C = (contribution_id("event", x) for x in "abc")


def test_a_count_adds_each_id_once_and_keeps_the_ids_of_its_last_write() -> None:
    value = added_once(None, {A: 1, B: 1})
    assert decode_count(value) == (2, sorted([A, B]))
    redone = added_once(value, {A: 1, B: 1, C: 1})  # a redo of that write, and one more
    assert decode_count(redone) == (3, sorted([A, B, C]))
    # ids done before a crash (another window's record): refused here too, but kept, so a
    # second crash's redo of this write is refused by the record itself
    later = added_once(None, {A: 1, C: 2}, done={A})
    assert decode_count(later) == (2, sorted([A, C]))


def test_older_and_unreadable_values() -> None:
    assert decode_count(7) == (7, [])  # written before the ids were kept
    assert decode_count(0) == (0, [])  # faust's default for a missing window
    for bad in ("7", [1], [1, ["x"]], True, None):
        with pytest.raises((TypeError, ValueError)):
            decode_count(bad)
    assert decode_count(added_once("garbage", {A: 1})) == (1, [A])
    items = [
        ((aggregate_key(["identical_repetition"], 0), (0, 60)), 5),
        ((aggregate_key(["identical_repetition"], 0), (60, 120)), [2, [A]]),
        ((aggregate_key(["retry_storm"], 1), (60, 120)), "garbage"),
    ]
    assert [(labels, n) for labels, _end, n in iter_window_counts(items)] == [
        (["identical_repetition"], 5),
        (["identical_repetition"], 2),
    ]


def test_last_ids_are_those_of_each_labels_latest_window_per_partition() -> None:
    k0, k1 = aggregate_key(["x"], 0), aggregate_key(["y"], 1)
    items = [
        ([k0, [60, 120]], [1, [B]]),
        ([k0, [0, 60]], [1, [A]]),  # an older window of the same label: not its last write
        ([k1, [0, 60]], [1, [C]]),
        (json.dumps([aggregate_key(["z"], 0), [0, 60]]), 1),  # unreadable key: skipped
    ]
    assert last_ids(items, {0, 1, 2}) == {0: {B}, 1: {C}, 2: set()}
    assert last_ids(items, {1}) == {1: {C}}


def test_a_version_record_adds_each_run_once() -> None:
    key = b'["prompt","s","a","","v1",0]'
    first = version_records.merged(None, {A: Seen(10, 20, 1), B: Seen(5, 30, 1)})
    assert version_records.decode_seen(first) == Seen(5, 30, 2)
    again = version_records.merged(first, {B: Seen(5, 30, 1), C: Seen(40, 50, 1)})
    assert version_records.decode_seen(again) == Seen(5, 50, 3)
    assert version_records.last_ids([(key, again)], {0}) == {0: {B, C}}
    older = b"[1,2,3]"  # three items: before the ids
    assert version_records.decode_seen(older) == Seen(1, 2, 3)
    assert version_records.decode_seen(version_records.merged(older, {A: Seen(0, 9, 1)})) == Seen(
        0, 9, 4
    )
    refused = version_records.merged(None, {A: Seen(1, 2, 1)}, done={A})
    assert version_records.decode_seen(refused) == Seen(1, 2, 0)
