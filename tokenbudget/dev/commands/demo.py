"""``tokenbudget demo``: eight datasets against the simulator, on the local broker."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenbudget.config import parse_budget
from tokenbudget.dev.demo import run_demo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default="demo-out")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--budget", default="400k", help="every dataset's budget (e.g. 50k)")


def main(args: argparse.Namespace) -> int:
    budget = parse_budget(args.budget, "--budget")
    return run_demo(Path(args.workdir), json_output=args.json, budget=budget)
