"""Progress bars for ``run`` and ``demo``: one per dataset, toward its budget.

Driven by the ledger snapshots a run's :class:`~streams.halts.BudgetBoard`
already receives; the runner turns them on only when stdout is a terminal, so
piped output and tests print nothing extra. One line per dataset, within 80
columns: name, bar, % used, kept/budget, tokens/s, ETA, state.
"""

from __future__ import annotations

import asyncio
import contextlib

from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn

from streams.halts import BudgetBoard
from tokenbudget.app.status import Tracker, format_eta
from tokenbudget.config import Config


def short(number: float) -> str:
    """1234 -> 1.2k, 400000 -> 400k, 2500000 -> 2.5M."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= limit:
            value = number / limit
            text = f"{value:.1f}" if value < 10 else f"{value:.0f}"
            return text.removesuffix(".0") + suffix
    return f"{number:.0f}"


class BudgetProgress:
    def __init__(self, config: Config, board: BudgetBoard, interval: float = 0.25) -> None:
        self.config = config
        self.board = board
        self.interval = interval
        self.tracker = Tracker()
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=16),
            TaskProgressColumn(),
            TextColumn("{task.fields[kept]:>5}/{task.fields[budget]:<5}"),
            TextColumn("{task.fields[rate]:>5}/s"),
            TextColumn("ETA {task.fields[eta]:>6}"),
            TextColumn("{task.fields[state]}"),
        )
        width = min(24, max((len(d.name) for d in config.datasets), default=0))
        self.tasks: dict[str, TaskID] = {
            d.name: self.progress.add_task(
                d.name[:width].ljust(width),
                total=d.budget,
                kept="0",
                budget=short(d.budget),
                rate="0",
                eta="-",
                state="open",
            )
            for d in config.datasets
        }
        self._task: asyncio.Task[None] | None = None

    def update(self) -> None:
        for name, task in self.tasks.items():
            snap = self.board.snapshot(name)
            if snap is None:
                continue
            self.tracker.observe(snap)
            row = self.tracker.row(name)
            budget = row.budget or row.kept
            self.progress.update(
                task,
                completed=min(row.kept, budget),  # the bar stops at the budget
                total=budget,
                kept=short(row.kept),
                budget=short(budget),
                rate=short(row.tokens_per_s),
                eta=format_eta(row.eta_s),
                state=row.state,
            )

    async def _loop(self) -> None:
        while True:
            self.update()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self.progress.start()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.update()
        self.progress.stop()
