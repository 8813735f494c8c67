"""The ledger's consumer: per-message delivery without Faust's tasks, a seek that
rewinds partitions never committed, a livelock check that waits for a position."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace
from typing import Any

import aiokafka
import mode
import pytest
from aiokafka import TopicPartition
from aiokafka.consumer.fetcher import Fetcher
from faust.tables.recovery import Recovery
from faust.transport.consumer import Consumer
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer

from tokenbudget.streams.faust_adapt import HotPath
from tokenbudget.streams.faust_adapt.consumer import (
    FastDeliveryConsumer,
    LedgerConsumer,
    never_committed,
    position_known,
    wait_first_fast,
)
from tokenbudget.streams.ledger_worker import LedgerSettings, build_app
from tokenbudget.streams.topics import Topics


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


class FakeConsumerThread:
    """The two calls LedgerConsumer makes on Faust's aiokafka consumer thread."""

    def __init__(self, committed: dict[TopicPartition, int | None]) -> None:
        self.committed = committed
        self.rewound: list[TopicPartition] = []

    async def seek_to_committed(self) -> dict[TopicPartition, int | None]:
        return self.committed

    async def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        self.rewound.extend(partitions)


def test_a_seek_to_committed_rewinds_source_partitions_never_committed() -> None:
    source, committed, changelog = (
        TopicPartition("ns.completions", 1),
        TopicPartition("ns.completions", 2),
        TopicPartition("ns-ledger-ledger-changelog", 1),
    )
    thread = FakeConsumerThread({source: None, committed: 20, changelog: None})
    consumer = object.__new__(LedgerConsumer)
    consumer._thread = thread  # type: ignore[assignment]
    consumer.app = SimpleNamespace(  # type: ignore[assignment]
        tables=SimpleNamespace(changelog_topics={"ns-ledger-ledger-changelog"})
    )

    result = asyncio.run(consumer.seek_to_committed())

    assert result == thread.committed  # Faust still learns what was committed
    # The recovery reads changelogs from its own offsets: not ours to move.
    assert thread.rewound == [source]


def test_never_committed_counts_a_zero_or_missing_offset() -> None:
    tps = [TopicPartition("t", p) for p in range(4)]
    assert never_committed(dict(zip(tps, [None, 0, -1, 7], strict=True)), set()) == tps[:3]


class ThreadWithSubscriptions:
    """Faust's consumer thread as LedgerConsumer.verify_event_path reaches into it:
    its aiokafka consumer's real SubscriptionState, and the check it guards."""

    def __init__(self, subscriptions: object) -> None:
        self.subscriptions = subscriptions
        self.verified: list[TopicPartition] = []

    def _ensure_consumer(self) -> SimpleNamespace:
        return SimpleNamespace(_fetcher=SimpleNamespace(_subscriptions=self.subscriptions))

    def verify_event_path(self, now: float, tp: TopicPartition) -> None:
        self.verified.append(tp)


def test_the_livelock_check_passes_over_a_partition_without_a_position() -> None:
    from aiokafka.consumer.subscription_state import SubscriptionState

    async def main() -> None:
        fresh, running = TopicPartition("ns.completions", 0), TopicPartition("ns.completions", 1)
        subscriptions = SubscriptionState()
        subscriptions.assign_from_user({fresh, running})
        subscriptions.seek(running, 42)
        assert not position_known(subscriptions, fresh)  # just assigned, as in a rebalance
        assert position_known(subscriptions, running)
        assert not position_known(subscriptions, TopicPartition("other", 0))

        thread = ThreadWithSubscriptions(subscriptions)
        consumer = object.__new__(LedgerConsumer)
        consumer._thread = thread  # type: ignore[assignment]
        consumer.verify_event_path(0.0, fresh)
        consumer.verify_event_path(0.0, running)
        assert thread.verified == [running]

    asyncio.run(main())


def test_fausts_livelock_check_still_reads_the_position_it_may_not_have() -> None:
    """The installed Faust reads aiokafka's ``position``, which asserts one is set:
    if a Faust upgrade stops doing so, LedgerConsumer.verify_event_path can go."""
    from aiokafka.consumer.subscription_state import TopicPartitionState
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    source = inspect.getsource(AIOKafkaConsumerThread.verify_event_path)
    assert "tp_state.position" in source
    assert "assert self._position is not None" in inspect.getsource(
        TopicPartitionState.position.fget  # type: ignore[attr-defined]
    )


# -- against the installed Faust, mode and aiokafka ------------------------------------


def shape(function: object) -> list[tuple[str, object, object]]:
    """A signature without its annotations: how callers bind the arguments."""
    parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in parameters]


@pytest.mark.parametrize(
    ("ours", "name"),
    [
        (LedgerConsumer, "verify_event_path"),
        (LedgerConsumer, "seek_to_committed"),
        (FastDeliveryConsumer, "wait_first"),
    ],
)
def test_the_overridden_methods_exist_on_fausts_consumer_with_their_signatures(
    ours: type, name: str
) -> None:
    assert shape(getattr(ours, name)) == shape(getattr(AIOKafkaConsumer, name))
    assert inspect.iscoroutinefunction(getattr(ours, name)) == inspect.iscoroutinefunction(
        getattr(AIOKafkaConsumer, name)
    )


def test_faust_delivers_every_message_through_wait_first() -> None:
    source = inspect.getsource(Consumer._drain_messages)
    assert "await self.wait_first(\n" in source
    assert "callback(message), self.suspend_flow.wait()" in source


def test_fausts_seek_after_recovery_goes_through_seek_to_committed() -> None:
    assert "await self.seek_to_committed()" in inspect.getsource(Consumer.perform_seek)
    assert "consumer.perform_seek()" in inspect.getsource(Recovery.on_recovery_completed)
    # LedgerConsumer rewinds through the thread, by aiokafka partitions.
    assert shape(AIOKafkaConsumerThread.seek_to_beginning) == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("partitions", inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty),
    ]


def test_the_livelock_check_reaches_aiokafkas_subscriptions_where_ledger_consumer_looks() -> None:
    assert "self._subscriptions = subscriptions" in inspect.getsource(Fetcher.__init__)
    assert "self._fetcher = Fetcher(" in inspect.getsource(aiokafka.AIOKafkaConsumer.start)
    assert (
        inspect.getsource(AIOKafkaConsumer.verify_event_path)
        .rstrip()
        .endswith("return self._thread.verify_event_path(now, tp)")
    )


def _app(hot_path: HotPath | None = None) -> Any:
    settings = LedgerSettings("127.0.0.1:9", Topics("unit"), hot_path=hot_path or HotPath())
    return build_app(settings)


def test_the_ledger_apps_consumer_is_ours_and_knows_its_changelogs() -> None:
    app = _app()
    assert type(app.consumer) is FastDeliveryConsumer
    assert app.tables.changelog_topics == {
        "unit-ledger-ledger-changelog",
        "unit-ledger-outcomes-changelog",
    }
    assert type(_app(HotPath(fast_delivery=False)).consumer) is LedgerConsumer


def test_the_real_consumer_delivers_at_once_and_closes_the_flow_wait() -> None:
    async def deliver() -> str:
        return "delivered"

    async def main() -> None:
        consumer = _app().consumer
        suspended = _never()
        result = await consumer.wait_first(deliver(), suspended)
        assert result.results == ["delivered"]
        assert inspect.getcoroutinestate(suspended) == inspect.CORO_CLOSED

    asyncio.run(main())


def test_the_real_consumer_still_abandons_a_waiting_delivery_when_the_flow_suspends() -> None:
    async def main() -> None:
        consumer = _app().consumer
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        suspend_flow = asyncio.Event()
        asyncio.get_running_loop().call_soon(suspend_flow.set)
        result = await consumer.wait_first(gate_waiter(gate), suspend_flow.wait())
        assert result.results == [True]
        await asyncio.sleep(0)
        assert gate.cancelled()

    async def gate_waiter(gate: asyncio.Future[None]) -> None:
        await gate

    asyncio.run(main())
