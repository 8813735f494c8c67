"""The whole loop on the real broker: prompts in, counted completions out, halts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tokenbudget.app.runner import RunReport, run_async
from tokenbudget.core import config as config_module
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import SimulatorConfig
from tokenbudget.dev.tiny_tokenizer import CORPUS, build_tokenizer, dataset_corpus

pytestmark = pytest.mark.integration

CONCURRENCY = 8
MAX_NEW_TOKENS = 2048


def write_jsonl(path: Path, marker: str, count: int, chat: bool = False) -> Path:
    with path.open("w") as handle:
        for i in range(count):
            text = f"{marker} {path.stem} prompt {i}"
            row = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
            handle.write(json.dumps(row) + "\n")
    return path


def make_config(
    tmp_path: Path, bootstrap: str, namespace: str, url: str, admission: str = "reserve"
) -> config_module.Config:
    data = {
        "kafka": {"bootstrap": bootstrap, "namespace": namespace},
        "budget": {"admission": admission},
        "inference": {
            "url": url,
            "api": "sglang",
            "concurrency": CONCURRENCY,
            "max_new_tokens": MAX_NEW_TOKENS,
            "tokenizer": "tok",
        },
        "sink": {"path": "out", "flush_interval_s": 1.0},
        "datasets": [
            # long answers, budget reached after ~15 completions: halted
            {"name": "long", "path": "long.jsonl", "budget": "50k"},
            # chat rows (templated here: /generate takes text), budget reached: halted
            {"name": "chat", "path": "chat.jsonl", "budget": "30k", "template": True},
            # too few prompts to reach its budget: exhausted
            {"name": "small", "path": "small.jsonl", "budget": "1M"},
        ],
    }
    write_jsonl(tmp_path / "long.jsonl", "#long-code", 200)
    write_jsonl(tmp_path / "chat.jsonl", "#chat", 200, chat=True)
    write_jsonl(tmp_path / "small.jsonl", "#short", 12)
    # Trained on the chat prompts, so each gets ids of its own (and a length of its own).
    build_tokenizer(tmp_path / "tok", [*CORPUS, *dataset_corpus([tmp_path / "chat.jsonl"])])
    return config_module.build(data, base_dir=tmp_path, environ={})


async def run_against_simulator(config_for_url, tps: float = 20000.0) -> tuple[RunReport, list]:
    sim = await sim_server.start(SimulatorConfig(port=0, tokens_per_second=tps))
    try:
        config = config_for_url(sim.url)
        report = await run_async(config, keep_dispatch_log=True)
        return report, list(sim.log)
    finally:
        await sim.stop()


def read_sink(root: Path) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for file in root.glob("dataset=*/*.parquet"):
        table = pq.read_table(file)
        for row in table.to_pylist():
            rows.setdefault(row["dataset"], []).append(row)
    return rows


@pytest.mark.parametrize("admission", ["halt", "reserve"])
def test_budgets_halt_datasets_and_parquet_matches_ledger(
    tmp_path: Path, kafka_bootstrap: str, namespace: str, admission: str
) -> None:
    configs: list[config_module.Config] = []

    def config_for(url: str) -> config_module.Config:
        configs.append(make_config(tmp_path, kafka_bootstrap, namespace, url, admission))
        return configs[-1]

    report, sim_log = asyncio.run(run_against_simulator(config_for))
    window = configs[0].max_queued_per_dataset
    results = report.datasets
    assert results["long"].status == "halted"
    assert results["chat"].status == "halted"
    assert results["small"].status == "exhausted"
    assert results["small"].samples == 12

    in_flight_bound = CONCURRENCY * MAX_NEW_TOKENS
    for name in ("long", "chat"):
        r = results[name]
        if admission == "halt":
            # Halting after the fact: what was in flight when the budget was reached
            # overshoots, and so does what was sent before the halt reached the
            # dispatcher: at most one more round of the concurrency.
            assert r.budget <= r.completion_tokens <= r.budget + 2 * in_flight_bound, name
        else:
            # Reserved before sending and clamped: the budget, to the token.
            assert r.completion_tokens == r.budget, name
        # Only the producer's window was left queued when the halt came (and what
        # was in flight); the rows never sent are recorded as skipped too: one
        # outcome per row.
        not_sent = report.produced[name].not_sent
        assert not_sent > 0
        assert r.skipped - not_sent <= window + CONCURRENCY
        assert r.samples + r.skipped + r.failed == 200

    # No request of a halted dataset left a dispatcher after it saw the halt.
    assert report.dispatch is not None
    for name in ("long", "chat"):
        halted_at = report.halt_seen_at[name]
        assert halted_at is not None
        sent = [d for d in report.dispatch.sent if d.dataset == name]
        assert sent and all(d.sent_at <= halted_at for d in sent)
    if admission == "reserve":
        # The last answers were cut at the line: the server was told exactly what was left.
        cut = [r for r in sim_log if r.finish == "length" and r.max_new_tokens < MAX_NEW_TOKENS]
        assert cut

    # Parquet holds exactly what the ledger counted, each prompt once.
    sink = read_sink(tmp_path / "out")
    for name, r in results.items():
        rows = sink[name]
        assert len(rows) == r.samples
        assert sum(row["completion_tokens"] for row in rows) == r.completion_tokens
        assert sum(row["prompt_tokens"] for row in rows) == r.prompt_tokens
        assert all(len(row["output_ids"]) == row["completion_tokens"] for row in rows)
        assert len({row["request_id"] for row in rows}) == len(rows)
        assert len({row["prompt_id"] for row in rows}) == len(rows)

    # The counts are the server's own: every kept request id was served as logged.
    served = {rec.rid: rec.completion_tokens for rec in sim_log}
    for rows in sink.values():
        for row in rows:
            assert served[row["request_id"]] == row["completion_tokens"]

    assert report.to_json()["datasets"]["small"]["status"] == "exhausted"
