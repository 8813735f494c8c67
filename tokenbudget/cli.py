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

from tokenbudget import lifetime, version
from tokenbudget.errors import EXPECTED_KAFKA_ERRORS, TokenBudgetError, expected_kafka_error

DESCRIPTION = "Exact per-dataset token budgets for synthetic data generation, over Kafka."

# Command name -> its module and one line of help. Only the module of the command
# being run is imported: all of them (Faust, pyarrow, the simulator, ...) would add
# 0.15-0.4 s to every start, and `run` starts several children (bench/cli_startup.py).
COMMANDS: dict[str, tuple[str, str]] = {
    "broker": (
        "tokenbudget.dev.commands.broker",
        "the local Kafka broker (KRaft, from Maven jars)",
    ),
    "simulate": ("tokenbudget.dev.commands.simulate", "a simulated SGLang/OpenAI inference server"),
    "ledger": ("tokenbudget.app.commands.ledger", "the Faust budget ledger worker"),
    "init": (
        "tokenbudget.app.commands.init",
        "write a job's config from its datasets and server",
    ),
    "plan": ("tokenbudget.app.commands.plan", "what each budget will buy, before it is spent"),
    "run": ("tokenbudget.app.commands.run", "run a job to its budgets"),
    "status": ("tokenbudget.app.commands.status", "per-dataset budget, kept, rate, ETA, state"),
    "demo": ("tokenbudget.dev.commands.demo", "eight datasets against the simulator"),
    "sink": (
        "tokenbudget.app.commands.sink",
        "the Parquet sink on its own (SIGTERM: flush, commit)",
    ),
    "replay": (
        "tokenbudget.app.commands.replay",
        "replay the completions topic (Parquet, ledger, ...)",
    ),
    "export": (
        "tokenbudget.app.commands.export",
        "the kept answers as training data (JSONL conversations, Parquet)",
    ),
    "dispatch": (
        "tokenbudget.app.commands.dispatch",
        "one dispatcher process (SIGTERM: finish, release)",
    ),
    "produce": ("tokenbudget.app.commands.produce", "the prompt producer on its own"),
    "budget": ("tokenbudget.app.commands.budget", "set or show budgets while a job runs"),
    "servers": (
        "tokenbudget.app.commands.servers",
        "add, drain or list the job's inference servers while it runs",
    ),
}


def command_module(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name][0])


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the command line, only its command's module is
    imported (the others are listed by name, without their arguments)."""
    named = next((arg for arg in argv or () if not arg.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="tokenbudget", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tokenbudget {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_line) in COMMANDS.items():
        command = sub.add_parser(name, help=help_line)
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
_THIRD_PARTY = frozenset({"kafka", "aiokafka", "faust", "mode", "httpx", "httpcore", "asyncio"})


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
    try:
        configure_logging()
        argv = sys.argv[1:] if argv is None else list(argv)
        args = build_parser(argv).parse_args(argv)
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
