"""Datasets whose prompt is not in ``prompt``, mapped by config, end to end on the
real broker: an Alpaca-layout file (instruction, input, output) through
``prompt_template`` and a MetaMathQA-layout file (query, response) through
``prompt_field``. Graded from outside the pipeline: the text each row should give
is built here from the dataset file by the Alpaca convention, and compared with
what the server's own request log says it received."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tokenbudget.app.run_report import RunReport
from tokenbudget.app.runner import run_async
from tokenbudget.core import config as config_module
from tokenbudget.dev.oracle import text_crc
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import SimulatorConfig

pytestmark = pytest.mark.integration


def alpaca_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(8):
        row = {"instruction": f"#short Describe item {i} in one line.", "output": "..."}
        # Alpaca's input: text, or "" when the instruction stands alone (null here too)
        row["input"] = [f"Item {i} is a\nbrass lamp.", "", None, "   "][i % 4]
        rows.append(row)
    return rows


def expected_alpaca(row: dict[str, Any]) -> str:
    """The Alpaca convention: the instruction, and the input after a blank line when
    there is one."""
    has_input = isinstance(row.get("input"), str) and row["input"].strip()
    return row["instruction"] + (f"\n\n{row['input']}" if has_input else "")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mapped_rows_reach_the_server_as_their_templated_text(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows())
    metamath = write_jsonl(
        tmp_path / "metamath.jsonl",
        [{"query": f"#short What is {i} + {i}?", "response": "...", "type": "x"} for i in range(5)],
    )
    log = tmp_path / "server-requests.jsonl"

    def config(url: str) -> config_module.Config:
        data = {
            "kafka": {"bootstrap": kafka_bootstrap, "namespace": namespace},
            "inference": {"url": url, "api": "sglang", "concurrency": 4, "max_new_tokens": 300},
            "budget": {"snapshot_interval_s": 0.2},
            "sink": {"path": "out", "flush_interval_s": 0.5},
            "datasets": [
                {
                    "name": "alpaca",
                    "path": "alpaca.jsonl",
                    "budget": "1M",
                    "prompt_template": "{instruction}\n\n{input?}",
                },
                {
                    "name": "metamath",
                    "path": "metamath.jsonl",
                    "budget": "1M",
                    "prompt_field": "query",
                },
            ],
        }
        return config_module.build(data, base_dir=tmp_path, environ={})

    async def run() -> RunReport:
        sim = await sim_server.start(
            SimulatorConfig(port=0, tokens_per_second=20000, log_file=str(log))
        )
        try:
            return await run_async(config(sim.url))
        finally:
            await sim.stop()

    report = asyncio.run(run())

    # what each row should give, read from the files here
    expected = [expected_alpaca(json.loads(line)) for line in alpaca.read_text().splitlines()]
    expected += [json.loads(line)["query"] for line in metamath.read_text().splitlines()]
    assert expected[0] == "#short Describe item 0 in one line.\n\nItem 0 is a\nbrass lamp."
    assert expected[1:4] == [f"#short Describe item {i} in one line." for i in (1, 2, 3)]

    served = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(record["fault"] == "" for record in served)
    # every prompt once, each exactly the text its row gives (a crc of the whole text)
    assert sorted(record["text_crc"] for record in served) == sorted(
        text_crc(text) for text in expected
    )
    assert sorted(record["text_head"] for record in served) == sorted(t[:80] for t in expected)
    assert report.datasets["alpaca"].status == "exhausted"
    assert report.datasets["alpaca"].samples == 8
    assert report.datasets["metamath"].samples == 5
