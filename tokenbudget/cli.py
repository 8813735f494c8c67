"""The ``tokenbudget`` command. Errors of ours end as one line on stderr, exit 2.

Each command is a module with ``add_arguments(parser)`` and ``main(args) -> int``:
the application's under :mod:`tokenbudget.app.commands`, the developer tools'
under :mod:`tokenbudget.dev.commands`. This module is the only one that knows both.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple

from tokenbudget import version
from tokenbudget.core import lifetime, roles
from tokenbudget.core.errors import EXPECTED_KAFKA_ERRORS, TokenBudgetError, expected_kafka_error

DESCRIPTION = "Exact per-dataset token budgets for synthetic data generation, over Kafka."


class Command(NamedTuple):
    module: str  # its add_arguments(parser) and main(args)
    group: str  # a key of GROUPS
    help: str  # one line
    # Whose Kafka login its clients use ([[kafka.roles]]; None: [kafka]'s own, an
    # admin's for `acls --apply`); `run` gives its parts theirs.
    role: roles.Role | None = "operator"


# The groups `tokenbudget --help` lists the commands in, in this order.
GROUPS: dict[str, str] = {
    "job": "commands for a job",
    "role": "process roles, which `run` starts itself (start one alone to run it elsewhere)",
    "dev": "developer tools",
}

# Command name -> its module, group and one line of help. Only the module of the
# command being run is imported: all of them (Faust, pyarrow, the simulator, ...) would
# add 0.15-0.4 s to every start, and `run` starts several children (bench/cli_startup.py).
COMMANDS: dict[str, Command] = {
    "init": Command(
        "tokenbudget.app.commands.init", "job", "write a job's config from its datasets and server"
    ),
    "plan": Command(
        "tokenbudget.app.commands.plan", "job", "what each budget will buy, before it is spent"
    ),
    "run": Command("tokenbudget.app.commands.run", "job", "run a job to its budgets"),
    "jobs": Command(
        "tokenbudget.app.commands.jobs", "job", "the jobs on a broker: kept, budget, state"
    ),
    "status": Command(
        "tokenbudget.app.commands.status", "job", "per-dataset budget, kept, rate, ETA, state"
    ),
    "budget": Command(
        "tokenbudget.app.commands.budget", "job", "set or show budgets, while a job runs or not"
    ),
    "servers": Command(
        "tokenbudget.app.commands.servers",
        "job",
        "add, drain or list the job's inference servers, while it runs or not",
    ),
    "export": Command(
        "tokenbudget.app.commands.export",
        "job",
        "the kept answers as training data (JSONL conversations, Parquet)",
    ),
    "replay": Command(
        "tokenbudget.app.commands.replay",
        "job",
        "read the completions topic again: Parquet, ledger audit, another topic, recount",
    ),
    "acls": Command(
        "tokenbudget.app.commands.acls",
        "job",
        "the Kafka ACLs that keep each role to its topics: printed, or applied",
        None,
    ),
    "produce": Command(
        "tokenbudget.app.commands.produce", "role", "the prompt producer on its own", "producer"
    ),
    "dispatch": Command(
        "tokenbudget.app.commands.dispatch",
        "role",
        "one dispatcher process (SIGTERM: finish, release)",
        "dispatcher",
    ),
    "ledger": Command(
        "tokenbudget.app.commands.ledger", "role", "one Faust budget ledger worker", "ledger"
    ),
    "sink": Command(
        "tokenbudget.app.commands.sink",
        "role",
        "the Parquet sink on its own (SIGTERM: flush, commit)",
        "sink",
    ),
    "broker": Command(
        "tokenbudget.dev.commands.broker", "dev", "the local Kafka broker (KRaft, from Maven jars)"
    ),
    "simulate": Command(
        "tokenbudget.dev.commands.simulate", "dev", "a simulated SGLang/OpenAI inference server"
    ),
    "demo": Command("tokenbudget.dev.commands.demo", "dev", "eight datasets against the simulator"),
}

EXAMPLES = (
    "tokenbudget init --server http://gpu-box:30000 data/a.jsonl data/b.parquet -o job.toml",
    "tokenbudget plan --config job.toml --pilot 20",
    "tokenbudget run --config job.toml",
)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, but a description's or epilog's indented lines (the
    examples) are kept as written; other paragraphs are wrapped as usual."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            lines = paragraph.splitlines()
            if any(line.startswith(" ") for line in lines):
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                paragraphs.append(super()._fill_text(paragraph, width, indent))
        return "\n\n".join(paragraphs)


class Parser(argparse.ArgumentParser):
    """Every parser of the command line, its commands' and their subcommands' too
    (argparse makes subparsers of the parent's class): one help formatter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def command_module(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name].module)


def command_list() -> str:
    """The commands by group, as `tokenbudget --help` lists them."""
    width = max(map(len, COMMANDS)) + 2
    sections = []
    for group, title in GROUPS.items():
        rows = [f"  {n:<{width}}{c.help}" for n, c in COMMANDS.items() if c.group == group]
        sections.append("\n".join([f"{title}:", *rows]))
    return "\n\n".join(sections)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the command line, only its command's module is
    imported (the others are listed by name, without their arguments)."""
    named = next((arg for arg in argv or () if not arg.startswith("-")), None)
    parser = Parser(
        prog="tokenbudget",
        usage="%(prog)s [-h] [--version] COMMAND ...",
        description=f"{DESCRIPTION}\n\n{command_list()}",
        epilog="`tokenbudget COMMAND --help` shows a command's options.\n\n"
        + "\n".join(["a job, from its datasets to its answers:", *(f"  {e}" for e in EXAMPLES)]),
    )
    parser.add_argument(
        "--version", action="version", version=f"tokenbudget {version()}", help="print the version"
    )
    # The commands are listed by group in the description, not by argparse.
    sub = parser.add_subparsers(
        prog="tokenbudget", dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS
    )
    for name, spec in COMMANDS.items():
        command = sub.add_parser(name, help=spec.help, description=spec.help)
        if argv is not None and name != named:
            continue
        module = command_module(name)
        module.add_arguments(command)
        command.set_defaults(func=module.main)
    return parser


EXIT_ERROR = 2  # a one-line error on stderr

# Loggers of the libraries we use: their warnings (kafka-python's "Task ... ran for",
# "group_id is None", aiokafka's reconnects) are ours to report, not the user's to
# read, unless TOKENBUDGET_LOG asks for that level.
_THIRD_PARTY = frozenset(
    {"kafka", "aiokafka", "faust", "mode", "httpx", "httpcore", "aiohttp", "asyncio"}
)


class QuietLibraries(logging.Filter):
    """Lets through every record of ours, and the libraries' errors only, less those
    about a leader election or a rebalance (:data:`EXPECTED_KAFKA_ERRORS`: aiokafka
    logs a fresh topic's ``NotLeaderForPartitionError`` as an error, and retries it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".")[0] not in _THIRD_PARTY:
            return True
        return record.levelno >= logging.ERROR and not _about_expected_kafka_error(record)


def _about_expected_kafka_error(record: logging.LogRecord) -> bool:
    raised = record.exc_info[1] if record.exc_info else None
    if raised is not None and expected_kafka_error(raised):
        return True
    try:
        message = record.getMessage()
    except Exception:  # a library's bad format string: let logging report it
        return False
    # The clients' errors print their class name, whether formatted with %s or %r.
    return any(name in message for name in EXPECTED_KAFKA_ERRORS)


def log_handler(raw_level: str) -> logging.Handler:
    """The terminal's log handler: the libraries' warnings filtered out unless
    ``TOKENBUDGET_LOG`` was set."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if not raw_level:
        handler.addFilter(QuietLibraries())
    return handler


def configure_logging(environ: Mapping[str, str] | None = None) -> None:
    """``TOKENBUDGET_LOG`` (any case: debug, INFO, Warning, ...) sets the level; the
    libraries are heard at that level only when it is set (see QuietLibraries)."""
    environ = os.environ if environ is None else environ
    raw = environ.get("TOKENBUDGET_LOG", "").strip()
    level = logging.getLevelName(raw.upper()) if raw else logging.WARNING
    if not isinstance(level, int):
        choices = "debug, info, warning, error, critical"
        raise TokenBudgetError(f"TOKENBUDGET_LOG={raw!r} is not a log level ({choices})")
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:  # an embedding application (or pytest) keeps its own
        root.addHandler(log_handler(raw))


def main(argv: Sequence[str] | None = None) -> int:
    lifetime.watch_parent()  # a child of `run` (or the demo) ends with it
    played = roles.play(None)  # given back at the end (called in-process: tests, tools)
    try:
        configure_logging()
        argv = sys.argv[1:] if argv is None else list(argv)
        args = build_parser(argv).parse_args(argv)
        roles.play(COMMANDS[args.command].role)
        return int(args.func(args))
    except TokenBudgetError as exc:
        print(f"tokenbudget: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # Not an error of ours: a library's, or a bug. One line for the user, the
        # traceback for whoever debugs it.
        logging.getLogger("tokenbudget").debug("unexpected error", exc_info=True)
        print(
            f"tokenbudget: error: {type(exc).__name__}: {exc} (TOKENBUDGET_LOG=debug shows where)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    finally:
        roles.play(played)
