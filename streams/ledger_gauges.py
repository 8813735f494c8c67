"""The ledger worker's state, mirrored into the Prometheus metrics of
:mod:`tokenbudget.core.metrics`."""

from __future__ import annotations

from tokenbudget.core import metrics
from tokenbudget.streams import budget, ledger


class LedgerGauges:
    """Mirrors ledger states into the metrics; used only by the ledger worker.

    Counters cannot be set, so kept totals advance by the difference from the last
    state seen (a restarted worker starts its counters at zero again, which
    Prometheus' ``rate`` and ``increase`` treat as a counter reset).
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int, int, int, int]] = {}

    def observe(self, state: object) -> None:
        assert isinstance(state, ledger.DatasetLedger)
        name = state.dataset
        before = self._last.get(name, (0, 0, 0, 0, 0))
        now = (
            state.completion_tokens,
            state.prompt_tokens,
            state.samples,
            state.failed,
            state.cut,
        )
        # Labelled children exist from the first state on (at 0), so "no progress"
        # is a series that does not grow rather than a missing one.
        for counter, current, last in zip(
            (
                metrics.COMPLETION_TOKENS,
                metrics.PROMPT_TOKENS,
                metrics.SAMPLES,
                metrics.FAILED_PROMPTS,
                metrics.CUT_ANSWERS,
            ),
            now,
            before,
            strict=True,
        ):
            child = counter.labels(dataset=name)
            if current > last:
                child.inc(current - last)
        self._last[name] = now
        metrics.HALTED.labels(dataset=name).set(1 if state.halted else 0)
        metrics.OPEN.labels(dataset=name).set(1 if ledger.status(state) == "open" else 0)
        metrics.RESERVED.labels(dataset=name).set(ledger.reserved(state))
        metrics.OPEN_LEASES.labels(dataset=name).set(len(state.leases))
        if state.budget is not None:
            spent = budget.used(state)
            metrics.BUDGET.labels(dataset=name).set(state.budget)
            metrics.BUDGET_USED.labels(dataset=name).set(spent)
            metrics.BUDGET_REMAINING.labels(dataset=name).set(budget.unused(state.budget, spent))
            metrics.OVERSHOOT.labels(dataset=name).set(budget.overshoot(state.budget, spent))
