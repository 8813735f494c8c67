"""``tokenbudget produce``: the prompt producer on its own."""

from __future__ import annotations

import argparse

from tokenbudget.app.commands import add_config, examples
from tokenbudget.app.commands.run import add_resume_changed
from tokenbudget.app.control import run_produce_cli


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
    return run_produce_cli(args)
