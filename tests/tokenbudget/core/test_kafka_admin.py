"""Topic sizes on any cluster: existing topics raised to the message size every
producer of ours sends, and a cluster that refuses it named with the fix; readiness;
topics a user may not create named with the role that may."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from tokenbudget.core import kafka_admin, sizes
from tokenbudget.core.errors import BrokerError, KafkaAuthError, KafkaLimitsError
from tokenbudget.core.kafka import aiokafka_producer_options, consumer_options
from tokenbudget.core.kafka_admin import TopicSpec
from tokenbudget.streams.topics import Topics

KAFKA_DEFAULT = 1048588  # a topic's max.message.bytes on a cluster of Kafka's defaults


class RefusingAdmin:
    """An admin client of a cluster whose topics allow Kafka's default and whose
    AlterConfigs is refused (a user without the right, or a managed plan's cap)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.altered: list[Any] = []

    def describe_configs(self, resources: list[Any], config_filter: str) -> dict[str, Any]:
        return {
            "topic": {
                r.name: {"max.message.bytes": {"value": str(KAFKA_DEFAULT)}} for r in resources
            }
        }

    def alter_configs(self, resources: list[Any], **_: Any) -> dict[str, Any]:
        self.altered += resources
        return {"topic": {r.name: "TopicAuthorizationFailedError: denied" for r in resources}}


def test_a_refused_raise_names_the_topics_the_setting_and_the_fix() -> None:
    specs = Topics("old").specs()
    admin = RefusingAdmin([s.name for s in specs])
    with pytest.raises(KafkaLimitsError) as info:
        kafka_admin._raise_message_limits(admin, "k1:9092", specs)
    message = str(info.value)
    assert "old.prompts (1,048,588 bytes" in message
    assert f"max.message.bytes to {sizes.MESSAGE_BYTES}" in message
    assert "kafka-configs.sh --bootstrap-server k1:9092 --alter --entity-type topics" in message
    assert f"--add-config max.message.bytes={sizes.MESSAGE_BYTES}" in message
    assert "\n" not in message
    # it asked for exactly the one setting, incrementally (their other settings stay)
    assert {r.name for r in admin.altered} == {s.name for s in specs}
    assert all(list(r.configs) == ["max.message.bytes"] for r in admin.altered)


def test_brokers_that_refuse_requests_of_a_message_are_named_with_the_fix() -> None:
    with pytest.raises(KafkaLimitsError, match=r"socket\.request\.max\.bytes = 1,048,576"):
        kafka_admin._check_request_limit("k1:9092", {"socket.request.max.bytes": 1048576})
    kafka_admin._check_request_limit("k1:9092", {"socket.request.max.bytes": 104857600})
    kafka_admin._check_request_limit("k1:9092", None)  # not readable: not checked


@pytest.mark.integration
def test_an_older_namespace_is_raised_to_the_message_size_and_then_takes_a_large_prompt(
    kafka_bootstrap: str,
) -> None:
    """A namespace made before its topics set max.message.bytes, on a cluster of
    Kafka's defaults: its prompts topic refused a 1.5 MB prompt."""
    topics = Topics(f"t{uuid.uuid4().hex[:10]}")
    older = [
        TopicSpec(s.name, s.partitions, {**s.configs, "max.message.bytes": str(KAFKA_DEFAULT)})
        for s in topics.specs()
    ]
    kafka_admin.ensure_topics(kafka_bootstrap, older)
    names = [s.name for s in older]
    admin = kafka_admin.admin_client(kafka_bootstrap)
    try:
        assert set(kafka_admin.message_limits(admin, names).values()) == {KAFKA_DEFAULT}
        kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
        assert set(kafka_admin.message_limits(admin, names).values()) == {sizes.MESSAGE_BYTES}
    finally:
        admin.close()

    big = b"p" * 1_500_000

    async def round_trip() -> bytes:
        producer = AIOKafkaProducer(**aiokafka_producer_options(kafka_bootstrap, "zstd"))
        await producer.start()
        try:
            await producer.send_and_wait(topics.prompts, big, partition=0)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(
            topics.prompts, **consumer_options(kafka_bootstrap), auto_offset_reset="earliest"
        )
        await consumer.start()
        try:
            record = await asyncio.wait_for(consumer.getone(), 60)
        finally:
            await consumer.stop()
        return bytes(record.value)

    assert asyncio.run(round_trip()) == big


# -- ready: a metadata request that lists the brokers (an open port is not) ---------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nothing_listening_is_not_ready() -> None:
    with pytest.raises(BrokerError, match=r"cannot reach Kafka at 127\.0\.0\.1"):
        kafka_admin.check_ready(f"127.0.0.1:{_free_port()}", 1.0)


def test_a_port_that_accepts_but_never_answers_is_not_ready() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        bootstrap = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(BrokerError, match=f"cannot reach Kafka at {re.escape(bootstrap)}"):
            kafka_admin.check_ready(bootstrap, 1.0)


def test_wait_ready_asks_again_until_its_timeout_then_says_why() -> None:
    started = time.monotonic()
    with pytest.raises(BrokerError, match="cannot reach Kafka"):
        kafka_admin.wait_ready(f"127.0.0.1:{_free_port()}", 1.5, interval=0.2)
    assert 1.5 <= time.monotonic() - started < 30


def test_a_broker_that_answers_is_ready_and_counts_as_one(kafka_bootstrap: str) -> None:
    kafka_admin.check_ready(kafka_bootstrap, 10)
    kafka_admin.wait_ready(kafka_bootstrap, 10)
    with pytest.raises(BrokerError, match="lists 1 of 2 brokers"):
        kafka_admin.check_ready(kafka_bootstrap, 10, brokers=2)


def test_topics_the_user_may_not_create_are_named_with_the_role_that_may(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Denying:
        def create_topics(self, topics: dict[str, Any], **_: Any) -> dict[str, Any]:
            return {
                "topics": [
                    {"name": name, "error_code": 29, "error_message": "Authorization failed."}
                    for name in topics
                ]
            }

    specs = [TopicSpec("N.prompts"), TopicSpec("N.control")]
    with pytest.raises(KafkaAuthError) as info:
        kafka_admin._create_topics(Denying(), "k:9092", specs, None, 1000)
    message = str(info.value)
    assert "does not let this client create topics N.control, N.prompts" in message
    assert "(TopicAuthorizationFailed): create them as the operator role" in message
    assert "tokenbudget acls --config F" in message and "error 29" not in message
