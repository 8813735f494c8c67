"""``tokenbudget init``: write a job's config from its datasets and its server."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from producers.inference import probe_server
from tokenbudget.app import init
from tokenbudget.config import parse_budget

API_KEY_ENV = "TOKENBUDGET_API_KEY"  # [inference] api_key_env's default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("datasets", nargs="+", metavar="DATASET", help=".jsonl, .parquet, ...")
    parser.add_argument("--server", required=True, metavar="URL", help="the inference server")
    parser.add_argument("-o", "--output", default="job.toml", help="the config to write")
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
