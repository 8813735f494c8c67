"""The drain's wait for fresh snapshots asks the ledger for them, only when the board
does not have them already, and never waits on the ask itself."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from tokenbudget.app import drain
from tokenbudget.core.sections import KafkaConfig


class Board:
    def __init__(self, at: dict[str, float]) -> None:
        self.at = at

    def snapshot(self, name: str) -> Any:
        return SimpleNamespace(at=self.at[name]) if name in self.at else None


def _wait(board: Board, since: float) -> None:
    watcher: Any = SimpleNamespace(board=board)
    coro = drain._snapshots_since(None, "127.0.0.1:9", watcher, ["a", "b"], since)  # type: ignore[arg-type]
    asyncio.run(asyncio.wait_for(coro, timeout=10))


def _answered(board: Board, monkeypatch: pytest.MonkeyPatch, since: float) -> list[list[str]]:
    """Asks recorded; the ledger answers each with a snapshot of every dataset asked."""
    asked: list[list[str]] = []

    async def ask_snapshots(config: Any, bootstrap: str, names: list[str]) -> None:
        asked.append(names)
        board.at.update({name: since + 1 for name in names})

    monkeypatch.setattr(drain, "ask_snapshots", ask_snapshots)
    _wait(board, since)
    return asked


def test_snapshots_older_than_the_drain_are_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _answered(Board({"a": 5.0}), monkeypatch, since=10.0) == [["a", "b"]]


def test_snapshots_newer_than_the_drain_are_not_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _answered(Board({"a": 11.0, "b": 12.0}), monkeypatch, since=10.0) == []


def test_an_ask_kafka_holds_up_does_not_hold_up_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker restarting: the ask hangs, the ledger's round comes, the wait ends
    and the ask is given up."""
    board = Board({})
    hanging = asyncio.Event()
    ended: list[str] = []

    async def ask_snapshots(config: Any, bootstrap: str, names: list[str]) -> None:
        asyncio.get_running_loop().call_later(0.3, board.at.update, {"a": 11.0, "b": 11.0})
        try:
            await hanging.wait()
        finally:
            ended.append("given up")

    monkeypatch.setattr(drain, "ask_snapshots", ask_snapshots)
    _wait(board, since=10.0)
    assert ended == ["given up"]


def test_an_ask_no_broker_takes_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    config: Any = SimpleNamespace(kafka=KafkaConfig())
    with caplog.at_level(logging.WARNING, logger=drain.__name__):
        asyncio.run(asyncio.wait_for(drain.ask_snapshots(config, "127.0.0.1:9", ["a"]), 30))
    assert "asking the ledger for snapshots failed" in caplog.text
