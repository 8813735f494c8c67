"""Training-ready rows, end to end on the real broker: every Parquet row carries the
prompt as sent, its ids, the model, the settings sent, the dataset row's id and kept
columns; ``n`` answers per prompt are budgeted and kept one by one. Graded from
outside the pipeline: the dataset files, the tokenizer applied here to the file's
messages, and the simulator's own request log."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_backends import MODEL, make_config, run_with_simulator
from tests.producers.tokenizer_fixture import build_tokenizer
from tokenbudget.app.commands.export import export_from_topic
from tokenbudget.dev.simulator.config import RequestRecord, SimulatorConfig
from tokenbudget.dev.simulator.generation import ids_crc
from tokenbudget.producers.templates import load_tokenizer
from tokenbudget.sinks.export import ExportOptions, export
from tokenbudget.sinks.parquet import read_rows
from tokenbudget.streams.fields import ChatMessage

pytestmark = pytest.mark.integration

SETTINGS = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "stop": ["</answer>"],
    "seed": 100,
    "extra_body": {"priority": 3},
}


def write_files(folder: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    plain = [
        {"id": f"q{i}", "prompt": f"#short tell me a story {i}", "topic": f"t{i % 2}", "level": i}
        for i in range(4)
    ]
    chat = [
        {
            "id": i,
            "messages": [
                {"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": f"write a detailed answer about item {i}"},
            ],
        }
        for i in range(3)
    ]
    for name, rows in (("plain.jsonl", plain), ("chat.jsonl", chat)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return plain, chat


def test_rows_carry_prompt_ids_settings_and_n_samples(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    tokenizer_dir = build_tokenizer(tmp_path / "tokenizer")
    plain, chat = write_files(tmp_path)
    datasets = [
        {"name": "plain", "path": "plain.jsonl", "budget": "1M", "n": 3,
         "keep_columns": ["topic", "level", "absent"]},
        {"name": "chat", "path": "chat.jsonl", "budget": "1M", "template": True,
         "chat_template_kwargs": {"enable_thinking": False}},
    ]  # fmt: skip
    configs = []

    def config_for(url: str) -> Any:
        configs.append(
            make_config(
                tmp_path,
                kafka_bootstrap,
                namespace,
                url,
                datasets,
                api="sglang",
                tokenizer=str(tokenizer_dir),
                **SETTINGS,
            )
        )
        return configs[-1]

    [(report, served)] = asyncio.run(
        run_with_simulator(SimulatorConfig(port=0, tokens_per_second=50_000, seed=3), [config_for])
    )
    config = configs[0]
    rows = read_rows(tmp_path / "out").to_pylist()
    by_rid = {record.rid: record for record in served}
    assert len(rows) == len(served) == 4 * 3 + 3
    # n = 3: each plain row answered three times, each answer its own budgeted sample
    assert report.datasets["plain"].samples == 12 and report.datasets["chat"].samples == 3
    plain_rows = [r for r in rows if r["dataset"] == "plain"]
    for source in plain:
        answers = sorted(
            (r for r in plain_rows if r["row_id"] == source["id"]),
            key=lambda r: r["sample_index"],
        )
        assert [r["sample_index"] for r in answers] == [0, 1, 2]
        assert len({r["prompt_id"] for r in answers}) == 3
        # the server saw seeds 100, 101, 102: three different answers, reproducibly
        seeds = [by_rid[r["request_id"]].sampling["sampling_seed"] for r in answers]
        assert seeds == [100, 101, 102]
        for r in answers:
            assert r["prompt"] == source["prompt"] and r["messages"] is None
            assert json.loads(r["input_columns"]) == {
                "topic": source["topic"], "level": source["level"], "absent": None,
            }  # fmt: skip
            assert r["sampling"]["seed"] == by_rid[r["request_id"]].sampling["sampling_seed"]
    tokenizer = load_tokenizer(tokenizer_dir)
    for source in chat:
        [row] = [r for r in rows if r["dataset"] == "chat" and r["row_id"] == str(source["id"])]
        messages = tuple(ChatMessage(**m) for m in source["messages"])
        expected_ids = tokenizer.apply_chat_template(messages, {"enable_thinking": False})
        record = by_rid[row["request_id"]]
        # the ids recorded are the ids templated from the file, and the ones the server got
        assert row["prompt_ids"] == expected_ids
        assert record.prompt_crc == ids_crc(expected_ids) != 0
        assert row["prompt_tokens"] == record.prompt_tokens == len(expected_ids)
        no_tools = {"tool_calls": None, "tool_call_id": None, "name": None}
        assert row["messages"] == [{**m, **no_tools} for m in source["messages"]]
        assert row["prompt"] is None
        assert json.loads(row["sampling"]["chat_template_kwargs"]) == {"enable_thinking": False}
    for row in rows:
        record = by_rid[row["request_id"]]
        assert row["model"] == MODEL  # as the server reported it (/get_model_info)
        sent = row["sampling"]
        # every setting the row claims is what the server's log says it received
        assert sent["max_new_tokens"] == record.max_new_tokens
        assert {k: record.sampling[k] for k in ("temperature", "top_p", "top_k", "stop")} == {
            k: sent[k] for k in ("temperature", "top_p", "top_k", "stop")
        }
        assert record.extra == {"priority": 3} == json.loads(sent["extra_body"])
        assert len(row["output_ids"]) == row["completion_tokens"] == record.completion_tokens
        assert ids_crc(row["output_ids"]) == record.output_crc
    check_export(tmp_path, config, rows)


def check_export(tmp_path: Path, config: Any, rows: list[dict[str, Any]]) -> None:
    """The export of the run's Parquet and the export replayed from its topic load
    with datasets.load_dataset, agree, and hold each row's prompt and answer; with
    ids (the templated dataset, whose prompt ids are known), the ids and mask too."""
    import datasets as hf

    def load(path: Path) -> list[dict[str, Any]]:
        return list(hf.load_dataset("json", data_files=str(path), split="train"))

    options = ExportOptions("conversations", tmp_path / "c.jsonl", tmp_path / "out")
    export(options)
    export_from_topic(config, dataclasses.replace(options, to=tmp_path / "t.jsonl"))
    from_files, from_topic = load(tmp_path / "c.jsonl"), load(tmp_path / "t.jsonl")
    assert sorted(map(json.dumps, from_files)) == sorted(map(json.dumps, from_topic))
    by_prompt = {r["prompt_id"]: r for r in rows}
    assert len(from_files) == len(rows)
    for record in from_files:
        row = by_prompt[record["prompt_id"]]
        assert record["conversations"][-1] == {"role": "assistant", "content": row["text"]}
        user = record["conversations"][-2]["content"]
        assert user == (row["prompt"] or row["messages"][-1]["content"])
    chat_only = dataclasses.replace(
        options, to=tmp_path / "ids.jsonl", datasets=frozenset({"chat"}), with_ids=True
    )
    export(chat_only)
    with_ids = load(tmp_path / "ids.jsonl")
    assert len(with_ids) == 3
    for record in with_ids:
        row = by_prompt[record["prompt_id"]]
        assert record["input_ids"] == row["prompt_ids"] + row["output_ids"]
        assert sum(record["loss_mask"]) == row["completion_tokens"]
        assert record["loss_mask"][: len(row["prompt_ids"])] == [0] * len(row["prompt_ids"])


def test_a_server_without_token_ids_leaves_output_ids_null(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"prompt": f"#short story {i}"}) + "\n" for i in range(4))
    )
    datasets = [{"name": "d", "path": "d.jsonl", "budget": "1M"}]
    no_ids = SimulatorConfig(port=0, tokens_per_second=50_000, seed=5, omit_token_ids=True)
    [(report, served)] = asyncio.run(
        run_with_simulator(
            no_ids,
            [
                lambda url: make_config(
                    tmp_path,
                    kafka_bootstrap,
                    namespace,
                    url,
                    datasets,
                    api="openai-chat",
                    stream=True,
                )
            ],
        )
    )
    rows = read_rows(tmp_path / "out").to_pylist()
    by_rid = {record.rid: record for record in served}
    assert len(rows) == 4 == report.datasets["d"].samples
    for row in rows:
        # counted from the server's usage; no list of ids rather than a wrong one
        assert row["count_source"] == "usage" and row["output_ids"] is None
        assert row["completion_tokens"] == by_rid[row["request_id"]].completion_tokens > 0
        assert row["model"] == MODEL
        assert row["messages"] is None and row["prompt"].startswith("#short story")


def expected_stop_reason(row: dict[str, Any], served: RequestRecord, dataset_max: int) -> str:
    """Why the row ends, from the server's own log: the budget's line when the row
    kept less than the server generated, or when the server stopped at a
    max_new_tokens lowered below the dataset's (the budget's last tokens); else the
    server's finish (its length limit being the dataset's max_new_tokens)."""
    if row["completion_tokens"] < served.completion_tokens:
        return "budget"
    if served.finish == "length" and served.max_new_tokens < dataset_max:
        return "budget"
    return served.finish


def test_a_row_cut_at_the_budgets_line_says_budget_and_the_others_the_servers_reason(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    # "#short" answers average 300 tokens: with max_new_tokens 250 about half stop on
    # their own, half at the limit; 40 prompts are far more than 3,000 tokens hold,
    # so the budget ends the dataset with its last answers cut at the line.
    source = [{"id": f"q{i}", "prompt": f"#short story {i}"} for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in source))
    datasets = [{"name": "d", "path": "d.jsonl", "budget": 3000, "max_new_tokens": 250}]
    configs: list[Any] = []

    def config_for(url: str) -> Any:
        configs.append(make_config(tmp_path, kafka_bootstrap, namespace, url, datasets))
        return configs[-1]

    [(report, served)] = asyncio.run(
        run_with_simulator(SimulatorConfig(port=0, tokens_per_second=50_000, seed=21), [config_for])
    )
    assert report.datasets["d"].status == "halted"
    rows = read_rows(tmp_path / "out").to_pylist()
    assert sum(row["completion_tokens"] for row in rows) == 3000
    by_rid = {record.rid: record for record in served}
    for row in rows:
        record = by_rid[row["request_id"]]
        assert row["stop_reason"] == expected_stop_reason(row, record, 250), row
        if row["completion_tokens"] == record.completion_tokens:
            assert row["finish_reason"] == record.finish  # the server's own, kept
    assert {r["stop_reason"] for r in rows} == {"stop", "length", "budget"}
    # an export, from the files and replayed from the topic, says the same per row
    options = ExportOptions(
        "conversations",
        tmp_path / "c.jsonl",
        tmp_path / "out",
        decode=lambda ids: "".join(f" w{i}" for i in ids),  # the simulator's text
    )
    export(options)
    export_from_topic(configs[0], dataclasses.replace(options, to=tmp_path / "t.jsonl"))
    stop_reasons = {r["request_id"]: r["stop_reason"] for r in rows}
    prompts = {r["prompt_id"]: r["request_id"] for r in rows}
    for name in ("c.jsonl", "t.jsonl"):
        exported = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        assert len(exported) == len(rows)
        for record in exported:
            assert record["stop_reason"] == stop_reasons[prompts[record["prompt_id"]]]
