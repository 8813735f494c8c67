"""The order a dispatcher reads its prompts in: a few from each partition of the
prompts topic in turn, rather than all a partition's fetch holds before the next's.

aiokafka hands out what it fetched one partition at a time, and a partition's fetch
holds up to ``max_partition_fetch_bytes`` (8 MiB, :mod:`tokenbudget.core.sizes`): a
dataset's whole queue of prompts. Read that way, every place freed at the fleet went
to one partition's datasets until its queue was through. In ``bench/fleet.py``
``short_qa`` had none of 1,024 requests in flight for a minute with 2,048 prompts
queued, and when a dataset ended, the others grew into its places only once the
partition being read was through.

Read in turns, each partition with prompts starts as many as each other one. A dataset
of short answers then holds fewer places than one of long answers and spends its
budget slower, so the datasets of long answers end first and a job's last answers,
which the fleet waits out at its end with nothing else to send, are short ones.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, TypeVar

P = TypeVar("P", bound=Hashable)

# Prompts read from a partition per turn: enough that a turn's read costs little
# beside the prompts' own work, few beside the fleet's places.
PER_TURN = 8


class Turns:
    """Whose turn it is: the partitions in order, starting after the one read last
    (pure)."""

    def __init__(self) -> None:
        self._last: Any = None

    def order(self, partitions: Iterable[P]) -> list[P]:
        """``partitions`` (those assigned now), sorted, the one after the last read
        first."""
        ordered = sorted(partitions)  # type: ignore[type-var]
        if self._last in ordered:
            after = ordered.index(self._last) + 1
            ordered = ordered[after:] + ordered[:after]
        return ordered

    def read(self, partition: Hashable) -> None:
        """Prompts were read from ``partition``: the next turn is the next one's."""
        self._last = partition


async def next_prompts(
    consumer: Any, turns: Turns, *, timeout_ms: int, per_turn: int = PER_TURN
) -> dict[Any, list[Any]]:
    """Up to ``per_turn`` prompts of one partition, the first in ``turns``' order that
    has some fetched already; when none has, whatever comes first within
    ``timeout_ms`` (empty when nothing does). ``consumer`` is an aiokafka consumer:
    ``getmany`` of a paused partition gives nothing. Raises what ``getmany`` raises."""
    for partition in turns.order(consumer.assignment()):
        got: dict[Any, list[Any]] = await consumer.getmany(
            partition, timeout_ms=0, max_records=per_turn
        )
        if got:
            turns.read(partition)
            return got
    got = await consumer.getmany(timeout_ms=timeout_ms, max_records=per_turn)
    if got:
        turns.read(next(iter(got)))
    return got
