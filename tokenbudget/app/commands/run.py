"""``tokenbudget run``: a whole job to its budgets, then its table."""

from __future__ import annotations

import argparse
import functools
import json
import sys

from tokenbudget.app.commands import add_config, add_server, examples
from tokenbudget.core import config as config_module
from tokenbudget.producers.prompts.dataset_checks import check_datasets

EXIT_PROMPTS_FAILED = 3  # the job ended, but some prompts failed for good


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a job until every dataset is exhausted (all its prompts have an outcome) or "
        "halted (its budget is reached), then print its table. It starts the broker for "
        'bootstrap = "local", and the producer, dispatchers, ledger workers and sink. '
        "Run it again to resume after any stop. Exit 0; 3 when some prompts failed for "
        "good; 2 on an error; 130 or 143 when interrupted."
    )
    parser.epilog = examples(
        "tokenbudget run --config job.toml",
        "nohup tokenbudget run --config job.toml --dispatchers 2 > run.log 2>&1 &",
    )
    add_config(parser)
    parser.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of the tables"
    )
    parser.add_argument(
        "--dispatchers",
        type=int,
        default=1,
        metavar="N",
        help="dispatcher processes sharing the budgets",
    )
    parser.add_argument(
        "--ledgers",
        type=int,
        default=1,
        metavar="N",
        help="ledger worker processes sharing the datasets",
    )
    add_server(parser)
    add_resume_changed(parser)


def add_resume_changed(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--resume-changed",
        action="store_true",
        help="resume the namespace's job although its datasets, model, sampling or "
        "sink.path changed since it was recorded, and record it as it is now",
    )


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    if args.server:
        config = config_module.with_servers(config, args.server)
    check_datasets(config)
    # Imported once the job is known to be sound: the pipeline's modules (Faust,
    # aiokafka, the runner) take most of a second to import, and a config that
    # cannot run should say so before that, not after (the runner checks again for
    # callers of the library, from the first rows only).
    from tokenbudget.app import plan, runner
    from tokenbudget.app.interrupts import Interrupted
    from tokenbudget.app.report import print_table
    from tokenbudget.streams.topics import Topics

    try:
        report = runner.run(
            config,
            progress="lines" if args.json else None,  # stdout is the JSON's
            dispatchers=args.dispatchers,
            ledgers=args.ledgers,
            resume_changed=args.resume_changed,
            on_start=functools.partial(plan.announce, config),
        )
    except Interrupted as stopped:  # it said so when the signal came
        return stopped.exit_code
    kept = plan.kept_report(config)
    if args.json:
        print(json.dumps({**report.to_json(), "kept": [k.to_json() for k in kept]}, indent=2))
    else:
        print_table(report)
        print("\n" + plan.kept_table(kept))
    bad = {name: report.bad_rows(name) for name in report.datasets}
    if any(bad.values()):
        per = ", ".join(f"{name} {n}" for name, n in bad.items() if n)
        print(
            f"tokenbudget: skipped {sum(bad.values())} bad row(s) ({per}), each dead-lettered to "
            f"{Topics(config.kafka.namespace).dead_letter} with its file:line and why",
            file=sys.stderr,
        )
    if report.failed:
        print(
            f"tokenbudget: {report.failed} prompt(s) failed for good (see the log); exit code 3",
            file=sys.stderr,
        )
        return EXIT_PROMPTS_FAILED
    return 0
