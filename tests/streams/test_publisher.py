"""publish_events: a few events sent from outside a worker, each keyed by its
dataset, in order, with the producer settings every producer of ours has; it
returns once Kafka has them all, and the producer is stopped whatever happens.
The producer is faked (the real broker's side is every integration run's start)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenbudget.core.kafka import aiokafka_producer_options
from tokenbudget.streams import codec, publisher
from tokenbudget.streams import events as ev


class FakeProducer:
    made: list[FakeProducer]

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.log: list[Any] = []
        self.sends = 0
        self.failing_send: int | None = None  # which send (from 1) the broker refuses
        FakeProducer.made.append(self)

    async def start(self) -> None:
        self.log.append("start")

    async def send_and_wait(self, topic: str, *, key: bytes | None, value: bytes) -> None:
        self.sends += 1
        if self.sends == self.failing_send:
            raise ConnectionError("broker gone")
        self.log.append((topic, key, codec.decode(value)))

    async def stop(self) -> None:
        self.log.append("stop")


@pytest.fixture
def producers(monkeypatch: pytest.MonkeyPatch) -> list[FakeProducer]:
    FakeProducer.made = []
    monkeypatch.setattr(publisher, "AIOKafkaProducer", FakeProducer)
    return FakeProducer.made


EVENTS = [ev.BudgetSet(dataset="a", budget=10), ev.BudgetSet(dataset="b", budget=20)]


def test_each_event_keyed_by_its_dataset_in_order_then_stopped(
    producers: list[FakeProducer],
) -> None:
    asyncio.run(publisher.publish_events("h:1", "ns.budgets", EVENTS, "lz4"))
    [producer] = producers
    assert producer.options == aiokafka_producer_options("h:1", "lz4")
    assert producer.log == [
        "start",
        ("ns.budgets", b"a", EVENTS[0]),
        ("ns.budgets", b"b", EVENTS[1]),
        "stop",
    ]


def test_the_producer_is_stopped_when_a_send_fails(
    producers: list[FakeProducer], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(**options: Any) -> FakeProducer:
        producer = FakeProducer(**options)
        producer.failing_send = 2
        return producer

    monkeypatch.setattr(publisher, "AIOKafkaProducer", failing)
    with pytest.raises(ConnectionError):
        asyncio.run(publisher.publish_events("h:1", "ns.budgets", EVENTS, "none"))
    assert producers[0].log == ["start", ("ns.budgets", b"a", EVENTS[0]), "stop"]
