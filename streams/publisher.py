"""Publishing a few events from outside a worker: budgets set by a user, a
producer's end, a replayed run's outcomes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer

from streams import events as ev
from tokenbudget.kafka import aiokafka_producer_options


async def publish_events(bootstrap: str, topic: str, events: Sequence[Any]) -> None:
    """Send events keyed by their dataset and wait until Kafka has them all."""
    producer = AIOKafkaProducer(**aiokafka_producer_options(bootstrap))
    await producer.start()
    try:
        for event in events:
            await producer.send_and_wait(topic, key=ev.event_key(event), value=ev.encode(event))
    finally:
        await producer.stop()
