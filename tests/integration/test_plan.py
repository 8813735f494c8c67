"""``tokenbudget plan`` against the simulator, graded by the runs that follow.

A job's first dataset has answers from an earlier run; a second has none, so the plan
sends it a pilot; a third has too few prompts for its budget. The run after the plan
then fills the budgets, and what it needed is counted from the simulator's own
request log (each prompt the server answered), checked against the Parquet rows.
The simulator's ``steady`` profile gives answers of one length give or take 10%, as
"stable lengths" asks: the plan must be within 10% of what the run needed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tokenbudget.app.plan import Plan, make_plan
from tokenbudget.app.runner import RunReport, run_async
from tokenbudget.core import config as config_module
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import RequestRecord, SimulatorConfig

pytestmark = pytest.mark.integration

ROWS = {"known": 150, "fresh": 120, "small": 30}
PILOT = 12


def write_datasets(folder: Path) -> None:
    for name, count in ROWS.items():
        with (folder / f"{name}.jsonl").open("w") as handle:
            for i in range(count):
                row = {"id": i, "prompt": f"{name} task {i}: write about item {i}"}
                handle.write(json.dumps(row) + "\n")


def job(
    folder: Path, bootstrap: str, namespace: str, url: str, budgets: dict[str, str]
) -> config_module.Config:
    data: dict[str, Any] = {
        "kafka": {"bootstrap": bootstrap, "namespace": namespace},
        "inference": {"url": url, "concurrency": 8, "max_new_tokens": 2000},
        "budget": {"snapshot_interval_s": 0.1},
        "sink": {"path": "out", "flush_interval_s": 1.0},
        "metrics": {"port": 0},
        "datasets": [
            {"name": name, "path": f"{name}.jsonl", "budget": budget}
            for name, budget in budgets.items()
        ],
    }
    return config_module.build(data, base_dir=folder, environ={})


async def plan_then_run(
    folder: Path, bootstrap: str, namespace: str
) -> tuple[Plan, RunReport, list[RequestRecord]]:
    sim = await sim_server.start(
        SimulatorConfig(port=0, tokens_per_second=50_000, profile="steady")
    )
    try:
        # An earlier run of the job, with a smaller budget for "known" alone.
        await run_async(job(folder, bootstrap, namespace, sim.url, {"known": "20k"}))
        budgets = {"known": "80k", "fresh": "60k", "small": "100k"}
        config = job(folder, bootstrap, namespace, sim.url, budgets)
        plan = await make_plan(config, pilot=PILOT)
        report = await run_async(config)
        return plan, report, list(sim.log)
    finally:
        await sim.stop()


def test_the_plan_predicts_what_the_run_needs(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    write_datasets(tmp_path)
    plan, report, log = asyncio.run(plan_then_run(tmp_path, kafka_bootstrap, namespace))
    plans = {p.dataset: p for p in plan.datasets}
    assert plan.piloted == ["fresh", "small"]
    assert plans["known"].answers_from == "earlier rows"
    assert plans["fresh"].answers_from == "pilot"
    assert plans["fresh"].answers is not None and plans["fresh"].answers.count == PILOT
    assert plan.tokens_per_s is not None

    # What the server answered, per dataset, over the earlier run, the pilot and the run.
    answered: dict[str, set[int]] = {}
    for record in log:
        if record.finish in ("stop", "length") and not record.fault:
            answered.setdefault(record.text_head.split()[0], set()).add(record.text_crc)
    for name in ROWS:
        rows = pq.read_table(tmp_path / "out" / f"dataset={name}", columns=["prompt_id"])
        assert rows.num_rows == len(answered[name]) == report.datasets[name].samples, name

    for name in ("known", "fresh"):
        p, needed = plans[name], len(answered[name])
        assert report.datasets[name].status == "halted"
        assert p.outcome == "fills"
        assert p.needed is not None and abs(p.needed - needed) <= 0.1 * needed, (p, needed)
        assert p.needed_low is not None and p.needed_high is not None
        assert p.needed_low <= p.needed_high <= ROWS[name]

    small = plans["small"]
    assert small.outcome == "runs out" and small.available == ROWS["small"]
    assert report.datasets["small"].status == "exhausted"
    assert len(answered["small"]) == ROWS["small"]
    assert small.keeps is not None
    assert abs(small.keeps - report.datasets["small"].completion_tokens) <= 0.1 * small.keeps
