"""Commands that steer a running job: ``dispatch`` and ``budget set|show``."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import signal
import time
from pathlib import Path

from tokenbudget.app import identity, precedence
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.runner import publish_budgets
from tokenbudget.app.tables import format_table
from tokenbudget.core import config as config_module
from tokenbudget.core import metrics, roles, tasks
from tokenbudget.core.config import parse_budget
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.files import write_atomic
from tokenbudget.core.tasks import cancel_and_wait
from tokenbudget.producers.dispatch.dispatcher import Dispatcher
from tokenbudget.producers.prompts.datasets import check_datasets
from tokenbudget.producers.prompts.producer import PromptProducer
from tokenbudget.sinks.parquet import stored_prompt_ids
from tokenbudget.sinks.reading import kept_completions, read_to_end
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard, BudgetWatcher
from tokenbudget.streams.publisher import publish_events
from tokenbudget.streams.topics import Topics


async def dispatch_until_stopped(
    config: config_module.Config,
    bootstrap: str,
    report_path: Path | None = None,
    instance: str | None = None,
) -> None:
    """One dispatcher process: runs until SIGTERM or SIGINT, then hands back its
    leases, commits and exits. On SIGTERM it first finishes the requests it started;
    on SIGINT (``run`` stopped by Ctrl-C) it publishes the answers it has and hands
    back the requests still at the server, for the group's next dispatcher."""
    topics = Topics(config.kafka.namespace)
    watcher = BudgetWatcher(bootstrap, topics)
    await watcher.start()
    watch_task = asyncio.create_task(watcher.run())
    stop = asyncio.Event()
    dispatcher = Dispatcher(config, bootstrap, watcher.board, instance=instance)

    def hand_back() -> None:
        dispatcher.hand_back()
        stop.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, hand_back)
    try:
        await dispatcher.run(stop)
    finally:
        await cancel_and_wait(watch_task, ignore_errors=True)
        await watcher.stop()
    if report_path is not None:
        refused = dict(dispatcher.refused_at)
        for name, view in watcher.board.views.items():
            if view.halted_at is not None:
                refused[name] = min(refused.get(name, view.halted_at), view.halted_at)
        write_atomic(
            report_path,
            json.dumps(
                {
                    "holder": dispatcher.holder,
                    "refused_at": refused,
                    "completed": dispatcher.report.completed,
                    "skipped": dispatcher.report.skipped,
                    "failed": dispatcher.report.failed,
                }
            ),
        )


def run_dispatch_cli(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    if args.server:
        config = config_module.with_servers(config, args.server)
    bootstrap = resolve_bootstrap(config)
    if args.metrics_port:
        metrics.serve(config.metrics.host, args.metrics_port, config.kafka.namespace, "dispatch")
    report = Path(args.report) if args.report else None
    tasks.run(dispatch_until_stopped(config, bootstrap, report, args.instance or None))
    return 0


async def produce_until_done(
    config: config_module.Config, bootstrap: str, *, resume_changed: bool = False
) -> None:
    """The prompt producer on its own: publishes every dataset's prompts (paced by
    the ledger's snapshots) until each is read to its end or halted. SIGTERM stops
    it early: what was sent is flushed; a restart skips what was completed. Like
    ``run``, it first settles whether this is the namespace's job (:mod:`.identity`)."""

    topics = Topics(config.kafka.namespace)
    with roles.acting_as("operator"):  # the job's record and budgets are operators' commands
        await identity.settle(config, bootstrap, resume_changed=resume_changed, command="produce")
        await publish_budgets(config, bootstrap)
    interrupt = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, interrupt.set)
    watcher = BudgetWatcher(bootstrap, topics)
    await watcher.start()
    watch_task = asyncio.create_task(watcher.run())
    try:
        await watcher.caught_up.wait()
        producer = PromptProducer(
            config,
            bootstrap,
            watcher.board,
            stored_prompt_ids=stored_prompt_ids(config),
            kept_completions=functools.partial(kept_completions, bootstrap, topics),
        )
        reports = await producer.run(interrupt=interrupt)
    finally:
        await cancel_and_wait(watch_task, ignore_errors=True)
        await watcher.stop()
    for name, report in reports.items():
        line = f"{name}: {report.produced} prompts produced ({report.reason})"
        extras = [
            f"{count} {label}"
            for count, label in (
                (report.not_sent, "not sent, recorded as skipped"),
                (report.already_done, "already done"),
                (report.bad_rows, "bad rows skipped"),
            )
            if count
        ]
        print(line + (f"; {', '.join(extras)}" if extras else ""))


def run_produce_cli(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    check_datasets(config)  # before the broker is asked for anything
    bootstrap = resolve_bootstrap(config)
    tasks.run(produce_until_done(config, bootstrap, resume_changed=args.resume_changed))
    return 0


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
