"""Waiting for a topic's metadata and reading a topic to its end: the one way every
module does it (:mod:`tokenbudget.core.kafka`)."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from kafka import KafkaAdminClient, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from tokenbudget.core.errors import BrokerError
from tokenbudget.core.kafka import (
    client_options,
    kafka_python_producer_options,
    read_topic,
    wait_for_partitions,
    wait_for_partitions_aio,
)


class _SlowMetadata:
    """A consumer whose metadata has the topic only from the ``after``-th ask on."""

    def __init__(self, partitions: set[int], after: int) -> None:
        self.partitions = partitions
        self.asks = itertools.count(1)
        self.after = after

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return self.partitions if next(self.asks) >= self.after else None


def test_partitions_are_waited_for_and_returned_sorted() -> None:
    consumer: Any = _SlowMetadata({2, 0, 1}, after=3)
    found = wait_for_partitions(consumer, "t", timeout=60, interval=0)
    assert found == [TopicPartition("t", 0), TopicPartition("t", 1), TopicPartition("t", 2)]


def test_a_topic_that_never_shows_partitions_raises_the_callers_message() -> None:
    consumer: Any = _SlowMetadata({0}, after=10**9)
    with pytest.raises(BrokerError) as default:
        wait_for_partitions(consumer, "t", timeout=0, interval=0)
    assert str(default.value) == "topic t does not exist"
    with pytest.raises(BrokerError) as own:
        wait_for_partitions(consumer, "t", timeout=0, interval=0, missing="no history known")
    assert str(own.value) == "no history known"


def _create(bootstrap: str, topic: str, partitions: int) -> None:
    admin = KafkaAdminClient(**client_options(bootstrap))
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        admin.close()


@pytest.mark.integration
def test_read_topic_hands_over_every_record_in_partition_order(kafka_bootstrap: str) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.read"
    _create(kafka_bootstrap, topic, 2)
    producer = KafkaProducer(**kafka_python_producer_options(kafka_bootstrap, "zstd"))
    for i in range(30):
        producer.send(topic, value=str(i).encode(), partition=i % 2)
    producer.flush()
    producer.close()

    seen: dict[int, list[int]] = {0: [], 1: []}
    read_topic(
        kafka_bootstrap,
        topic,
        lambda record: seen[record.partition].append(int(record.value)),
        max_records=4,  # several polls per partition
    )
    assert seen == {0: list(range(0, 30, 2)), 1: list(range(1, 30, 2))}


@pytest.mark.integration
def test_read_topic_of_a_missing_topic_raises_the_callers_message(kafka_bootstrap: str) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.never"
    with pytest.raises(BrokerError) as info:
        read_topic(kafka_bootstrap, topic, print, metadata_timeout=0.5, missing="it is missing")
    assert str(info.value) == "it is missing"


@pytest.mark.integration
def test_an_aiokafka_consumer_sees_a_topic_created_after_it_started(kafka_bootstrap: str) -> None:
    """aiokafka refreshes an unsubscribed topic's metadata only every few minutes:
    the wait asks for it."""
    topic = f"t{uuid.uuid4().hex[:10]}.late"

    async def main() -> list[Any]:
        consumer = AIOKafkaConsumer(**client_options(kafka_bootstrap), group_id=None)
        await consumer.start()
        try:
            assert not consumer.partitions_for_topic(topic)
            await asyncio.to_thread(_create, kafka_bootstrap, topic, 3)
            return await wait_for_partitions_aio(consumer, topic, timeout=60)
        finally:
            await consumer.stop()

    found = asyncio.run(main())
    assert [(tp.topic, tp.partition) for tp in found] == [(topic, 0), (topic, 1), (topic, 2)]
