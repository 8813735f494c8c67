from __future__ import annotations

from prometheus_client import REGISTRY

from sinks.metrics import LedgerGauges
from streams.ledger import DatasetLedger


def value(name: str, dataset: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"dataset": dataset})


def test_ledger_gauges_follow_the_ledger_state() -> None:
    gauges = LedgerGauges()
    gauges.observe(DatasetLedger(dataset="gauged", budget=1000, completion_tokens=400, samples=2))
    gauges.observe(
        DatasetLedger(
            dataset="gauged", budget=1000, completion_tokens=1100, samples=3, halted=True
        )
    )
    assert value("tokenbudget_completion_tokens_total", "gauged") == 1100
    assert value("tokenbudget_samples_total", "gauged") == 3
    assert value("tokenbudget_budget_tokens", "gauged") == 1000
    assert value("tokenbudget_budget_remaining_tokens", "gauged") == 0
    assert value("tokenbudget_overshoot_tokens", "gauged") == 100
    assert value("tokenbudget_dataset_halted", "gauged") == 1
