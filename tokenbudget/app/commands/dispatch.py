"""``tokenbudget dispatch``: one dispatcher process, until SIGTERM (then it
finishes what it holds and releases its leases)."""

from __future__ import annotations

import argparse

from tokenbudget.app.commands import add_config, add_server, examples
from tokenbudget.app.control import run_dispatch_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "One dispatcher process: it takes the job's prompts, admits each against its "
        "dataset's budget, sends it to the inference server and publishes its outcome. "
        "`run` starts one (and N with --dispatchers N); start more, on any host, to share "
        "the budgets. SIGTERM: it finishes its requests, hands back its leases and commits; "
        "SIGINT: it publishes the answers it has and hands back the requests still at the "
        "server."
    )
    parser.epilog = examples(
        "tokenbudget dispatch --config job.toml --instance gpu-box-2 --metrics-port 9470"
    )
    add_config(parser)
    parser.add_argument(
        "--report", metavar="PATH", help="write refusal times and counts here on exit (JSON)"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, metavar="PORT", help="serve /metrics (0: off)"
    )
    parser.add_argument(
        "--instance",
        default="",
        help="a name unique in the job: restarted under it, the dispatcher takes its "
        "prompts straight back (Kafka static group membership)",
    )
    add_server(parser)


def main(args: argparse.Namespace) -> int:
    return run_dispatch_cli(args)
