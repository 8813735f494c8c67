"""``tokenbudget run``: a whole job to its budgets, then its table."""

from __future__ import annotations

import argparse
import functools
import json
import sys

from tokenbudget import config as config_module
from tokenbudget.app import plan, runner
from tokenbudget.app.report import print_table

EXIT_PROMPTS_FAILED = 3  # the job ended, but some prompts failed for good


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--dispatchers", type=int, default=1, help="dispatcher processes sharing the budgets"
    )
    parser.add_argument(
        "--ledgers", type=int, default=1, help="ledger worker processes sharing the datasets"
    )


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    report = runner.run(
        config,
        progress=False if args.json else None,
        dispatchers=args.dispatchers,
        ledgers=args.ledgers,
        on_start=functools.partial(plan.announce, config),
    )
    kept = plan.kept_report(config)
    if args.json:
        print(json.dumps({**report.to_json(), "kept": [k.to_json() for k in kept]}, indent=2))
    else:
        print_table(report)
        print("\n" + plan.kept_table(kept))
    if report.failed:
        print(
            f"tokenbudget: {report.failed} prompt(s) failed for good (see the log); exit code 3",
            file=sys.stderr,
        )
        return EXIT_PROMPTS_FAILED
    return 0
