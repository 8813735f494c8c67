"""What ``run`` tells at the end: per dataset, what it kept of its budget and how it
ended (from the ledger's last snapshots), what the producer and the dispatcher
reported, when each dispatcher first refused each dataset, and the children
started again. :mod:`tokenbudget.app.report` prints it as tables; ``--json``
prints :meth:`RunReport.to_json`."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenbudget.app.supervision import Restart
from tokenbudget.core.config import Config
from tokenbudget.core.sections import Unit
from tokenbudget.producers.dispatch.step import DispatchReport
from tokenbudget.producers.prompts.producer import ProduceReport
from tokenbudget.streams import budget
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.counts import DatasetCounts


@dataclass(frozen=True)
class DatasetResult(DatasetCounts):
    budget: int
    status: str  # "exhausted" | "halted"
    unit: Unit
    cut: int = 0  # answers kept that the budget's line cut (stop_reason "budget")

    @property
    def overshoot(self) -> int:
        return budget.overshoot(self.budget, budget.used(self))


@dataclass
class RunReport:
    datasets: dict[str, DatasetResult]
    produced: dict[str, ProduceReport] = field(default_factory=dict)
    dispatch: DispatchReport | None = None
    parquet_rows: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    halt_seen_at: dict[str, float | None] = field(default_factory=dict)
    # per dataset, when each dispatcher process first refused it (halt latency)
    refused_at: dict[str, list[float]] = field(default_factory=dict)
    restarts: list[Restart] = field(default_factory=list)  # children started again

    def already_done(self, dataset: str) -> int:
        """Prompts not produced because an earlier run of the namespace completed them."""
        report = self.produced.get(dataset)
        return report.already_done if report is not None else 0

    def bad_rows(self, dataset: str) -> int:
        """Rows of the dataset that are not prompts: dead-lettered and skipped."""
        report = self.produced.get(dataset)
        return report.bad_rows if report is not None else 0

    def to_json(self) -> dict[str, object]:
        return {
            "datasets": {
                name: {
                    "budget": r.budget,
                    "completion_tokens": r.completion_tokens,
                    "prompt_tokens": r.prompt_tokens,
                    "samples": r.samples,
                    "cut": r.cut,
                    "skipped": r.skipped,
                    "failed": r.failed,
                    "status": r.status,
                    "unit": r.unit,
                    "overshoot": r.overshoot,
                    "overshoot_percent": round(100.0 * r.overshoot / r.budget, 3)
                    if r.budget
                    else 0.0,
                    "already_done": self.already_done(name),
                    "bad_rows": self.bad_rows(name),
                }
                for name, r in self.datasets.items()
            },
            "failed": self.failed,
            "bad_rows": sum(self.bad_rows(name) for name in self.datasets),
            "already_done": sum(self.already_done(name) for name in self.datasets),
            "seconds": round(self.seconds, 3),
            "restarts": [vars(r) for r in self.restarts],
        }

    @property
    def failed(self) -> int:
        """Prompts that failed for good, over every dataset (``run`` then exits 3)."""
        return sum(r.failed for r in self.datasets.values())


def dataset_results(config: Config, board: BudgetBoard) -> dict[str, DatasetResult]:
    """Each dataset of the job as the ledger's last snapshot on ``board`` has it."""
    results = {}
    for dataset in config.datasets:
        snap = board.snapshot(dataset.name)
        assert snap is not None
        results[dataset.name] = DatasetResult.of(
            snap,
            budget=snap.budget or dataset.budget,
            status="halted" if snap.halted else "exhausted",
            unit=snap.unit,
            cut=snap.cut,
        )
    return results


def refusals(
    extra_refused: dict[str, list[float]],
    refused_here: dict[str, float],
    board: BudgetBoard,
) -> dict[str, list[float]]:
    """When each dispatcher first refused each dataset: the extra dispatchers'
    times (``extra_refused``, extended in place), this process's dispatcher's, and
    for a dataset it never refused but saw halted, the time the halt was seen."""
    refused = extra_refused
    for refused_name, at in refused_here.items():
        refused.setdefault(refused_name, []).append(at)
    for name, view in board.views.items():
        if view.halted_at is not None and name not in refused_here:
            refused.setdefault(name, []).append(view.halted_at)
    return refused
