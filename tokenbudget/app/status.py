"""``tokenbudget status``: where each dataset stands, read from the ledger.

The ledger publishes a ``LedgerSnapshot`` of every dataset to the budgets topic a
few times a second while it changes, and of all of them every few seconds. This
reads that topic from the beginning (no consumer group), keeps the recent
snapshots of each dataset and derives tokens/s and the ETA to the budget from two
of them (:func:`rate_and_eta`, pure). ``--watch`` keeps following the topic.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tokenbudget.app import servers as fleet
from tokenbudget.app.tables import format_table, printable
from tokenbudget.core.tasks import cancel_and_wait
from tokenbudget.streams import budget as policy
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard, BudgetWatcher
from tokenbudget.streams.counts import COUNTS, DatasetCounts
from tokenbudget.streams.topics import Topics

#: seconds of snapshots that tokens/s is measured over
RATE_WINDOW_S = 30.0


def rate_and_eta(
    points: Sequence[tuple[float, int]],
    remaining: int | None,
    window: float = RATE_WINDOW_S,
    now: float | None = None,
) -> tuple[float, float | None]:
    """Tokens/s and seconds until the budget is used, from ``(at, used)`` points.

    The rate is measured between the latest point and the oldest one at most
    ``window`` seconds before it (0 with fewer than two such points). With ``now``,
    only points of the last ``window`` seconds before ``now`` count, so a dataset
    whose snapshots stopped (job over, ledger down) shows no rate. The ETA is
    ``remaining / rate``: 0 when nothing remains, ``None`` when there is no budget
    or no progress."""
    if remaining is not None and remaining <= 0:
        eta: float | None = 0.0
    else:
        eta = None
    if now is not None:
        points = [p for p in points if now - window <= p[0] <= now]
    if len(points) < 2:
        return 0.0, eta
    ordered = sorted(points)
    last_at, last_used = ordered[-1]
    first = next(p for p in ordered if p[0] >= last_at - window)
    elapsed = last_at - first[0]
    if elapsed <= 0:
        return 0.0, eta
    rate = max(0.0, (last_used - first[1]) / elapsed)
    if eta is None and remaining is not None and rate > 0:
        eta = remaining / rate
    return rate, eta


@dataclass(frozen=True)
class StatusRow(DatasetCounts):
    dataset: str
    budget: int | None
    unit: str
    kept: int
    reserved: int
    remaining: int | None
    percent_used: float | None
    tokens_per_s: float
    eta_s: float | None
    state: str  # open | halted | exhausted | unknown (no snapshot yet)
    snapshot_at: float | None = None

    def to_json(self) -> dict[str, object]:
        """The row, how its prompts ended, then when its snapshot was taken (its
        tokens are ``kept``)."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in COUNTS}
        snapshot_at = own.pop("snapshot_at")
        return own | self.outcomes() | {"snapshot_at": snapshot_at}


@dataclass
class Tracker:
    """Recent snapshots per dataset, and the rows they make."""

    window: float = RATE_WINDOW_S
    history: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    latest: dict[str, ev.LedgerSnapshot] = field(default_factory=dict)

    def observe(self, snap: ev.LedgerSnapshot) -> None:
        previous = self.latest.get(snap.dataset)
        if previous is not None and snap.at <= previous.at:
            return
        self.latest[snap.dataset] = snap
        points = self.history.setdefault(snap.dataset, deque())
        points.append((snap.at, policy.used(snap)))
        while points and points[0][0] < snap.at - 2 * self.window:
            points.popleft()

    def row(self, dataset: str, budget: int | None = None, now: float | None = None) -> StatusRow:
        snap = self.latest.get(dataset)
        if snap is None:
            return StatusRow(
                dataset,
                budget,
                "completion_tokens",
                0,
                0,
                budget,
                0.0 if budget else None,
                0.0,
                None,
                "unknown",
            )
        budget = snap.budget if snap.budget is not None else budget
        kept = policy.used(snap)
        remaining = None if budget is None else policy.unused(budget, kept)
        points = list(self.history.get(dataset, ()))
        rate, eta = rate_and_eta(points, remaining, self.window, now)
        if snap.status != "open":
            eta = None  # halted or exhausted: no longer heading for the budget
        return StatusRow.of(
            snap,
            dataset=dataset,
            budget=budget,
            unit=snap.unit,
            kept=kept,
            reserved=int(getattr(snap, "reserved", 0) or 0),
            remaining=remaining,
            percent_used=(100.0 * kept / budget) if budget else None,
            tokens_per_s=rate,
            eta_s=eta,
            state=snap.status,
            snapshot_at=snap.at,
        )

    def rows(
        self,
        names: Sequence[str],
        budgets: dict[str, int] | None = None,
        now: float | None = None,
    ) -> list[StatusRow]:
        """One row per configured dataset (then any other the ledger knows)."""
        budgets = budgets or {}
        extra = sorted(set(self.latest) - set(names))
        return [self.row(name, budgets.get(name), now) for name in [*names, *extra]]


@dataclass
class TrackingBoard(BudgetBoard):
    """A budget board that also keeps each dataset's recent snapshots."""

    tracker: Tracker = field(default_factory=Tracker)
    servers: fleet.FleetTracker = field(default_factory=fleet.FleetTracker)

    def apply(self, event: ev.Event, seen_at: float | None = None) -> None:
        super().apply(event, seen_at)
        if isinstance(event, ev.LedgerSnapshot):
            self.tracker.observe(event)
        else:
            self.servers.observe(event)


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def to_json(rows: Sequence[StatusRow], at: float) -> dict[str, object]:
    return {"at": at, "datasets": {r.dataset: r.to_json() for r in rows}}


HEADERS = ["dataset", "budget", "kept", "reserved", "remaining", "used", "tokens/s", "ETA", "state"]


def cells(r: StatusRow) -> list[str]:
    def n(value: int | None) -> str:
        return "-" if value is None else f"{value:,}"

    return [
        printable(r.dataset),  # a dataset the ledger knows may be any name an event gave
        n(r.budget),
        n(r.kept),
        n(r.reserved),
        n(r.remaining),
        "-" if r.percent_used is None else f"{r.percent_used:.1f}%",
        f"{r.tokens_per_s:,.0f}",
        format_eta(r.eta_s),
        r.state,
    ]


def footer(rows: Sequence[StatusRow], now: float) -> str:
    seen = [r.snapshot_at for r in rows if r.snapshot_at is not None]
    if not seen:
        return "no ledger snapshot yet (is the job or `tokenbudget ledger` running?)"
    age = now - max(seen)
    return f"latest ledger snapshot {age:,.0f} s ago; tokens/s over the last {RATE_WINDOW_S:.0f} s"


def plain_table(
    rows: Sequence[StatusRow], now: float, planned: dict[str, str] | None = None
) -> str:
    """The table; with ``planned`` (the prompts the saved plan said each budget
    needs, :func:`tokenbudget.app.plan.planned`), the samples kept beside them."""
    headers = [*HEADERS, "samples", "planned"] if planned else HEADERS
    body = [
        [*cells(r), f"{r.samples:,}", planned.get(r.dataset, "-")] if planned else cells(r)
        for r in rows
    ]
    return format_table(headers, body) + "\n" + footer(rows, now)


def table(rows: Sequence[StatusRow], width: int = 200) -> Table:
    """A rich table for ``--watch``, fitted to ``width`` columns by shortening the
    dataset names (the numbers and states are never cut)."""
    now = time.time()
    body = [cells(r) for r in rows]
    widths = [max([len(name), *(len(row[i]) for row in body)]) for i, name in enumerate(HEADERS)]
    spare = width - (sum(widths) + len(widths) - 1)
    if spare < 0:
        widths[0] = max(len(HEADERS[0]), widths[0] + spare)
        for row in body:
            if len(row[0]) > widths[0]:
                row[0] = row[0][: widths[0] - 1] + "…"
    out = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), caption=footer(rows, now))
    for name, column_width in zip(HEADERS, widths, strict=True):
        out.add_column(
            name,
            justify="left" if name in ("dataset", "state") else "right",
            no_wrap=True,
            min_width=column_width,
        )
    for row in body:
        out.add_row(*map(Text, row))  # text, not rich markup: "[red]" stays as written
    return out


async def follow(
    bootstrap: str,
    topics: Topics,
    names: Sequence[str],
    budgets: dict[str, int],
    *,
    watch: bool,
    as_json: bool,
    interval: float = 1.0,
    planned: dict[str, str] | None = None,
    servers: Sequence[str] = (),
) -> int:
    """Read the budgets and control topics up to now and print; with ``watch``, keep going. The
    fleet (``servers``: the config's URLs, and those added) follows the datasets
    when it has several servers or one is not up."""
    board = TrackingBoard()
    watcher = BudgetWatcher(bootstrap, topics, board, fleet_reports=True)
    await watcher.start()
    task = asyncio.create_task(watcher.run())
    console = Console()
    try:
        await watcher.caught_up.wait()

        def render() -> list[StatusRow]:
            return board.tracker.rows(names, budgets, time.time())

        def as_dict() -> dict[str, object]:
            out = to_json(render(), time.time())
            out["servers"] = [asdict(row) for row in board.servers.rows(servers)]
            return out

        if not watch:
            if as_json:
                out = as_dict()
                if planned:
                    out["planned"] = planned
                print(json.dumps(out, indent=2))
            else:
                print(plain_table(render(), time.time(), planned))
                rows = board.servers.rows(servers)
                if fleet.shown(rows):
                    print("\n" + fleet.table(rows))
            return 0
        if as_json:
            while True:
                print(json.dumps(as_dict()), flush=True)
                await asyncio.sleep(interval)

        def view() -> Any:
            rows = board.servers.rows(servers)
            datasets = table(render(), console.width)
            if not fleet.shown(rows):
                return datasets
            return Group(datasets, Text("\n" + fleet.table(rows)))

        with Live(view(), console=console, auto_refresh=False) as live:
            while True:
                await asyncio.sleep(interval)
                live.update(view(), refresh=True)
    finally:
        await cancel_and_wait(task, ignore_errors=True)
        await watcher.stop()
