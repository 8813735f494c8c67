"""How every Kafka client of ours connects: options for aiokafka and kafka-python,
with the TLS/SASL settings registered for the address (:mod:`tokenbudget.security`),
and the producer settings fit for a cluster. Also :class:`GroupLag`, how far a
consumer group is behind.

Where the broker is (``[kafka] bootstrap``, ``"local"`` for the project's own) is
the application's business (:mod:`tokenbudget.app.bootstrap`); creating topics is
:mod:`tokenbudget.kafka_admin`'s.
"""

from __future__ import annotations

import logging
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from tokenbudget import security

log = logging.getLogger(__name__)


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
        self._admin = KafkaAdminClient(**kafka_python_options(bootstrap))
        self._consumer = KafkaConsumer(**kafka_python_options(bootstrap), group_id=None)

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
