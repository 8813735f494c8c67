"""Answers the budget cuts, at a thinking model's sizes: ``[budget] cut`` any vs last,
and reservations that grow (``[budget] reserve = "grow"``).

    .venv/bin/python bench/thinking_cut.py [--budget 3000000] [--concurrency 64]
        [--max-new-tokens 131072] [--tokens-per-second 2000] [--runs 1]

One dataset of prompts whose answers average 20k tokens spread wide (the simulator's
``thinking`` profile: median ~14.5k, 1% over ~93k), ``max_new_tokens = 131072``,
run through ``tokenbudget run`` on the local broker under each cut policy, the
variants alternating (``--runs`` pairs):

  any   the old clamping: once the ledger has no more to give, what a lease still
        holds goes out at once as a shorter max_new_tokens, while the requests in
        flight will hand most of their room back
  last  requests wait for those leftovers; only the answer at the line is cut
  grow  ``cut = "last"`` with ``reserve = "grow"`` and streamed answers: a request
        reserves the mean answer, not its 131,072, and grows as it streams; an
        answer that outgrows the budget's end is aborted there and cut at the line

Per variant, graded by the simulator's own request log (each request's
max_new_tokens as sent and the length its answer would have had): answers cut by
the budget (sent with less room than they needed, below the dataset's own
max_new_tokens) and the room they were sent with, and answers aborted at the line;
then the ledger's count of them, overshoot and unused budget (the run's report,
against the budget), requests sent, the most the server had at once, and the run's
wall time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from tokenbudget.app.runner import RunReport, run
from tokenbudget.app.tables import format_table
from tokenbudget.core import config as config_module
from tokenbudget.dev import jobs, oracle
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings

VARIANTS = ("any", "last", "grow")


def write_config(
    workdir: Path, variant: str, data: Path, url: str, args: argparse.Namespace
) -> Path:
    bootstrap = BrokerSettings.from_env().bootstrap
    return jobs.write_job(
        workdir,
        bootstrap,
        f"bench-cut-{variant}-{int(time.time())}",
        url,
        {"thinking": (data, args.budget)},
        inference={
            "concurrency": args.concurrency,
            "max_new_tokens": args.max_new_tokens,
            "read_timeout_s": 600.0,
            "stream": variant == "grow",
        },
        budget={"cut": "last", "reserve": "grow"} if variant == "grow" else {"cut": variant},
        metrics={"port": 0},
    )


def one_run(variant: str, workdir: Path, data: Path, args: argparse.Namespace) -> dict[str, object]:
    # The simulator appends to its log: an earlier run's requests must not be graded.
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    server = jobs.start_simulator(
        workdir, "--profile", "thinking", "--tokens-per-second", str(args.tokens_per_second)
    )
    try:
        config = config_module.load(write_config(workdir, variant, data, server.url, args))
        started = time.monotonic()
        report: RunReport = run(config, progress=False, dispatchers=args.dispatchers)
        wall = time.monotonic() - started
    finally:
        server.stop()
    sent = oracle.rooms(server.log)
    cut = oracle.cut_by_budget(sent, args.max_new_tokens)
    aborted = sum(1 for a in oracle.read_server_log(server.log).values() if a.finish == "abort")
    result = report.datasets["thinking"]
    kept = result.completion_tokens
    return {
        "variant": variant,
        "requests": len(sent),
        "samples": result.samples,
        "cut": len(cut),
        "cut_room": sum(r.max_new_tokens for r in cut),
        "aborted": aborted,
        "peak": oracle.peak_in_flight(server.log),
        "ledger_cut": result.cut,
        "kept": kept,
        "overshoot": max(0, kept - args.budget),
        "unused": max(0, args.budget - kept) if result.status == "halted" else None,
        "status": result.status,
        "seconds": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=3_000_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=131_072)
    parser.add_argument("--tokens-per-second", type=float, default=2000.0)
    parser.add_argument("--dispatchers", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=600)
    parser.add_argument("--runs", type=int, default=1, help="pairs of runs, alternating")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--workdir", default="bench-out/thinking_cut")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    data = jobs.rows(workdir / "thinking.jsonl", "#think", args.prompts)
    broker.up(BrokerSettings.from_env(), [])
    print(
        f"one dataset, budget {args.budget:,} completion tokens, answers of mean 20k (profile"
        f" thinking), max_new_tokens {args.max_new_tokens:,}, {args.dispatchers} dispatcher(s)"
        f" x concurrency {args.concurrency}, {args.tokens_per_second:g} tokens/s per request"
    )
    results = []
    for n in range(args.runs):
        for variant in args.variants.split(","):
            result = one_run(variant, workdir / f"{variant}-{n}", data, args)
            print(json.dumps(result), flush=True)
            results.append(result)
    headers = [
        "cut",
        "requests",
        "kept answers",
        "cut by budget (server log)",
        "their room",
        "aborted at the line",
        "cut (ledger)",
        "most at once",
        "overshoot",
        "unused",
        "wall time",
    ]
    rows = []
    for r in results:
        unused = r["unused"]
        rows.append(
            [
                r["variant"],
                r["requests"],
                r["samples"],
                f"{r['cut']} ({100 * int(r['cut']) / max(1, int(r['samples'])):.1f}%)",
                f"{r['cut_room']:,} ({100 * int(r['cut_room']) / args.budget:.1f}%)",
                r["aborted"],
                r["ledger_cut"],
                r["peak"],
                f"{r['overshoot']:,}",
                "-" if unused is None else f"{unused:,}",
                f"{r['seconds']} s",
            ]
        )
    print()
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
