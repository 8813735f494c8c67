"""The ledger's replacements for Faust's per-message delivery and table writes."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import mode
import pytest
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.memory_records import MemoryRecords

from streams.faust_hot_path import wait_first_fast, write_changelog


class Fallback:
    """mode's real ``Service.wait_first``, counting its calls."""

    def __init__(self) -> None:
        self.service = mode.Service()
        self.calls = 0

    async def __call__(self, *waitables: Any) -> Any:
        self.calls += 1
        return await self.service.wait_first(*waitables)


async def _never() -> None:
    await asyncio.Event().wait()


def test_a_delivery_that_does_not_wait_wins_without_the_fallback() -> None:
    async def deliver() -> str:
        return "delivered"

    async def main() -> None:
        fallback = Fallback()
        loser = _never()
        result = await wait_first_fast(fallback, deliver(), loser)
        assert result.results == ["delivered"]
        assert not result.stopped
        assert fallback.calls == 0
        assert inspect.getcoroutinestate(loser) == inspect.CORO_CLOSED

    asyncio.run(main())


def test_a_delivery_that_waits_is_finished_under_the_fallback() -> None:
    steps: list[str] = []

    async def deliver(gate: asyncio.Future[int]) -> int:
        steps.append("started")
        value = await gate
        await asyncio.sleep(0)  # a bare yield after the future
        steps.append("finished")
        return value * 2

    async def main() -> None:
        fallback = Fallback()
        gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, gate.set_result, 21)
        result = await wait_first_fast(fallback, deliver(gate), _never())
        assert result.results == [42]
        assert fallback.calls == 1
        assert steps == ["started", "finished"]

    asyncio.run(main())


def test_a_waiting_delivery_is_abandoned_when_the_flow_is_suspended() -> None:
    cleaned_up: list[bool] = []

    async def deliver(gate: asyncio.Future[None]) -> None:
        try:
            await gate
        finally:
            cleaned_up.append(True)

    async def main() -> None:
        fallback = Fallback()
        suspend_flow = asyncio.Event()
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, suspend_flow.set)
        result = await wait_first_fast(fallback, deliver(gate), suspend_flow.wait())
        assert result.results == [True]  # the suspension won
        await asyncio.sleep(0)
        assert cleaned_up == [True]
        assert gate.cancelled()

    asyncio.run(main())


def test_a_delivery_error_is_raised_whether_or_not_it_waited() -> None:
    async def fails_at_once() -> None:
        raise ValueError("undeliverable")

    async def fails_later() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("undeliverable later")

    async def main() -> None:
        loser = _never()
        with pytest.raises(ValueError, match="undeliverable"):
            await wait_first_fast(Fallback(), fails_at_once(), loser)
        assert inspect.getcoroutinestate(loser) == inspect.CORO_CLOSED
        with pytest.raises(ValueError, match="undeliverable later"):
            await wait_first_fast(Fallback(), fails_later(), _never())

    asyncio.run(main())


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
