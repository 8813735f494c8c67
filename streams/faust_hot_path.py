"""Faust's per-message costs, cut out of the ledger's inner loop.

On a slow 2-core box one ledger worker spent about 250 us of Faust's own time per
consumed message and about 300 us per table write, capping it near 1,800 completion
events/s (bench/ledger.py; py-spy profiles). Both costs are bookkeeping, not work,
and each replacement keeps Faust's guarantees:

* :class:`FastDeliveryConsumer`. Faust hands every fetched message to the streams
  with ``wait_first(deliver(message), suspend_flow.wait())``: four tasks and an
  ``asyncio.wait`` per message, so that a delivery blocked by flow control can be
  abandoned when a rebalance suspends the flow. Delivery almost never blocks, so
  this consumer runs it synchronously up to its first suspension
  (:func:`wait_first_fast`); only a delivery that does suspend is finished under
  Faust's ``wait_first``, exactly as before.
* :func:`write_changelog`. ``Table.send_changelog`` builds a Faust message, a
  pending-message record and a future per key. The ledger writes its table changes
  once per batch, so they go to the changelog as record batches per partition
  through the same aiokafka producer. Faust flushes that producer before it commits
  source offsets, so a commit still never covers a change that is not written.
* :class:`RawSchema` hands key and value over as the bytes they arrived as, instead
  of through two codec-registry lookups per message, and :class:`QuietMonitor` keeps
  Faust's monitor out of the four sensor calls every message makes (only Faust's
  web views read it; the ledger serves none and keeps its metrics in tokenbudget/metrics).

Written against faust-streaming 0.15 (pinned below 0.16 in pyproject.toml).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

import faust
from faust.sensors.monitor import Monitor
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from mode.services import WaitResults

WaitFirst = Callable[..., Awaitable[WaitResults]]


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


class FastDeliveryConsumer(AIOKafkaConsumer):
    """Faust's aiokafka consumer whose per-message delivery skips the task
    machinery unless the delivery has to wait (see :func:`wait_first_fast`)."""

    async def wait_first(self, *coros: Any, timeout: Any = None) -> WaitResults:
        if timeout is not None or self._stopped.is_set() or self._crashed.is_set():
            return await super().wait_first(*coros, timeout=timeout)
        return await wait_first_fast(super().wait_first, *coros)


class RawSchema(faust.Schema):
    """Message key and value as the bytes they arrived as."""

    def loads_key(
        self, app: Any, message: Any, *, loads: Any = None, serializer: Any = None
    ) -> Any:
        return message.key

    def loads_value(
        self, app: Any, message: Any, *, loads: Any = None, serializer: Any = None
    ) -> Any:
        return message.value


class QuietMonitor(Monitor):
    """Faust's monitor without its per-message bookkeeping."""

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        pass

    def on_stream_event_in(self, tp: Any, offset: int, stream: Any, event: Any) -> None:
        return None

    def on_stream_event_out(
        self, tp: Any, offset: int, stream: Any, event: Any, state: Any = None
    ) -> None:
        pass

    def on_message_out(self, tp: Any, offset: int, message: Any) -> None:
        pass


def kafka_producer(app: faust.App) -> Any:
    """The started ``AIOKafkaProducer`` under ``app``'s Faust producer: the one Faust
    flushes before every offset commit."""
    return app.producer._ensure_producer()  # type: ignore[attr-defined]


def changelog_key_encoder(table: Any) -> Callable[[Any], bytes]:
    """The bytes Faust itself writes as ``table``'s changelog key for a key (JSON for
    a str key by default): recovery decodes them, and compaction keeps one record per
    distinct key bytes, so both writers must agree."""
    prepare_key = table.changelog_topic.prepare_key

    def encode(key: Any) -> bytes:
        return bytes(prepare_key(key, None)[0])

    return encode


async def write_changelog(
    producer: Any, topic: str, partition: int, entries: Iterable[tuple[bytes, bytes]]
) -> list[asyncio.Future[Any]]:
    """Queue ``entries`` (key, value) for one partition of ``topic`` as record batches
    on ``producer`` (an ``AIOKafkaProducer``), in order; each future resolves once the
    broker has its batch."""
    futures: list[asyncio.Future[Any]] = []
    batch = producer.create_batch()
    for key, value in entries:
        if batch.append(key=key, value=value, timestamp=None) is None:
            futures.append(await producer.send_batch(batch, topic, partition=partition))
            batch = producer.create_batch()
            # an empty batch takes any one record, however large
            batch.append(key=key, value=value, timestamp=None)
    if batch.record_count():
        futures.append(await producer.send_batch(batch, topic, partition=partition))
    return futures
