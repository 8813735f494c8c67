"""A job's budgets on the control topic: the ones a job starts with
(:func:`publish_budgets`, by ``run`` and ``produce``), and ``budget set|show``, which
change one while a job runs or print the ledger's view beside the config's."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from tokenbudget.app import precedence
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.tables import format_table
from tokenbudget.core import config as config_module
from tokenbudget.core import metrics
from tokenbudget.core.config import Config, parse_budget
from tokenbudget.core.errors import ConfigError
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.publisher import publish_events
from tokenbudget.streams.topics import Topics


async def publish_budgets(config: Config, bootstrap: str) -> list[precedence.BudgetChoice]:
    """Put each dataset's budget in force for a job: the config's, unless a value set
    with ``budget set`` holds (:mod:`tokenbudget.app.precedence`); say on stderr which
    one a dataset runs with, and why, when a set value was involved."""
    topics = Topics(config.kafka.namespace)
    latest = await asyncio.to_thread(precedence.latest_budget_sets, bootstrap, topics)
    chosen = precedence.choices(config, latest)
    events = [precedence.config_budget_set(config, c) for c in chosen if c.source == "config"]
    if events:
        await publish_events(bootstrap, topics.control, events, config.kafka.compression)
        metrics.EVENTS_PRODUCED.labels(topic="control").inc(len(events))
    for choice in chosen:
        if (line := choice.explain()) is not None:
            print(f"tokenbudget: {line}", file=sys.stderr)
    return chosen


def run_budget_cli(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    bootstrap = resolve_bootstrap(config)
    topics = Topics(config.kafka.namespace)
    if args.budget_command == "set":
        return _set_budget(config, bootstrap, topics, args.dataset, args.budget, args.force)
    return _show_budgets(config, bootstrap, topics, args.json)


def _set_budget(
    config: config_module.Config,
    bootstrap: str,
    topics: Topics,
    dataset: str,
    raw_budget: str,
    force: bool,
) -> int:
    configured = {d.name: d.budget for d in config.datasets}
    if dataset not in configured and not force:
        raise ConfigError(
            "datasets",
            f"{dataset!r} is not a dataset of this config ({', '.join(sorted(configured))});"
            " pass --force to set it anyway",
            source=config.source,
        )
    budget = parse_budget(raw_budget, "budget")
    event = ev.BudgetSet(
        dataset=dataset,
        budget=budget,
        unit=config.budget.unit,
        set_at=time.time(),
        set_by=precedence.SET_BY_COMMAND,
        config_budget=configured.get(dataset),
    )
    asyncio.run(publish_events(bootstrap, topics.control, [event], config.kafka.compression))
    unit = config.budget.unit
    if dataset in configured:
        later = f"later jobs keep it while the config's {configured[dataset]:,} is unchanged"
    else:
        later = "later jobs of this config do not run it"
    print(f"{dataset}: budget set to {budget:,} {unit}; a running job applies it now, {later}")
    return 0


def _show_budgets(
    config: config_module.Config, bootstrap: str, topics: Topics, as_json: bool
) -> int:
    """The ledger's view of each dataset, beside the config's budget, the one set with
    ``budget set`` and which of them the next job runs with."""
    board = BudgetBoard()
    latest: dict[str, ev.BudgetSet] = {}

    def apply(event: ev.Event) -> None:
        board.apply(event)
        if isinstance(event, ev.BudgetSet):
            latest[event.dataset] = event

    read_to_end(bootstrap, topics.budgets, apply)
    read_to_end(bootstrap, topics.control, apply)
    snapshots = {n: v.snapshot for n, v in board.views.items() if v.snapshot is not None}
    choices = {c.dataset: c for c in precedence.choices(config, latest)}
    names = [*choices, *sorted(set(snapshots) - set(choices))]
    if as_json:
        print(json.dumps({n: _shown(snapshots.get(n), choices.get(n)) for n in names}, indent=2))
        return 0
    rows = [_row(n, snapshots.get(n), choices.get(n)) for n in names]
    headers = [
        "dataset",
        "budget",
        "config",
        "set",
        "next run",
        "unit",
        "completion_tokens",
        "reserved",
        "samples",
        "skipped",
        "status",
    ]
    print(format_table(headers, rows) if rows else "no datasets and no ledger snapshots yet")
    return 0


def _shown(
    s: ev.LedgerSnapshot | None, choice: precedence.BudgetChoice | None
) -> dict[str, object]:
    shown: dict[str, object] = {
        "config_budget": choice.config if choice else None,
        "set_budget": choice.set_value if choice else None,
        "next_run": choice.source if choice else None,
    }
    if s is not None:
        shown |= {
            "budget": s.budget,
            "unit": s.unit,
            "completion_tokens": s.completion_tokens,
            "prompt_tokens": s.prompt_tokens,
            "samples": s.samples,
            "reserved": s.reserved,
            "skipped": s.skipped,
            "failed": s.failed,
            "halted": s.halted,
            "status": s.status,
            "at": s.at,
        }
    return shown


def _row(
    name: str, s: ev.LedgerSnapshot | None, choice: precedence.BudgetChoice | None
) -> list[object]:
    def n(value: int | None) -> str:
        return "-" if value is None else f"{value:,}"

    budgets = [
        n(s.budget if s else None),
        n(choice.config if choice else None),
        n(choice.set_value if choice else None),
        choice.source if choice else "-",
    ]
    if s is None:  # not run yet
        return [name, *budgets, choice.unit if choice else "-", *["-"] * 5]
    ledger = [f"{s.completion_tokens:,}", f"{s.reserved:,}", s.samples, s.skipped, s.status]
    return [name, *budgets, s.unit, *ledger]
