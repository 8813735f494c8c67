"""``tokenbudget replay``: read the completions topic again with the sink's rules:
into Parquet, against the live ledger, onto another topic, or recounted with a
tokenizer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sinks.parquet import WriterSettings
from sinks.replay import ReplayOptions, ReplaySummary, parse_offsets, parse_time, replay
from streams.topics import Topics
from tokenbudget import config as config_module
from tokenbudget import sizes
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.errors import TokenBudgetError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="bootstrap and namespace from this config")
    parser.add_argument("--bootstrap", help="HOST:PORT (instead of --config)")
    parser.add_argument("--namespace", default="tokenbudget")
    parser.add_argument("--topic", help="default: the namespace's completions topic")
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--from-beginning", action="store_true", help="start at the beginning (default)"
    )
    start.add_argument("--from-offset", metavar="N|P:N,...", help="start offset(s)")
    parser.add_argument("--since", metavar="TIME", help="epoch seconds or ISO 8601")
    parser.add_argument("--until", metavar="TIME", help="epoch seconds or ISO 8601")
    parser.add_argument("--dataset", action="append", default=[], metavar="NAME", help="repeatable")
    parser.add_argument("--to-parquet", metavar="DIR", help="write the sink's layout here")
    parser.add_argument("--ledger", action="store_true", help="compare with the live ledger")
    parser.add_argument("--to-topic", metavar="NAME", help="re-emit the completions here")
    parser.add_argument(
        "--recount-with", metavar="TOKENIZER_PATH", help="a local transformers tokenizer"
    )
    parser.add_argument("--rotate-rows", type=int, default=20_000)
    parser.add_argument("--rotate-bytes", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--row-group-rows", type=int, default=None)
    parser.add_argument("--row-group-bytes", type=int, default=32 * 1024 * 1024)
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def options_from_args(args: argparse.Namespace) -> ReplayOptions:
    if args.config:
        config = config_module.load(args.config)
        bootstrap = resolve_bootstrap(config)
        namespace = config.kafka.namespace
        row_group_rows = config.sink.row_group_rows
        compression = config.kafka.compression
    elif args.bootstrap:
        bootstrap, namespace, row_group_rows = args.bootstrap, args.namespace, 1000
        compression = sizes.DEFAULT_COMPRESSION
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
