"""One module per command of the application, each with ``add_arguments(parser)``
and ``main(args) -> int`` (the exit code); :mod:`tokenbudget.cli` imports only the
one the command line names.

Every option has a help line and every command's help ends with an example
(:func:`examples`); tests/tokenbudget/test_cli.py walks the whole parser for both.
"""

from __future__ import annotations

import argparse

# The help of every command's --config: what most commands take first.
CONFIG_HELP = "the job's config file (TOML; docs/configuration.md)"


def examples(*lines: str) -> str:
    """A command's epilog: command lines shown as written (indented lines are kept
    by the command line's help formatter, paragraphs wrapped)."""
    title = "example:" if len(lines) == 1 else "examples:"
    return "\n".join([title, *(f"  {line}" for line in lines)])


def add_config(
    parser: argparse.ArgumentParser, *, required: bool = True, help: str = CONFIG_HELP
) -> None:
    parser.add_argument("--config", required=required, metavar="FILE", help=help)


def add_server(parser: argparse.ArgumentParser) -> None:
    """``--server URL``, once per server: the fleet instead of the config's (``run``
    and ``dispatch``)."""
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="URL",
        help="an inference server, once per server of the fleet: these instead of the "
        "config.s (docs/servers.md)",
    )
