"""``tokenbudget produce``: the prompt producer on its own."""

from __future__ import annotations

import argparse

from tokenbudget.app.commands.run import add_resume_changed
from tokenbudget.app.control import run_produce_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    add_resume_changed(parser)


def main(args: argparse.Namespace) -> int:
    return run_produce_cli(args)
