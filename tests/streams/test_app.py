"""The ledger worker's guard on its table writes (the rest of streams/app.py runs
against the real broker in tests/integration/test_ledger_worker.py)."""

from __future__ import annotations

import asyncio

import pytest

from streams import app


class Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited

    monkeypatch.setattr(app.os, "_exit", fake_exit)
    return codes


def _future() -> asyncio.Future[object]:
    return asyncio.new_event_loop().create_future()


def test_a_failed_changelog_write_ends_the_worker(exits: list[int]) -> None:
    future = _future()
    future.set_exception(ConnectionError("broker gone"))
    with pytest.raises(Exited):
        app._exit_unless_written(future)
    assert exits == [75]


def test_a_cancelled_changelog_write_ends_the_worker(exits: list[int]) -> None:
    future = _future()
    future.cancel()
    with pytest.raises(Exited):
        app._exit_unless_written(future)
    assert exits == [75]


def test_a_written_change_lets_it_go_on(exits: list[int]) -> None:
    future = _future()
    future.set_result(object())
    app._exit_unless_written(future)
    assert exits == []
