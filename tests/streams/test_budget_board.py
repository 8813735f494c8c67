"""BudgetBoard: the local view of halted datasets, without a broker."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from tests.producers.dispatch.test_admission import open_snapshot
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard, BudgetWatcher
from tokenbudget.streams.topics import Topics


def snapshot(dataset: str, *, halted: bool, at: float, samples: int = 0) -> ev.LedgerSnapshot:
    return ev.LedgerSnapshot(
        dataset=dataset,
        budget=100,
        unit="completion_tokens",
        completion_tokens=0,
        prompt_tokens=0,
        samples=samples,
        skipped=0,
        failed=0,
        produced=None,
        halted=halted,
        status="halted" if halted else "open",
        at=at,
    )


def exceeded(dataset: str = "a") -> ev.BudgetExceeded:
    return ev.BudgetExceeded(dataset=dataset, budget=10, used=12)


def raised(dataset: str = "a") -> ev.BudgetRaised:
    return ev.BudgetRaised(dataset=dataset, budget=20, used=12)


def test_unknown_dataset_is_open() -> None:
    board = BudgetBoard()
    assert not board.is_halted("a")
    assert board.snapshot("a") is None
    assert "a" not in board.views  # asking does not create a view


def test_exceeded_halts_and_records_halted_at() -> None:
    board = BudgetBoard()
    board.apply(exceeded("a"), seen_at=5.0)
    assert board.is_halted("a")
    assert not board.is_halted("b")
    assert board.views["a"].halted_at == 5.0
    assert board.changed.is_set()


def test_second_exceeded_keeps_first_halted_at() -> None:
    board = BudgetBoard()
    board.apply(exceeded(), seen_at=5.0)
    board.apply(exceeded(), seen_at=9.0)
    assert board.views["a"].halted_at == 5.0


def test_halted_at_defaults_to_now() -> None:
    board = BudgetBoard()
    board.apply(exceeded())
    halted_at = board.views["a"].halted_at
    assert halted_at is not None
    assert halted_at > 1e9  # a wall-clock time, not a monotonic one


def test_raised_reopens() -> None:
    board = BudgetBoard()
    board.apply(exceeded(), seen_at=5.0)
    board.changed.clear()
    board.apply(raised(), seen_at=6.0)
    assert not board.is_halted("a")
    assert board.views["a"].halted_at is None
    assert board.changed.is_set()
    board.apply(exceeded(), seen_at=7.0)
    assert board.views["a"].halted_at == 7.0


def test_snapshots_carry_the_halted_flag() -> None:
    board = BudgetBoard()
    first = snapshot("a", halted=False, at=1.0)
    board.apply(first, seen_at=1.0)
    assert board.snapshot("a") == first
    assert not board.is_halted("a")

    halted = snapshot("a", halted=True, at=2.0)
    board.apply(halted, seen_at=2.5)
    assert board.snapshot("a") == halted
    assert board.is_halted("a")
    assert board.views["a"].halted_at == 2.5

    reopened = snapshot("a", halted=False, at=3.0)
    board.apply(reopened, seen_at=3.5)
    assert not board.is_halted("a")
    assert board.views["a"].halted_at is None


def test_older_snapshot_does_not_override_a_newer_one() -> None:
    board = BudgetBoard()
    newer = snapshot("a", halted=True, at=10.0, samples=5)
    board.apply(newer, seen_at=10.0)
    board.apply(snapshot("a", halted=False, at=9.0, samples=4), seen_at=11.0)
    assert board.snapshot("a") == newer
    assert board.is_halted("a")
    assert board.views["a"].halted_at == 10.0


def test_snapshot_with_equal_time_replaces() -> None:
    board = BudgetBoard()
    board.apply(snapshot("a", halted=False, at=10.0, samples=1), seen_at=10.0)
    later = snapshot("a", halted=True, at=10.0, samples=2)
    board.apply(later, seen_at=10.0)
    assert board.snapshot("a") == later
    assert board.is_halted("a")


def test_datasets_are_independent() -> None:
    board = BudgetBoard()
    board.apply(exceeded("a"), seen_at=1.0)
    board.apply(snapshot("b", halted=False, at=1.0), seen_at=1.0)
    board.apply(raised("c"), seen_at=1.0)
    assert board.is_halted("a")
    assert not board.is_halted("b")
    assert not board.is_halted("c")
    assert board.snapshot("a") is None


def test_other_events_are_ignored() -> None:
    board = BudgetBoard()
    board.apply(ev.BudgetSet(dataset="a", budget=5), seen_at=1.0)
    board.apply(ev.ProducerDone(dataset="a", produced=3, reason="end_of_data"), seen_at=1.0)
    assert not board.changed.is_set()
    assert not board.is_halted("a")
    assert board.views == {}


# ---- budgets being lowered ---------------------------------------------------------


def test_a_lower_budget_is_pending_until_a_snapshot_shows_it_applied() -> None:
    board = BudgetBoard()
    board.apply(ev.BudgetSet(dataset="a", budget=1000))
    assert not board.lowering("a")  # the first budget lowers nothing
    board.apply(ev.BudgetSet(dataset="a", budget=600))
    assert board.lowering("a")
    assert not board.lowering("b")
    # A snapshot of the ledger before it applied the new budget decides nothing.
    board.apply(open_snapshot(1000, "a", at=1.0))
    assert board.lowering("a")
    board.apply(open_snapshot(600, "a", at=2.0))
    assert not board.lowering("a")


def test_a_raise_is_not_a_lowering() -> None:
    board = BudgetBoard()
    board.apply(ev.BudgetSet(dataset="a", budget=1000))
    board.apply(ev.BudgetSet(dataset="a", budget=2000))
    assert not board.lowering("a")


def test_a_lowering_is_judged_against_the_ledgers_budget_without_an_earlier_set() -> None:
    board = BudgetBoard()
    board.apply(open_snapshot(1000, "a", at=1.0))  # read after the first set's retention
    board.apply(ev.BudgetSet(dataset="a", budget=500))
    assert board.lowering("a")


def test_lowered_then_raised_before_the_ledger_applied_either_waits_for_the_last() -> None:
    board = BudgetBoard()
    board.apply(ev.BudgetSet(dataset="a", budget=1000))
    board.apply(ev.BudgetSet(dataset="a", budget=500))
    board.apply(ev.BudgetSet(dataset="a", budget=800))
    board.apply(open_snapshot(500, "a", at=1.0))
    assert board.lowering("a")  # the ledger has not read the 800 yet
    board.apply(open_snapshot(800, "a", at=2.0))
    assert not board.lowering("a")


def test_decided_returns_once_the_lowering_is_applied() -> None:
    async def main() -> None:
        board = BudgetBoard()
        await asyncio.wait_for(board.decided("a"), 1)  # nothing pending
        await asyncio.wait_for(board.sync(), 1)  # no watcher: nothing to read
        board.apply(ev.BudgetSet(dataset="a", budget=1000))
        board.apply(ev.BudgetSet(dataset="a", budget=400))
        waiting = asyncio.create_task(board.decided("a"))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        board.apply(open_snapshot(400, "a", at=1.0))
        await asyncio.wait_for(waiting, 1)

    asyncio.run(main())


# ---- the watcher, on a fake consumer ---------------------------------------------------


class FakeConsumer:
    """Hands out queued budget events like aiokafka's getmany; fails when told to."""

    def __init__(self, tp: TopicPartition) -> None:
        self.tp = tp
        self.log: list[bytes] = []  # the partition
        self.pos = 0
        self.failures = 0
        self.end_calls = 0

    def publish(self, event: ev.Event) -> None:
        self.log.append(codec.encode(event))

    async def getmany(self, timeout_ms: int, max_records: int) -> dict:
        await asyncio.sleep(0.001)
        if self.failures:
            self.failures -= 1
            raise KafkaError("fetch failed")
        records = [
            SimpleNamespace(value=v, topic=self.tp.topic, partition=self.tp.partition, offset=i)
            for i, v in enumerate(self.log[self.pos :], self.pos)
        ]
        self.pos = len(self.log)
        return {self.tp: records} if records else {}

    async def position(self, tp: TopicPartition) -> int:
        return self.pos

    async def end_offsets(self, tps: list[TopicPartition]) -> dict:
        self.end_calls += 1
        return {self.tp: len(self.log)}


def watching(consumer: FakeConsumer) -> BudgetWatcher:
    watcher = BudgetWatcher("127.0.0.1:1", Topics("t"))
    watcher._consumer = consumer  # type: ignore[assignment]
    watcher._end = {consumer.tp: 0}
    watcher.board.syncer = watcher.sync
    return watcher


def test_the_watcher_reads_on_after_a_failed_fetch() -> None:
    async def main() -> None:
        consumer = FakeConsumer(TopicPartition("t.budgets", 0))
        consumer.failures = 2
        consumer.publish(exceeded("a"))
        watcher = watching(consumer)
        task = asyncio.create_task(watcher.run())
        try:
            for _ in range(5000):
                if watcher.board.is_halted("a"):
                    break
                await asyncio.sleep(0.001)
            assert watcher.board.is_halted("a")
            assert not task.done()
        finally:
            task.cancel()

    asyncio.run(main())


def test_sync_returns_once_what_was_published_before_it_is_applied() -> None:
    async def main() -> None:
        consumer = FakeConsumer(TopicPartition("t.control", 0))
        watcher = watching(consumer)
        consumer.publish(ev.BudgetSet(dataset="a", budget=1000))
        consumer.publish(ev.BudgetSet(dataset="a", budget=500))
        task = asyncio.create_task(watcher.run())
        try:
            await asyncio.wait_for(watcher.board.sync(), 5)
            assert watcher.board.lowering("a")  # both sets were read before it returned
            # Callers waiting at the same time share one request for the end offsets.
            calls = consumer.end_calls
            await asyncio.wait_for(asyncio.gather(*(watcher.board.sync() for _ in range(5))), 5)
            assert consumer.end_calls - calls <= 2
        finally:
            task.cancel()

    asyncio.run(main())


def test_events_of_a_stale_ledger_worker_are_dropped_by_epoch() -> None:
    """Two workers spoke for one dataset (one had lost the partition and did not know):
    readers keep the newer ownership's view, whatever the order or the clocks."""
    board = BudgetBoard()
    replies: list[ev.Event] = []
    board.lease_listeners["h1"] = replies.append
    old, new = ev.ledger_epoch(100, 50.0), ev.ledger_epoch(140, 70.0)
    board.apply(
        msgspec.structs.replace(snapshot("a", halted=True, at=10.0, samples=110), epoch=old)
    )
    # The new owner's clock is behind: its snapshot still wins by epoch.
    fresh = msgspec.structs.replace(snapshot("a", halted=False, at=5.0, samples=14), epoch=new)
    board.apply(fresh)
    assert board.snapshot("a") == fresh and not board.is_halted("a")
    board.apply(
        msgspec.structs.replace(snapshot("a", halted=True, at=11.0, samples=110), epoch=old)
    )
    board.apply(ev.BudgetExceeded(dataset="a", budget=1, used=1, epoch=old))
    assert board.snapshot("a") == fresh and not board.is_halted("a")
    stale_grant = ev.LeaseGranted(
        dataset="a", lease_id="h1:a:1", holder="h1", granted=500, expires_at=0.0, epoch=old
    )
    board.apply(stale_grant)
    assert replies == []
    grant = msgspec.structs.replace(stale_grant, epoch=new)
    board.apply(grant)
    assert replies == [grant]


def test_epochs_order_by_recovery_point_then_time() -> None:
    assert ev.ledger_epoch(10, 1_000.0) < ev.ledger_epoch(11, 900.0)
    assert ev.ledger_epoch(10, 1_000.0) < ev.ledger_epoch(10, 1_001.0)
