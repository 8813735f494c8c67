"""``tokenbudget status``: each dataset's budget, kept tokens, rate, ETA and state,
read from the ledger's snapshots (read-only: it starts nothing)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from tokenbudget.app.bootstrap import local_broker_settings, resolve_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.app.saved_plan import planned
from tokenbudget.app.status import Tracker, follow, to_json
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import TokenBudgetError
from tokenbudget.core.kafka_admin import topic_layout
from tokenbudget.localkafka import broker
from tokenbudget.streams.topics import Topics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Per dataset: budget, kept, reserved, remaining, % used, tokens/s, ETA and state, "
        "read from the ledger's snapshots, and the samples kept beside those the last plan "
        "said the budget needs. Read-only: it never starts a broker."
    )
    parser.epilog = examples("tokenbudget status --config job.toml --watch")
    add_config(parser)
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--interval", type=float, default=1.0, help="--watch refresh, seconds")


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    if config.kafka.bootstrap == "local":
        # Read-only: never start a broker just to say there is nothing to show.
        settings = local_broker_settings(config)
        state = broker.status(settings)
        if not state.ready:
            how = "is starting" if state.running else "is not running"
            raise TokenBudgetError(
                f"the local broker ({state.bootstrap}) {how}, so no job of this config runs; "
                f"start it with `{_broker_up(settings)}`, or start the job with "
                f"`tokenbudget run --config {args.config}`"
            )
        bootstrap = state.bootstrap
    else:
        bootstrap = resolve_bootstrap(config, create_topics=False)  # registers TLS/SASL
    topics = Topics(config.kafka.namespace)
    names = [d.name for d in config.datasets]
    budgets = {d.name: d.budget for d in config.datasets}
    if not _wait_until_ran(bootstrap, topics, args):
        if args.json:  # the same shape: every dataset without a snapshot yet
            print(json.dumps(to_json(Tracker().rows(names, budgets), time.time()), indent=2))
        return 0
    return asyncio.run(
        follow(
            bootstrap,
            topics,
            names,
            budgets,
            watch=args.watch,
            as_json=args.json,
            interval=args.interval,
            planned=planned(config),
            servers=[server.url for server in config.servers],
        )
    )


def _wait_until_ran(bootstrap: str, topics: Topics, args: argparse.Namespace) -> bool:
    """Whether the namespace has its topics (a job, or `broker up`, made them); if it
    has not, say so in one line and, with ``--watch``, wait until it has."""
    if topic_layout(bootstrap, topics.budgets) is not None:
        return True
    print(
        f"namespace {topics.namespace!r} has never run on {bootstrap} (no topic "
        f"{topics.budgets}): nothing to show; `tokenbudget run --config {args.config}` "
        "starts it" + ("; waiting for it" if args.watch else ""),
        file=sys.stderr if args.json else sys.stdout,
        flush=True,
    )
    if not args.watch:
        return False
    while topic_layout(bootstrap, topics.budgets) is None:
        time.sleep(args.interval)
    return True


def _broker_up(settings: broker.BrokerSettings) -> str:
    """The command that starts this broker: ``broker up`` reads its ports from the
    environment only, not from ``[kafka] local_port``."""
    if settings.port == broker.BrokerSettings.from_env().port:
        return "tokenbudget broker up"
    return (
        f"TOKENBUDGET_KAFKA_PORT={settings.port} "
        f"TOKENBUDGET_KAFKA_CONTROLLER_PORT={settings.controller_port} tokenbudget broker up"
    )
