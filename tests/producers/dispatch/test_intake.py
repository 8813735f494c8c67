"""The order prompts are read in: partitions in turns, a few prompts each."""

from __future__ import annotations

import asyncio
from collections import deque

from tokenbudget.producers.dispatch.intake import Turns, next_prompts


class FetchedAlready:
    """An aiokafka consumer's getmany over records fetched already, handed out as
    aiokafka does: without partitions named, the first partition's records until
    they are through."""

    def __init__(self, records: dict[int, list[str]], paused: set[int] | None = None) -> None:
        self.buffers = {p: deque(r) for p, r in records.items()}
        self.paused = paused or set()
        self.waited: list[int] = []

    def assignment(self) -> set[int]:
        return set(self.buffers)

    async def getmany(
        self, *partitions: int, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[int, list[str]]:
        wanted = partitions or tuple(self.buffers)
        for p in wanted:
            buffer = self.buffers[p]
            if buffer and p not in self.paused:
                count = min(len(buffer), max_records or len(buffer))
                return {p: [buffer.popleft() for _ in range(count)]}
        if timeout_ms:
            self.waited.append(timeout_ms)
        return {}


def read_all(consumer: FetchedAlready, per_turn: int) -> list[str]:
    turns = Turns()

    async def go() -> list[str]:
        read: list[str] = []
        while got := await next_prompts(consumer, turns, timeout_ms=200, per_turn=per_turn):
            read += [r for records in got.values() for r in records]
        return read

    return asyncio.run(go())


def test_each_partition_fetched_gets_its_turn_a_few_prompts_at_a_time() -> None:
    consumer = FetchedAlready(
        {
            2: [f"math{i}" for i in range(5)],
            0: [f"short{i}" for i in range(3)],
            1: [f"code{i}" for i in range(4)],
        }
    )
    assert read_all(consumer, per_turn=2) == [
        "short0", "short1", "code0", "code1", "math0", "math1",
        "short2", "code2", "code3", "math2", "math3",
        "math4",
    ]  # fmt: skip
    # it waited for more only once none had any left
    assert consumer.waited == [200]


def test_a_paused_partition_is_passed_over_and_read_again_once_resumed() -> None:
    consumer = FetchedAlready({0: ["a0", "a1", "a2"], 1: ["b0", "b1", "b2"]}, paused={0})
    turns = Turns()

    async def take() -> dict[int, list[str]]:
        return await next_prompts(consumer, turns, timeout_ms=200, per_turn=2)

    assert asyncio.run(take()) == {1: ["b0", "b1"]}
    consumer.paused.clear()
    assert asyncio.run(take()) == {0: ["a0", "a1"]}
    assert asyncio.run(take()) == {1: ["b2"]}


def test_turns_go_on_after_the_partition_read_last_even_when_the_assignment_changes() -> None:
    turns = Turns()
    assert turns.order([3, 1, 2]) == [1, 2, 3]
    turns.read(2)
    assert turns.order([1, 2, 3]) == [3, 1, 2]
    assert turns.order([2, 4]) == [4, 2]
    turns.read(5)  # taken away since (a rebalance): start from the first again
    assert turns.order([1, 2]) == [1, 2]
