"""Which offsets are safe to commit when work finishes out of order.

A consumer hands prompts to concurrent tasks; they finish in any order. Committing
offset N tells Kafka everything below N is done, so the commit point is the lowest
offset still in progress (or one past the highest seen when nothing is). A crash then
replays only unfinished work, and the ledger's per-prompt idempotency absorbs any
repeat. Gaps in offsets (transaction markers, compaction) need no special case.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PartitionProgress:
    pending: set[int] = field(default_factory=set)
    highest_seen: int = -1

    def started(self, offset: int) -> None:
        self.pending.add(offset)
        self.highest_seen = max(self.highest_seen, offset)

    def finished(self, offset: int) -> None:
        self.pending.discard(offset)

    def committable(self) -> int | None:
        if self.highest_seen < 0:
            return None
        return min(self.pending) if self.pending else self.highest_seen + 1


class OffsetTracker:
    """Tracks started/finished offsets per (topic, partition)."""

    def __init__(self) -> None:
        self._partitions: dict[tuple[str, int], PartitionProgress] = {}

    def started(self, topic: str, partition: int, offset: int) -> None:
        self._partitions.setdefault((topic, partition), PartitionProgress()).started(offset)

    def finished(self, topic: str, partition: int, offset: int) -> None:
        progress = self._partitions.get((topic, partition))
        if progress is not None:
            progress.finished(offset)

    def committable(self) -> dict[tuple[str, int], int]:
        """The offset to commit (the next one to read) per partition seen."""
        result = {}
        for tp, progress in self._partitions.items():
            offset = progress.committable()
            if offset is not None:
                result[tp] = offset
        return result

    def in_flight(self) -> int:
        return sum(len(p.pending) for p in self._partitions.values())

    def forget(self, topic: str, partition: int) -> None:
        """After a partition is revoked its offsets belong to another consumer."""
        self._partitions.pop((topic, partition), None)
