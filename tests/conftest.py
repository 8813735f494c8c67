"""One real Kafka broker for the whole test session.

It runs in a temporary home on free ports, so it never touches a developer's own
broker. ``TOKENBUDGET_TEST_BOOTSTRAP=HOST:PORT`` reuses a broker already running.
Each test gets its own topic namespace, so tests never see each other's events, and
may ask for ``sim``, a fast simulator of its own.
Also the work units ``make test``'s pytest-xdist workers take, and their order (the
longest first, as ``tests/durations.json`` recorded them).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import durations
from tokenbudget.dev.jobs import Simulator, start_simulator
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings


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
    defaults = BrokerSettings.from_env()
    settings = BrokerSettings(
        home=Path(tmp_path_factory.mktemp("kafka")),
        port=_free_port(),
        controller_port=_free_port(),
        kafka_version=defaults.kafka_version,
        jars_root=defaults.jars_root,
        quick_start=True,
    )
    bootstrap = broker.up(settings, [])
    try:
        yield bootstrap
    finally:
        broker.down(settings)


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Simulator]:
    """A simulator for this test alone, fast enough (50,000 tokens/s) that its
    answers never set the test's pace; stopped after the test."""
    server = start_simulator(tmp_path, "--tokens-per-second", "50000")
    try:
        yield server
    finally:
        server.stop()


# Modules whose tests share a costly module fixture (a three-node cluster, a secured
# broker, Prometheus with Alertmanager, simulators of every wire format): one worker
# runs all of a module's tests, one after the other, so the fixture starts once.
ONE_WORKER = ("test_acls", "test_backends", "test_cluster", "test_observability", "test_security")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The work units ``make test``'s workers take, in collection order: a module of
    ONE_WORKER whole, every other test alone. (xdist's own ``--dist loadgroup`` groups
    by a suffix it writes into node ids, which pytest 9.2 no longer honours:
    pytest-dev/pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).stem in ONE_WORKER else nodeid

    config.option.loadscopereorder = False  # keep the order of tests/durations.json
    return Units(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for the session broker is an integration test, marked or not,
    so ``make test-fast`` (``-m "not integration"``) never waits for a JVM. Integration
    tests run first, the longest work units first, as ``tests/durations.json``
    recorded them (:func:`tests.durations.order`): ``make test``'s workers take them
    in this order, so the long ones start first and the short ones fill in around
    them instead of one long one starting last and running alone."""
    for item in items:
        if "kafka_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
    tests = [
        durations.Collected(i.nodeid, i.get_closest_marker("integration") is not None)
        for i in items
    ]
    rank = {
        nodeid: n
        for n, nodeid in enumerate(durations.order(tests, durations.Durations.read(), ONE_WORKER))
    }
    items.sort(key=lambda item: rank[item.nodeid])
