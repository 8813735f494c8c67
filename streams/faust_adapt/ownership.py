"""Which datasets a ledger worker may speak for, read off Faust and aiokafka.

A ledger worker publishes a dataset's snapshots, halts and lease replies, and writes
its table state, only while it owns the dataset's partition; several workers (or a
killed run's leftover beside a new one) share a namespace's partitions through the
consumer group. Two things can make a worker speak out of turn, and both are closed
here:

* **A revoked partition.** Faust's memory store keeps the keys of partitions it no
  longer holds, and its revocation signal comes only after the worker has drained
  its streams. :class:`Ownership` stops speaking as soon as the rebalance starts
  (``app.rebalancing``, which Faust sets first thing) and, after it, speaks only for
  the partitions it was assigned.
* **A worker expelled without knowing.** A worker frozen (SIGSTOP, a stalled VM or
  disk) past the group's session timeout has lost its partitions at the broker; when
  it wakes it may process what it had fetched before its next heartbeat tells it. It
  counts as owner only while the last heartbeat that succeeded was *sent* less than
  the session timeout (less a margin) ago; past that it must wait for the next one.

Each ownership of a partition has an epoch (:func:`tokenbudget.streams.events.ledger_epoch`),
stamped on everything the worker publishes for datasets of that partition, so that
readers drop what a stale worker published anyway.

This module reaches into aiokafka's group coordinator (``_do_heartbeat``) through
Faust's consumer thread (versions pinned in :mod:`tokenbudget.streams.faust_adapt.versions`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from faust.types import TP

from tokenbudget.streams import events as ev

log = logging.getLogger(__name__)

# Of the session timeout, what a heartbeat's answer may take on its way back.
MARGIN = 0.2


class Ownership:
    def __init__(
        self, app: Any, source_topics: Iterable[str], changelog: str, session_timeout: float
    ) -> None:
        self.app = app
        self.source_topics = set(source_topics)
        self.changelog = changelog
        self.session_timeout = session_timeout
        self.epochs: dict[int, int] = {}  # partition -> epoch of this worker's ownership
        self._last_epochs: dict[int, int] = {}  # kept past a revocation, for writes
        self._heartbeat_sent_ok = 0.0  # monotonic: send time of the last good heartbeat
        self._hooked: Any = None
        app.on_partitions_assigned.connect(self._on_assigned)
        app.on_partitions_revoked.connect(self._on_revoked)

    # -- what the worker asks ----------------------------------------------------------

    def epoch(self, partition: int) -> int | None:
        """The epoch to stamp on what is published for ``partition`` now, or None when
        this worker may not speak for it (not its partition, a rebalance under way,
        or no heartbeat recent enough to be sure it is still in the group)."""
        if self.app.rebalancing or not self.current():
            return None
        return self.epochs.get(partition)

    def write_epoch(self, partition: int) -> int:
        """The epoch to stamp on table state written for ``partition``: this worker's
        latest ownership of it, also while a rebalance takes it away (a write that
        lands after the next owner's is then recognised as older at recovery)."""
        return self._last_epochs.get(partition, 0)

    def current(self) -> bool:
        """Whether the group cannot have expelled this worker yet."""
        age = time.monotonic() - self._heartbeat_sent_ok
        return age < self.session_timeout * (1 - MARGIN)

    async def confirmed(self, timeout: float) -> bool:
        """Wait (up to ``timeout``) until :meth:`current`, as after a freeze the next
        heartbeat tells whether this worker is still in the group; False if it is not
        (its partitions are being revoked) or no heartbeat came back in time."""
        deadline = time.monotonic() + timeout
        while not self.current():
            if self.app.rebalancing or time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return not self.app.rebalancing

    # -- Faust's signals and aiokafka's heartbeat --------------------------------------

    async def _on_assigned(self, app: Any, assigned: Any, **_: Any) -> None:
        self._hook_heartbeats()
        self._heartbeat_sent_ok = time.monotonic()  # the join just succeeded
        partitions = sorted({tp.partition for tp in assigned if tp.topic in self.source_topics})
        tps = [TP(self.changelog, p) for p in partitions]
        ends = await app.consumer.highwaters(*tps) if tps else {}
        now = time.time()
        self.epochs = {tp.partition: ev.ledger_epoch(int(ends.get(tp, 0)), now) for tp in tps}
        self._last_epochs.update(self.epochs)
        log.info("ledger owns partitions %s", partitions)

    async def _on_revoked(self, app: Any, revoked: Any, **_: Any) -> None:
        gone = {tp.partition for tp in revoked if tp.topic in self.source_topics}
        for partition in gone:
            self.epochs.pop(partition, None)

    def _hook_heartbeats(self) -> None:
        coordinator = self.app.consumer._thread._consumer._coordinator
        if coordinator is self._hooked:
            return
        do_heartbeat = coordinator._do_heartbeat

        async def tracked() -> bool:
            sent = time.monotonic()
            ok = bool(await do_heartbeat())
            if ok:
                self._heartbeat_sent_ok = max(self._heartbeat_sent_ok, sent)
            return ok

        coordinator._do_heartbeat = tracked
        self._hooked = coordinator
