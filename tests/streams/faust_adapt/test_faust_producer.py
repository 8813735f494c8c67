"""The ledger's table changelog writes, as record batches."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from faust.transport.consumer import Consumer
from faust.transport.drivers.aiokafka import Producer as FaustProducer
from faust.types import Message

from tokenbudget.streams.faust_adapt.producer import (
    LedgerProducer,
    changelog_key_encoder,
    kafka_producer,
    write_changelog,
)
from tokenbudget.streams.ledger_worker import LedgerSettings, build_app
from tokenbudget.streams.topics import Topics


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


# -- against the installed Faust and aiokafka -------------------------------------------


def _app() -> Any:
    return build_app(LedgerSettings("127.0.0.1:9", Topics("unit")))


def test_changelog_batches_are_aiokafkas_real_ones_in_order_split_where_it_says() -> None:
    """write_changelog on a real (unstarted) AIOKafkaProducer: its create_batch and
    BatchBuilder.append decide the split; only the network send is recorded."""
    entries = [(f"prompt-{i}".encode(), bytes([i]) * 40) for i in range(30)]

    async def main() -> list[tuple[str, int, list[tuple[bytes, bytes]]]]:
        producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:9", max_batch_size=512)
        recorder = RecordingProducer(batch_size=512)
        producer.send_batch = recorder.send_batch  # type: ignore[method-assign]
        await write_changelog(producer, "ns-outcomes-changelog", 3, entries)
        await producer.client.close()
        return recorder.sent

    sent = asyncio.run(main())
    assert len(sent) > 1
    assert [entry for _, _, batch in sent for entry in batch] == entries


def test_aiokafkas_batch_calls_have_the_signatures_write_changelog_uses() -> None:
    keyword = inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(AIOKafkaProducer.send_batch).parameters["partition"].kind == keyword
    assert list(inspect.signature(AIOKafkaProducer.create_batch).parameters) == ["self"]
    append = inspect.signature(BatchBuilder.append).parameters
    assert {"key", "value", "timestamp"} <= set(append)
    assert inspect.iscoroutinefunction(AIOKafkaProducer.send_batch)


def test_the_producer_written_to_is_the_one_faust_flushes_before_a_commit() -> None:
    assert "await self.app.producer.flush()" in inspect.getsource(Consumer._commit_offsets)
    assert "await self._producer.flush()" in inspect.getsource(FaustProducer.flush)
    assert "return self._producer" in inspect.getsource(FaustProducer._ensure_producer)
    app = _app()
    assert app.conf.producer_threaded is False  # else flush goes through a thread

    async def main() -> None:
        started = app.producer._new_producer()
        app.producer._producer = started  # what Producer.on_start does
        assert kafka_producer(app) is started
        await started.client.close()

    asyncio.run(main())


def test_the_ledgers_producer_is_idempotent_where_fausts_is_not() -> None:
    assert list(inspect.signature(LedgerProducer._settings_extra).parameters) == list(
        inspect.signature(FaustProducer._settings_extra).parameters
    )
    assert inspect.getsource(FaustProducer._new_producer).count("self._settings_extra()") == 1
    app = _app()
    assert type(app.producer) is LedgerProducer

    async def main() -> list[Any]:
        ours = app.producer._new_producer()
        stock = FaustProducer(app.transport)._new_producer()
        managers = [ours._txn_manager, stock._txn_manager]
        await ours.client.close()
        await stock.client.close()
        return managers

    ours, stock = asyncio.run(main())
    assert ours is not None  # aiokafka keeps sequence numbers: retries are written once
    assert stock is None


def test_the_changelog_key_is_the_one_faust_writes_and_recovery_reads() -> None:
    app = _app()
    table = app.tables["ledger"]
    encoded = changelog_key_encoder(table)("d0")
    topic = table.changelog_topic
    assert encoded == topic.prepare_key("d0", table.key_serializer)[0]
    message = Message(topic.get_topic_name(), 0, 0, 0.0, 0, [], encoded, b"v", None)
    event = asyncio.run(topic.schema.decode(app, message, propagate=True))
    assert event.key == "d0"
