"""Real wire formats end to end: every API mode, plain and streaming, against the
simulator on the real broker; the counts kept are the counts the server reported.
Chat templates applied locally (ShareGPT JSONL, a Hugging Face dataset on disk), the
tokenizer fallback, and a rerun of a finished config that dispatches nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.producers.tokenizer_fixture import build_tokenizer
from tokenbudget.app.runner import RunReport, run_async
from tokenbudget.core import config as config_module
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import RequestRecord, SimulatorConfig
from tokenbudget.producers.prompts.datasets import read_options, read_prompts

# One worker runs them all (ONE_WORKER in tests/conftest.py): their module fixture is costly.
pytestmark = pytest.mark.integration

MODEL = "tokenbudget-sim"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def make_config(
    tmp_path: Path,
    bootstrap: str,
    namespace: str,
    url: str,
    datasets: list[dict[str, Any]],
    **inference: Any,
) -> config_module.Config:
    data = {
        "kafka": {"bootstrap": bootstrap, "namespace": namespace},
        "inference": {
            "url": url,
            "model": MODEL,
            "concurrency": 4,
            "max_new_tokens": 400,
            **inference,
        },
        "budget": {"snapshot_interval_s": 0.2},
        "sink": {"path": "out", "flush_interval_s": 0.5},
        "datasets": datasets,
    }
    return config_module.build(data, base_dir=tmp_path, environ={})


async def run_with_simulator(
    sim_config: SimulatorConfig, configs: list[Any]
) -> list[tuple[RunReport, list[RequestRecord]]]:
    """Run each config (a function of the simulator's URL) in turn against one
    simulator; returns each run's report and the requests it served."""
    sim = await sim_server.start(sim_config)
    try:
        out = []
        for config_for_url in configs:
            served_before = len(sim.log)
            report = await run_async(config_for_url(sim.url))
            out.append((report, list(sim.log[served_before:])))
        return out
    finally:
        await sim.stop()


def read_sink(root: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for file in sorted(root.glob("dataset=*/*.parquet")):
        rows.extend(pq.read_table(file).to_pylist())
    return rows


def write_prompts(path: Path, count: int) -> Path:
    with path.open("w") as handle:
        for i in range(count):
            handle.write(json.dumps({"id": f"p{i}", "prompt": f"#short tell me a story {i}"}))
            handle.write("\n")
    return path


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", ["sglang", "openai-completions", "openai-chat"])
def test_counts_kept_equal_the_servers(
    tmp_path: Path, kafka_bootstrap: str, namespace: str, api: str, stream: bool
) -> None:
    write_prompts(tmp_path / "d.jsonl", 6)
    datasets = [{"name": "d", "path": "d.jsonl", "budget": "1M"}]
    [(report, served)] = asyncio.run(
        run_with_simulator(
            SimulatorConfig(port=0, tokens_per_second=50_000, seed=11),
            [
                lambda url: make_config(
                    tmp_path, kafka_bootstrap, namespace, url, datasets, api=api, stream=stream
                )
            ],
        )
    )
    result = report.datasets["d"]
    assert result.status == "exhausted" and result.samples == 6
    rows = read_sink(tmp_path / "out")
    assert len(rows) == 6
    by_rid = {record.rid: record for record in served}
    assert all(record.api == api for record in served)
    for row in rows:
        record = by_rid[row["request_id"]]  # the rid we sent is the one the server logged
        assert row["completion_tokens"] == record.completion_tokens > 0
        assert row["prompt_tokens"] == record.prompt_tokens
        assert len(row["output_ids"]) == row["completion_tokens"]
        assert row["count_source"] == "server"
        assert (row["first_token_at"] is not None) is stream
    # the ledger kept the same counts
    assert result.completion_tokens == sum(r["completion_tokens"] for r in rows)
    assert result.prompt_tokens == sum(r["prompt_tokens"] for r in rows)


def test_tokenizer_counts_when_the_server_gives_none(
    tmp_path: Path, kafka_bootstrap: str, namespace: str, tokenizer_dir: Path
) -> None:
    write_prompts(tmp_path / "d.jsonl", 5)
    datasets = [{"name": "d", "path": "d.jsonl", "budget": "1M"}]
    bare = SimulatorConfig(
        port=0, tokens_per_second=50_000, seed=11, omit_usage=True, omit_token_ids=True
    )
    [(report, served)] = asyncio.run(
        run_with_simulator(
            bare,
            [
                lambda url: make_config(
                    tmp_path,
                    kafka_bootstrap,
                    namespace,
                    url,
                    datasets,
                    api="openai-completions",
                    stream=True,
                    tokenizer=str(tokenizer_dir),
                )
            ],
        )
    )
    rows = read_sink(tmp_path / "out")
    assert len(rows) == 5 == report.datasets["d"].samples
    by_rid = {record.rid: record for record in served}
    for row in rows:
        assert row["count_source"] == "tokenizer"
        assert row["output_ids"] is None  # the server returned no ids
        # each simulated word is one token of the test tokenizer: the counts agree
        assert row["completion_tokens"] == by_rid[row["request_id"]].completion_tokens


def sharegpt_rows(count: int) -> list[dict[str, Any]]:
    return [
        {
            "conversations": [
                {"from": "system", "value": "you are a helpful assistant"},
                {"from": "human", "value": f"write a detailed answer about item {i}"},
                {"from": "gpt", "value": "the old answer"},
            ]
        }
        for i in range(count)
    ]


def test_chat_template_datasets_and_a_rerun_that_dispatches_nothing(
    tmp_path: Path,
    kafka_bootstrap: str,
    namespace: str,
    tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import datasets as hf

    with (tmp_path / "chat.jsonl").open("w") as handle:
        for row in sharegpt_rows(6):
            handle.write(json.dumps(row) + "\n")
    hf.Dataset.from_list(
        [{"id": f"h{i}", "messages": [{"role": "user", "content": f"hello {i}"}]} for i in range(5)]
    ).save_to_disk(str(tmp_path / "hf"))
    datasets = [
        {"name": "sharegpt", "path": "chat.jsonl", "budget": "1M", "format": "sharegpt",
         "template": True},
        {"name": "hfdisk", "path": "hf", "budget": "1M", "format": "hf", "template": True},
    ]  # fmt: skip

    def config_for(url: str) -> config_module.Config:
        return make_config(
            tmp_path,
            kafka_bootstrap,
            namespace,
            url,
            datasets,
            api="sglang",
            stream=True,
            tokenizer=str(tokenizer_dir),
        )

    (first, served), (second, served_again) = asyncio.run(
        run_with_simulator(
            SimulatorConfig(port=0, tokens_per_second=50_000, seed=11),
            [config_for, config_for],
        )
    )
    # First run: every prompt generated from the ids templated here.
    assert first.datasets["sharegpt"].samples == 6
    assert first.datasets["hfdisk"].samples == 5
    config = config_for("http://unused")
    expected = {
        row.prompt_id: row.input_ids
        for dataset in config.datasets
        for row in read_prompts(dataset.name, dataset.path, **read_options(config, dataset))
    }
    assert len(expected) == 11 and all(ids for ids in expected.values())
    rows = read_sink(tmp_path / "out")
    assert len(rows) == 11
    by_rid = {record.rid: record for record in served}
    for row in rows:
        ids = expected[row["prompt_id"]]
        assert ids is not None
        # the server saw exactly the template's ids, and that is what was recorded
        assert by_rid[row["request_id"]].prompt_tokens == len(ids) == row["prompt_tokens"]
        assert by_rid[row["request_id"]].text_head.startswith(" ".join(map(str, ids))[:80])
        assert row["completion_tokens"] == by_rid[row["request_id"]].completion_tokens
    # Second run of the same config: nothing new reaches the server.
    assert served_again == []
    report = second.to_json()["datasets"]
    assert report["sharegpt"]["already_done"] == 6  # type: ignore[index]
    assert report["hfdisk"]["already_done"] == 5  # type: ignore[index]
    assert first.to_json()["datasets"]["sharegpt"]["already_done"] == 0  # type: ignore[index]
    assert second.datasets["sharegpt"].samples == 6  # the ledger still holds the first run
    assert second.datasets["sharegpt"].status == "exhausted"
    assert len(read_sink(tmp_path / "out")) == 11
    from tokenbudget.app.report import print_table

    print_table(second)
    printed = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + printed)
    assert "skipped 11 prompts already done by an earlier run (sharegpt 6, hfdisk 5)" in printed


def test_a_new_namespace_skips_the_prompts_already_in_the_parquet_output(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    """The ledger of a new namespace has no record of the first run: the sink's
    files are what says those prompts are done."""
    write_prompts(tmp_path / "d.jsonl", 5)
    datasets = [{"name": "d", "path": "d.jsonl", "budget": "1M"}]
    (_first, served), (second, served_again) = asyncio.run(
        run_with_simulator(
            SimulatorConfig(port=0, tokens_per_second=50_000, seed=11),
            [
                lambda url: make_config(tmp_path, kafka_bootstrap, namespace, url, datasets),
                lambda url: make_config(tmp_path, kafka_bootstrap, namespace + "b", url, datasets),
            ],
        )
    )
    assert len(served) == 5 and served_again == []
    assert second.to_json()["datasets"]["d"]["already_done"] == 5  # type: ignore[index]
    assert len(read_sink(tmp_path / "out")) == 5
