"""A config written by ``tokenbudget init`` runs as it is: the demo's eight datasets
(plain prompts, and chat turns that need a template) against the simulator, which
names its tokenizer as SGLang does. Only the broker's address comes from the
environment (the test's broker, not the project's own). Graded from the
simulator's request log and the Parquet rows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tokenbudget import cli
from tokenbudget.app.runner import RunReport, run_async
from tokenbudget.core import config as config_module
from tokenbudget.dev import demo
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import RequestRecord, SimulatorConfig

pytestmark = pytest.mark.integration


async def init_then_run(
    tmp_path: Path, bootstrap: str
) -> tuple[int, RunReport, list[RequestRecord]]:
    paths = demo.write_datasets(tmp_path / "data", 3000)
    tokenizer = demo.write_tokenizer(tmp_path / "tokenizer", paths)
    sim = await sim_server.start(
        SimulatorConfig(port=0, tokens_per_second=50_000, tokenizer=str(tokenizer))
    )
    try:
        job = tmp_path / "job.toml"
        args = ["init", "--server", sim.url, *map(str, paths.values()), "--budget", "3k"]
        code = await asyncio.to_thread(cli.main, [*args, "-o", str(job)])
        environ = {"TOKENBUDGET__KAFKA__BOOTSTRAP": bootstrap, "TOKENBUDGET__METRICS__PORT": "0"}
        report = await run_async(config_module.load(job, environ=environ))
        return code, report, list(sim.log)
    finally:
        await sim.stop()


def test_a_config_written_by_init_runs_unchanged(tmp_path: Path, kafka_bootstrap: str) -> None:
    code, report, log = asyncio.run(init_then_run(tmp_path, kafka_bootstrap))
    assert code == 0
    names = [d.name for d in demo.DEMO_DATASETS]
    assert list(report.datasets) == names
    assert all(
        r.status == "halted" and r.completion_tokens == 3000 for r in report.datasets.values()
    )
    # The chat dataset went out templated here, as ids; the others as text.
    served: dict[str, list[RequestRecord]] = {}
    for record in log:
        name = next(n for n in names if n in record.text_head)
        served.setdefault(name, []).append(record)
    for name in names:
        chat = name == "B7_sharegpt_chat"
        assert served[name] and all((r.prompt_crc != 0) == chat for r in served[name]), name
        rows = pq.read_table(tmp_path / "out" / f"dataset={name}", columns=["request_id"])
        kept = {r.rid for r in served[name] if r.finish in ("stop", "length")}
        assert set(rows.column("request_id").to_pylist()) <= kept
        assert rows.num_rows == report.datasets[name].samples
