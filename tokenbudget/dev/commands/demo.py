"""``tokenbudget demo``: eight datasets against the simulator, on the local broker."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenbudget.app.commands import examples
from tokenbudget.core.config import parse_budget
from tokenbudget.dev.demo import run_demo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Eight JSONL datasets modelled on the run that motivated tokenbudget, run against "
        "the simulator on the local broker, each to its budget; the table shows per "
        "dataset the tokens kept, the overshoot and the status, beside what a sample cap "
        "chosen from the average answer would have kept. The broker is left running."
    )
    parser.epilog = examples(
        "tokenbudget demo", "tokenbudget demo --budget 50k --workdir /tmp/demo"
    )
    parser.add_argument(
        "--workdir",
        default="demo-out",
        metavar="DIR",
        help="where the config, datasets, tokenizer and Parquet output go",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the run's report as JSON instead of the table"
    )
    parser.add_argument("--budget", default="400k", help="every dataset's budget (e.g. 50k)")


def main(args: argparse.Namespace) -> int:
    budget = parse_budget(args.budget, "--budget")
    return run_demo(Path(args.workdir), json_output=args.json, budget=budget)
