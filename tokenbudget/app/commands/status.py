"""``tokenbudget status``: each dataset's budget, kept tokens, rate, ETA and state,
read from the ledger's snapshots (read-only: it starts nothing)."""

from __future__ import annotations

import argparse
import asyncio

from streams.topics import Topics
from tokenbudget import config as config_module
from tokenbudget.app.bootstrap import local_broker_settings, resolve_bootstrap
from tokenbudget.app.saved_plan import planned
from tokenbudget.app.status import follow
from tokenbudget.errors import TokenBudgetError
from tokenbudget.localkafka import broker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--interval", type=float, default=1.0, help="--watch refresh, seconds")


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    if config.kafka.bootstrap == "local":
        # Read-only: never start a broker just to say there is nothing to show.
        state = broker.status(local_broker_settings(config))
        if not state.ready:
            raise TokenBudgetError(f"the local broker ({state.bootstrap}) is not running")
        bootstrap = state.bootstrap
    else:
        bootstrap = resolve_bootstrap(config, create_topics=False)  # registers TLS/SASL
    names = [d.name for d in config.datasets]
    budgets = {d.name: d.budget for d in config.datasets}
    return asyncio.run(
        follow(
            bootstrap,
            Topics(config.kafka.namespace),
            names,
            budgets,
            watch=args.watch,
            as_json=args.json,
            interval=args.interval,
            planned=planned(config),
        )
    )
