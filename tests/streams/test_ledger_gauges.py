from __future__ import annotations

from prometheus_client import REGISTRY

from tokenbudget.streams.ledger import DatasetLedger
from tokenbudget.streams.ledger_gauges import LedgerGauges


def value(name: str, dataset: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"dataset": dataset})


def test_ledger_gauges_follow_the_ledger_state() -> None:
    gauges = LedgerGauges()
    gauges.observe(DatasetLedger(dataset="gauged", budget=1000, completion_tokens=400, samples=2))
    gauges.observe(
        DatasetLedger(dataset="gauged", budget=1000, completion_tokens=1100, samples=3, halted=True)
    )
    assert value("tokenbudget_completion_tokens_total", "gauged") == 1100
    assert value("tokenbudget_samples_total", "gauged") == 3
    assert value("tokenbudget_budget_tokens", "gauged") == 1000
    assert value("tokenbudget_budget_remaining_tokens", "gauged") == 0
    assert value("tokenbudget_overshoot_tokens", "gauged") == 100
    assert value("tokenbudget_dataset_halted", "gauged") == 1


def test_ledger_gauges_export_used_open_and_reserved() -> None:
    from tokenbudget.streams.ledger import DatasetLedger as Ledger

    gauges = LedgerGauges()
    gauges.observe(Ledger(dataset="fresh", budget=500))
    # Series exist from the first state on, at zero: "no progress" is visible.
    assert value("tokenbudget_completion_tokens_total", "fresh") == 0
    assert value("tokenbudget_samples_total", "fresh") == 0
    assert value("tokenbudget_dataset_open", "fresh") == 1
    assert value("tokenbudget_reserved_tokens", "fresh") == 0
    gauges.observe(
        Ledger(
            dataset="fresh",
            budget=500,
            unit="total_tokens",
            completion_tokens=300,
            prompt_tokens=250,
            samples=2,
            halted=True,
        )
    )
    assert value("tokenbudget_budget_used_tokens", "fresh") == 550
    assert value("tokenbudget_overshoot_tokens", "fresh") == 50
    assert value("tokenbudget_dataset_open", "fresh") == 0
    assert value("tokenbudget_prompt_tokens_total", "fresh") == 250


def test_reserved_and_open_leases_come_from_the_ledgers_leases() -> None:
    from tokenbudget.streams.ledger import DatasetLedger as Ledger
    from tokenbudget.streams.ledger import Lease

    gauges = LedgerGauges()
    gauges.observe(Ledger(dataset="reserving", budget=10_000))
    assert value("tokenbudget_reserved_tokens", "reserving") == 0
    assert value("tokenbudget_open_leases", "reserving") == 0
    leases = {
        "a": Lease(holder="d1", granted=4096, committed=1000, expires_at=0.0),
        "b": Lease(holder="d2", granted=2048, expires_at=0.0),
    }
    gauges.observe(Ledger(dataset="reserving", budget=10_000, leases=leases))
    assert value("tokenbudget_reserved_tokens", "reserving") == 3096 + 2048
    assert value("tokenbudget_open_leases", "reserving") == 2


def test_failed_prompts_are_counted_once_per_prompt() -> None:
    gauges = LedgerGauges()
    gauges.observe(DatasetLedger(dataset="failing", budget=100, failed=2))
    gauges.observe(DatasetLedger(dataset="failing", budget=100, failed=2))  # a repeat
    gauges.observe(DatasetLedger(dataset="failing", budget=100, failed=3))
    assert value("tokenbudget_failed_prompts_total", "failing") == 3


def test_answers_cut_by_the_budget_follow_the_ledgers_count() -> None:
    gauges = LedgerGauges()
    gauges.observe(DatasetLedger(dataset="cutting", budget=100))
    assert value("tokenbudget_cut_answers_total", "cutting") == 0  # a series from the start
    gauges.observe(DatasetLedger(dataset="cutting", budget=100, samples=4, cut=1))
    gauges.observe(DatasetLedger(dataset="cutting", budget=100, samples=5, cut=1))
    assert value("tokenbudget_cut_answers_total", "cutting") == 1
