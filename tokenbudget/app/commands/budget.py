"""``tokenbudget budget set|show``: change a dataset's budget while a job runs (a
raise resumes it, a lower one halts it), or print the ledger."""

from __future__ import annotations

import argparse

from tokenbudget.app.commands import add_config, examples
from tokenbudget.app.control import run_budget_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Set a dataset's budget, with or without a job running (a running job applies it "
        "at once: a raise resumes a halted dataset, a lowering cuts what is in flight at the "
        "new line; later jobs keep it while the config's own value is unchanged), or show "
        "every dataset's budgets and counts."
    )
    parser.epilog = examples(
        "tokenbudget budget set B2 12M --config job.toml",
        "tokenbudget budget show --config job.toml",
    )
    sub = parser.add_subparsers(
        dest="budget_command", required=True, metavar="{set,show}", help="what to do"
    )
    set_cmd = sub.add_parser(
        "set",
        help="publish a new budget: raise resumes, lower halts",
        description="Publish a dataset's new budget on the control topic: a running job "
        "applies it at once, and later jobs keep it while the config's value for the "
        "dataset is unchanged (docs/running.md, Budgets set by hand).",
        epilog=examples("tokenbudget budget set B2 12M --config job.toml"),
    )
    set_cmd.add_argument("dataset", help="the dataset's name, as in the config")
    set_cmd.add_argument("budget", help="the new budget: 10M, 250k, 1.5M, 1_000_000")
    add_config(set_cmd)
    set_cmd.add_argument(
        "--force",
        action="store_true",
        help="set it even for a dataset the config does not list (refused without it, "
        "since a misspelt name would set a budget no job uses)",
    )
    show = sub.add_parser(
        "show",
        help="print the ledger's budgets and counts",
        description="Per dataset: the ledger's budget, the config's value, the value set "
        "with `budget set`, which of the two the next run uses, kept, reserved, samples, "
        "skipped and status.",
        epilog=examples("tokenbudget budget show --config job.toml --json"),
    )
    add_config(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    return run_budget_cli(args)
