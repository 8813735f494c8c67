"""Publishing a few events from outside a worker: the budgets a job starts with and
those `tokenbudget budget set` changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer

from tokenbudget.core import sizes
from tokenbudget.core.kafka import aiokafka_producer_options
from tokenbudget.streams import codec


async def publish_events(
    bootstrap: str, topic: str, events: Sequence[Any], compression: sizes.Compression
) -> None:
    """Send events keyed by their dataset and wait until Kafka has them all."""
    producer = AIOKafkaProducer(**aiokafka_producer_options(bootstrap, compression))
    await producer.start()
    try:
        for event in events:
            await producer.send_and_wait(
                topic, key=codec.event_key(event), value=codec.encode(event)
            )
    finally:
        await producer.stop()
