"""Commands that steer a running job: ``dispatch`` and ``budget set|show``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path

from producers.datasets import check_datasets
from producers.dispatcher import Dispatcher
from producers.prompts import PromptProducer
from sinks.parquet import stored_prompt_ids
from sinks.replay import live_snapshots
from streams import events as ev
from streams.halts import BudgetWatcher
from streams.publisher import publish_events
from streams.topics import Topics
from tokenbudget import config as config_module
from tokenbudget import metrics
from tokenbudget.app import identity
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.runner import publish_budgets
from tokenbudget.app.tables import format_table
from tokenbudget.config import parse_budget
from tokenbudget.errors import ConfigError


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
        watch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watch_task
        await watcher.stop()
    if report_path is not None:
        refused = dict(dispatcher.refused_at)
        for name, view in watcher.board.views.items():
            if view.halted_at is not None:
                refused[name] = min(refused.get(name, view.halted_at), view.halted_at)
        report_path.write_text(
            json.dumps(
                {
                    "holder": dispatcher.holder,
                    "refused_at": refused,
                    "completed": dispatcher.report.completed,
                    "skipped": dispatcher.report.skipped,
                    "failed": dispatcher.report.failed,
                }
            )
        )


def run_dispatch_cli(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    bootstrap = resolve_bootstrap(config)
    if args.metrics_port:
        metrics.serve(config.metrics.host, args.metrics_port, config.kafka.namespace, "dispatch")
    report = Path(args.report) if args.report else None
    asyncio.run(dispatch_until_stopped(config, bootstrap, report, args.instance or None))
    return 0


async def produce_until_done(
    config: config_module.Config, bootstrap: str, *, resume_changed: bool = False
) -> None:
    """The prompt producer on its own: publishes every dataset's prompts (paced by
    the ledger's snapshots) until each is read to its end or halted. SIGTERM stops
    it early: what was sent is flushed; a restart skips what was completed. Like
    ``run``, it first settles whether this is the namespace's job (:mod:`.identity`)."""

    topics = Topics(config.kafka.namespace)
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
            config, bootstrap, watcher.board, stored_prompt_ids=stored_prompt_ids(config)
        )
        reports = await producer.run(interrupt=interrupt)
    finally:
        watch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watch_task
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
    asyncio.run(produce_until_done(config, bootstrap, resume_changed=args.resume_changed))
    return 0


def run_budget_cli(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    bootstrap = resolve_bootstrap(config)
    topics = Topics(config.kafka.namespace)
    if args.budget_command == "set":
        names = {d.name for d in config.datasets}
        if args.dataset not in names and not args.force:
            raise ConfigError(
                "datasets",
                f"{args.dataset!r} is not a dataset of this config ({', '.join(sorted(names))});"
                " pass --force to set it anyway",
                source=config.source,
            )
        budget = parse_budget(args.budget, "budget")
        event = ev.BudgetSet(
            dataset=args.dataset,
            budget=budget,
            unit=config.budget.unit,
            set_at=time.time(),
            set_by="tokenbudget budget set",
        )
        asyncio.run(publish_events(bootstrap, topics.budgets, [event], config.kafka.compression))
        print(f"{args.dataset}: budget set to {budget:,} {config.budget.unit}")
        return 0
    snapshots = dict(sorted(live_snapshots(bootstrap, topics).items()))
    if args.json:
        print(
            json.dumps(
                {
                    name: {
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
                    for name, s in snapshots.items()
                },
                indent=2,
            )
        )
        return 0
    rows = [
        [
            name,
            f"{s.budget:,}" if s.budget is not None else "-",
            s.unit,
            f"{s.completion_tokens:,}",
            f"{s.reserved:,}",
            s.samples,
            s.skipped,
            s.status,
        ]
        for name, s in snapshots.items()
    ]
    headers = [
        "dataset",
        "budget",
        "unit",
        "completion_tokens",
        "reserved",
        "samples",
        "skipped",
        "status",
    ]
    print(format_table(headers, rows) if rows else "no ledger snapshots yet")
    return 0
