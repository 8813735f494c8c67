"""Ledger arithmetic: each prompt counted once, halts and reopens emitted exactly once."""

from __future__ import annotations

import msgspec
import pytest

from tokenbudget.streams import ledger
from tokenbudget.streams.budget import used
from tokenbudget.streams.events import (
    BudgetExceeded,
    BudgetRaised,
    BudgetSet,
    CompletionEvent,
    ProducerDone,
    PromptFailed,
    PromptSkipped,
)
from tokenbudget.streams.ledger import DatasetLedger, apply_budget_set, apply_outcome

DS = "ds"
AT = 1000.0


def completion(
    request_id: str = "r1",
    prompt_id: str = "p1",
    *,
    completion_tokens: int = 10,
    prompt_tokens: int = 3,
) -> CompletionEvent:
    return CompletionEvent(
        request_id=request_id,
        prompt_id=prompt_id,
        dataset=DS,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        output_ids=[1, 2, 3],  # the ledger counts completion_tokens, not ids
        finish_reason="stop",
        max_new_tokens=4096,
    )


def skipped(prompt_id: str = "p1") -> PromptSkipped:
    return PromptSkipped(prompt_id=prompt_id, dataset=DS, reason="halted")


def failed(prompt_id: str = "p1") -> PromptFailed:
    return PromptFailed(prompt_id=prompt_id, dataset=DS, reason="boom", attempts=4)


def fresh(**kwargs: object) -> DatasetLedger:
    return DatasetLedger(dataset=DS, **kwargs)  # type: ignore[arg-type]


def counts(state: DatasetLedger) -> tuple[int, int, int, int, int]:
    return (
        state.completion_tokens,
        state.prompt_tokens,
        state.samples,
        state.skipped,
        state.failed,
    )


# ---- counting once -----------------------------------------------------------------


def test_first_completion_is_counted_once() -> None:
    t = apply_outcome(fresh(), completion(completion_tokens=10, prompt_tokens=3), None, AT)
    assert counts(t.state) == (10, 3, 1, 0, 0)
    assert t.outcome == "completed"
    assert t.changed
    assert t.emit == []
    assert t.state.last_event_id == "completed:r1"
    assert t.state.outcome_events == 1


def test_same_request_id_repeated_after_outcome_recorded_changes_nothing() -> None:
    first = apply_outcome(fresh(), completion(), None, AT)
    again = apply_outcome(first.state, completion(), "completed", AT)
    assert counts(again.state) == counts(first.state)
    assert again.outcome is None
    assert again.emit == []


def test_same_request_id_repeated_later_changes_no_counts() -> None:
    state = apply_outcome(fresh(), completion("r1", "p1"), None, AT).state
    state = apply_outcome(state, completion("r2", "p2", completion_tokens=5), None, AT).state
    before = counts(state)
    # r1 comes back after r2, so it is not the last event: the outcome table rules.
    again = apply_outcome(state, completion("r1", "p1"), "completed", AT)
    assert counts(again.state) == before
    assert again.outcome is None
    assert again.emit == []


def test_second_completion_for_same_prompt_with_new_request_id_is_ignored() -> None:
    first = apply_outcome(fresh(), completion("r1", "p1", completion_tokens=10), None, AT)
    second = apply_outcome(
        first.state, completion("r2", "p1", completion_tokens=99), "completed", AT
    )
    assert counts(second.state) == counts(first.state)
    assert second.outcome is None  # the first completion is the one kept
    assert second.emit == []
    assert second.state.last_event_id == "completed:r1"


def test_answers_the_budget_cut_are_counted_once_and_in_the_snapshot() -> None:
    cut = msgspec.structs.replace(completion("r1", "p1"), stop_reason="budget")
    whole = msgspec.structs.replace(completion("r2", "p2"), stop_reason="length")
    state = apply_outcome(fresh(), cut, None, AT).state
    state = apply_outcome(state, whole, None, AT).state
    assert state.cut == 1
    # The same answer again, or another answer to the same prompt: nothing more.
    state = apply_outcome(state, cut, "completed", AT).state
    again = msgspec.structs.replace(cut, request_id="r3")
    state = apply_outcome(state, again, "completed", AT).state
    assert (state.samples, state.cut) == (2, 1)
    assert ledger.snapshot(state, AT).cut == 1


def test_skipped_then_completed_moves_prompt_from_skipped_to_samples() -> None:
    s = apply_outcome(fresh(), skipped("p1"), None, AT)
    assert counts(s.state) == (0, 0, 0, 1, 0)
    assert s.outcome == "skipped"
    c = apply_outcome(s.state, completion("r1", "p1", completion_tokens=7), "skipped", AT)
    assert counts(c.state) == (7, 3, 1, 0, 0)
    assert c.outcome == "completed"
    assert ledger.outcomes_recorded(c.state) == 1


def test_failed_then_completed_moves_prompt_from_failed_to_samples() -> None:
    f = apply_outcome(fresh(), failed("p1"), None, AT)
    assert counts(f.state) == (0, 0, 0, 0, 1)
    c = apply_outcome(f.state, completion("r1", "p1", completion_tokens=7), "failed", AT)
    assert counts(c.state) == (7, 3, 1, 0, 0)
    assert c.outcome == "completed"


def test_completed_then_skipped_is_ignored() -> None:
    c = apply_outcome(fresh(), completion("r1", "p1"), None, AT)
    s = apply_outcome(c.state, skipped("p1"), "completed", AT)
    assert counts(s.state) == counts(c.state)
    assert s.outcome is None


def test_skipped_then_failed_first_wins() -> None:
    s = apply_outcome(fresh(), skipped("p1"), None, AT)
    f = apply_outcome(s.state, failed("p1"), "skipped", AT)
    assert counts(f.state) == (0, 0, 0, 1, 0)
    assert f.outcome is None


@pytest.mark.parametrize(
    ("previous", "new", "expected"),
    [
        (None, "completed", True),
        (None, "skipped", True),
        (None, "failed", True),
        ("skipped", "completed", True),
        ("failed", "completed", True),
        ("completed", "completed", False),
        ("completed", "skipped", False),
        ("completed", "failed", False),
        ("skipped", "failed", False),
        ("failed", "skipped", False),
        ("skipped", "skipped", False),
    ],
)
def test_outcome_change_table(previous: str | None, new: str, expected: bool) -> None:
    assert ledger.outcome_change(previous, new) is expected  # type: ignore[arg-type]


# ---- torn write guard --------------------------------------------------------------


def test_torn_write_returns_outcome_without_counting_again() -> None:
    applied = apply_outcome(fresh(), completion("r1", "p1"), None, AT)
    # Crash after the ledger entry was written but before the outcome entry: the event
    # is replayed and the outcome table still says nothing about p1.
    replay = apply_outcome(applied.state, completion("r1", "p1"), None, AT)
    assert replay.state == applied.state
    assert replay.outcome == "completed"
    assert replay.emit == []
    assert not replay.changed


def test_torn_write_of_skipped_to_completed_records_completed() -> None:
    state = apply_outcome(fresh(), skipped("p1"), None, AT).state
    applied = apply_outcome(state, completion("r1", "p1"), "skipped", AT)
    replay = apply_outcome(applied.state, completion("r1", "p1"), "skipped", AT)
    assert counts(replay.state) == counts(applied.state) == (10, 3, 1, 0, 0)
    assert replay.outcome == "completed"


def test_torn_write_guard_does_not_reemit_budget_exceeded() -> None:
    applied = apply_outcome(fresh(budget=10), completion("r1", "p1"), None, AT)
    assert len(applied.emit) == 1
    replay = apply_outcome(applied.state, completion("r1", "p1"), None, AT)
    assert replay.emit == []
    assert replay.outcome == "completed"


def test_event_ids_distinguish_kinds() -> None:
    assert ledger.event_id(completion("r9", "p1")) == "completed:r9"
    assert ledger.event_id(skipped("p1")) == "skipped:p1"
    assert ledger.event_id(failed("p1")) == "failed:p1"


# ---- halting -----------------------------------------------------------------------


def test_budget_exceeded_emitted_exactly_when_used_reaches_budget() -> None:
    state = fresh(budget=100)
    t = apply_outcome(state, completion("r1", "p1", completion_tokens=60), None, AT)
    assert t.emit == []
    assert not t.state.halted
    t = apply_outcome(t.state, completion("r2", "p2", completion_tokens=39), None, AT)
    assert t.emit == []  # 99 < 100
    assert not t.state.halted
    t = apply_outcome(t.state, completion("r3", "p3", completion_tokens=1), None, AT + 1)
    assert t.state.halted
    assert t.emit == [
        BudgetExceeded(
            dataset=DS,
            budget=100,
            used=100,
            unit="completion_tokens",
            trigger_request_id="r3",
            at=AT + 1,
        )
    ]
    assert ledger.status(t.state) == "halted"
    assert ledger.remaining(t.state) == 0


def test_budget_exceeded_only_once() -> None:
    t = apply_outcome(fresh(budget=10), completion("r1", "p1", completion_tokens=15), None, AT)
    assert len(t.emit) == 1
    assert isinstance(t.emit[0], BudgetExceeded)
    assert t.emit[0].used == 15
    t2 = apply_outcome(t.state, completion("r2", "p2", completion_tokens=5), None, AT)
    assert t2.state.halted
    assert t2.state.completion_tokens == 20  # in-flight completions still count
    assert t2.emit == []
    t3 = apply_outcome(t2.state, skipped("p3"), None, AT)
    assert t3.state.halted
    assert t3.emit == []


def test_no_budget_never_halts() -> None:
    t = apply_outcome(fresh(), completion(completion_tokens=10**9), None, AT)
    assert not t.state.halted
    assert t.emit == []
    assert ledger.remaining(t.state) is None


@pytest.mark.parametrize(
    ("unit", "budget", "halts_after"),
    [
        ("completion_tokens", 20, 2),  # 10, 20
        ("total_tokens", 26, 2),  # 13, 26
        ("samples", 3, 3),
    ],
)
def test_units(unit: str, budget: int, halts_after: int) -> None:
    state = fresh(budget=budget, unit=unit)
    for i in range(1, 5):
        t = apply_outcome(state, completion(f"r{i}", f"p{i}"), None, AT)
        state = t.state
        if i < halts_after:
            assert t.emit == [], i
        elif i == halts_after:
            assert len(t.emit) == 1
            assert isinstance(t.emit[0], BudgetExceeded)
            assert t.emit[0].unit == unit
            assert t.emit[0].used == used(state)
            assert t.emit[0].used >= budget
        else:
            assert t.emit == []
        assert state.halted is (i >= halts_after)


def test_skips_and_failures_do_not_use_budget() -> None:
    state = fresh(budget=1, unit="samples")
    t = apply_outcome(state, skipped("p1"), None, AT)
    t = apply_outcome(t.state, failed("p2"), None, AT)
    assert not t.state.halted
    assert t.emit == []


# ---- budget set --------------------------------------------------------------------


def budget_set(budget: int, unit: str = "completion_tokens") -> BudgetSet:
    return BudgetSet(dataset=DS, budget=budget, unit=unit)  # type: ignore[arg-type]


def test_raising_budget_above_used_reopens_a_halted_dataset() -> None:
    halted = apply_outcome(fresh(budget=10), completion(completion_tokens=12), None, AT).state
    assert halted.halted
    t = apply_budget_set(halted, budget_set(50), AT + 5)
    assert not t.state.halted
    assert t.state.budget == 50
    assert t.changed
    assert t.emit == [BudgetRaised(dataset=DS, budget=50, used=12, at=AT + 5)]
    assert ledger.status(t.state) == "open"


def test_raising_budget_but_not_above_used_keeps_halted() -> None:
    halted = apply_outcome(fresh(budget=10), completion(completion_tokens=12), None, AT).state
    t = apply_budget_set(halted, budget_set(12), AT)
    assert t.state.halted
    assert t.state.budget == 12
    assert t.emit == []


def test_lowering_budget_below_used_halts() -> None:
    state = apply_outcome(fresh(budget=100), completion(completion_tokens=30), None, AT).state
    t = apply_budget_set(state, budget_set(20), AT + 2)
    assert t.state.halted
    assert t.changed
    assert t.emit == [
        BudgetExceeded(dataset=DS, budget=20, used=30, trigger_request_id="", at=AT + 2)
    ]


def test_first_budget_set_on_a_dataset_with_no_budget() -> None:
    t = apply_budget_set(fresh(), budget_set(1000), AT)
    assert t.state.budget == 1000
    assert t.changed
    assert t.emit == []


def test_same_budget_is_a_no_op() -> None:
    state = fresh(budget=100, completion_tokens=30)
    t = apply_budget_set(state, budget_set(100), AT)
    assert t.state is state
    assert not t.changed
    assert t.emit == []


def test_same_budget_on_halted_dataset_emits_nothing() -> None:
    halted = apply_outcome(fresh(budget=10), completion(completion_tokens=12), None, AT).state
    t = apply_budget_set(halted, budget_set(10), AT)
    assert not t.changed
    assert t.emit == []
    assert t.state.halted


def test_changing_unit_rechecks_the_budget() -> None:
    state = fresh(budget=6, completion_tokens=4, prompt_tokens=4, samples=1)
    assert not apply_budget_set(state, budget_set(5), AT).state.halted  # 4 completion tokens
    # Same number, new unit: 4 + 4 total tokens reach 6.
    t = apply_budget_set(state, budget_set(6, "total_tokens"), AT)
    assert t.changed
    assert t.state.unit == "total_tokens"
    assert t.state.halted
    assert len(t.emit) == 1
    assert t.emit[0].used == 8  # type: ignore[union-attr]


# ---- producer done, status, settled -----------------------------------------------


def test_producer_done_sets_produced_once() -> None:
    t = ledger.apply_producer_done(
        fresh(), ProducerDone(dataset=DS, produced=3, reason="end_of_data")
    )
    assert t.changed
    assert t.state.produced == 3
    again = ledger.apply_producer_done(
        t.state, ProducerDone(dataset=DS, produced=3, reason="end_of_data")
    )
    assert not again.changed


def test_status() -> None:
    state = fresh(budget=1000)
    assert ledger.status(state) == "open"
    state = ledger.apply_producer_done(
        state, ProducerDone(dataset=DS, produced=3, reason="end_of_data")
    ).state
    assert ledger.status(state) == "open"
    state = apply_outcome(state, completion("r1", "p1"), None, AT).state
    state = apply_outcome(state, skipped("p2"), None, AT).state
    assert ledger.status(state) == "open"
    state = apply_outcome(state, failed("p3"), None, AT).state
    assert ledger.status(state) == "exhausted"


def test_halted_status_wins() -> None:
    state = apply_outcome(fresh(budget=5), completion("r1", "p1"), None, AT).state
    state = msgspec.structs.replace(state, produced=2)
    assert ledger.status(state) == "halted"
    state = apply_outcome(state, skipped("p2"), None, AT).state
    assert ledger.status(state) == "halted"


def test_produced_zero_is_exhausted_immediately() -> None:
    state = fresh(produced=0)
    assert ledger.status(state) == "exhausted"


def test_snapshot_copies_state() -> None:
    state = fresh(budget=50, completion_tokens=60, samples=2, halted=True, outcome_events=4)
    snap = ledger.snapshot(state, 12.5)
    assert snap.dataset == DS
    assert snap.budget == 50
    assert snap.completion_tokens == 60
    assert snap.samples == 2
    assert snap.halted
    assert snap.status == "halted"
    assert snap.outcome_events == 4
    assert snap.at == 12.5


# ---- persistence and outcome_events -------------------------------------------------


def test_dump_load_round_trip() -> None:
    state = fresh(
        budget=123,
        unit="total_tokens",
        completion_tokens=10,
        prompt_tokens=20,
        samples=2,
        skipped=3,
        failed=4,
        produced=9,
        halted=True,
        last_event_id="completed:abc",
        outcome_events=11,
    )
    data = ledger.dump_ledger(state)
    assert isinstance(data, bytes)
    assert ledger.load_ledger(data) == state
    assert ledger.load_ledger(ledger.dump_ledger(fresh())) == fresh()


def test_outcome_events_grows_on_repeats_too() -> None:
    t = apply_outcome(fresh(), completion("r1", "p1"), None, AT)
    assert t.state.outcome_events == 1
    # A second completion for the same prompt changes no count but is still an event.
    t2 = apply_outcome(t.state, completion("r2", "p1"), "completed", AT)
    assert counts(t2.state) == counts(t.state)
    assert t2.state.outcome_events == 2
    assert t2.changed  # the grown counter must be stored
    t3 = apply_outcome(t2.state, skipped("p1"), "completed", AT)
    assert t3.state.outcome_events == 3
    t4 = apply_outcome(t3.state, skipped("p2"), None, AT)
    assert t4.state.outcome_events == 4
    assert t4.state.skipped == 1
