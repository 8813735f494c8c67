"""``tokenbudget produce``: the prompt producer on its own."""

from __future__ import annotations

import argparse
import asyncio
import signal

from tokenbudget.app import identity
from tokenbudget.app.assembly import start_producer, start_watcher
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.app.commands.run import add_resume_changed
from tokenbudget.app.control import publish_budgets
from tokenbudget.core import config as config_module
from tokenbudget.core import roles, tasks
from tokenbudget.producers.prompts.dataset_checks import check_datasets
from tokenbudget.producers.prompts.producer import ProduceReport
from tokenbudget.streams.topics import Topics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The prompt producer on its own: it publishes the config's budgets, then every "
        "dataset's prompts, paced by the ledger, until each is read to its end or halted. "
        "`run` starts one itself."
    )
    parser.epilog = examples("tokenbudget produce --config job.toml")
    add_config(parser)
    add_resume_changed(parser)


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    check_datasets(config)  # before the broker is asked for anything
    bootstrap = resolve_bootstrap(config)
    tasks.run(produce_until_done(config, bootstrap, resume_changed=args.resume_changed))
    return 0


async def produce_until_done(
    config: config_module.Config, bootstrap: str, *, resume_changed: bool = False
) -> None:
    """The prompt producer on its own: publishes every dataset's prompts (paced by
    the ledger's snapshots) until each is read to its end or halted. SIGTERM stops
    it early: what was sent is flushed; a restart skips what was completed. Like
    ``run``, it first settles whether this is the namespace's job (:mod:`.identity`)."""
    with roles.acting_as("operator"):  # the job's record and budgets are operators' commands
        await identity.settle(config, bootstrap, resume_changed=resume_changed, command="produce")
        await publish_budgets(config, bootstrap)
    interrupt = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, interrupt.set)
    watching = await start_watcher(bootstrap, Topics(config.kafka.namespace))
    try:
        await watching.watcher.caught_up.wait()
        producing = start_producer(config, bootstrap, watching.board, interrupt=interrupt)
        reports = await producing.task
    finally:
        await watching.stop()
    for name, report in reports.items():
        print(_produced_line(name, report))


def _produced_line(name: str, report: ProduceReport) -> str:
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
    return line + (f"; {', '.join(extras)}" if extras else "")
