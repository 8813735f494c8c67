"""recover_preferring on Faust's real Table and memory store: Faust's recovery
calls the method it replaces, and the store it writes is the one Faust reads."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import faust
from faust.tables.recovery import Recovery
from faust.types import TP, Message

from tokenbudget.streams.faust_adapt import recover_preferring

CHANGELOG = "unit-recovery-t-changelog"


def _table() -> Any:
    app = faust.App("unit-recovery", store="memory://", web_enabled=False)
    return app.Table("t", partitions=4, key_type=str, value_type=bytes)


def _record(table: Any, key: Any, value: bytes | None, partition: int = 1) -> Any:
    message = Message(CHANGELOG, partition, 0, 0.0, 0, [], b"raw", value, None)
    return table.app.create_event(key, value, [], message)


def newer(current: bytes, record: bytes) -> bool:
    return record > current


def test_fausts_recovery_applies_changelog_records_through_the_replaced_method() -> None:
    source = inspect.getsource(Recovery)
    assert "table.apply_changelog_batch(buf" in source  # while recovering
    assert "table.apply_changelog_batch(buffer)" in source  # flushing at the end


def test_stock_recovery_lets_the_last_record_win() -> None:
    # What recover_preferring exists for: a stale writer's late record would win.
    table = _table()
    table.apply_changelog_batch([_record(table, "d0", b"2"), _record(table, "d0", b"1")])
    assert table["d0"] == b"1"


def test_the_preferred_record_wins_whatever_the_order() -> None:
    table = _table()
    recover_preferring(table, newer)
    table.apply_changelog_batch([_record(table, "d0", b"2"), _record(table, "d0", b"1")])
    table.apply_changelog_batch([_record(table, "d1", b"1"), _record(table, "d1", b"3")])
    assert (table["d0"], table["d1"]) == (b"2", b"3")


def test_a_tombstone_deletes_and_keys_are_converted_as_faust_does() -> None:
    table = _table()
    recover_preferring(table, newer)
    table.apply_changelog_batch(
        [_record(table, "d0", b"1"), _record(table, "d0", None), _record(table, [1, [2]], b"w")]
    )
    assert "d0" not in table
    assert table[(1, (2,))] == b"w"  # a JSON list key, as Faust's _to_key makes it


def test_recovered_keys_keep_their_partition_for_the_store() -> None:
    """The memory store drops the keys of partitions not assigned after recovery,
    by the partition recorded per key."""
    table = _table()
    recover_preferring(table, newer)
    table.apply_changelog_batch(
        [_record(table, "kept", b"1", partition=1), _record(table, "gone", b"1", partition=2)]
    )
    asyncio.run(table.data.on_recovery_completed({TP(CHANGELOG, 1)}, set()))
    assert list(table.data.data) == ["kept"]
