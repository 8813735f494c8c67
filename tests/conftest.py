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
from typing import Any

import pytest

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
    )
    bootstrap = broker.up(settings, [])
    try:
        yield bootstrap
    finally:
        broker.down(settings)


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


# The modules whose tests take longest, longest first: ``make test`` runs the tests
# on several workers (pytest-xdist), which take them in collection order, so these
# start first and the short ones fill in around them instead of one of these
# starting last and running alone.
LONGEST_FIRST = (
    "test_wheel",
    "test_cluster",
    "test_faults",
    "test_chaos",
    "test_fleet",
    "test_unattended",
    "test_plan",
    "test_job_identity",
    "test_backends",
    "test_observability",
    "test_reservations",
    "test_sizes",
    "test_replay",
)

# Modules whose tests share a costly module fixture (a three-node cluster, a secured
# broker, Prometheus with Alertmanager, simulators of every wire format): one worker
# runs all of a module's tests, one after the other, so the fixture starts once.
ONE_WORKER = ("test_acls", "test_backends", "test_cluster", "test_observability", "test_security")


def _order(item: pytest.Item) -> tuple[int, int]:
    module = item.path.stem
    rank = LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)
    return (0 if item.get_closest_marker("integration") else 1, rank)


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

    config.option.loadscopereorder = False  # keep LONGEST_FIRST's order
    return Units(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for the session broker is an integration test, marked or not,
    so ``make test-fast`` (``-m "not integration"``) never waits for a JVM. Integration
    tests run first, the longest modules first (see LONGEST_FIRST); the sort is
    stable, so a module's tests keep their order."""
    for item in items:
        if "kafka_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
    items.sort(key=_order)
