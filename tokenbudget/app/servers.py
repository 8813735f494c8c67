"""The fleet as people see it: the table ``run`` prints after probing its servers,
``tokenbudget servers add|drain|list``, and the fleet's rows in ``status`` and the
run's progress.

A change (``servers add URL``, ``servers drain URL``) is an event on the
namespace's control topic, like a budget set by hand: every dispatcher of the job
reads it and applies it at once (:meth:`tokenbudget.producers.inference.fleet.Fleet.apply`), and
later
runs of the namespace start from the config's servers with every change made so far
applied (a server drained stays drained until added again). What each dispatcher
sees of its servers comes on the reservations topic (the dispatchers' own), every
few seconds (``fleet_report``): :class:`FleetTracker` adds those up per server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from tokenbudget.app.tables import format_table, printable
from tokenbudget.core.config import Config, check_added_server
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.tasks import cancel_and_wait
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard, BudgetWatcher
from tokenbudget.streams.publisher import publish_events
from tokenbudget.streams.topics import Topics

if TYPE_CHECKING:
    from tokenbudget.producers.inference.backends import ServerCheck

# A dispatcher whose latest report is this much older than the newest one has stopped.
STALE_S = 30.0
# Which state a server shows when its dispatchers see it differently: the best one.
_RANK = {"up": 0, "draining": 1, "paused": 2, "drained": 3, "dropped": 4}


def start_table(checks: Sequence[ServerCheck]) -> str:
    """``tokenbudget: 3 inference servers, 2 up`` and a line per server."""
    up = sum(check.up for check in checks)
    rows = [
        [
            c.url,
            "up" if c.up else "down",
            printable(", ".join(c.models)) or "-",  # as the server named them
            printable(c.problem) or "-",
        ]
        for c in checks
    ]
    head = f"tokenbudget: {len(checks)} inference server(s), {up} up"
    if up < len(checks):
        head += " (the job starts on those; the others are polled and join when they answer)"
    return head + "\n" + format_table(["server", "state", "model", "why not"], rows)


@dataclass(frozen=True)
class ServerRow:
    url: str
    state: str  # as its dispatchers see it ("-": none reported it yet)
    in_flight: int = 0
    limit: int = 0  # its windows, over the dispatchers
    concurrency: int = 0  # their ceilings
    requests: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    errors: int = 0
    change: str = ""  # the last change made with `servers`, if any


@dataclass
class FleetTracker:
    """The fleet's changes and what each dispatcher reported, and the rows they make."""

    changes: list[ev.ServerAdded | ev.ServerDrained] = field(default_factory=list)
    reports: dict[str, deque[ev.FleetReport]] = field(default_factory=dict)

    def observe(self, event: ev.Event) -> None:
        if isinstance(event, ev.ServerAdded | ev.ServerDrained):
            self.changes.append(event)
        elif isinstance(event, ev.FleetReport):
            history = self.reports.setdefault(event.holder, deque(maxlen=32))
            if not history or event.at > history[-1].at:
                history.append(event)

    def follow(self, board: BudgetBoard) -> None:
        """Catch up with the reports a budget board kept (its latest per dispatcher)."""
        for report in list(board.fleet.reports.values()):
            self.observe(report)

    def urls(self, configured: Iterable[str]) -> list[str]:
        """The fleet's servers: the config's, then those added, in order."""
        urls = list(dict.fromkeys(configured))
        for change in self.changes:
            if isinstance(change, ev.ServerAdded) and change.url not in urls:
                urls.append(change.url)
        return urls

    def rows(self, configured: Iterable[str]) -> list[ServerRow]:
        latest = [history[-1] for history in self.reports.values() if history]
        newest = max((r.at for r in latest), default=0.0)
        live = [h for h in self.reports.values() if h and h[-1].at >= newest - STALE_S]
        return [self._row(url, live) for url in self.urls(configured)]

    def _row(self, url: str, live: list[deque[ev.FleetReport]]) -> ServerRow:
        seen = [(h, s) for h in live for s in h[-1].servers if s.url == url]
        last = next((c for c in reversed(self.changes) if c.url == url), None)
        change = ""
        if last is not None:
            verb = "added" if isinstance(last, ev.ServerAdded) else "drained"
            change = f"{verb} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(last.at))}"
        if not seen:
            state = "drained" if isinstance(last, ev.ServerDrained) else "-"
            return ServerRow(url, state, change=change)
        states = [s.state for _, s in seen]
        return ServerRow(
            url=url,
            state=min(states, key=lambda state: _RANK[state]),
            in_flight=sum(s.in_flight for _, s in seen),
            limit=sum(s.limit for _, s in seen),
            concurrency=sum(s.concurrency for _, s in seen),
            requests=sum(s.requests for _, s in seen),
            tokens=sum(s.tokens for _, s in seen),
            tokens_per_s=sum(_rate(history, url) for history, _ in seen),
            errors=sum(s.errors for _, s in seen),
            change=change,
        )


def _rate(history: deque[ev.FleetReport], url: str) -> float:
    """Tokens/s ``url`` generated for one dispatcher, between its last two reports."""
    if len(history) < 2:
        return 0.0
    before, after = history[-2], history[-1]
    then = next((s.tokens for s in before.servers if s.url == url), None)
    now = next((s.tokens for s in after.servers if s.url == url), None)
    elapsed = after.at - before.at
    if then is None or now is None or elapsed <= 0:
        return 0.0
    return max(0.0, (now - then) / elapsed)


HEADERS = ["server", "state", "in flight", "window", "requests", "tokens", "tokens/s", "errors"]


def cells(row: ServerRow) -> list[str]:
    window = f"{row.limit:,}/{row.concurrency:,}" if row.concurrency else "-"
    return [
        printable(row.url),  # as a change on the topic wrote it
        row.state,
        f"{row.in_flight:,}",
        window,
        f"{row.requests:,}",
        f"{row.tokens:,}",
        f"{row.tokens_per_s:,.0f}",
        f"{row.errors:,}",
    ]


def table(rows: Sequence[ServerRow]) -> str:
    changed = any(row.change for row in rows)
    headers = [*HEADERS, "changed"] if changed else HEADERS
    body = [[*cells(r), r.change or "-"] if changed else cells(r) for r in rows]
    return format_table(headers, body)


def progress_line(row: ServerRow) -> str:
    """``server http://gpu1:30000: up, 128/128 in flight, 5,120 tokens/s, 3 errors``."""
    return (
        f"server {printable(row.url)}: {row.state}, {row.in_flight:,}/{row.limit:,} in flight, "
        f"{row.tokens_per_s:,.0f} tokens/s, {row.errors:,} errors"
    )


def state_line(row: ServerRow, before: str) -> str | None:
    """The line saying a server entered its state (``before``: the last one
    reported, ``-`` before any); None when there is no news."""
    if row.state == before or row.state == "-" or (row.state == "up" and before == "-"):
        return None
    if row.state == "up":
        return f"server {printable(row.url)}: up again"
    return f"server {printable(row.url)}: {row.state}"


def summary(rows: Sequence[ServerRow]) -> str:
    """``7/8 up`` (and the others' states)."""
    up = sum(row.state == "up" for row in rows)
    others = sorted({row.state for row in rows} - {"up", "-"})
    extra = "".join(f", {sum(r.state == state for r in rows)} {state}" for state in others)
    return f"{up}/{len(rows)} up{extra}"


def shown(rows: Sequence[ServerRow]) -> bool:
    """Whether the fleet is worth a line: several servers, or one not up."""
    return len(rows) > 1 or any(row.state not in ("up", "-") for row in rows)


# ---- tokenbudget servers add | drain | list ---------------------------------------


def change(config: Config, bootstrap: str, event: ev.ServerAdded | ev.ServerDrained) -> None:
    """Publish a change of the fleet on the namespace's control topic."""
    topics = Topics(config.kafka.namespace)
    asyncio.run(publish_events(bootstrap, topics.control, [event], config.kafka.compression))


def added(
    config: Config,
    url: str,
    *,
    concurrency: int | None,
    weight: float | None,
    key_env: str | None,
) -> ev.ServerAdded:
    """The event ``servers add`` publishes, refused before it is (as every dispatcher
    would refuse it) when the config does not take the server or its key variable;
    without ``key_env`` the server gets no key."""
    check_added_server(config, url, key_env)
    if concurrency is not None and concurrency <= 0:
        raise ConfigError("--concurrency", f"must be positive, got {concurrency}")
    if weight is not None and not weight > 0:
        raise ConfigError("--weight", f"must be a positive number, got {weight}")
    return ev.ServerAdded(
        url=url.rstrip("/"),
        concurrency=concurrency,
        weight=weight,
        api_key_env=key_env,
        at=time.time(),
        by="tokenbudget servers add",
    )


def drained(url: str) -> ev.ServerDrained:
    """The event ``servers drain`` publishes."""
    return ev.ServerDrained(url=url, at=time.time(), by="tokenbudget servers drain")


async def _fleet_board(bootstrap: str, topics: Topics) -> BudgetBoard:
    """A board that has read the fleet's changes and its dispatchers' latest reports."""
    watcher = BudgetWatcher(bootstrap, topics, fleet_reports=True)
    await watcher.start()
    task = asyncio.create_task(watcher.run())
    try:
        await watcher.caught_up.wait()
    finally:
        await cancel_and_wait(task, ignore_errors=True)
        await watcher.stop()
    return watcher.board


def listing(config: Config, bootstrap: str, as_json: bool) -> str:
    """``servers list``: the fleet as configured and changed, and as its dispatchers
    last reported it."""
    tracker = FleetTracker()
    board = asyncio.run(_fleet_board(bootstrap, Topics(config.kafka.namespace)))
    for change in board.fleet.changes:
        tracker.observe(change)
    tracker.follow(board)
    rows = tracker.rows(s.url for s in config.servers)
    if as_json:
        return json.dumps({"servers": [asdict(r) for r in rows]}, indent=2)
    return table(rows)
