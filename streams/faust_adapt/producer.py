"""The ledger's Faust producer, idempotent, and its table changelog writes as record
batches.

* :class:`LedgerProducer`: a send retried across a leader election or a lost
  connection is written once, not twice. Faust turns idempotence on only inside
  transactions (``_settings_extra``); its ``acks`` setting stays -1.
* :func:`write_changelog`. ``Table.send_changelog`` builds a Faust message, a
  pending-message record and a future per key. The ledger writes its table changes
  once per batch, so they go to the changelog as record batches per partition
  through the aiokafka producer under Faust's (:func:`kafka_producer`). Faust flushes
  that producer before it commits source offsets, so a commit still never covers a
  change that is not written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import faust
from faust.transport.drivers.aiokafka import Producer as AIOKafkaProducer


class LedgerProducer(AIOKafkaProducer):
    """Faust's producer, idempotent, acks from every in-sync replica."""

    def _settings_extra(self) -> Mapping[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}


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
