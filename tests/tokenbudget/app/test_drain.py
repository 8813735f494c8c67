"""The drain's wait for fresh snapshots asks the ledger for them, and only when the
board does not have them already."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from tokenbudget.app import drain


class Board:
    def __init__(self, at: dict[str, float]) -> None:
        self.at = at

    def snapshot(self, name: str) -> Any:
        return SimpleNamespace(at=self.at[name]) if name in self.at else None


def _wait(board: Board, monkeypatch: pytest.MonkeyPatch, since: float) -> list[list[str]]:
    asked: list[list[str]] = []

    async def ask_snapshots(config: Any, bootstrap: str, names: list[str]) -> None:
        asked.append(names)
        board.at.update({name: since + 1 for name in names})  # as the ledger answers

    monkeypatch.setattr(drain, "ask_snapshots", ask_snapshots)
    watcher: Any = SimpleNamespace(board=board)
    coro = drain._snapshots_since(None, "127.0.0.1:9", watcher, ["a", "b"], since)  # type: ignore[arg-type]
    asyncio.run(asyncio.wait_for(coro, timeout=5))
    return asked


def test_snapshots_older_than_the_drain_are_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _wait(Board({"a": 5.0}), monkeypatch, since=10.0) == [["a", "b"]]


def test_snapshots_newer_than_the_drain_are_not_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _wait(Board({"a": 11.0, "b": 12.0}), monkeypatch, since=10.0) == []
