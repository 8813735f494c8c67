"""One real Kafka broker for the whole test session.

It runs in a temporary home on free ports, so it never touches a developer's own
broker. ``TOKENBUDGET_TEST_BOOTSTRAP=HOST:PORT`` reuses a broker already running.
Each test gets its own topic namespace, so tests never see each other's events.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenbudget.localkafka import broker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    existing = os.environ.get("TOKENBUDGET_TEST_BOOTSTRAP")
    if existing:
        yield existing
        return
    defaults = broker.BrokerSettings.from_env()
    settings = broker.BrokerSettings(
        home=Path(tmp_path_factory.mktemp("kafka")),
        port=_free_port(),
        controller_port=_free_port(),
        kafka_version=defaults.kafka_version,
        jars_root=defaults.jars_root,
    )
    bootstrap = broker.up(settings, [])
    try:
        yield bootstrap
    finally:
        broker.down(settings)


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for the session broker is an integration test, marked or not,
    so ``make test-fast`` (``-m "not integration"``) never waits for a JVM."""
    for item in items:
        if "kafka_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
