"""``tokenbudget budget set|show``: change a dataset's budget while a job runs (a
raise resumes it, a lower one halts it), or print the ledger."""

from __future__ import annotations

import argparse

from tokenbudget.app.control import run_budget_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="budget_command", required=True)
    set_cmd = sub.add_parser("set", help="publish a new budget: raise resumes, lower halts")
    set_cmd.add_argument("dataset")
    set_cmd.add_argument("budget", help="10M, 250k, 1_000_000")
    set_cmd.add_argument("--config", required=True)
    set_cmd.add_argument("--force", action="store_true")
    show = sub.add_parser("show", help="print the ledger")
    show.add_argument("--config", required=True)
    show.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    return run_budget_cli(args)
