"""The ledger worker's guard on its table writes and its batch step (the rest of
streams/ledger_worker.py runs against the real broker in
tests/integration/test_ledger_worker.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from faust.types import Message

from tokenbudget.streams import codec, ledger, ledger_worker
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics


class Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited

    monkeypatch.setattr(ledger_worker.os, "_exit", fake_exit)
    return codes


def _future() -> asyncio.Future[object]:
    return asyncio.new_event_loop().create_future()


def test_a_failed_changelog_write_ends_the_worker(exits: list[int]) -> None:
    future = _future()
    future.set_exception(ConnectionError("broker gone"))
    with pytest.raises(Exited):
        ledger_worker._exit_unless_written(future)
    assert exits == [75]


def test_a_cancelled_changelog_write_ends_the_worker(exits: list[int]) -> None:
    future = _future()
    future.cancel()
    with pytest.raises(Exited):
        ledger_worker._exit_unless_written(future)
    assert exits == [75]


def test_a_written_change_lets_it_go_on(exits: list[int]) -> None:
    future = _future()
    future.set_result(object())
    ledger_worker._exit_unless_written(future)
    assert exits == []


def test_received_offsets_report_what_was_never_delivered() -> None:
    received = ledger_worker.ReceivedOffsets()
    assert received.record(1, "completions:2", 25) is None
    assert received.record(1, "completions:2", 26) is None
    assert received.record(1, "budgets:0", 7) is None  # partitions are tracked apart
    assert received.record(1, "completions:2", 99) == (27, 98)


def test_received_offsets_accept_a_jump_or_a_reread_after_a_rebalance() -> None:
    received = ledger_worker.ReceivedOffsets()
    received.record(1, "completions:2", 25)
    assert received.record(2, "completions:2", 99) is None  # sought after a rebalance
    assert received.record(2, "completions:2", 40) is None  # read again from a commit
    assert received.record(2, "completions:2", 41) is None
    assert received.record(2, "completions:2", 43) == (42, 42)


def test_a_skipped_delivery_ends_the_worker(exits: list[int]) -> None:
    with pytest.raises(Exited):
        ledger_worker._exit_after_skipped_delivery("completions", 2, (27, 98))
    assert exits == [75]


# -- LedgerWorker's steps, one by one, on a real Faust app without a broker ------------


def _worker() -> ledger_worker.LedgerWorker:
    settings = ledger_worker.LedgerSettings("127.0.0.1:9", Topics("unit"))
    return ledger_worker.LedgerWorker(ledger_worker.new_app(settings), settings)


def _delivered(worker: ledger_worker.LedgerWorker, topic: str, offset: int, event: ev.Event) -> Any:
    """A Faust event as the ledger's source topic hands it over."""
    value = codec.encode(event)
    message = Message(topic, 1, offset, 0.0, 0, [], b"d0", value, None)
    return worker.app.create_event(b"d0", value, [], message)


def _completion(prompt: str, tokens: int) -> ev.CompletionEvent:
    return ev.CompletionEvent(
        request_id=f"r-{prompt}",
        prompt_id=prompt,
        dataset="d0",
        prompt_tokens=10,
        completion_tokens=tokens,
        output_ids=[],
        finish_reason="stop",
        max_new_tokens=100,
    )


def _own_snapshot() -> ev.Event:
    return ledger.snapshot(ledger.DatasetLedger(dataset="d0", budget=5), 0.0)


def _letters(worker: Any) -> list[tuple[Any, str]]:
    """The worker's dead letters, kept here instead of sent."""
    letters: list[tuple[Any, str]] = []

    async def send_dead_letter(event: Any, exc: Exception) -> None:
        letters.append((event, str(exc)))

    worker.send_dead_letter = send_dead_letter
    return letters


def test_a_batch_is_applied_in_memory_with_offsets_and_outcomes_nothing_written() -> None:
    worker = _worker()
    letters = _letters(worker)
    batch = [
        _delivered(worker, "unit.control", 4, ev.BudgetSet(dataset="d0", budget=1000)),
        _delivered(worker, "unit.completions", 7, _completion("p1", 30)),
        _delivered(worker, "unit.completions", 8, _completion("p2", 12)),
        # A ledger's announcement does not travel on the control topic: whoever wrote
        # it there is not the ledger. Dead-lettered, not applied.
        _delivered(worker, "unit.control", 5, _own_snapshot()),
    ]
    changes = asyncio.run(worker.apply_batch(batch))
    state = changes.states["d0"]
    assert (state.budget, state.completion_tokens, state.samples) == (1000, 42, 2)
    assert state.applied == {"unit.control:1": 4, "unit.completions:1": 8}
    assert changes.partition_of == {"d0": 1}
    assert set(changes.outcome_entries) == {"p1", "p2"}
    assert changes.per_topic == {"unit.control": 2, "unit.completions": 2}
    assert worker.datasets.data == {} and worker.outcomes.data == {}
    assert [(e.message.offset, reason) for e, reason in letters] == [
        (5, "a 'ledger_snapshot' event does not travel on unit.control: only on unit.budgets")
    ]


def test_a_snapshot_asked_changes_nothing_but_puts_the_dataset_among_the_written() -> None:
    """Written states are the ones announced on the next tick: an ask that changed
    nothing must still be among them, or the drain waits for the round."""
    worker = _worker()
    budget = _delivered(worker, "unit.control", 4, ev.BudgetSet(dataset="d0", budget=1000))
    first = asyncio.run(worker.apply_batch([budget]))
    worker.datasets.data["d0"] = ledger.dump_ledger(first.states["d0"])  # as written
    asked = _delivered(worker, "unit.outcomes", 3, ev.SnapshotAsked(dataset="d0", at=1.0))
    changes = asyncio.run(worker.apply_batch([asked]))
    state = changes.states["d0"]
    assert state.budget == 1000 and state.completion_tokens == 0
    assert state.applied == {"unit.control:1": 4, "unit.outcomes:1": 3}
    assert msgspec.structs.replace(state, applied=first.states["d0"].applied) == first.states["d0"]


def test_events_applied_before_a_restart_are_skipped_by_offset() -> None:
    worker = _worker()
    first = asyncio.run(
        worker.apply_batch([_delivered(worker, "unit.completions", 7, _completion("p1", 30))])
    )
    worker.datasets.data["d0"] = ledger.dump_ledger(first.states["d0"])  # as written
    again = asyncio.run(
        worker.apply_batch([_delivered(worker, "unit.completions", 7, _completion("p1", 30))])
    )
    assert again.states == {}


def test_an_event_that_cannot_be_applied_stops_the_worker_naming_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Never skipped: its tokens would go uncounted. The worker exits before its
    offset can be committed, with one line naming the record and the reason."""
    worker = _worker()

    def broken(*args: Any) -> Any:
        raise KeyError("lease")

    monkeypatch.setattr(worker, "apply", broken)
    exits: list[int] = []

    def exit_(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(ledger_worker.os, "_exit", exit_)
    with pytest.raises(SystemExit):
        asyncio.run(
            worker.apply_batch([_delivered(worker, "unit.completions", 7, _completion("p1", 3))])
        )
    assert exits == [70]
    assert "ledger: applying unit.completions[1]@7 failed (KeyError: 'lease')" in caplog.text
