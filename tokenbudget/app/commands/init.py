"""``tokenbudget init``: write a job's config from its datasets and its server."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tokenbudget.app import init
from tokenbudget.app.commands import examples
from tokenbudget.core.config import parse_budget
from tokenbudget.producers.inference.backends import probe_server

API_KEY_ENV = "TOKENBUDGET_API_KEY"  # [inference] api_key_env's default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write a job's config from its datasets and its server: the server is asked what "
        "it is, each dataset's first rows are read as `run` reads them (with the column "
        "mapping their fields need), and a commented config that `run` takes as it is "
        "comes out, every budget to set. Never over an existing file."
    )
    parser.epilog = examples(
        "tokenbudget init --server http://gpu-box:30000 data/a.jsonl data/b.parquet -o job.toml"
    )
    parser.add_argument(
        "datasets",
        nargs="+",
        metavar="DATASET",
        help="a dataset file (.jsonl, .json, .ndjson, .parquet, .pq) or a saved Hugging Face "
        "dataset folder",
    )
    parser.add_argument(
        "--server",
        required=True,
        metavar="URL",
        help="the inference server, e.g. http://gpu-box:30000",
    )
    parser.add_argument(
        "-o", "--output", default="job.toml", metavar="FILE", help="the config to write"
    )
    parser.add_argument(
        "--budget", help=f"every dataset's budget (default {init.PLACEHOLDER_BUDGET}, to set)"
    )


def main(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if out.exists():  # before the server and the datasets are read
        raise init.exists(out)
    if args.budget is not None:
        parse_budget(args.budget, "--budget")
    found = init.find_datasets([Path(p).expanduser() for p in args.datasets])
    server = probe_server(args.server, api_key=os.environ.get(API_KEY_ENV), key_env=API_KEY_ENV)
    text = init.config_text(server, found, out.resolve().parent, budget=args.budget)
    init.write_config(text, out)
    for f in found:
        mapping = f" ({f.shape.mapping[0]} = {f.shape.mapping[1]!r})" if f.shape.mapping else ""
        kind = "chat" if f.shape.chat else "prompts"
        print(f"{f.name}: {f.path}, {f.shape.read_as}, {kind}{mapping}", file=sys.stderr)
    model = f", model {server.model}" if server.model else ""
    print(
        f"wrote {out} for {server.url} ({server.kind}{model}); set each budget"
        f" (now {args.budget or init.PLACEHOLDER_BUDGET}), then:"
        f" tokenbudget plan --config {out} --pilot 20",
    )
    return 0
