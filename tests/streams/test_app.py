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


def test_received_offsets_report_what_was_never_delivered() -> None:
    received = app.ReceivedOffsets()
    assert received.record(1, "completions:2", 25) is None
    assert received.record(1, "completions:2", 26) is None
    assert received.record(1, "budgets:0", 7) is None  # partitions are tracked apart
    assert received.record(1, "completions:2", 99) == (27, 98)


def test_received_offsets_accept_a_jump_or_a_reread_after_a_rebalance() -> None:
    received = app.ReceivedOffsets()
    received.record(1, "completions:2", 25)
    assert received.record(2, "completions:2", 99) is None  # sought after a rebalance
    assert received.record(2, "completions:2", 40) is None  # read again from a commit
    assert received.record(2, "completions:2", 41) is None
    assert received.record(2, "completions:2", 43) == (42, 42)


def test_a_skipped_delivery_ends_the_worker(exits: list[int]) -> None:
    with pytest.raises(Exited):
        app._exit_after_skipped_delivery("completions", 2, (27, 98))
    assert exits == [75]
