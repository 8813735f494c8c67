"""``tokenbudget dispatch``: one dispatcher process, until SIGTERM (then it
finishes what it holds and releases its leases)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenbudget.app.assembly import start_dispatcher, start_watcher
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.commands import add_config, add_server, examples
from tokenbudget.core import config as config_module
from tokenbudget.core import metrics, tasks
from tokenbudget.core.files import write_atomic
from tokenbudget.streams.topics import Topics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "One dispatcher process: it takes the job's prompts, admits each against its "
        "dataset's budget, sends it to the inference server and publishes its outcome. "
        "`run` starts one (and N with --dispatchers N); start more, on any host, to share "
        "the budgets. SIGTERM: it finishes its requests, hands back its leases and commits; "
        "SIGINT: it publishes the answers it has and hands back the requests still at the "
        "server."
    )
    parser.epilog = examples(
        "tokenbudget dispatch --config job.toml --instance gpu-box-2 --metrics-port 9470"
    )
    add_config(parser)
    parser.add_argument(
        "--report", metavar="PATH", help="write refusal times and counts here on exit (JSON)"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, metavar="PORT", help="serve /metrics (0: off)"
    )
    parser.add_argument(
        "--instance",
        default="",
        help="a name unique in the job: restarted under it, the dispatcher takes its "
        "prompts straight back (Kafka static group membership)",
    )
    add_server(parser)


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    if args.server:
        config = config_module.with_servers(config, args.server)
    bootstrap = resolve_bootstrap(config)
    if args.metrics_port:
        metrics.serve(config.metrics.host, args.metrics_port, config.kafka.namespace, "dispatch")
    report = Path(args.report) if args.report else None
    tasks.run(dispatch_until_stopped(config, bootstrap, report, args.instance or None))
    return 0


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
    watching = await start_watcher(bootstrap, Topics(config.kafka.namespace))
    try:
        dispatching = start_dispatcher(
            config, bootstrap, watching.board, instance=instance, signals=True
        )
        await dispatching.task
    finally:
        await watching.stop()
    if report_path is None:
        return
    dispatcher = dispatching.dispatcher
    refused = dict(dispatcher.refused_at)
    for name, view in watching.board.views.items():
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
