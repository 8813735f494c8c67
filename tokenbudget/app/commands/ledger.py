"""``tokenbudget ledger``: one Faust budget ledger worker, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import sys
import typing

from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.core import config as config_module
from tokenbudget.core import metrics, sizes
from tokenbudget.core.errors import TokenBudgetError
from tokenbudget.core.kafka_admin import ensure_topics, topic_layout, wait_ready
from tokenbudget.streams.faust_adapt import HotPath
from tokenbudget.streams.ledger_gauges import LedgerGauges
from tokenbudget.streams.ledger_worker import LedgerSettings, run_worker
from tokenbudget.streams.topics import Topics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "One Faust budget ledger worker, until SIGTERM or SIGINT: the single writer of "
        "each dataset's budget state (grants leases, counts completions, halts). `run` "
        "starts its own (N with --ledgers N); workers started N times, on any hosts, share "
        "the datasets as one group. It exits 75 to be restarted from what is durable: run "
        "it alone under a supervisor that restarts it."
    )
    parser.epilog = examples(
        "tokenbudget ledger --config job.toml --metrics-port 9465",
        "tokenbudget ledger --bootstrap kafka-1:9092 --namespace regen-2026-12",
    )
    add_config(
        parser,
        required=False,
        help="the job's config: its broker, namespace, snapshot interval and compression",
    )
    parser.add_argument(
        "--bootstrap",
        metavar="HOST:PORT",
        help="the broker, without a config (instead of --config)",
    )
    parser.add_argument(
        "--namespace",
        default="tokenbudget",
        metavar="NAME",
        help="with --bootstrap: the job's [kafka] namespace",
    )
    parser.add_argument(
        "--snapshot-interval",
        type=float,
        default=0.5,
        metavar="S",
        help="with --bootstrap: seconds between snapshots of changed datasets",
    )
    parser.add_argument(
        "--compression",
        choices=typing.get_args(sizes.Compression),
        default=sizes.DEFAULT_COMPRESSION,
        help="of what it produces (with --bootstrap; a config's [kafka] compression)",
    )
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", metavar="HOST", help="the address /metrics binds to"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, metavar="PORT", help="serve /metrics (0: off)"
    )


def main(args: argparse.Namespace) -> int:
    if args.config:
        config = config_module.load(args.config)
        bootstrap = resolve_bootstrap(config)
        namespace = config.kafka.namespace
        interval = config.budget.snapshot_interval_s
        compression = config.kafka.compression
    elif args.bootstrap:
        bootstrap, namespace, interval = args.bootstrap, args.namespace, args.snapshot_interval
        compression = args.compression
        wait_ready(bootstrap)  # Faust gives up at once on a broker restarting
    else:
        raise TokenBudgetError("ledger needs --config FILE, or --bootstrap HOST:PORT")
    if args.metrics_port:
        metrics.serve(args.metrics_host, args.metrics_port, namespace, "ledger")
    serve(bootstrap, namespace, interval, compression=compression)
    return 0


def serve(
    bootstrap: str,
    namespace: str,
    snapshot_interval: float,
    hot_path: HotPath | None = None,
    *,
    compression: sizes.Compression = sizes.DEFAULT_COMPRESSION,
) -> None:
    """Run one ledger worker of ``namespace`` until SIGTERM/SIGINT, on its topics as
    they are (made by run, or by an operator; made here if there are none).
    ``hot_path``: Faust's per-message cuts (all on by default; bench/ledger.py
    turns some off); ``compression``: of the events and changelogs it writes."""
    layout = topic_layout(bootstrap, Topics(namespace).completions)
    if layout is None:
        ensure_topics(bootstrap, Topics(namespace).specs())
        layout = topic_layout(bootstrap, Topics(namespace).completions)
        assert layout is not None
    sys.argv = [sys.argv[0], "worker"]  # Faust's Worker reads argv
    run_worker(
        LedgerSettings(
            bootstrap,
            Topics(namespace, layout.partitions),
            snapshot_interval=snapshot_interval,
            on_state=LedgerGauges().observe,
            replication_factor=layout.replication_factor,
            hot_path=hot_path or HotPath(),
            compression=compression,
        )
    )
