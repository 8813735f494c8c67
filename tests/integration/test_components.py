"""The pipeline as separate processes, as on separate hosts: ledger, dispatcher,
sink and producer started on their own, read with ``budget show``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.integration.test_ledger_worker import wait_for_snapshot
from tests.integration.test_reservations import write_config, write_prompts
from tokenbudget.app.runner import cli_command
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import SimulatorConfig
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration


def test_components_run_apart_and_stop_cleanly_on_sigterm(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    topics = Topics(namespace)
    write_prompts(tmp_path / "d.jsonl", "#code", 300)

    async def scenario() -> None:
        sim = await sim_server.start(SimulatorConfig(port=0, tokens_per_second=20000))
        config = write_config(
            tmp_path,
            kafka_bootstrap,
            namespace,
            sim.url,
            [{"name": "d", "path": "d.jsonl", "budget": "20k"}],
        )
        workers = [
            subprocess.Popen(cli_command(name, "--config", str(config)), start_new_session=True)
            for name in ("ledger", "dispatch", "sink")
        ]
        try:
            produced = await asyncio.to_thread(
                subprocess.run,
                cli_command("produce", "--config", str(config)),
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert produced.returncode == 0, produced.stderr
            assert "d:" in produced.stdout and "(halted)" in produced.stdout
            halted = await asyncio.to_thread(
                wait_for_snapshot, kafka_bootstrap, topics, "d", lambda s: s.halted
            )
            assert halted.completion_tokens == 20_000

            shown = await asyncio.to_thread(
                subprocess.run,
                cli_command("budget", "show", "--json", "--config", str(config)),
                capture_output=True,
                text=True,
                timeout=60,
            )
            ledger_view = json.loads(shown.stdout)["d"]
            assert ledger_view["completion_tokens"] == 20_000
            assert ledger_view["status"] == "halted"
        finally:
            for worker in workers:
                if worker.poll() is None:
                    os.killpg(worker.pid, signal.SIGTERM)
            for worker in workers:
                worker.wait(60)
            await sim.stop()
        # SIGTERM: the sink read to the end, wrote its files and committed.
        assert [w.returncode for w in workers] == [0, 0, 0]
        rows = []
        for file in (tmp_path / "out").glob("dataset=*/*.parquet"):
            rows += pq.read_table(file, columns=["completion_tokens"]).to_pylist()
        assert len(rows) == halted.samples
        assert sum(r["completion_tokens"] for r in rows) == 20_000

    asyncio.run(scenario())
