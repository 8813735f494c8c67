"""Completion events per second the ledger sustains, with one or several workers.

    .venv/bin/python bench/ledger.py [--events 100000] [--datasets 8] [--output-tokens 0]
    .venv/bin/python bench/ledger.py --cluster --workers 1,2,4
    .venv/bin/python bench/ledger.py --without none,fast_delivery,changelog_batches,all
    .venv/bin/python bench/ledger.py --compression zstd,none

``--cluster`` runs on a three-node KRaft cluster (tokenbudget.dev.cluster: replication 3,
min.insync.replicas 2) instead of the local broker; ``--workers`` lists the worker
counts to measure, each on a fresh namespace with the same backlog, the first being
the baseline the others are compared with.

A fresh namespace on the local broker gets its budgets and N small completion
events (distinct prompts, a lease id on each) while no ledger runs; then one Faust
ledger worker starts and works through the backlog with its idempotency table and
reservations. The rate is measured between the first and the last snapshot the
ledger publishes while catching up, so worker start-up is not counted (with several
workers, the rebalances as they join are: a real scale-out pays them too). The worker's
peak resident memory is printed too: a catching-up worker buffers up to the stream
buffer's worth of events, so try ``--output-tokens 4000`` (events the size of long
real answers) for its memory.

``--without`` measures the ledger with some of the cuts of Faust's per-message costs
(:class:`tokenbudget.streams.faust_adapt.HotPath`) turned off, one variant after the other in
the same run: each variant names the cuts turned off, joined by ``+`` (``none``:
every cut on; ``all``: stock Faust's hot path). The worker then runs from this
script (``--serve-ledger``) instead of ``tokenbudget ledger``.

``--compression`` measures the ledger with each codec in turn (``[kafka]
compression``: the backlog is produced with it, and the worker compresses its
changelogs and snapshots with it), the first being the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess
import sys
import time
import typing
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory

from kafka import KafkaAdminClient, KafkaProducer

from tokenbudget.app.commands import ledger as ledger_command
from tokenbudget.app.runner import start_ledger_process, stop_process
from tokenbudget.core import kafka_admin, lifetime, sizes
from tokenbudget.core.kafka import kafka_python_producer_options
from tokenbudget.core.security import subprocess_env
from tokenbudget.dev.cluster import LocalCluster
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.streams import codec as event_codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetWatcher
from tokenbudget.streams.faust_adapt import HotPath
from tokenbudget.streams.topics import Topics

SNAPSHOT_INTERVAL_S = 0.25
ALL_CUTS = "+".join(field.name for field in dataclasses.fields(HotPath))


def hot_path(variant: str) -> HotPath:
    """The cuts of a ``--without`` variant (``none``, ``all`` or names joined by +)."""
    names = {"none": "", "all": ALL_CUTS}.get(variant, variant)
    return HotPath.without({name for name in names.split("+") if name})


def serve_ledger(bootstrap: str, namespace: str, variant: str) -> None:
    """Run one ledger worker as ``tokenbudget ledger`` does, with ``variant``'s cuts."""
    ledger_command.serve(bootstrap, namespace, SNAPSHOT_INTERVAL_S, hot_path(variant))


def start_ledger(
    bootstrap: str, namespace: str, variant: str | None, compression: sizes.Compression
) -> subprocess.Popen[bytes]:
    if variant is None:
        return start_ledger_process(
            bootstrap, namespace, SNAPSHOT_INTERVAL_S, compression=compression
        )
    command = [sys.executable, __file__, "--serve-ledger", namespace, "--bootstrap", bootstrap]
    return lifetime.spawn([*command, "--variant", variant], env=subprocess_env(bootstrap))


def produce(
    bootstrap: str, topics: Topics, args: argparse.Namespace, compression: sizes.Compression
) -> None:
    events, datasets, output_tokens = args.events, args.datasets, args.output_tokens
    producer = KafkaProducer(
        **kafka_python_producer_options(bootstrap, compression),
        linger_ms=20,
        batch_size=256 * 1024,
    )
    names = [f"d{i}" for i in range(datasets)]
    for name in names:
        budget = ev.BudgetSet(dataset=name, budget=10**12)
        producer.send(topics.control, key=name.encode(), value=event_codec.encode(budget))
    for i in range(events):
        name = names[i % datasets]
        completion = ev.CompletionEvent(
            request_id=uuid.uuid4().hex,
            prompt_id=uuid.uuid4().hex,
            dataset=name,
            prompt_tokens=100,
            completion_tokens=1000 + i % 500,
            output_ids=list(range(output_tokens)),
            finish_reason="stop",
            max_new_tokens=4096,
            lease_id=f"bench:{name}:1",
        )
        producer.send(topics.completions, key=name.encode(), value=event_codec.encode(completion))
    producer.flush()
    producer.close()


async def watch(
    bootstrap: str, topics: Topics, events: int, datasets: int
) -> tuple[float, float, int]:
    watcher = BudgetWatcher(bootstrap, topics)
    await watcher.start()
    task = asyncio.create_task(watcher.run())
    first: tuple[float, int] | None = None
    try:
        while True:
            snaps = [watcher.board.snapshot(f"d{i}") for i in range(datasets)]
            counted = sum(s.samples for s in snaps if s is not None)
            if counted and first is None:
                first = (time.monotonic(), counted)
            if counted >= events:
                assert first is not None
                return first[0], time.monotonic(), counted - first[1]
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await watcher.stop()


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def measure(
    bootstrap: str,
    workers: int,
    args: argparse.Namespace,
    variant: str | None = None,
    compression: sizes.Compression = sizes.DEFAULT_COMPRESSION,
) -> float:
    topics = Topics(f"bench-ledger-{workers}w-{uuid.uuid4().hex[:6]}")
    kafka_admin.ensure_topics(bootstrap, topics.specs())
    t0 = time.monotonic()
    produce(bootstrap, topics, args, compression)
    print(
        f"produced {args.events:,} completion events in {time.monotonic() - t0:.1f} s"
        f" (compression {compression})"
    )
    ledgers = [
        start_ledger(bootstrap, topics.namespace, variant, compression) for _ in range(workers)
    ]
    try:
        start, end, processed = asyncio.run(watch(bootstrap, topics, args.events, args.datasets))
        peak_rss_mb = max(peak_rss_kb(ledger.pid) for ledger in ledgers) / 1024
    finally:
        for ledger in ledgers:
            stop_process(ledger)
    rate = processed / (end - start)
    print(
        f"ledger: {processed:,} completion events in {end - start:.1f} s = {rate:,.0f} events/s"
        f" ({workers} Faust worker{'s' if workers > 1 else ''}, idempotency table,"
        f" {args.datasets} datasets, {topics.partitions} partitions"
        + (f", without: {variant})" if variant is not None else ")")
    )
    print(
        f"ledger worker peak RSS: {peak_rss_mb:,.0f} MB ({args.output_tokens} token ids per event)"
    )
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.delete_topics([spec.name for spec in topics.specs()])
    admin.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--datasets", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=0, help="token ids per event")
    parser.add_argument("--cluster", action="store_true", help="a three-node cluster")
    parser.add_argument("--workers", default="1", help="worker counts, e.g. 1,2,4")
    parser.add_argument(
        "--without",
        default="",
        help=f"variants of cuts turned off, e.g. none,fast_delivery,all (cuts: {ALL_CUTS})",
    )
    parser.add_argument(
        "--compression",
        default="",
        help="codecs to compare, e.g. zstd,none (choices: zstd, lz4, gzip, none)",
    )
    parser.add_argument("--bootstrap", default="", help="a running broker (default: local)")
    parser.add_argument("--serve-ledger", default="", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_ledger:
        serve_ledger(args.bootstrap, args.serve_ledger, args.variant)
        return
    if args.without:
        compare_variants(args)
        return
    if args.compression:
        compare_compression(args)
        return
    counts = [int(n) for n in args.workers.split(",")]
    with TemporaryDirectory(prefix="bench-cluster-") as home:
        cluster = LocalCluster.create(Path(home)) if args.cluster else None
        try:
            if cluster is not None:
                bootstrap = cluster.up()
                print(f"three-node cluster at {bootstrap}")
            else:
                bootstrap = args.bootstrap or broker.up(BrokerSettings.from_env(), [])
            rates = {workers: measure(bootstrap, workers, args) for workers in counts}
        finally:
            if cluster is not None:
                cluster.down()
    baseline = rates[counts[0]]
    for workers, rate in rates.items():
        print(
            f"{workers} worker(s): {rate:,.0f} events/s = {rate / baseline:.2f}x"
            f" the {counts[0]}-worker baseline"
        )


def compare_variants(args: argparse.Namespace) -> None:
    """One worker per ``--without`` variant, in order, on the local (or given) broker."""
    variants = args.without.split(",")
    for variant in variants:
        hot_path(variant)  # refuse a misspelt cut before producing anything
    bootstrap = args.bootstrap or broker.up(BrokerSettings.from_env(), [])
    rates = {variant: measure(bootstrap, 1, args, variant) for variant in variants}
    baseline = rates[variants[0]]
    for variant, rate in rates.items():
        print(
            f"without {variant}: {rate:,.0f} events/s = {rate / baseline:.2f}x"
            f" the {variants[0]} variant"
        )


def compare_compression(args: argparse.Namespace) -> None:
    """One worker per ``--compression`` codec, in order, on the local (or given) broker."""
    codecs = args.compression.split(",")
    for codec in codecs:
        if codec not in typing.get_args(sizes.Compression):
            raise SystemExit(f"--compression: unknown codec {codec!r}")
    bootstrap = args.bootstrap or broker.up(BrokerSettings.from_env(), [])
    # A codec may be listed again (zstd,none,zstd,none): the runs alternate, so load
    # from elsewhere on the box falls on both.
    rates = [(codec, measure(bootstrap, 1, args, compression=codec)) for codec in codecs]  # type: ignore[arg-type]
    baseline = rates[0][1]
    for codec, rate in rates:
        print(
            f"compression {codec}: {rate:,.0f} events/s = {rate / baseline:.2f}x"
            f" the first ({codecs[0]}) run"
        )


if __name__ == "__main__":
    main()
