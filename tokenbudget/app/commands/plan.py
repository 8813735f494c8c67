"""``tokenbudget plan``: what each dataset's budget will buy, before it is spent."""

from __future__ import annotations

import argparse
import asyncio
import json

from tokenbudget.app import plan, saved_plan
from tokenbudget.app.commands import add_config, examples
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "What each dataset's budget will buy, before it is spent: prompts available, their "
        "tokens, answer lengths, the prompts the budget needs, whether it fills or runs out "
        "first, and the time. Answer lengths come from rows an earlier run kept, else from a "
        "pilot (--pilot N); without either they are unknown. Without --pilot it touches no "
        "broker and no server."
    )
    parser.epilog = examples("tokenbudget plan --config job.toml --pilot 20")
    add_config(parser)
    parser.add_argument(
        "--pilot",
        type=int,
        default=0,
        metavar="N",
        help="send N requests of each dataset without earlier rows first (kept, and "
        "counted against its budget) to measure its answers",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    if args.pilot < 0:
        raise ConfigError("--pilot", f"must be 0 or more, got {args.pilot}", source="command line")
    config = config_module.load(args.config)
    result = asyncio.run(plan.make_plan(config, pilot=args.pilot))
    saved_plan.save(config, result.to_json())
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(plan.table(result))
    return 0
