"""``tokenbudget dispatch``: one dispatcher process, until SIGTERM (then it
finishes what it holds and releases its leases)."""

from __future__ import annotations

import argparse

from tokenbudget.app.control import run_dispatch_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--report", help="write refusal times and counts here on exit (JSON)")
    parser.add_argument("--metrics-port", type=int, default=0, help="serve /metrics (0: off)")
    parser.add_argument(
        "--instance",
        default="",
        help="a name unique in the job: restarted under it, the dispatcher takes its "
        "prompts straight back (Kafka static group membership)",
    )
    add_server(parser)


def add_server(parser: argparse.ArgumentParser) -> None:
    """``--server URL``, once per server: the fleet instead of the config's (``run``
    and ``dispatch``)."""
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="URL",
        help="an inference server, once per server: these instead of the config's",
    )


def main(args: argparse.Namespace) -> int:
    return run_dispatch_cli(args)
