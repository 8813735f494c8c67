"""``tokenbudget jobs``: the jobs a broker or cluster holds, each with its datasets,
kept and budget, state, first and last run, and its config file as recorded."""

from __future__ import annotations

import argparse
import json

from tokenbudget.app.bootstrap import reading_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.app.jobs import every_job, table, to_json
from tokenbudget.core import config as config_module


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The jobs on the local broker (or on the cluster of --config or --bootstrap): each "
        "job's name, datasets, kept and budget (in each budget's unit, from the ledger's "
        "latest snapshots), state (running: a ledger worker of it is up; halted: "
        "every budget reached; finished: every dataset reached its budget or its end; "
        "interrupted: a rerun of its config resumes it), first and last run, and its "
        "config file as its last run recorded it. Read-only: it never starts a broker."
    )
    parser.epilog = examples("tokenbudget jobs", "tokenbudget jobs --json")
    add_config(parser, required=False, help="a job's config: its cluster is listed")
    parser.add_argument("--bootstrap", default="", metavar="HOST:PORT", help="a cluster to list")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config) if args.config else None
    jobs = every_job(reading_bootstrap(config, args.bootstrap))
    if args.json:
        print(json.dumps(to_json(jobs), indent=2))
    elif jobs:
        print(table(jobs))
    else:
        print("no jobs")
    return 0
