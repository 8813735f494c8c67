"""What ``run`` and ``demo`` show while a job runs: one bar per dataset on a
terminal, progress lines elsewhere.

Both are driven by the ledger snapshots a run's
:class:`~tokenbudget.streams.budget_board.BudgetBoard` already receives, through the
same :class:`~tokenbudget.app.status.Tracker` that ``tokenbudget status`` uses, and
show the same fields (:func:`fields`): kept/budget, % used, tokens/s, ETA, state.

* ``live``: a rich bar per dataset, within 80 columns, when stdout and stderr are a
  terminal (:class:`BudgetProgress`), and one for the fleet (requests in flight
  against its windows, tokens/s, servers up).
* ``lines``: when the output goes to a file (``nohup``, a batch scheduler, ``>
  run.log``), nothing redraws; instead one line per dataset every ``[metrics]
  progress_interval_s`` seconds, and one line whenever a dataset changes state
  (halted, open again, exhausted), logged on ``tokenbudget.progress`` at INFO
  (:class:`ProgressLines`); and the same per server of the fleet (paused, dropped,
  up again, drained).

The fleet is shown when it has several servers or one is not up, from what the
dispatchers report on the reservations topic (:class:`~tokenbudget.app.servers.FleetTracker`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Literal, Protocol

from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn

from tokenbudget.app import servers as fleet
from tokenbudget.app.status import StatusRow, Tracker, format_eta
from tokenbudget.core.config import Config
from tokenbudget.core.tasks import cancel_and_wait
from tokenbudget.streams.budget_board import BudgetBoard

# Shown whatever TOKENBUDGET_LOG says (its level is set when lines are asked for):
# a run's progress is its output, not a diagnostic.
progress_log = logging.getLogger("tokenbudget.progress")

ProgressMode = Literal["live", "lines", "off"]


def short(number: float) -> str:
    """1234 -> 1.2k, 400000 -> 400k, 2500000 -> 2.5M."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= limit:
            value = number / limit
            text = f"{value:.1f}" if value < 10 else f"{value:.0f}"
            return text.removesuffix(".0") + suffix
    return f"{number:.0f}"


def fields(row: StatusRow) -> dict[str, str]:
    """A dataset's progress as the bars and the lines both show it."""
    budget = row.budget or row.kept
    return {
        "kept": short(row.kept),
        "budget": short(budget),
        "used": "-" if row.percent_used is None else f"{row.percent_used:.0f}%",
        "rate": short(row.tokens_per_s),
        "eta": format_eta(row.eta_s),
        "state": row.state,
    }


def progress_line(row: StatusRow) -> str:
    """``B2: 1.2M/4M completion_tokens (30%), 3.4k/s, ETA 14m02s, open``."""
    f = fields(row)
    return (
        f"{row.dataset}: {f['kept']}/{f['budget']} {row.unit} ({f['used']}), "
        f"{f['rate']}/s, ETA {f['eta']}, {f['state']}"
    )


def state_line(row: StatusRow, before: str) -> str | None:
    """The line saying a dataset entered its state, ``before`` being the last one
    reported (``unknown`` before its first snapshot); None when there is no news: a
    dataset seen open for the first time, or a state it was already in."""
    if row.state == before or (row.state == "open" and before == "unknown"):
        return None
    f = fields(row)
    kept = f"{f['kept']}/{f['budget']} {row.unit}"
    outcomes = ", ".join(f"{name} {n:,}" for name, n in row.outcomes().items())
    if row.state == "halted":
        return f"{row.dataset}: halted, its budget is reached: {kept} ({outcomes})"
    if row.state == "exhausted":
        return f"{row.dataset}: exhausted, every prompt has an outcome: {kept} ({outcomes})"
    if row.state == "open":
        return f"{row.dataset}: open again, budget {f['budget']} {row.unit} ({kept})"
    return f"{row.dataset}: {row.state}"


class Display(Protocol):
    def start(self) -> None: ...

    async def stop(self) -> None: ...


def choose_mode(*, terminal: bool | None = None) -> ProgressMode:
    """``live`` when stdout and stderr are both a terminal (``terminal`` overrides
    the check), ``lines`` otherwise."""
    if terminal is None:
        terminal = sys.stdout.isatty() and sys.stderr.isatty()
    return "live" if terminal else "lines"


def display(mode: ProgressMode, config: Config, board: BudgetBoard) -> Display | None:
    if mode == "live":
        return BudgetProgress(config, board)
    if mode == "lines" and config.metrics.progress_interval_s > 0:
        return ProgressLines(config, board, config.metrics.progress_interval_s)
    return None


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
        width = max(7, min(24, max((len(d.name) for d in config.datasets), default=0)))
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
        self.urls = [server.url for server in config.servers]
        self.servers = fleet.FleetTracker()
        self.fleet_task: TaskID | None = None
        self._width = width
        self._task: asyncio.Task[None] | None = None

    def update_fleet(self) -> None:
        """The fleet's bar: requests in flight against its windows."""
        self.servers.follow(self.board)
        rows = self.servers.rows(self.urls)
        if not fleet.shown(rows):
            return
        window = sum(row.limit for row in rows)
        in_flight = sum(row.in_flight for row in rows)
        if self.fleet_task is None:
            name = "servers"[: self._width].ljust(self._width)
            self.fleet_task = self.progress.add_task(
                name, total=max(1, window), kept="0", budget="0", rate="0", eta="-", state=""
            )
        self.progress.update(
            self.fleet_task,
            completed=in_flight,
            total=max(1, window),
            kept=short(in_flight),
            budget=short(window),
            rate=short(sum(row.tokens_per_s for row in rows)),
            eta="-",
            state=fleet.summary(rows),
        )

    def update(self) -> None:
        for name, task in self.tasks.items():
            snap = self.board.snapshot(name)
            if snap is None:
                continue
            self.tracker.observe(snap)
            row = self.tracker.row(name)
            budget = row.budget or row.kept
            shown = fields(row)
            self.progress.update(
                task,
                completed=min(row.kept, budget),  # the bar stops at the budget
                total=budget,
                kept=shown["kept"],
                budget=shown["budget"],
                rate=shown["rate"],
                eta=shown["eta"],
                state=shown["state"],
            )
        self.update_fleet()

    async def _loop(self) -> None:
        while True:
            self.update()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self.progress.start()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self.update()
        self.progress.stop()


class ProgressLines:
    """The bars' stand-in for output that is not a terminal: every ``interval``
    seconds a line per dataset (:func:`progress_line`), at once a line for each
    change of state (:func:`state_line`), and a last line per dataset when stopped.
    Snapshots are sampled every ``poll`` seconds, for the rate and the changes."""

    def __init__(
        self, config: Config, board: BudgetBoard, interval: float, poll: float = 0.5
    ) -> None:
        self.board = board
        self.interval = interval
        self.poll = min(poll, interval)
        self.names = [d.name for d in config.datasets]
        self.budgets = {d.name: d.budget for d in config.datasets}
        self.tracker = Tracker()
        self.reported: dict[str, str] = dict.fromkeys(self.names, "unknown")
        self.urls = [server.url for server in config.servers]
        self.servers = fleet.FleetTracker()
        self.reported_servers: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    def _server_rows(self) -> list[fleet.ServerRow]:
        self.servers.follow(self.board)
        rows = self.servers.rows(self.urls)
        return rows if fleet.shown(rows) else []

    def _rows(self, now: float) -> list[StatusRow]:
        for name in self.names:
            snap = self.board.snapshot(name)
            if snap is not None:
                self.tracker.observe(snap)
        return [self.tracker.row(name, self.budgets[name], now) for name in self.names]

    def changes(self, now: float | None = None) -> list[str]:
        """The state lines due since the last call."""
        lines = []
        for row in self._rows(time.time() if now is None else now):
            if row.state == "unknown":
                continue
            line = state_line(row, self.reported[row.dataset])
            self.reported[row.dataset] = row.state
            if line is not None:
                lines.append(line)
        for server in self._server_rows():
            said = fleet.state_line(server, self.reported_servers.get(server.url, "-"))
            self.reported_servers[server.url] = server.state
            if said is not None:
                lines.append(said)
        return lines

    def lines(self, now: float | None = None) -> list[str]:
        """A progress line per dataset, as of ``now``, and one per server."""
        rows = self._rows(time.time() if now is None else now)
        return [
            *(progress_line(row) for row in rows),
            *(fleet.progress_line(row) for row in self._server_rows()),
        ]

    async def _loop(self) -> None:
        due = time.monotonic() + self.interval
        while True:
            await asyncio.sleep(self.poll)
            _emit(self.changes())
            if time.monotonic() >= due:
                _emit(self.lines())
                due = time.monotonic() + self.interval

    def start(self) -> None:
        if progress_log.getEffectiveLevel() > logging.INFO:
            progress_log.setLevel(logging.INFO)
        names = ", ".join(self.names)
        _emit([f"{len(self.names)} dataset(s) ({names}): a line each every {self.interval:g} s"])
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        _emit([*self.changes(), *self.lines()])


def _emit(lines: list[str]) -> None:
    for line in lines:
        progress_log.info("%s", line)
