"""A namespace made before the control topic, brought up to date once.

Until roles had principals of their own, the operators' commands (budgets set, the
fleet's changes, the job's identity) travelled on the budgets topic beside the
ledger's announcements. Readers now believe them only from the control topic
(:data:`tokenbudget.streams.codec.ON_TOPIC`), so the first operator to start a job
of such a namespace (``run`` or ``produce``, before it compares the job) copies them
there, in their order, each to its partition: an empty control topic beside a
budgets topic that holds commands is such a namespace.
"""

from __future__ import annotations

import sys
from typing import Any

from kafka import KafkaProducer

from tokenbudget.core.errors import EventDecodeError
from tokenbudget.core.kafka import kafka_python_producer_options, read_topic
from tokenbudget.core.sizes import Compression
from tokenbudget.streams import codec
from tokenbudget.streams.topics import Topics

_COMMANDS = codec.ON_TOPIC["control"]


def move_commands(bootstrap: str, topics: Topics, compression: Compression) -> int:
    """Copy the operators' commands of the budgets topic to an empty control topic;
    how many were copied (0: nothing to do). Blocking."""
    commands: list[Any] = []
    read_topic(bootstrap, topics.control, commands.append)  # a few records, if any
    if commands:
        return 0
    found: list[Any] = []

    def keep(record: Any) -> None:
        try:
            event = codec.decode(record.value)
        except EventDecodeError:
            return
        if isinstance(event, _COMMANDS):
            found.append(record)

    read_topic(bootstrap, topics.budgets, keep)
    if not found:
        return 0
    producer = KafkaProducer(**kafka_python_producer_options(bootstrap, compression))
    try:
        for record in found:
            producer.send(
                topics.control, key=record.key, value=record.value, partition=record.partition
            )
        producer.flush()
    finally:
        producer.close()
    print(
        f"tokenbudget: namespace {topics.namespace}: moved {len(found)} operators' commands "
        f"(budgets set, servers added or drained, the job's identity) from {topics.budgets} "
        f"to {topics.control}, where they are read from now on",
        file=sys.stderr,
    )
    return len(found)
