"""What ``tokenbudget plan --pilot N`` said beside what the run that followed did.

    .venv/bin/python bench/plan_vs_run.py [--budget 400k] [--pilot 16]
        [--workdir bench-out/plan_vs_run]

The job of ``tokenbudget demo`` (its eight datasets, tokenizer and config, written
by :mod:`tokenbudget.dev.demo`), in a namespace and an output folder of its own,
against the simulator the demo starts. First ``tokenbudget plan --pilot N --json``,
then ``tokenbudget run --json`` to the end, both as the CLI a user runs.

The pilot is not kept apart from the run, by design (tokenbudget/app/plan.py): it
runs the first N prompts of each dataset as the job itself (same namespace and sink
path, ``limit`` lowered), so the ledger counts its answers against the budgets, the
sink keeps them as rows, and the run resumes past them. The plan's ``needed``
counts them too (done + the prompts the rest of the budget takes). So both sides
are job totals: pilot + run.

Per dataset: budget; prompts available; the pilot's answers; prompts planned (the
plan's ``needed``, capped at the prompts available: a dataset that runs out answers
them all) with its 10-90% range, capped alike; answers the ledger counted (the
run's report) and the rows in the Parquet files under the output folder (read here,
an independent count; distinct prompt ids, which must match); the plan's error
against the Parquet count; whether that count is within the range; the outcome
planned (fills / may run out / runs out) against the run's status (halted /
exhausted); and the mean answer tokens the pilot measured against the kept answers
that ended on their own (not cut at the budget's line: the plan measures those
only), with the answers cut. A summary line follows: datasets within 10%, within
the range, outcomes that agree.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tokenbudget.app.children import cli_command
from tokenbudget.app.tables import format_table
from tokenbudget.core import lifetime
from tokenbudget.core.config import parse_budget
from tokenbudget.dev import demo
from tokenbudget.dev.ports import free_port

# The plan's outcome, and the run status it foretells ("may run out": either).
EXPECTED = {"fills": {"halted"}, "runs out": {"exhausted"}, "may run out": {"halted", "exhausted"}}


def build_job(workdir: Path, budget: int, port: int) -> Path:
    """The demo's datasets, tokenizer and config under ``workdir``, in a namespace
    no earlier run used."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    paths = demo.write_datasets(workdir / "data", budget)
    tokenizer = demo.write_tokenizer(workdir / "tokenizer", paths)
    config = demo.write_config(workdir, paths, port, budget, tokenizer)
    namespace = f"bench-plan-vs-run-{time.time_ns()}"
    text = re.sub(r'(?m)^namespace = ".*"$', f'namespace = "{namespace}"', config.read_text())
    config.write_text(text)
    return config


def command_json(args: list[str], log: Path, timeout: float) -> dict[str, Any]:
    """Run a ``tokenbudget`` command (a child bound to this process), its stderr to
    ``log``; its stdout, JSON."""
    with log.open("wb") as err:
        process = lifetime.spawn(cli_command(*args), stdout=subprocess.PIPE, stderr=err)
        try:
            out, _ = process.communicate(timeout=timeout)
        finally:
            if process.poll() is None:
                process.terminate()
                process.wait(30)
    if process.returncode != 0:
        sys.stderr.write(log.read_text())
        raise SystemExit(f"tokenbudget {args[0]} exited {process.returncode} (log: {log})")
    result: dict[str, Any] = json.loads(out)
    return result


def parquet_rows(root: Path, dataset: str) -> dict[str, Any]:
    """The rows under the sink path ``root`` for ``dataset``, read directly."""
    columns = ["prompt_id", "completion_tokens", "stop_reason"]
    rows: list[dict[str, Any]] = []
    for file in sorted((root / f"dataset={dataset}").glob("*.parquet")):
        if not file.name.startswith("."):
            rows += pq.read_table(file, columns=columns).to_pylist()
    whole = [r["completion_tokens"] for r in rows if r["stop_reason"] not in ("budget", "abort")]
    return {
        "rows": len(rows),
        "distinct": len({r["prompt_id"] for r in rows}),
        "cut": len(rows) - len(whole),
        "mean": statistics.fmean(whole) if whole else None,
    }


def capped(value: int | None, available: int) -> int | None:
    return None if value is None else min(value, available)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default=f"{demo.DEMO_BUDGET // 1000}k")
    parser.add_argument("--pilot", type=int, default=16, help="requests per dataset")
    parser.add_argument("--workdir", default="bench-out/plan_vs_run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per command, seconds")
    args = parser.parse_args()
    budget = parse_budget(args.budget, "--budget")
    workdir = Path(args.workdir).resolve()
    port = free_port()
    config = build_job(workdir, budget, port)
    tokenizer = workdir / "tokenizer"
    simulator = demo.start_simulator(port, demo.TOKENS_PER_SECOND, tokenizer)
    try:
        started = time.monotonic()
        plan = command_json(
            ["plan", "--config", str(config), "--pilot", str(args.pilot), "--json"],
            workdir / "plan.log",
            args.timeout,
        )
        plan_seconds = time.monotonic() - started
        started = time.monotonic()
        report = command_json(
            ["run", "--config", str(config), "--json"], workdir / "run.log", args.timeout
        )
        run_seconds = time.monotonic() - started
    finally:
        lifetime.stop(simulator, 10)

    out = workdir / "out"
    rows = []
    within10 = within_range = agree = counted = ranged = 0
    for name, p in plan["datasets"].items():
        r = report["datasets"][name]
        kept = parquet_rows(out, name)
        available = p["available"]
        needed = capped(p["needed"], available)
        low, high = capped(p["needed_low"], available), capped(p["needed_high"], available)
        actual = kept["rows"]
        error = None if needed is None or not actual else 100.0 * (needed - actual) / actual
        if error is not None:
            counted += 1
            within10 += abs(error) <= 10.0
        inside = None
        if low is not None and high is not None:
            ranged += 1
            inside = low <= actual <= high
            within_range += inside
        matches = r["status"] in EXPECTED.get(p["outcome"], set())
        agree += matches
        answers = p["answers"]
        rows.append(
            [
                name,
                f"{p['budget']:,}",
                f"{available:,}",
                f"{p['done']:,}",
                "unknown" if needed is None else f"{needed:,} ({low:,}-{high:,})",
                f"{r['samples']:,}",
                f"{actual:,}"
                + ("" if kept["distinct"] == actual else f" ({kept['distinct']:,} distinct!)"),
                "-" if error is None else f"{error:+.1f}%",
                "-" if inside is None else ("yes" if inside else "no"),
                f"{p['outcome']} / {r['status']}" + ("" if matches else " (!)"),
                "unknown" if answers is None else f"{answers['mean']:,.0f}",
                "-" if kept["mean"] is None else f"{kept['mean']:,.0f}",
                f"{kept['cut']:,}",
            ]
        )
    headers = [
        "dataset",
        "budget",
        "avail",
        "pilot",
        "planned (10-90%)",
        "ledger",
        "parquet",
        "error",
        "in range",
        "outcome plan / run",
        "mean tok plan",
        "mean tok run",
        "cut",
    ]
    print(
        f"demo job, budget {budget:,} completion tokens per dataset, pilot {args.pilot}"
        f" requests each; plan {plan_seconds:.1f} s, run {run_seconds:.1f} s;"
        f" logs and Parquet in {workdir}"
    )
    print(format_table(headers, rows))
    print(
        f"\n{within10}/{counted} datasets within 10% of the Parquet count, {within_range}/{ranged}"
        f" within the plan's 10-90% range, {agree}/{len(rows)} outcomes as planned"
        " (counts are job totals: pilot + run; planned capped at the prompts available)"
    )


if __name__ == "__main__":
    main()
