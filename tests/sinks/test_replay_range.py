"""What a replay reads: the offsets its options select, the records it keeps of
them, and the batches it hands to the processor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import TopicPartition

from tokenbudget.core.errors import TokenBudgetError
from tokenbudget.sinks.audit import ReplaySummary
from tokenbudget.sinks.replay_range import (
    ReplayOptions,
    _Batches,
    _Range,
    _RecordFilter,
    _start_offsets,
)
from tokenbudget.sinks.rows import Decoded
from tokenbudget.streams.topics import Topics

P0, P1, P2 = (TopicPartition("c", p) for p in range(3))
BEGINS = {P0: 0, P1: 10, P2: 5}


def test_without_from_offset_every_partition_starts_at_its_beginning() -> None:
    assert _start_offsets([P0, P1, P2], BEGINS, None) == BEGINS


def test_one_from_offset_applies_to_every_partition_never_before_its_beginning() -> None:
    assert _start_offsets([P0, P1, P2], BEGINS, 7) == {P0: 7, P1: 10, P2: 7}


def test_per_partition_offsets_leave_the_others_at_their_beginning() -> None:
    assert _start_offsets([P0, P1, P2], BEGINS, {0: 3, 1: 4}) == {P0: 3, P1: 10, P2: 5}


def test_an_offset_for_a_partition_the_topic_lacks_is_refused() -> None:
    with pytest.raises(TokenBudgetError, match=r"no partition \[3, 9\]"):
        _start_offsets([P0, P1, P2], BEGINS, {9: 1, 3: 1, 0: 1})


def test_a_range_reads_only_partitions_with_something_between_start_and_end() -> None:
    plan = _Range({P0: 4, P1: 10, P2: 0}, {P0: 9, P1: 10, P2: 2})
    assert plan.active == [P0, P2]
    assert plan.events == 7


@dataclass
class _Record:
    key: bytes
    timestamp: int
    value: bytes = b"{}"


def _options(**changes: Any) -> ReplayOptions:
    return ReplayOptions(bootstrap="unused:9092", topics=Topics("t"), **changes)


def test_records_are_kept_by_dataset_key_and_inclusive_time_bounds() -> None:
    keep = _RecordFilter.of(_options(datasets=frozenset({"a"}), since=2.0, until=3.0))
    records = [
        _Record(b"a", 1999),
        _Record(b"a", 2000),
        _Record(b"b", 2500),
        _Record(b"a", 3000),
        _Record(b"a", 3001),
    ]
    assert keep(records) == [records[1], records[3]]


def test_without_a_filter_the_records_are_passed_on_as_they_are() -> None:
    keep = _RecordFilter.of(_options())
    records = [_Record(b"a", 1), _Record(b"b", 2)]
    assert keep.keeps_all
    assert keep(records) is records


class _Collecting:
    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def submit(self, records: list[Any], decoded: Decoded) -> None:
        assert len(decoded.values) == len(records)
        self.batches.append(records)


def test_a_partition_batch_is_handed_on_when_full_or_when_its_partition_ends() -> None:
    options = _options(batch_records=3, batch_bytes=10**9)
    processor = _Collecting()
    batches = _Batches(options, ReplaySummary(topic="c"), processor)
    records = [_Record(b"a", i) for i in range(5)]
    batches.add(P0, records[:2], last=False)
    batches.add(P1, records[4:], last=False)
    assert processor.batches == []
    batches.add(P0, records[2:4], last=False)  # P0 holds 4 >= 3
    assert processor.batches == [records[:4]]
    batches.add(P1, [], last=True)
    assert processor.batches == [records[:4], records[4:]]
    batches.add(P0, [], last=True)  # nothing left to hand on
    assert len(processor.batches) == 2


def test_a_partition_batch_is_handed_on_at_its_byte_limit() -> None:
    options = _options(batch_records=1000, batch_bytes=5)
    processor = _Collecting()
    batches = _Batches(options, ReplaySummary(topic="c"), processor)
    batches.add(P0, [_Record(b"a", 1, b"abc")], last=False)
    assert processor.batches == []
    batches.add(P0, [_Record(b"a", 2, b"def")], last=False)
    assert [len(b) for b in processor.batches] == [2]
