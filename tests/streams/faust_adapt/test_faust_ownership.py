"""Ownership against the installed Faust and aiokafka: the heartbeat it watches is
aiokafka's real GroupCoordinator._do_heartbeat, reached the way it reaches it, and
Faust's real rebalance signals reach it."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.errors import KafkaConnectionError
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.types import TP

from tokenbudget.streams.faust_adapt import Ownership
from tokenbudget.streams.ledger_worker import LedgerSettings, build_app
from tokenbudget.streams.topics import Topics

SOURCE, CHANGELOG = "unit.completions", "unit-ledger-ledger-changelog"


def test_aiokafkas_heartbeat_loop_calls_the_method_ownership_wraps() -> None:
    assert inspect.iscoroutinefunction(GroupCoordinator._do_heartbeat)
    assert list(inspect.signature(GroupCoordinator._do_heartbeat).parameters) == ["self"]
    # Looked up on the instance at every beat, so the instance attribute wins.
    assert "await self._do_heartbeat()" in inspect.getsource(GroupCoordinator._heartbeat_routine)
    # The path Ownership takes to it: Faust's consumer thread -> aiokafka's consumer.
    assert "self._consumer = " in inspect.getsource(AIOKafkaConsumerThread)
    assert "self._coordinator = GroupCoordinator(" in inspect.getsource(AIOKafkaConsumer.start)


def _coordinator(answer: Any) -> GroupCoordinator:
    """aiokafka's coordinator, not started, whose heartbeat request gets ``answer``."""
    coordinator = object.__new__(GroupCoordinator)
    coordinator.group_id, coordinator.generation, coordinator.member_id = "unit", 3, "m-1"

    async def send_req(request: Any) -> Any:
        if isinstance(answer, Exception):
            raise answer
        return answer

    coordinator._send_req = send_req  # type: ignore[method-assign]
    return coordinator


@pytest.mark.parametrize(
    ("answer", "current"),
    [(SimpleNamespace(error_code=0), True), (KafkaConnectionError("gone"), False)],
)
def test_a_heartbeat_makes_the_worker_current_only_when_it_succeeds(
    answer: Any, current: bool
) -> None:
    async def main() -> tuple[bool, bool, bool]:
        app = build_app(LedgerSettings("127.0.0.1:9", Topics("unit")))
        consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9")
        coordinator = _coordinator(answer)
        consumer._coordinator = coordinator
        app.consumer._thread._consumer = consumer
        ownership = Ownership(app, [SOURCE], CHANGELOG, session_timeout=10.0)
        before = ownership.current()
        ownership._hook_heartbeats()
        ok = await coordinator._do_heartbeat()  # as aiokafka's heartbeat loop calls it
        return before, ok, ownership.current()

    assert asyncio.run(main()) == (False, current, current)


def test_fausts_revoke_signal_takes_the_partitions_epochs_away() -> None:
    async def main() -> dict[int, int]:
        app = build_app(LedgerSettings("127.0.0.1:9", Topics("unit")))
        ownership = Ownership(app, [SOURCE], CHANGELOG, session_timeout=10.0)
        ownership.epochs = {1: 5, 2: 6}
        await app.on_partitions_revoked.send({TP(SOURCE, 1), TP("other", 2)})
        return ownership.epochs

    assert asyncio.run(main()) == {2: 6}


def test_the_attributes_ownership_reads_off_the_app_exist() -> None:
    app = build_app(LedgerSettings("127.0.0.1:9", Topics("unit")))
    assert app.rebalancing is False
    assert inspect.iscoroutinefunction(app.consumer.highwaters)
    assert isinstance(app.consumer._thread, AIOKafkaConsumerThread)
