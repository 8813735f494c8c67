"""How every Kafka client of ours connects: options for aiokafka and kafka-python,
with the TLS/SASL settings registered for the address (:mod:`tokenbudget.core.security`),
and the producer settings fit for a cluster. Also :class:`GroupLag`, how far a
consumer group is behind.

Where the broker is (``[kafka] bootstrap``, ``"local"`` for the project's own) is
the application's business (:mod:`tokenbudget.app.bootstrap`); creating topics is
:mod:`tokenbudget.core.kafka_admin`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypedDict, Unpack

from aiokafka import AIOKafkaConsumer
from aiokafka import TopicPartition as AIOTopicPartition
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from tokenbudget.core import security, sizes
from tokenbudget.core.errors import BrokerError
from tokenbudget.core.retry import retry_until, retry_until_async

log = logging.getLogger(__name__)


def client_options(bootstrap: str) -> dict[str, Any]:
    """Every client's connection: the address and the security registered for it
    (aiokafka and kafka-python take the same keywords)."""
    return {
        "bootstrap_servers": bootstrap,
        "client_id": "tokenbudget",
        **security.client_options(bootstrap),
    }


# kafka-python backs off an address that refused it exponentially, up to 30 s by
# default, and at bootstrap draws one listed address at random and waits out that
# address's backoff. With a listed node down, a bootstrap could draw the dead
# addresses until their backoff outgrew its timeout: with 3 dead addresses listed and
# a 10 s timeout, bench/bootstrap.py saw 3 of 300 bootstraps fail at the default and
# none of 300 at a 1 s cap. Java's client caps the backoff at 1 s; ours do too.
# aiokafka tries the addresses in turn and has no such key.
_KAFKA_PYTHON_BACKOFF = {"reconnect_backoff_max_ms": 1000}


def kafka_python_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` (:func:`client_options`, :func:`consumer_options`) made fit for a
    kafka-python client: every one of ours is built through this."""
    return {**options, **_KAFKA_PYTHON_BACKOFF}


def consumer_options(bootstrap: str) -> dict[str, Any]:
    """Every consumer's connection and fetch sizes (:mod:`tokenbudget.core.sizes`)."""
    return {**client_options(bootstrap), **sizes.fetch_options()}


# Producers fit for a cluster: a write counts once every in-sync replica has it
# (acks=all), a send retried after a lost connection or a leader election is written
# once (idempotence), and retries go on for as long as the delivery timeout, well past
# the seconds a leader election takes, instead of surfacing as an error. Records up
# to the topics' message size, batches compressed as ``[kafka] compression`` says.
DELIVERY_TIMEOUT_MS = 120_000


def aiokafka_producer_options(bootstrap: str, compression: sizes.Compression) -> dict[str, Any]:
    """aiokafka retries a batch until ``request_timeout_ms`` has passed since it was
    queued: that is its delivery timeout."""
    return {
        **client_options(bootstrap),
        **sizes.producer_options(compression),
        "acks": "all",
        "enable_idempotence": True,
        "request_timeout_ms": DELIVERY_TIMEOUT_MS,
        "retry_backoff_ms": 250,
    }


def kafka_python_producer_options(bootstrap: str, compression: sizes.Compression) -> dict[str, Any]:
    return {
        **kafka_python_options(client_options(bootstrap)),
        **sizes.producer_options(compression),
        "acks": "all",
        "enable_idempotence": True,
        "delivery_timeout_ms": DELIVERY_TIMEOUT_MS,
        "retry_backoff_ms": 250,
    }


class GroupLag:
    """Measures how far consumer groups are behind the end of topics.

    ``run`` uses it to know the pipeline is drained: every prompt has an outcome
    (the dispatchers' group reached the end of the prompts topic), the ledger and
    the sink have read every completion. It works across processes and hosts.
    """

    def __init__(self, bootstrap: str) -> None:
        self._admin = KafkaAdminClient(**kafka_python_options(client_options(bootstrap)))
        self._consumer = KafkaConsumer(
            **kafka_python_options(client_options(bootstrap)), group_id=None
        )

    def lag(self, group: str, topics: list[str]) -> int:
        partitions = [
            TopicPartition(topic, p)
            for topic in topics
            for p in sorted(self._consumer.partitions_for_topic(topic) or ())
        ]
        ends = self._consumer.end_offsets(partitions)
        committed = self._admin.list_group_offsets({group: partitions}).get(group, {})
        total = 0
        for tp in partitions:
            meta = committed.get(tp)
            position = meta.offset if meta is not None and meta.offset >= 0 else 0
            total += max(0, ends[tp] - position)
        return total

    def members(self, group: str) -> int:
        """How many consumers are in the group and past rebalancing."""
        described = self._admin.describe_groups([group]).get(group, {})
        if described.get("group_state") != "Stable":
            return 0
        return len(described.get("members") or [])

    def close(self) -> None:
        self._admin.close()
        self._consumer.close()


# ----------------------------------------------------------------- waiting for a topic
#
# Every topic is created before any worker starts, so a consumer that sees no
# partitions for one has not got its metadata yet (a busy broker, a topic made a
# moment ago): it asks again until ``timeout``. Then the topic is taken to be missing,
# with the caller's ``missing`` message (what that means for the caller).


class PartitionWait(TypedDict, total=False):
    """How a wait for a topic's partitions asks (every key optional)."""

    interval: float  # seconds between looks (default 0.2)
    missing: str  # the error when it has none (default: "topic ... does not exist")


def _sorted_or_missing(topic: str, found: set[int] | None, wait: PartitionWait) -> list[int]:
    if not found:
        raise BrokerError(wait.get("missing") or f"topic {topic} does not exist")
    return sorted(found)


def wait_for_partitions(
    consumer: KafkaConsumer, topic: str, *, timeout: float, **wait: Unpack[PartitionWait]
) -> list[TopicPartition]:
    """The partitions of ``topic``, sorted, once the kafka-python ``consumer`` has
    metadata for it; it asks every ``interval`` seconds. Raises
    :class:`BrokerError` (``missing``, by default "topic ... does not exist") if it
    has none after ``timeout`` seconds. Blocking."""

    def partitions() -> list[TopicPartition]:
        found = _sorted_or_missing(topic, consumer.partitions_for_topic(topic), wait)
        return [TopicPartition(topic, p) for p in found]

    interval = wait.get("interval", 0.2)
    return retry_until(partitions, timeout=timeout, retry_on=BrokerError, interval=interval)


async def wait_for_partitions_aio(
    consumer: AIOKafkaConsumer, topic: str, *, timeout: float, **wait: Unpack[PartitionWait]
) -> list[AIOTopicPartition]:
    """:func:`wait_for_partitions` for a started aiokafka ``AIOKafkaConsumer``: the
    same contract, without blocking the event loop."""

    async def partitions() -> list[AIOTopicPartition]:
        # aiokafka refreshes the metadata of topics it is not subscribed to only
        # every few minutes (metadata_max_age_ms): ask for it now.
        await consumer._client.force_metadata_update()
        found = _sorted_or_missing(topic, consumer.partitions_for_topic(topic), wait)
        return [AIOTopicPartition(topic, p) for p in found]

    return await retry_until_async(
        partitions, timeout=timeout, retry_on=BrokerError, interval=wait.get("interval", 0.2)
    )


# ----------------------------------------------------------------- reading a topic
#
# Small topics (budgets, outcomes, a changelog, the prompts still queued) are read
# from blocking code, from a position to the end offsets as of the start, with
# kafka-python; bulk reads in async code (``tokenbudget replay``) use aiokafka.


def read_to_ends(
    consumer: KafkaConsumer,
    handle: Callable[[Any], None],
    *,
    timeout: float,
    started: float | None = None,
    max_records: int = 5000,
) -> None:
    """Hand ``handle`` each record (a kafka-python ``ConsumerRecord``, in offset
    order within a partition) of the partitions assigned to ``consumer``, from its
    positions up to their end offsets as of this call. Raises :class:`BrokerError`
    if the ends are not reached ``timeout`` seconds after ``started`` (a
    ``time.monotonic()`` reading; default: now). Blocking."""
    deadline = (time.monotonic() if started is None else started) + timeout
    tps = list(consumer.assignment())
    ends = consumer.end_offsets(tps)
    while any(consumer.position(tp) < ends[tp] for tp in tps):
        if time.monotonic() > deadline:
            topics = ", ".join(sorted({tp.topic for tp in tps}))
            raise BrokerError(f"reading {topics} to its end took longer than {timeout:.0f} s")
        for records in consumer.poll(timeout_ms=500, max_records=max_records).values():
            for record in records:
                handle(record)


def read_topic(
    bootstrap: str,
    topic: str,
    handle: Callable[[Any], None],
    *,
    timeout: float = 60.0,
    metadata_timeout: float = 15.0,
    missing: str = "",
    max_records: int = 5000,
    extra_options: Mapping[str, Any] | None = None,
) -> None:
    """Hand ``handle`` every record of ``topic`` from the beginning to its end
    offsets as of the call (see :func:`read_to_ends`), with a consumer of no group
    (``extra_options`` added to its settings, e.g. a receive buffer). Raises
    :class:`BrokerError` if the topic has no partitions within ``metadata_timeout``
    seconds (``missing``, as in :func:`wait_for_partitions`) or is not read within
    ``timeout`` seconds of the call. Blocking: run it in a thread from async code."""
    started = time.monotonic()
    consumer = KafkaConsumer(
        **kafka_python_options({**consumer_options(bootstrap), **(extra_options or {})}),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    try:
        tps = wait_for_partitions(consumer, topic, timeout=metadata_timeout, missing=missing)
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        read_to_ends(consumer, handle, timeout=timeout, started=started, max_records=max_records)
    finally:
        consumer.close(autocommit=False)
