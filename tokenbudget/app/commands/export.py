"""``tokenbudget export``: the kept answers as training data (JSONL
conversations or messages, or Parquet), from the sink's folder or the topic."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import tempfile
from pathlib import Path
from typing import Any

from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ExportError
from tokenbudget.core.tokenizer import TRUST_FLAG, load_pretrained
from tokenbudget.sinks.export import FORMATS, Decode, ExportOptions, ExportSummary, export
from tokenbudget.sinks.replay import ReplayOptions, replay
from tokenbudget.streams.topics import Topics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The kept answers as training data, each loadable with datasets.load_dataset: "
        "conversations or messages (JSONL, one record per answer, or per conversation "
        "regenerated turn by turn) or parquet (every column). Rows come from the sink's "
        "folder, or the completions topic replayed with the sink's rules."
    )
    parser.epilog = examples(
        "tokenbudget export --config job.toml --format conversations --to train.jsonl",
        "tokenbudget export --config job.toml --format parquet --to train/ --with-ids",
    )
    parser.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="conversations and messages: JSONL chat records (turns under "
        '"conversations" or "messages"); parquet: a folder of every column',
    )
    parser.add_argument("--to", required=True, metavar="PATH", help="a .jsonl file, or a folder")
    add_config(
        parser, required=False, help="the job's config: its sink folder, tokenizer and broker"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--from",
        dest="source",
        metavar="DIR",
        help="the sink's output folder (default: the config's sink.path)",
    )
    source.add_argument(
        "--from-topic", action="store_true", help="replay the completion topic (needs --config)"
    )
    parser.add_argument(
        "--dataset",
        action="append",
        default=[],
        metavar="NAME",
        help="only this dataset (repeatable; default: all)",
    )
    parser.add_argument(
        "--with-ids",
        action="store_true",
        help="add input_ids (prompt then answer) and loss_mask (1 over the answer) columns",
    )
    parser.add_argument(
        "--drop-unfinished",
        action="store_true",
        help="leave out answers cut while the model was still thinking (no answer in them)",
    )
    parser.add_argument(
        "--drop-incomplete",
        action="store_true",
        help='leave out conversations regenerated turn by turn (turns = "regenerate") that '
        "are not whole: a turn not generated, cut, or a tool call that differs",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local tokenizer folder that decodes answers cut at the budget's line, kept as "
        "ids only (default: [inference] tokenizer)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the tokenizer code the --tokenizer folder ships, if any (its auto_map; "
        "default: [inference] trust_remote_code)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary")


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config) if args.config else None
    if args.from_topic and config is None:
        raise ExportError("export --from-topic needs --config (the broker and namespace)")
    if config is None and not args.source:
        raise ExportError("export needs --config FILE (its sink folder) or --from DIR")
    tokenizer_path = args.tokenizer or (
        str(config.tokenizer_path) if config and config.tokenizer_path else ""
    )
    decode: Decode | None = None
    if tokenizer_path:
        tokenizer = load_pretrained(
            Path(tokenizer_path),
            "export --tokenizer",
            trust_remote_code=args.trust_remote_code
            or bool(config and config.inference.trust_remote_code),
            trusted_by=TRUST_FLAG,
        )
        decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
    options = ExportOptions(
        format=args.format,
        to=Path(args.to).resolve(),
        source=Path(args.source).resolve() if args.source else Path(),
        datasets=frozenset(args.dataset),
        with_ids=args.with_ids,
        decode=decode,
        drop_unfinished=args.drop_unfinished,
        drop_incomplete=args.drop_incomplete,
    )
    if args.from_topic:
        assert config is not None
        summary = export_from_topic(config, options)
    else:
        if not args.source:
            assert config is not None
            options = dataclasses.replace(options, source=config.sink_path)
        summary = export(options)
    _print_summary(summary, args.json)
    return 0


def export_from_topic(config: Any, options: ExportOptions) -> ExportSummary:
    """Replay the completion topic with the sink's rules into a scratch folder,
    then export from it."""
    with tempfile.TemporaryDirectory(prefix="tokenbudget-export-") as scratch:
        replay(
            ReplayOptions(
                bootstrap=resolve_bootstrap(config),
                topics=Topics(config.kafka.namespace),
                datasets=options.datasets,
                to_parquet=Path(scratch),
            ),
            progress=False,
        )
        return export(dataclasses.replace(options, source=Path(scratch)))


def _print_summary(summary: ExportSummary, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary.to_json(), indent=2))
        return
    total = sum(summary.rows.values())
    per_dataset = ", ".join(f"{name} {count}" for name, count in sorted(summary.rows.items()))
    where = summary.files[0].parent if len(summary.files) > 1 else summary.files[0]
    print(f"exported {total} rows ({per_dataset}) to {where}")
    if summary.decoded:
        print(f"{summary.decoded} answers cut at the budget's line were decoded from their ids")
    if summary.unfinished:
        dropped = ", ".join(f"{name} {n}" for name, n in sorted(summary.unfinished.items()))
        total = sum(summary.unfinished.values())
        print(f"left out {total} unfinished answers, cut while still thinking ({dropped})")
    if summary.conversations:
        whole = ", ".join(f"{name} {n}" for name, n in sorted(summary.conversations.items()))
        print(f"of them conversations regenerated turn by turn, one record each: {whole}")
    if summary.incomplete:
        dropped = ", ".join(f"{name} {n}" for name, n in sorted(summary.incomplete.items()))
        total = sum(summary.incomplete.values())
        print(f"left out {total} incomplete conversations ({dropped})")
