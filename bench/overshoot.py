"""Overshoot, unused budget, waste and halt latency per strategy.

    .venv/bin/python bench/overshoot.py [--budget 400000] [--dispatchers 3] [--concurrency 64]

The demo's eight datasets (tokenbudget/dev/demo.py) against the simulator, on the local
broker, with N dispatcher processes of the given concurrency, once per strategy:

  sample-cap       every dataset capped at budget / (average answer length) samples
  halt             halt after the completion that reaches the budget (no reservation)
  reserve-truncate reservations, the last answers cut at the line
  reserve-finish   reservations, answers never cut, the rest of the budget unused
  reserve-stream-lowered  reservations and streaming; once a dataset has kept half
                   its budget (by the ledger's snapshots), the budget is lowered to
                   what it has kept plus half of what it has reserved, while requests
                   are in flight: they run on while what they generate fits, then are
                   aborted (SGLang /abort_request) and cut at the line. A lowered
                   budget is measured against what was already published when the
                   ledger's revocation took effect (answers finished by then cannot
                   be un-kept). Waste is what they generated beyond the new budget.

Per dataset: budget, kept tokens, overshoot %, unused %, waste (tokens the server
generated that were not kept, from the simulator's own request log), and halt
latency: from the completion that reached the budget to the moment the last
dispatcher refused the dataset (p50 / p99 over the halted datasets).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import threading
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
from kafka import KafkaProducer

from tokenbudget.app.runner import RunReport, run
from tokenbudget.app.tables import format_table
from tokenbudget.core import config as config_module
from tokenbudget.core import lifetime
from tokenbudget.dev.demo import (
    DEMO_DATASETS,
    start_simulator,
    write_datasets,
    write_tokenizer,
)
from tokenbudget.dev.ports import free_port
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetWatcher
from tokenbudget.streams.topics import Topics

STRATEGIES = ("sample-cap", "halt", "reserve-truncate", "reserve-finish", "reserve-stream-lowered")
LOWERED = 0.5  # reserve-stream-lowered: share of the in-flight reservation left to keep


def write_config(
    workdir: Path,
    strategy: str,
    paths: dict[str, Path],
    url: str,
    args: argparse.Namespace,
    tokenizer: Path,
) -> Path:
    namespace = f"bench-{strategy}-{int(time.time())}"
    chats = {d.name for d in DEMO_DATASETS if d.chat}
    mean_answer = statistics.mean(d.mean_tokens for d in DEMO_DATASETS)
    cap = round(args.budget / mean_answer)
    budget_block = {
        "sample-cap": ['admission = "halt"'],
        "halt": ['admission = "halt"'],
        "reserve-truncate": ['admission = "reserve"', 'on_boundary = "truncate"'],
        "reserve-finish": ['admission = "reserve"', 'on_boundary = "finish"'],
        "reserve-stream-lowered": ['admission = "reserve"', 'on_boundary = "truncate"'],
    }[strategy]
    lines = [
        "[kafka]",
        'bootstrap = "local"',
        f'namespace = "{namespace}"',
        "[inference]",
        f'url = "{url}"',
        f"concurrency = {args.concurrency}",
        f"max_new_tokens = {args.max_new_tokens}",
        f"stream = {'true' if strategy == 'reserve-stream-lowered' else 'false'}",
        f'tokenizer = "{tokenizer}"',  # the chat datasets' template, as in the demo
        "[budget]",
        *budget_block,
        *(["snapshot_interval_s = 0.1"] if strategy == "reserve-stream-lowered" else []),
        "[sink]",
        f'path = "out-{strategy}"',
        "flush_interval_s = 1.0",
    ]
    for name, path in paths.items():
        lines += ["[[datasets]]", f'name = "{name}"', f'path = "{path}"']
        lines += ["template = true"] if name in chats else []
        if strategy == "sample-cap":
            # The usual tool: a sample count, no token budget at all.
            lines += [f"budget = {args.budget * 100}", f"limit = {cap}"]
        else:
            lines += [f"budget = {args.budget}"]
    config_path = workdir / f"{strategy}.toml"
    config_path.write_text("\n".join(lines) + "\n")
    return config_path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def measure(
    strategy: str,
    report: RunReport,
    config: config_module.Config,
    sim_log: list[dict],
    budgets: dict[str, int],
) -> tuple[list[list[object]], list[float], dict[str, int]]:
    rows_by_id: dict[str, float] = {}
    for file in config.sink_path.glob("dataset=*/*.parquet"):
        table = pq.read_table(file, columns=["request_id", "finished_at"])
        ids, finished = table["request_id"].to_pylist(), table["finished_at"].to_pylist()
        rows_by_id.update(zip(ids, finished, strict=True))
    bootstrap = BrokerSettings.from_env().bootstrap
    topics = Topics(config.kafka.namespace)
    exceeded: dict[str, ev.BudgetExceeded] = {}
    revoked_at: dict[str, float] = {}
    budget_events: list[ev.Event] = []
    read_to_end(bootstrap, topics.budgets, budget_events.append)
    for event in budget_events:
        if isinstance(event, ev.BudgetExceeded) and event.dataset not in exceeded:
            exceeded[event.dataset] = event
        if isinstance(event, ev.LeaseRevoked):
            revoked_at.setdefault(event.dataset, event.at)
    # What was already published when the lowering took effect cannot be cut: it was
    # generated under the old budget (some of it not yet counted by the ledger).
    kept_when_lowered: dict[str, int] = {}
    for file in config.sink_path.glob("dataset=*/*.parquet"):
        table = pq.read_table(file, columns=["dataset", "completion_tokens", "finished_at"])
        for row in table.to_pylist():
            name = str(row["dataset"])
            if name in revoked_at and row["finished_at"] <= revoked_at[name]:
                kept_when_lowered[name] = kept_when_lowered.get(name, 0) + row["completion_tokens"]
    generated: dict[str, int] = {}
    for record in sim_log:
        for d in DEMO_DATASETS:
            if d.name in record["text_head"]:
                generated[d.name] = generated.get(d.name, 0) + record["completion_tokens"]
    latencies: list[float] = []
    rows: list[list[object]] = []
    totals = {"budget": 0, "kept": 0, "overshoot": 0, "unused": 0, "waste": 0}
    for name, r in report.datasets.items():
        # A budget lowered below what was already kept cannot un-keep it: measure
        # against what the lowering could still control.
        budget = max(budgets[name], kept_when_lowered.get(name, 0))
        kept = r.completion_tokens
        overshoot = max(0, kept - budget)
        unused = max(0, budget - kept) if r.status == "halted" or strategy == "sample-cap" else 0
        waste = max(0, generated.get(name, 0) - kept)
        latency = "-"
        trigger = exceeded.get(name)
        refused = report.refused_at.get(name, [])
        if trigger is not None and trigger.trigger_request_id in rows_by_id and refused:
            value = max(refused) - rows_by_id[trigger.trigger_request_id]
            latencies.append(value)
            latency = f"{value * 1000:.0f} ms"
        totals["budget"] += budget
        totals["kept"] += kept
        totals["overshoot"] += overshoot
        totals["unused"] += unused
        totals["waste"] += waste
        rows.append(
            [
                name,
                f"{budget:,}",
                f"{kept:,}",
                f"{100 * overshoot / budget:.2f}%",
                f"{100 * unused / budget:.2f}%",
                f"{waste:,}",
                r.samples,
                r.status,
                latency,
            ]
        )
    return rows, latencies, totals


class BudgetLowerer(threading.Thread):
    """Lowers each dataset's budget once it has kept half of it, mid-run."""

    def __init__(self, config: config_module.Config, budget: int) -> None:
        super().__init__(daemon=True)
        self.config = config
        self.budget = budget
        self.stop = threading.Event()
        self.lowered: dict[str, float] = {}
        self.budgets: dict[str, int] = {}  # the lowered budget of each dataset

    def run(self) -> None:
        asyncio.run(self._watch())

    async def _watch(self) -> None:
        bootstrap = BrokerSettings.from_env().bootstrap
        topics = Topics(self.config.kafka.namespace)
        watcher = None
        while watcher is None and not self.stop.is_set():
            try:
                watcher = BudgetWatcher(bootstrap, topics)
                await watcher.start()
            except Exception:
                watcher = None
                await asyncio.sleep(0.5)
        if watcher is None:
            return
        task = asyncio.create_task(watcher.run())
        producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
        try:
            while not self.stop.is_set():
                for d in self.config.datasets:
                    snap = watcher.board.snapshot(d.name)
                    if d.name in self.lowered or snap is None:
                        continue
                    if snap.completion_tokens >= self.budget // 2:
                        lowered = snap.completion_tokens + int(snap.reserved * LOWERED)
                        self.budgets[d.name] = lowered
                        event = ev.BudgetSet(dataset=d.name, budget=lowered)
                        producer.send(
                            topics.control, key=d.name.encode(), value=codec.encode(event)
                        )
                        producer.flush()
                        self.lowered[d.name] = time.time()
                await asyncio.sleep(0.05)
        finally:
            producer.close()
            task.cancel()
            await watcher.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=400_000)
    parser.add_argument("--dispatchers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=8192)
    parser.add_argument("--tokens-per-second", type=float, default=6000.0)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--workdir", default="bench-out/overshoot")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    paths = write_datasets(workdir / "data", args.budget)
    tokenizer = write_tokenizer(workdir / "tokenizer", paths)
    broker.up(BrokerSettings.from_env(), [])
    print(
        f"eight datasets, budget {args.budget:,} completion tokens each, {args.dispatchers}"
        f" dispatchers x concurrency {args.concurrency}, max_new_tokens {args.max_new_tokens}"
    )
    for strategy in args.strategies.split(","):
        port = free_port()
        simulator = start_simulator(port, args.tokens_per_second, tokenizer)
        try:
            url = f"http://127.0.0.1:{port}"
            config_path = write_config(workdir, strategy, paths, url, args, tokenizer)
            config = config_module.load(config_path)
            # A fresh output folder: earlier Parquet output counts as work already done.
            shutil.rmtree(config.sink_path, ignore_errors=True)
            lowerer = BudgetLowerer(config, args.budget)
            if strategy == "reserve-stream-lowered":
                lowerer.start()
            report = run(config, progress=False, dispatchers=args.dispatchers)
            lowerer.stop.set()
            sim_log = httpx.get(f"http://127.0.0.1:{port}/sim/log", timeout=30).json()
        finally:
            lifetime.stop(simulator, 10)
        budgets = {d.name: lowerer.budgets.get(d.name, args.budget) for d in config.datasets}
        rows, latencies, totals = measure(strategy, report, config, sim_log, budgets)
        headers = [
            "dataset",
            "budget",
            "kept",
            "overshoot",
            "unused",
            "waste",
            "samples",
            "status",
            "halt latency",
        ]
        print(f"\n== {strategy} ({report.seconds:.0f} s)")
        print(format_table(headers, rows))
        share = {k: 100 * v / totals["budget"] for k, v in totals.items()}
        summary = (
            f"total: kept {totals['kept']:,} of {totals['budget']:,};"
            f" overshoot {totals['overshoot']:,} ({share['overshoot']:.2f}%);"
            f" unused {share['unused']:.2f}%;"
            f" waste {totals['waste']:,} ({share['waste']:.2f}%)"
        )
        if latencies:
            summary += (
                f"; halt latency p50 {percentile(latencies, 0.5) * 1000:.0f} ms,"
                f" p99 {percentile(latencies, 0.99) * 1000:.0f} ms"
            )
        print(summary)
        print(json.dumps({"strategy": strategy, **totals}))


if __name__ == "__main__":
    main()
