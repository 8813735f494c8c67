"""Commit only what is done: the contiguous prefix of finished offsets."""

from __future__ import annotations

from tokenbudget.producers.dispatch.offsets import OffsetTracker, PartitionProgress

T = "ns.prompts"


def test_nothing_seen_commits_nothing() -> None:
    tracker = OffsetTracker()
    assert tracker.committable() == {}
    assert tracker.in_flight() == 0
    assert PartitionProgress().committable() is None


def test_in_order_finishes() -> None:
    tracker = OffsetTracker()
    tracker.started(T, 0, 0)
    assert tracker.committable() == {(T, 0): 0}
    tracker.finished(T, 0, 0)
    assert tracker.committable() == {(T, 0): 1}


def test_out_of_order_finishes_commit_only_the_contiguous_prefix() -> None:
    tracker = OffsetTracker()
    for offset in range(5):
        tracker.started(T, 0, offset)
    assert tracker.in_flight() == 5

    tracker.finished(T, 0, 3)
    tracker.finished(T, 0, 4)
    assert tracker.committable() == {(T, 0): 0}  # 0 is still running

    tracker.finished(T, 0, 1)
    assert tracker.committable() == {(T, 0): 0}

    tracker.finished(T, 0, 0)
    assert tracker.committable() == {(T, 0): 2}  # 2 is still running

    tracker.finished(T, 0, 2)
    assert tracker.committable() == {(T, 0): 5}  # everything done: one past the highest
    assert tracker.in_flight() == 0


def test_gaps_in_offsets() -> None:
    tracker = OffsetTracker()
    for offset in (10, 11, 15, 20):  # 12-14 and 16-19 are transaction markers
        tracker.started(T, 0, offset)
    tracker.finished(T, 0, 10)
    assert tracker.committable() == {(T, 0): 11}
    tracker.finished(T, 0, 11)
    assert tracker.committable() == {(T, 0): 15}
    tracker.finished(T, 0, 20)
    assert tracker.committable() == {(T, 0): 15}
    tracker.finished(T, 0, 15)
    assert tracker.committable() == {(T, 0): 21}


def test_partitions_and_topics_are_independent() -> None:
    tracker = OffsetTracker()
    tracker.started(T, 0, 0)
    tracker.started(T, 0, 1)
    tracker.started(T, 1, 100)
    tracker.started("other", 0, 7)
    tracker.finished(T, 0, 1)
    tracker.finished(T, 1, 100)
    assert tracker.committable() == {(T, 0): 0, (T, 1): 101, ("other", 0): 7}
    assert tracker.in_flight() == 2


def test_finishing_unknown_partition_or_offset_is_harmless() -> None:
    tracker = OffsetTracker()
    tracker.finished(T, 3, 5)
    assert tracker.committable() == {}
    tracker.started(T, 0, 4)
    tracker.finished(T, 0, 99)
    tracker.finished(T, 0, 4)
    tracker.finished(T, 0, 4)
    assert tracker.committable() == {(T, 0): 5}


def test_forget_drops_a_revoked_partition() -> None:
    tracker = OffsetTracker()
    tracker.started(T, 0, 0)
    tracker.started(T, 1, 0)
    tracker.started(T, 1, 1)
    tracker.forget(T, 1)
    assert tracker.committable() == {(T, 0): 0}
    assert tracker.in_flight() == 1
    # A late finish for the revoked partition must not resurrect it.
    tracker.finished(T, 1, 0)
    assert tracker.committable() == {(T, 0): 0}
    tracker.forget(T, 7)  # never seen: no error
    # Reassigned later, it starts from scratch.
    tracker.started(T, 1, 50)
    tracker.finished(T, 1, 50)
    assert tracker.committable()[(T, 1)] == 51
