"""``tokenbudget export``: the kept answers as training data (JSONL
conversations or messages, Parquet, or the records SpecForge, speculators and
Model-Optimizer load as they are), from the sink's folder or the topic."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ExportError
from tokenbudget.core.request_sections import InferenceConfig
from tokenbudget.core.tokenizer import TRUST_FLAG, load_pretrained
from tokenbudget.sinks.export import (
    FORMATS,
    Decode,
    Encode,
    ExportOptions,
    ExportSummary,
    export,
)
from tokenbudget.sinks.replay import replay
from tokenbudget.sinks.replay_range import ReplayOptions
from tokenbudget.streams.topics import Topics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The kept answers as training data, each loadable with datasets.load_dataset: "
        "conversations or messages (JSONL, one record per answer, or per conversation "
        "regenerated turn by turn), parquet (every column), or the JSONL records the "
        "drafter trainers load as they are: specforge, speculators, modelopt. Rows come "
        "from the sink's folder, or the completions topic replayed with the sink's rules."
    )
    parser.epilog = examples(
        "tokenbudget export --config job.toml --format conversations --to train.jsonl",
        "tokenbudget export --config job.toml --format parquet --to train/ --with-ids",
        "tokenbudget export --config job.toml --format specforge --to regen.jsonl --per-turn",
        "tokenbudget export --config job.toml --format speculators --to train.jsonl",
        "tokenbudget export --config job.toml --format modelopt --to train.jsonl",
    )
    parser.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="conversations and messages: JSONL chat records (turns under "
        '"conversations" or "messages"); parquet: a folder of every column; specforge '
        "({id, conversations, status}; with --with-ids {id, input_ids, loss_mask} per "
        "answer), speculators ({id, primary_id, input_ids, loss_mask, metadata} per "
        "answer), modelopt ({conversation_id, messages})",
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
        help="add input_ids (prompt then answer: the server's ids, or the prompt's text "
        "encoded with --tokenizer where the server returned none) and loss_mask (1 over the "
        "answer) columns; specforge: one such record per answer instead of the text",
    )
    parser.add_argument(
        "--per-turn",
        action="store_true",
        help="specforge: a conversation regenerated turn by turn as one record per answer, "
        "with the history it was sent (earlier answers without their thinking), for "
        "SpecForge's data.train_only_last_turn",
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
    _add_tokenizer(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON summary")


def _add_tokenizer(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local tokenizer folder that decodes answers cut at the budget's line, kept as "
        "ids only, and with --with-ids encodes prompts sent as text whose ids the server did "
        "not return (default: [inference] tokenizer)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the tokenizer code the --tokenizer folder ships, if any (its auto_map; "
        "default: [inference] trust_remote_code)",
    )


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config) if args.config else None
    if args.from_topic and config is None:
        raise ExportError("export --from-topic needs --config (the broker and namespace)")
    if config is None and not args.source:
        raise ExportError("export needs --config FILE (its sink folder) or --from DIR")
    decode, encode = _tokenizer(args, config)
    options = ExportOptions(
        format=args.format,
        to=Path(args.to).resolve(),
        source=Path(args.source).resolve() if args.source else Path(),
        datasets=frozenset(args.dataset),
        with_ids=args.with_ids,
        decode=decode,
        encode=encode,
        drop_unfinished=args.drop_unfinished,
        drop_incomplete=args.drop_incomplete,
        per_turn=args.per_turn,
        reasoning_end=(config.inference if config else InferenceConfig()).reasoning_end,
    )
    if args.from_topic:
        assert config is not None
        summary = export_from_topic(config, options)
    else:
        if not args.source:
            assert config is not None
            options = dataclasses.replace(options, source=config.sink_path)
        summary = export(options)
    _print_summary(summary, options, args.json)
    return 0


def _tokenizer(args: argparse.Namespace, config: Any) -> tuple[Decode | None, Encode | None]:
    """The local tokenizer's decode (cut answers) and encode (text prompts, as the
    servers encode them: special tokens added), when a folder is given."""
    path = args.tokenizer or (
        str(config.tokenizer_path) if config and config.tokenizer_path else ""
    )
    if not path:
        return None, None
    tokenizer = load_pretrained(
        Path(path),
        "export --tokenizer",
        trust_remote_code=args.trust_remote_code
        or bool(config and config.inference.trust_remote_code),
        trusted_by=TRUST_FLAG,
    )

    def encode(text: str) -> list[int]:
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=True)]

    return functools.partial(tokenizer.decode, skip_special_tokens=False), encode


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


def _print_summary(summary: ExportSummary, options: ExportOptions, as_json: bool) -> None:
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
        if summary.conversation_records == summary.conversations:
            print(f"of them conversations regenerated turn by turn, one record each: {whole}")
        else:
            print(
                f"of them {sum(summary.conversation_records.values())} of the "
                f"{sum(summary.conversations.values())} conversations regenerated turn by "
                f"turn, one record per answer ({whole})"
            )
    if summary.incomplete:
        dropped = ", ".join(f"{name} {n}" for name, n in sorted(summary.incomplete.items()))
        total = sum(summary.incomplete.values())
        print(f"left out {total} incomplete conversations ({dropped})")
    if summary.encoded:
        print(
            f"{summary.encoded} prompts sent as text had no ids from the server: computed "
            "from that text with the local tokenizer"
        )
    if summary.split:
        print(
            f"{summary.split} answers had their thinking inline: split at "
            f"{options.reasoning_end!r} into reasoning_content"
        )
    if summary.tools_dropped:
        dropped = ", ".join(f"{name} {n}" for name, n in sorted(summary.tools_dropped.items()))
        total = sum(summary.tools_dropped.values())
        print(
            f"warning: Model-Optimizer never passes tools to the chat template: {total} records "
            f"({dropped}) are written without the tools they were offered (their calls and "
            "tool turns kept)",
            file=sys.stderr,
        )
