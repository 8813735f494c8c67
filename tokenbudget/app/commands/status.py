"""``tokenbudget status``: each dataset's budget, kept tokens, rate, ETA and state,
read from the ledger's snapshots (read-only: it starts nothing)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from tokenbudget.app.bootstrap import reading_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.app.jobs import describe, job_names
from tokenbudget.app.saved_plan import planned
from tokenbudget.app.status import Tracker, follow, to_json
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ConfigError, TokenBudgetError
from tokenbudget.core.kafka_admin import topic_layout
from tokenbudget.streams.topics import Topics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Per dataset: budget, kept, reserved, remaining, % used, tokens/s, ETA and state, "
        "read from the ledger's snapshots, and the samples kept beside those the last plan "
        "said the budget needs. Of the job of --config, or of JOB by its name (`tokenbudget "
        "jobs` lists them), on the local broker unless --config or --bootstrap says where. "
        "Read-only: it never starts a broker."
    )
    parser.epilog = examples(
        "tokenbudget status --config job.toml --watch", "tokenbudget status job-3f9a1c2e"
    )
    parser.add_argument("job", nargs="?", help="a job's name, instead of --config")
    add_config(parser, required=False)
    parser.add_argument(
        "--bootstrap", default="", metavar="HOST:PORT", help="where JOB runs (a cluster)"
    )
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--interval", type=float, default=1.0, help="--watch refresh, seconds")


def main(args: argparse.Namespace) -> int:
    if not args.config and not args.job:
        raise ConfigError("--config", "give the job's config, or its name (tokenbudget jobs)")
    config = config_module.load(args.config) if args.config else None
    bootstrap = reading_bootstrap(config, args.bootstrap)
    if config is None:
        return _status_of_named(args, bootstrap)
    topics = Topics(config.kafka.namespace)
    names = [d.name for d in config.datasets]
    budgets = {d.name: d.budget for d in config.datasets}
    if not _wait_until_ran(bootstrap, topics, args, f"tokenbudget run --config {args.config}"):
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


def _status_of_named(args: argparse.Namespace, bootstrap: str) -> int:
    """``status JOB``: its datasets as its record names them, its budgets as the
    ledger last showed them; no config needed."""
    job = describe(bootstrap, args.job)
    if job is None:
        known = ", ".join(job_names(bootstrap)) or "none"
        raise TokenBudgetError(
            f"no job {args.job!r} on {bootstrap} (its jobs: {known}); `tokenbudget jobs` lists them"
        )
    budgets = {d.name: d.budget for d in job.datasets if d.budget is not None}
    names = [d.name for d in job.datasets]
    return asyncio.run(
        follow(
            bootstrap,
            Topics(job.name),
            names,
            budgets,
            watch=args.watch,
            as_json=args.json,
            interval=args.interval,
        )
    )


def _wait_until_ran(bootstrap: str, topics: Topics, args: argparse.Namespace, run: str) -> bool:
    """Whether the namespace has its topics (a job, or `broker up`, made them); if it
    has not, say so in one line and, with ``--watch``, wait until it has."""
    if topic_layout(bootstrap, topics.budgets) is not None:
        return True
    print(
        f"job {topics.namespace!r} has never run on {bootstrap} (no topic "
        f"{topics.budgets}): nothing to show; `{run}` starts it"
        + ("; waiting for it" if args.watch else ""),
        file=sys.stderr if args.json else sys.stdout,
        flush=True,
    )
    if not args.watch:
        return False
    while topic_layout(bootstrap, topics.budgets) is None:
        time.sleep(args.interval)
    return True
