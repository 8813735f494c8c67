"""The ledger's table changelog writes, as record batches."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.memory_records import MemoryRecords

from streams.faust_adapt.producer import write_changelog


class RecordingProducer:
    """The two aiokafka producer calls write_changelog makes, with real record batches."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.sent: list[tuple[str, int, list[tuple[bytes, bytes]]]] = []

    def create_batch(self) -> BatchBuilder:
        return BatchBuilder(self.batch_size, 0)

    async def send_batch(self, batch: BatchBuilder, topic: str, *, partition: int) -> Any:
        records = MemoryRecords(bytes(batch._build())).next_batch()
        self.sent.append((topic, partition, [(r.key, r.value) for r in records]))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def test_changelog_entries_go_out_in_order_split_at_the_batch_size() -> None:
    entries = [(f"prompt-{i}".encode(), bytes([i]) * 40) for i in range(30)]

    async def main() -> tuple[RecordingProducer, list[Any]]:
        producer = RecordingProducer(batch_size=512)
        futures = await write_changelog(producer, "ns-outcomes-changelog", 3, entries)
        return producer, futures

    producer, futures = asyncio.run(main())
    assert len(producer.sent) > 1  # 30 entries of ~50 bytes do not fit one 512-byte batch
    assert len(futures) == len(producer.sent)
    assert {(topic, partition) for topic, partition, _ in producer.sent} == {
        ("ns-outcomes-changelog", 3)
    }
    assert [entry for _, _, batch in producer.sent for entry in batch] == entries


def test_no_entries_send_nothing() -> None:
    producer = RecordingProducer(batch_size=512)
    assert asyncio.run(write_changelog(producer, "t", 0, [])) == []
    assert producer.sent == []


def test_an_entry_larger_than_the_batch_size_goes_out_alone_in_order() -> None:
    small, large = (b"a", b"1" * 10), (b"b", b"2" * 2000)
    entries = [small, large, (b"c", b"3" * 10)]
    producer = RecordingProducer(batch_size=512)
    asyncio.run(write_changelog(producer, "t", 0, entries))
    assert [batch for _, _, batch in producer.sent] == [[small], [large], [entries[2]]]
