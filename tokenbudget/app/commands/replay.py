"""``tokenbudget replay``: read the completions topic again with the sink's rules:
into Parquet, against the live ledger, onto another topic, or recounted with a
tokenizer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.core import config as config_module
from tokenbudget.core import sizes
from tokenbudget.core.errors import TokenBudgetError
from tokenbudget.sinks.audit import ReplaySummary
from tokenbudget.sinks.parquet import WriterSettings
from tokenbudget.sinks.replay import replay
from tokenbudget.sinks.replay_range import ReplayOptions, parse_offsets, parse_time
from tokenbudget.streams.topics import Topics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Read a completions topic again, from its beginning to its end as of the start, "
        "without a consumer group, with the sink's rules (the first completion of a prompt "
        "kept), and feed any of its targets in one pass: Parquet, an audit of the live "
        "ledger, another topic, a recount with another tokenizer. Exit 0; 1 for a ledger "
        "mismatch; 2 on an error."
    )
    parser.epilog = examples(
        "tokenbudget replay --config job.toml --to-parquet rebuilt/",
        "tokenbudget replay --config job.toml --ledger",
        "tokenbudget replay --config job.toml --to-topic other.completions",
        "tokenbudget replay --config job.toml --recount-with ./tokenizer",
    )
    add_config(parser, required=False, help="bootstrap and namespace from this config")
    parser.add_argument("--bootstrap", metavar="HOST:PORT", help="the broker (instead of --config)")
    parser.add_argument(
        "--namespace",
        default="tokenbudget",
        metavar="NAME",
        help="with --bootstrap: the job's [kafka] namespace",
    )
    parser.add_argument(
        "--topic", metavar="NAME", help="default: the namespace's completions topic"
    )
    _add_range(parser)
    _add_targets(parser)
    _add_sizes(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print a JSON summary: events, MB, rates, kept, duplicates, per-dataset totals, "
        "per-target results, busy seconds per stage",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (else a bar on a terminal, a line every 5 s elsewhere)",
    )


def _add_range(parser: argparse.ArgumentParser) -> None:
    """Which records: where to start, a time range, which datasets."""
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--from-beginning", action="store_true", help="start at the beginning (default)"
    )
    start.add_argument(
        "--from-offset",
        metavar="N|P:N,...",
        help="start at offset N of every partition, or at N of partition P, per partition",
    )
    parser.add_argument(
        "--since",
        metavar="TIME",
        help="records from this time: epoch seconds or ISO 8601 (2026-12-02T10:00:00Z)",
    )
    parser.add_argument(
        "--until", metavar="TIME", help="records up to this time: epoch seconds or ISO 8601"
    )
    parser.add_argument(
        "--dataset",
        action="append",
        default=[],
        metavar="NAME",
        help="only this dataset (repeatable; default: all)",
    )


def _add_targets(parser: argparse.ArgumentParser) -> None:
    """Where the kept completions go, any of them in one pass."""
    parser.add_argument(
        "--to-parquet",
        metavar="DIR",
        help="write the live sink's layout and rows here (prompts already in DIR are skipped, "
        "so an interrupted replay resumes)",
    )
    parser.add_argument(
        "--ledger",
        action="store_true",
        help="recount each dataset with the ledger's rules and compare with the live ledger's "
        "latest snapshot; exit 1 on a mismatch (needs the whole topic)",
    )
    parser.add_argument(
        "--to-topic",
        metavar="NAME",
        help="re-emit the kept completions here, byte for byte (created if missing)",
    )
    parser.add_argument(
        "--recount-with",
        metavar="TOKENIZER_PATH",
        help="count each kept answer's text with this local transformers tokenizer folder",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="--recount-with: run the tokenizer code the folder ships, if any (its auto_map; "
        "default: [inference] trust_remote_code)",
    )


def _add_sizes(parser: argparse.ArgumentParser) -> None:
    """--to-parquet's files and row groups."""
    parser.add_argument(
        "--rotate-rows", type=int, default=20_000, metavar="N", help="--to-parquet: rows per file"
    )
    parser.add_argument(
        "--rotate-bytes",
        type=int,
        default=256 * 1024 * 1024,
        metavar="N",
        help="--to-parquet: about this many bytes per file",
    )
    parser.add_argument(
        "--row-group-rows",
        type=int,
        default=None,
        metavar="N",
        help="--to-parquet: rows per row group (default: the config's sink.row_group_rows, "
        "else 1000)",
    )
    parser.add_argument(
        "--row-group-bytes",
        type=int,
        default=32 * 1024 * 1024,
        metavar="N",
        help="--to-parquet: about this many bytes per row group",
    )


def options_from_args(args: argparse.Namespace) -> ReplayOptions:
    if args.config:
        config = config_module.load(args.config)
        bootstrap = resolve_bootstrap(config)
        namespace = config.kafka.namespace
        row_group_rows = config.sink.row_group_rows
        compression = config.kafka.compression
        trust = config.inference.trust_remote_code
    elif args.bootstrap:
        bootstrap, namespace, row_group_rows = args.bootstrap, args.namespace, 1000
        compression = sizes.DEFAULT_COMPRESSION
        trust = False
    else:
        raise TokenBudgetError("replay needs --config FILE, or --bootstrap HOST:PORT")
    for name in ("rotate_rows", "rotate_bytes", "row_group_bytes"):
        if getattr(args, name) <= 0:
            raise TokenBudgetError(f"--{name.replace('_', '-')} must be positive")
    return ReplayOptions(
        bootstrap=bootstrap,
        topics=Topics(namespace),
        topic=args.topic or "",
        from_offset=parse_offsets(args.from_offset) if args.from_offset else None,
        since=parse_time(args.since) if args.since else None,
        until=parse_time(args.until) if args.until else None,
        datasets=frozenset(args.dataset),
        to_parquet=Path(args.to_parquet).resolve() if args.to_parquet else None,
        writer=WriterSettings(
            rotate_rows=args.rotate_rows,
            rotate_bytes=args.rotate_bytes,
            row_group_rows=args.row_group_rows or row_group_rows,
            row_group_bytes=args.row_group_bytes,
        ),
        ledger=args.ledger,
        to_topic=args.to_topic,
        recount_with=Path(args.recount_with) if args.recount_with else None,
        trust_remote_code=args.trust_remote_code or trust,
        compression=compression,
    )


def print_summary(summary: ReplaySummary, out: Any = None) -> None:
    out = out or sys.stdout
    data = summary.to_json()
    print(
        f"replayed {data['events']:,} events ({summary.bytes / 1e6:,.1f} MB) from "
        f"{summary.topic} in {summary.seconds:.2f} s: {data['events_per_s']:,.0f} events/s, "
        f"{data['mb_per_s']:,.1f} MB/s",
        file=out,
    )
    print(
        f"kept {summary.kept:,}, duplicates {summary.duplicates:,}, undecodable "
        f"{summary.undecodable:,}, filtered {summary.filtered:,}",
        file=out,
    )
    if summary.datasets:
        header = f"{'dataset':<28}{'samples':>10}{'completion_tokens':>20}{'prompt_tokens':>16}"
        print(header, file=out)
        for name, t in sorted(summary.datasets.items()):
            print(
                f"{name:<28}{t.samples:>10,}{t.completion_tokens:>20,}{t.prompt_tokens:>16,}",
                file=out,
            )
    if summary.parquet is not None:
        rows = sum(summary.parquet["rows"].values())
        print(
            f"parquet: {rows:,} rows in {summary.parquet['files']} files under "
            f"{summary.parquet['path']} ({summary.already_in_parquet:,} already there)",
            file=out,
        )
    if summary.to_topic is not None:
        topic, count = summary.to_topic["topic"], summary.to_topic["events"]
        print(f"to topic {topic}: {count:,} events", file=out)
    if summary.recount is not None:
        print(f"recount with {summary.recount['tokenizer']}:", file=out)
        for name, r in summary.recount["datasets"].items():
            print(
                f"  {name:<26} stored {r['stored_completion_tokens']:>14,}  recounted "
                f"{r['recounted_tokens']:>14,}  ratio {r['ratio']}  without text "
                f"{r['rows_without_text']:,}",
                file=out,
            )
    if summary.ledger is not None:
        if summary.ledger["match"]:
            count = len(summary.ledger["datasets"])
            print(f"ledger: matches the live ledger ({count} datasets)", file=out)
        else:
            print("ledger: MISMATCH with the live ledger", file=out)
            for d in summary.ledger["differences"]:
                if d["field"] == "snapshot":
                    print(f"  {d['dataset']}: the live ledger has no snapshot", file=out)
                else:
                    print(
                        f"  {d['dataset']}.{d['field']}: replay {d['replay']:,} "
                        f"live {d['live']:,} (diff {d['replay'] - d['live']:+,})",
                        file=out,
                    )


def main(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    summary = replay(options, progress=not args.quiet)
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        print_summary(summary)
    return 0 if summary.ok else 1
