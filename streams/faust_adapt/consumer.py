"""The ledger's Faust consumer: two more rebalance races closed, and per-message
delivery without Faust's task machinery.

* **No committed offset, no seek.** During recovery the fetcher drops records of the
  paused stream partitions after fetching them, relying on the seek to committed
  offsets to fetch them again. A partition the group never committed (a ledger
  killed before its first commit) is not sought at all, so its position stays past
  the dropped records. :class:`LedgerConsumer` seeks such partitions to their
  beginning, where ``auto_offset_reset = earliest`` starts them anyway.
* **The livelock check reads a position not set yet.** Faust's commit livelock
  detector reads aiokafka's position of every assigned partition; one assigned a
  moment ago, in a rebalance as a second ledger worker joins, has none yet, and
  aiokafka's ``assert`` crashed the worker (seen in the two-worker cluster test).
  :class:`LedgerConsumer` skips the check for such partitions: they are not stuck,
  they have not started.
* **Delivery without four tasks per message** (:class:`FastDeliveryConsumer`). Faust
  hands every fetched message to the streams with ``wait_first(deliver(message),
  suspend_flow.wait())``: four tasks and an ``asyncio.wait`` per message, so that a
  delivery blocked by flow control can be abandoned when a rebalance suspends the
  flow. Delivery almost never blocks, so this consumer runs it synchronously up to
  its first suspension (:func:`wait_first_fast`); only a delivery that does suspend
  is finished under Faust's ``wait_first``, exactly as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any

from aiokafka.structs import TopicPartition as AIOKafkaTopicPartition
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from mode.services import WaitResults

WaitFirst = Callable[..., Awaitable[WaitResults]]


def never_committed(committed: Mapping[Any, int | None], changelogs: set[str]) -> list[Any]:
    """The source partitions in ``committed`` (partition -> committed offset, as
    aiokafka's ``seek_to_committed`` returns it) without a committed position."""
    return [
        tp
        for tp, offset in committed.items()
        if (offset is None or offset <= 0) and tp.topic not in changelogs
    ]


def position_known(subscriptions: Any, tp: Any) -> bool:
    """Whether aiokafka's ``SubscriptionState`` has a fetch position for ``tp``."""
    subscription = subscriptions.subscription
    assignment = subscription.assignment if subscription is not None else None
    state = assignment.state_value(tp) if assignment is not None else None
    return state is not None and bool(state.has_valid_position)


class LedgerConsumer(AIOKafkaConsumer):
    """The ledger's consumer: a seek to committed offsets also rewinds the source
    partitions that have none, and the livelock check passes over partitions that
    have no position yet."""

    def verify_event_path(self, now: float, tp: Any) -> None:
        consumer = self._thread._ensure_consumer()
        aiotp = AIOKafkaTopicPartition(tp.topic, tp.partition)
        if not position_known(consumer._fetcher._subscriptions, aiotp):
            return None
        return super().verify_event_path(now, tp)

    async def seek_to_committed(self) -> Mapping[Any, int]:
        committed = await super().seek_to_committed()
        unsought = never_committed(committed, self.app.tables.changelog_topics)
        if unsought:
            await self._thread.seek_to_beginning(*unsought)
        return committed


async def wait_first_fast(fallback: WaitFirst, *waitables: Any) -> WaitResults:
    """``fallback(*waitables)`` (mode's ``Service.wait_first``), except that when the
    first waitable is a coroutine that finishes without suspending, it alone wins and
    no task is made. A coroutine that suspends goes on under ``fallback`` from where it
    stopped, so it is still abandoned (and closed) if another waitable wins."""
    first = waitables[0] if waitables else None
    if not asyncio.iscoroutine(first):
        return await fallback(*waitables)
    try:
        blocker = first.send(None)
    except StopIteration as stop:
        _close(waitables[1:])
        return WaitResults([first], [stop.value], False)
    except BaseException:
        _close(waitables[1:])
        raise
    return await fallback(_carry_on(first, blocker), *waitables[1:])


async def _carry_on(coroutine: Coroutine[Any, Any, Any], blocker: Any) -> Any:
    """Run a coroutine that suspended on ``blocker`` to its end, stepping it the way an
    asyncio Task would; if this is cancelled, so is ``blocker``, and the coroutine is
    closed (its ``finally`` blocks run)."""
    try:
        while True:
            if blocker is None:  # a bare yield, as in asyncio.sleep(0)
                await asyncio.sleep(0)
            else:
                blocker._asyncio_future_blocking = False
                try:
                    await asyncio.wait([blocker])
                except asyncio.CancelledError:
                    blocker.cancel()
                    raise
            try:
                blocker = coroutine.send(None)
            except StopIteration as stop:
                return stop.value
    finally:
        coroutine.close()


def _close(waitables: Iterable[Any]) -> None:
    # The losers were never awaited: close them so Python does not warn about it.
    for waitable in waitables:
        if asyncio.iscoroutine(waitable):
            waitable.close()


class FastDeliveryConsumer(LedgerConsumer):
    """The ledger's consumer whose per-message delivery skips the task machinery
    unless the delivery has to wait (see :func:`wait_first_fast`)."""

    async def wait_first(self, *coros: Any, timeout: Any = None) -> WaitResults:
        if timeout is not None or self._stopped.is_set() or self._crashed.is_set():
            return await super().wait_first(*coros, timeout=timeout)
        return await wait_first_fast(super().wait_first, *coros)
