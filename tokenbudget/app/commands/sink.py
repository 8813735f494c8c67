"""``tokenbudget sink``: the live Parquet sink on its own."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from tokenbudget.app.assembly import build_sink
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.core import config as config_module
from tokenbudget.core import metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The Parquet sink on its own: the kept completions into <sink.path>/dataset=<name>/, "
        "each file whole or not at all, offsets committed after. SIGTERM or SIGINT: it "
        "reads to the end of the topic, writes its files, commits and exits. `run` runs "
        "one in a thread of its own."
    )
    parser.epilog = examples("tokenbudget sink --config job.toml --metrics-port 9471")
    add_config(parser)
    parser.add_argument(
        "--metrics-port", type=int, default=0, metavar="PORT", help="serve /metrics (0: off)"
    )


def main(args: argparse.Namespace) -> int:
    """``tokenbudget sink``: the live Parquet sink on its own, until SIGTERM/SIGINT
    (then it reads to the end of the topic, writes its files and commits)."""
    config = config_module.load(args.config)
    bootstrap = resolve_bootstrap(config)
    if args.metrics_port:
        metrics.serve(config.metrics.host, args.metrics_port, config.kafka.namespace, "sink")
    sink = build_sink(config, bootstrap)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"sink: {config.kafka.namespace} -> {config.sink_path}", file=sys.stderr, flush=True)
    sink.run(stop, drain=False)
    rows = sum(sink.rows_written.values())
    print(
        f"sink: stopped; {rows:,} rows written, {sink.duplicates_dropped:,} duplicates dropped",
        file=sys.stderr,
    )
    return 0
