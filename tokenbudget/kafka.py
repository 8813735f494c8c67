"""Where the broker is and how clients connect: the one place that knows.

``[kafka] bootstrap = "local"`` means the project's own broker (see
:mod:`tokenbudget.broker`), started on demand; anything else is ``HOST:PORT`` of an
existing cluster. Either way every topic is created before a worker starts.

Every client is built with :func:`aiokafka_options` or :func:`kafka_python_options`
(the Faust app with :func:`tokenbudget.security.faust_credentials`), which add the
TLS/SASL settings :func:`resolve_bootstrap` registered for the address.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka import TopicPartition as AIOTopicPartition
from kafka import KafkaConsumer, TopicPartition

from streams.topics import Topics, TopicSpec
from tokenbudget import broker, security
from tokenbudget.config import Config
from tokenbudget.errors import BrokerError

log = logging.getLogger(__name__)

# How long a command waits at start for an existing cluster that does not answer.
STARTUP_WAIT_S = 60.0


def wait_reachable(bootstrap: str, timeout: float = STARTUP_WAIT_S) -> None:
    """Return once Kafka at ``bootstrap`` answers a metadata request; raise
    :class:`BrokerError` if it has not within ``timeout`` seconds."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    deadline = time.monotonic() + timeout
    while True:
        try:
            KafkaAdminClient(**kafka_python_options(bootstrap)).close()
            return
        except KafkaError as exc:
            if time.monotonic() > deadline:
                raise BrokerError(f"cannot reach Kafka at {bootstrap}: {exc!r}") from exc
            log.warning("Kafka at %s does not answer (%r); trying again", bootstrap, exc)
            time.sleep(2.0)


def local_broker_settings(config: Config) -> broker.BrokerSettings:
    settings = broker.BrokerSettings.from_env()
    env_port_set = settings.port != broker.BrokerSettings.__dataclass_fields__["port"].default
    if env_port_set:
        return settings
    return dataclasses.replace(
        settings,
        port=config.kafka.local_port,
        controller_port=config.kafka.local_controller_port,
    )


def topic_specs(config: Config) -> list[TopicSpec]:
    """The namespace's topics, with the configured partitions, replication and
    retentions."""
    return Topics(config.kafka.namespace, config.kafka.partitions).specs(
        prompt_retention_ms=config.kafka.prompt_retention_ms,
        completion_retention_ms=config.kafka.completion_retention_ms,
        budget_retention_ms=config.kafka.budget_retention_ms,
        replication_factor=config.kafka.replication_factor,
        min_insync_replicas=config.kafka.min_insync_replicas,
    )


@dataclasses.dataclass(frozen=True)
class TopicLayout:
    partitions: int
    replication_factor: int  # the fewest replicas of any partition


def topic_layout(bootstrap: str, topic: str) -> TopicLayout | None:
    """How ``topic`` is laid out on the cluster; None if it does not exist."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(**kafka_python_options(bootstrap))
    try:
        described = admin.describe_topics([topic])
    finally:
        admin.close()
    for found in described:
        parts = found.get("partitions") or []
        if found.get("error_code", 0) == 0 and parts:
            replicas = min(len(p["replica_nodes"]) for p in parts)
            return TopicLayout(len(parts), replicas)
    return None


def resolve_bootstrap(config: Config, *, create_topics: bool = True) -> str:
    """Return HOST:PORT, starting the local broker if configured, with topics made.

    For an existing cluster this also registers ``[kafka]``'s security for the address
    and connects once, so wrong credentials fail here, as
    :class:`~tokenbudget.errors.KafkaAuthError`, before any worker starts.
    """
    specs = topic_specs(config) if create_topics else []
    if config.kafka.bootstrap == "local":
        return broker.up(local_broker_settings(config), specs)
    security.register(config.kafka.bootstrap, security.KafkaSecurity.from_config(config))
    # A broker restarting as a job (re)starts is waited out; wrong credentials are not.
    deadline = time.monotonic() + STARTUP_WAIT_S
    while True:
        try:
            security.check_credentials(config.kafka.bootstrap)
            if create_topics:
                broker.ensure_topics(config.kafka.bootstrap, specs)
            return config.kafka.bootstrap
        except BrokerError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("%s; trying again for up to %.0f s", exc, STARTUP_WAIT_S)
            time.sleep(2.0)


async def publish_events(bootstrap: str, topic: str, events: Sequence[Any]) -> None:
    """Send events keyed by their dataset and wait until Kafka has them all."""
    from aiokafka import AIOKafkaProducer

    from streams import events as ev

    producer = AIOKafkaProducer(**aiokafka_producer_options(bootstrap))
    await producer.start()
    try:
        for event in events:
            await producer.send_and_wait(topic, key=ev.event_key(event), value=ev.encode(event))
    finally:
        await producer.stop()


def aiokafka_options(bootstrap: str) -> dict[str, Any]:
    return {
        "bootstrap_servers": bootstrap,
        "client_id": "tokenbudget",
        **security.client_options(bootstrap),
    }


# Producers fit for a cluster: a write counts once every in-sync replica has it
# (acks=all), a send retried after a lost connection or a leader election is written
# once (idempotence), and retries go on for as long as the delivery timeout, well past
# the seconds a leader election takes, instead of surfacing as an error.
DELIVERY_TIMEOUT_MS = 120_000


def aiokafka_producer_options(bootstrap: str) -> dict[str, Any]:
    """aiokafka retries a batch until ``request_timeout_ms`` has passed since it was
    queued: that is its delivery timeout."""
    return {
        **aiokafka_options(bootstrap),
        "acks": "all",
        "enable_idempotence": True,
        "request_timeout_ms": DELIVERY_TIMEOUT_MS,
        "retry_backoff_ms": 250,
    }


def kafka_python_producer_options(bootstrap: str) -> dict[str, Any]:
    return {
        **kafka_python_options(bootstrap),
        "acks": "all",
        "enable_idempotence": True,
        "delivery_timeout_ms": DELIVERY_TIMEOUT_MS,
        "retry_backoff_ms": 250,
    }


def kafka_python_options(bootstrap: str) -> dict[str, Any]:
    return {
        "bootstrap_servers": bootstrap,
        "client_id": "tokenbudget",
        **security.client_options(bootstrap),
    }


class GroupLag:
    """Measures how far consumer groups are behind the end of topics.

    ``run`` uses it to know the pipeline is drained: every prompt has an outcome
    (the dispatchers' group reached the end of the prompts topic), the ledger and
    the sink have read every completion. It works across processes and hosts.
    """

    def __init__(self, bootstrap: str) -> None:
        from kafka import KafkaAdminClient, KafkaConsumer

        self._admin = KafkaAdminClient(**kafka_python_options(bootstrap))
        self._consumer = KafkaConsumer(**kafka_python_options(bootstrap), group_id=None)

    def lag(self, group: str, topics: list[str]) -> int:
        from kafka import TopicPartition

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


def wait_for_partitions(
    consumer: KafkaConsumer,
    topic: str,
    *,
    timeout: float,
    interval: float = 0.2,
    missing: str = "",
) -> list[TopicPartition]:
    """The partitions of ``topic``, sorted, once the kafka-python ``consumer`` has
    metadata for it; it asks every ``interval`` seconds. Raises
    :class:`BrokerError` (``missing``, by default "topic ... does not exist") if it
    has none after ``timeout`` seconds. Blocking."""
    deadline = time.monotonic() + timeout
    while True:
        found = consumer.partitions_for_topic(topic)
        if found:
            return [TopicPartition(topic, p) for p in sorted(found)]
        if time.monotonic() > deadline:
            raise BrokerError(missing or f"topic {topic} does not exist")
        time.sleep(interval)


async def wait_for_partitions_aio(
    consumer: AIOKafkaConsumer,
    topic: str,
    *,
    timeout: float,
    interval: float = 0.2,
    missing: str = "",
) -> list[AIOTopicPartition]:
    """:func:`wait_for_partitions` for a started aiokafka ``AIOKafkaConsumer``: the
    same contract, without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        # aiokafka refreshes the metadata of topics it is not subscribed to only
        # every few minutes (metadata_max_age_ms): ask for it now.
        await consumer._client.force_metadata_update()
        found = consumer.partitions_for_topic(topic)
        if found:
            return [AIOTopicPartition(topic, p) for p in sorted(found)]
        if time.monotonic() > deadline:
            raise BrokerError(missing or f"topic {topic} does not exist")
        await asyncio.sleep(interval)


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
    consumer_options: Mapping[str, Any] | None = None,
) -> None:
    """Hand ``handle`` every record of ``topic`` from the beginning to its end
    offsets as of the call (see :func:`read_to_ends`), with a consumer of no group
    (``consumer_options`` added to its settings, e.g. fetch sizes). Raises
    :class:`BrokerError` if the topic has no partitions within ``metadata_timeout``
    seconds (``missing``, as in :func:`wait_for_partitions`) or is not read within
    ``timeout`` seconds of the call. Blocking: run it in a thread from async code."""
    started = time.monotonic()
    consumer = KafkaConsumer(
        **kafka_python_options(bootstrap),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **(consumer_options or {}),
    )
    try:
        tps = wait_for_partitions(consumer, topic, timeout=metadata_timeout, missing=missing)
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        read_to_ends(consumer, handle, timeout=timeout, started=started, max_records=max_records)
    finally:
        consumer.close(autocommit=False)
