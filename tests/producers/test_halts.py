"""BudgetBoard: the local view of halted datasets, without a broker."""

from __future__ import annotations

from producers.halts import BudgetBoard
from streams import events as ev


def snapshot(dataset: str, *, halted: bool, at: float, samples: int = 0) -> ev.LedgerSnapshot:
    return ev.LedgerSnapshot(
        dataset=dataset,
        budget=100,
        unit="completion_tokens",
        completion_tokens=0,
        prompt_tokens=0,
        samples=samples,
        skipped=0,
        failed=0,
        produced=None,
        halted=halted,
        status="halted" if halted else "open",
        at=at,
    )


def exceeded(dataset: str = "a") -> ev.BudgetExceeded:
    return ev.BudgetExceeded(dataset=dataset, budget=10, used=12)


def raised(dataset: str = "a") -> ev.BudgetRaised:
    return ev.BudgetRaised(dataset=dataset, budget=20, used=12)


def test_unknown_dataset_is_open() -> None:
    board = BudgetBoard()
    assert not board.is_halted("a")
    assert board.snapshot("a") is None
    assert "a" not in board.views  # asking does not create a view


def test_exceeded_halts_and_records_halted_at() -> None:
    board = BudgetBoard()
    board.apply(exceeded("a"), seen_at=5.0)
    assert board.is_halted("a")
    assert not board.is_halted("b")
    assert board.views["a"].halted_at == 5.0
    assert board.changed.is_set()


def test_second_exceeded_keeps_first_halted_at() -> None:
    board = BudgetBoard()
    board.apply(exceeded(), seen_at=5.0)
    board.apply(exceeded(), seen_at=9.0)
    assert board.views["a"].halted_at == 5.0


def test_halted_at_defaults_to_now() -> None:
    board = BudgetBoard()
    board.apply(exceeded())
    halted_at = board.views["a"].halted_at
    assert halted_at is not None
    assert halted_at > 1e9  # a wall-clock time, not a monotonic one


def test_raised_reopens() -> None:
    board = BudgetBoard()
    board.apply(exceeded(), seen_at=5.0)
    board.changed.clear()
    board.apply(raised(), seen_at=6.0)
    assert not board.is_halted("a")
    assert board.views["a"].halted_at is None
    assert board.changed.is_set()
    board.apply(exceeded(), seen_at=7.0)
    assert board.views["a"].halted_at == 7.0


def test_snapshots_carry_the_halted_flag() -> None:
    board = BudgetBoard()
    first = snapshot("a", halted=False, at=1.0)
    board.apply(first, seen_at=1.0)
    assert board.snapshot("a") == first
    assert not board.is_halted("a")

    halted = snapshot("a", halted=True, at=2.0)
    board.apply(halted, seen_at=2.5)
    assert board.snapshot("a") == halted
    assert board.is_halted("a")
    assert board.views["a"].halted_at == 2.5

    reopened = snapshot("a", halted=False, at=3.0)
    board.apply(reopened, seen_at=3.5)
    assert not board.is_halted("a")
    assert board.views["a"].halted_at is None


def test_older_snapshot_does_not_override_a_newer_one() -> None:
    board = BudgetBoard()
    newer = snapshot("a", halted=True, at=10.0, samples=5)
    board.apply(newer, seen_at=10.0)
    board.apply(snapshot("a", halted=False, at=9.0, samples=4), seen_at=11.0)
    assert board.snapshot("a") == newer
    assert board.is_halted("a")
    assert board.views["a"].halted_at == 10.0


def test_snapshot_with_equal_time_replaces() -> None:
    board = BudgetBoard()
    board.apply(snapshot("a", halted=False, at=10.0, samples=1), seen_at=10.0)
    later = snapshot("a", halted=True, at=10.0, samples=2)
    board.apply(later, seen_at=10.0)
    assert board.snapshot("a") == later
    assert board.is_halted("a")


def test_datasets_are_independent() -> None:
    board = BudgetBoard()
    board.apply(exceeded("a"), seen_at=1.0)
    board.apply(snapshot("b", halted=False, at=1.0), seen_at=1.0)
    board.apply(raised("c"), seen_at=1.0)
    assert board.is_halted("a")
    assert not board.is_halted("b")
    assert not board.is_halted("c")
    assert board.snapshot("a") is None


def test_other_events_are_ignored() -> None:
    board = BudgetBoard()
    board.apply(ev.BudgetSet(dataset="a", budget=5), seen_at=1.0)
    board.apply(ev.ProducerDone(dataset="a", produced=3, reason="end_of_data"), seen_at=1.0)
    assert not board.changed.is_set()
    assert not board.is_halted("a")
    assert board.views == {}
