"""How every client reaches the cluster: bootstrap lists and producers fit for one."""

from __future__ import annotations

import ast
import asyncio
import socket
import uuid
from pathlib import Path

import aiokafka.codec
import kafka.codec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from faust.transport.drivers.aiokafka import server_list
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from tokenbudget.core import kafka_admin, sizes
from tokenbudget.core.kafka import (
    GroupLag,
    aiokafka_producer_options,
    client_options,
    consumer_options,
    kafka_python_options,
    kafka_python_producer_options,
)
from tokenbudget.streams.ledger_worker import LedgerSettings, build_app
from tokenbudget.streams.topics import Topics, TopicSpec


def _dead_address() -> str:
    """An address where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_every_producer_is_idempotent_and_waits_for_every_in_sync_replica() -> None:
    for options in (
        aiokafka_producer_options("h1:9092", "zstd"),
        kafka_python_producer_options("h1:9092", "zstd"),
    ):
        assert options["acks"] == "all"
        assert options["enable_idempotence"] is True
    # a leader election takes seconds: retries must go on far longer than that
    assert aiokafka_producer_options("h1:9092", "zstd")["request_timeout_ms"] >= 60_000
    assert kafka_python_producer_options("h1:9092", "zstd")["delivery_timeout_ms"] >= 60_000


ROOT = Path(__file__).resolve().parents[3]
KAFKA_PYTHON_CLIENTS = {"KafkaConsumer", "KafkaProducer", "KafkaAdminClient", "_Admin"}
CAPPED = {"kafka_python_options", "kafka_python_producer_options"}


def _kafka_python_clients_built() -> list[tuple[str, int, str | None]]:
    """Each kafka-python client the product builds (file, line) and the function its
    ``**options`` come from."""
    found = []
    files = {
        p.resolve()
        for d in ("tokenbudget", "streams", "producers", "sinks")
        for p in (ROOT / d).rglob("*.py")
    }
    for path in sorted(files):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in KAFKA_PYTHON_CLIENTS:
                continue
            spread = [k.value for k in node.keywords if k.arg is None]
            source = None
            if spread and isinstance(spread[0], ast.Call) and isinstance(spread[0].func, ast.Name):
                source = spread[0].func.id
            found.append((str(path.relative_to(ROOT)), node.lineno, source))
    return found


def test_every_kafka_python_client_caps_its_reconnect_backoff_at_javas_second() -> None:
    """kafka-python's default backoff grows to 30 s, and its bootstrap waits out the
    backoff of whichever listed address it drew: with a cluster's node down, a
    bootstrap through a list that names it could time out (bench/bootstrap.py: 3
    of 300 with 3 dead addresses and a 10 s timeout, none of 300 with the cap)."""
    assert kafka_python_options(client_options("h1:9092"))["reconnect_backoff_max_ms"] == 1000
    producer = kafka_python_producer_options("h1:9092", "zstd")
    assert producer["reconnect_backoff_max_ms"] == 1000
    built = _kafka_python_clients_built()
    assert len(built) >= 8  # GroupLag, read_topic, the admin, identity, resume, the sink
    assert [b for b in built if b[2] not in CAPPED] == []


@pytest.mark.parametrize("build", [aiokafka_producer_options, kafka_python_producer_options])
def test_every_producer_sends_what_the_topics_accept_compressed_as_configured(build) -> None:
    for compression, codec in (("zstd", "zstd"), ("lz4", "lz4"), ("gzip", "gzip"), ("none", None)):
        options = build("h1:9092", compression)
        assert options["compression_type"] == codec
        # the client library's own default (1 MiB) refused a 1.5 MB prompt
        assert options["max_request_size"] == sizes.MESSAGE_BYTES


def test_both_client_libraries_have_every_codec() -> None:
    """Consumers decompress whatever any producer wrote, and aiokafka refuses to build
    a producer whose codec library is missing."""
    assert kafka.codec.has_zstd() and kafka.codec.has_lz4() and kafka.codec.has_gzip()
    assert aiokafka.codec.has_zstd() and aiokafka.codec.has_lz4() and aiokafka.codec.has_gzip()


def test_every_consumer_fetches_a_whole_message_per_partition() -> None:
    options = consumer_options("h1:9092")
    assert options["max_partition_fetch_bytes"] >= sizes.MESSAGE_BYTES
    assert options["fetch_max_bytes"] >= options["max_partition_fetch_bytes"]
    assert options["bootstrap_servers"] == "h1:9092"


def test_the_ledger_producer_compresses_and_sends_what_the_topics_accept() -> None:
    for compression, codec in (("lz4", "lz4"), ("none", None)):
        app = build_app(LedgerSettings("h1:9092", Topics("unit"), compression=compression))
        producer = app.transport.create_producer()
        settings = {**producer._settings_default(), **producer._settings_extra()}
        assert settings["compression_type"] == codec
        assert settings["max_request_size"] == sizes.MESSAGE_BYTES
        assert app.conf.consumer_max_fetch_size >= sizes.MESSAGE_BYTES


def test_the_ledger_app_is_given_every_address_in_faust_url_form() -> None:
    app = build_app(LedgerSettings("h1:9092,h2:9093,[::1]:9094", Topics("unit")))
    assert [str(url) for url in app.conf.broker] == [
        "kafka://h1:9092",
        "kafka://h2:9093",
        "kafka://[::1]:9094",
    ]
    assert server_list(app.transport.url, 9092) == ["h1:9092", "h2:9093", "[::1]:9094"]


def test_the_ledger_producer_is_idempotent_with_acks_all() -> None:
    app = build_app(LedgerSettings("h1:9092", Topics("unit")))
    producer = app.transport.create_producer()
    settings = {**producer._settings_default(), **producer._settings_extra()}
    assert settings["enable_idempotence"] is True
    assert settings["acks"] in ("all", -1)


@pytest.mark.integration
def test_kafka_python_and_aiokafka_clients_reach_the_cluster_through_any_address(
    kafka_bootstrap: str,
) -> None:
    """Two dead addresses before the live one: each client must try them all."""
    listed = f"{_dead_address()},{_dead_address()},{kafka_bootstrap}"
    topic = f"t{uuid.uuid4().hex[:10]}.listed"
    kafka_admin.ensure_topics(listed, [TopicSpec(topic, partitions=1)])

    producer = KafkaProducer(**kafka_python_producer_options(listed, "lz4"))
    producer.send(topic, b"from kafka-python").get(timeout=30)
    producer.close()

    async def aiokafka_round_trip() -> list[bytes]:
        sender = AIOKafkaProducer(**aiokafka_producer_options(listed, "zstd"))
        await sender.start()
        try:
            await sender.send_and_wait(topic, b"from aiokafka")
        finally:
            await sender.stop()
        reader = AIOKafkaConsumer(topic, **client_options(listed), auto_offset_reset="earliest")
        await reader.start()
        try:
            batch = await reader.getmany(timeout_ms=10_000, max_records=10)
            return [record.value for records in batch.values() for record in records]
        finally:
            await reader.stop()

    values = asyncio.run(aiokafka_round_trip())
    assert values == [b"from kafka-python", b"from aiokafka"]

    consumer = KafkaConsumer(**kafka_python_options(client_options(listed)))
    ends = consumer.end_offsets([TopicPartition(topic, 0)])
    consumer.close()
    assert ends == {TopicPartition(topic, 0): 2}
    lag = GroupLag(listed)
    try:
        assert lag.lag("nobody", [topic]) == 2
    finally:
        lag.close()


@pytest.mark.integration
def test_existing_topics_with_fewer_replicas_than_asked_are_refused_with_the_fix(
    kafka_bootstrap: str,
) -> None:
    """Not silently used: the error names the topic and the command that raises its
    replication, with the plan written where the command reads it."""
    import json
    import re
    from pathlib import Path

    from tokenbudget.core.errors import BrokerError

    name = f"t{uuid.uuid4().hex[:10]}.completions"
    kafka_admin.ensure_topics(kafka_bootstrap, [TopicSpec(name, partitions=2)])  # the broker's 1
    with pytest.raises(BrokerError) as info:
        kafka_admin.ensure_topics(
            kafka_bootstrap, [TopicSpec(name, partitions=2, replication_factor=2)]
        )
    message = str(info.value)
    assert f"{name} (1 < 2)" in message
    assert "kafka-reassign-partitions.sh --bootstrap-server" in message
    match = re.search(r"--reassignment-json-file (\S+) --execute", message)
    assert match is not None, message
    plan = json.loads(Path(match.group(1)).read_text())
    assert {(p["topic"], p["partition"]) for p in plan["partitions"]} == {(name, 0), (name, 1)}
