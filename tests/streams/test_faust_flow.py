"""The ledger's flow control: stream queues survive a resume, not a revoke."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka import TopicPartition
from mode.utils.queues import FlowControlEvent, FlowControlQueue

from streams.app import LedgerSettings, build_app
from streams.faust_flow import LedgerConsumer, ResumeKeepsQueued, never_committed
from streams.topics import Topics


def queue_after(flow: FlowControlEvent, step: str) -> list[str]:
    async def main() -> list[str]:
        queue: FlowControlQueue[str] = FlowControlQueue(flow_control=flow, clear_on_resume=True)
        flow.resume()
        await queue.put("delivered after the seek")
        flow.suspend()
        getattr(flow, step)()
        return [queue.get_nowait() for _ in range(queue.qsize())]

    return asyncio.run(main())


def test_events_queued_before_a_resume_are_kept() -> None:
    assert queue_after(ResumeKeepsQueued(), "resume") == ["delivered after the seek"]
    # Faust's own flow control drops them: the loss this class exists for.
    assert queue_after(FlowControlEvent(), "resume") == []


def test_a_revoke_still_clears_the_queues() -> None:
    assert queue_after(ResumeKeepsQueued(), "clear") == []


def test_deliveries_wait_while_suspended_and_go_on_after_resume() -> None:
    async def main() -> None:
        flow = ResumeKeepsQueued()
        waiting = asyncio.ensure_future(flow.acquire())
        await asyncio.sleep(0)
        assert not waiting.done()
        flow.resume()
        await asyncio.wait_for(waiting, 5)
        assert flow.is_active()

    asyncio.run(main())


def test_the_ledger_app_uses_it() -> None:
    app = build_app(LedgerSettings("127.0.0.1:9", Topics("unit")))
    assert isinstance(app.flow_control, ResumeKeepsQueued)


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

    from streams.faust_flow import position_known

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
    import inspect

    from aiokafka.consumer.subscription_state import TopicPartitionState
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    source = inspect.getsource(AIOKafkaConsumerThread.verify_event_path)
    assert "tp_state.position" in source
    assert "assert self._position is not None" in inspect.getsource(
        TopicPartitionState.position.fget  # type: ignore[attr-defined]
    )
