"""A thinking model end to end on the real broker: the reasoning a chat server splits
off (SGLang's ``reasoning_content``, vLLM's ``reasoning``; whole and streamed) lands
in every Parquet row and export record beside the answer; ``reasoning = "disable"``
reaches the server as the template's switches; answers cut while thinking are marked
unfinished, counted, and left out by ``export --drop-unfinished``; with ``/generate``
and a local template the ids keep the template's thinking markers. Graded by the
simulator's own request log (what each answer held, as it sent it) and the dataset
files."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.integration.test_backends import make_config, run_with_simulator
from tests.producers.tokenizer_fixture import build_tokenizer
from tokenbudget.app.commands.export import export_from_topic
from tokenbudget.dev.oracle import text_crc
from tokenbudget.dev.simulator.config import RequestRecord, SimulatorConfig
from tokenbudget.dev.simulator.generation import ids_crc
from tokenbudget.producers.templates import load_tokenizer
from tokenbudget.sinks.export import ExportOptions, export
from tokenbudget.sinks.parquet import read_rows
from tokenbudget.streams.fields import ChatMessage

pytestmark = pytest.mark.integration

OFF = {"enable_thinking": False, "thinking": False}


def write(folder: Path, name: str, rows: int, *, chat: bool = True) -> None:
    lines = [
        {"id": f"{name}{i}", "messages": [{"role": "user", "content": f"#short question {i}"}]}
        if chat
        else {"id": f"{name}{i}", "prompt": f"#short question {i}"}
        for i in range(rows)
    ]
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def cut_while_thinking(record: RequestRecord) -> bool:
    """The server's own account: stopped by the limit with every token thinking."""
    return record.finish == "length" and record.reasoning_tokens == record.completion_tokens


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("style", "stream"), [("reasoning_content", False), ("reasoning", True)], ids=["sglang", "vllm"]
)
def test_chat_rows_and_exports_hold_the_reasoning_the_server_sent(
    tmp_path: Path, kafka_bootstrap: str, namespace: str, style: str, stream: bool
) -> None:
    think, off, cut = (f"{kind}-{style}" for kind in ("think", "off", "cut"))
    for name in (think, off, cut):
        write(tmp_path, name, 5)
    datasets: list[dict[str, Any]] = [
        {"name": think, "path": f"{think}.jsonl", "budget": "1M", "reasoning": "save",
         "max_new_tokens": 4000},  # room to think and answer
        {"name": off, "path": f"{off}.jsonl", "budget": "1M", "reasoning": "disable"},
        # "#short" answers think for ~90 tokens or more: 40 stops most of them thinking
        {"name": cut, "path": f"{cut}.jsonl", "budget": "1M", "max_new_tokens": 40},
    ]  # fmt: skip
    configs: list[Any] = []

    def config_for(url: str) -> Any:
        configs.append(
            make_config(
                tmp_path, kafka_bootstrap, namespace, url, datasets, api="openai-chat",
                stream=stream,
            )
        )  # fmt: skip
        return configs[-1]

    parts = "tokenbudget_completion_token_parts_total"
    before = {
        "unfinished": sample("tokenbudget_unfinished_answers_total", dataset=cut),
        "reasoning": sample(parts, dataset=think, part="reasoning"),
        "answer": sample(parts, dataset=think, part="answer"),
    }
    server = SimulatorConfig(port=0, tokens_per_second=50_000, seed=29, reasoning_style=style)
    [(report, served)] = asyncio.run(run_with_simulator(server, [config_for]))
    by_rid = {record.rid: record for record in served}
    rows = read_rows(tmp_path / "out").to_pylist()
    assert len(rows) == len(served) == 15
    for row in rows:
        record = by_rid[row["request_id"]]
        # the counts, the ids and both texts are what the server says it sent
        assert row["completion_tokens"] == record.completion_tokens
        assert ids_crc(row["output_ids"]) == record.output_crc
        assert row["reasoning_tokens"] == record.reasoning_tokens
        assert text_crc(row["reasoning"]) == record.reasoning_crc
        assert text_crc(row["text"]) == record.content_crc
        assert row["unfinished"] is cut_while_thinking(record), row
        # thinking off goes out as the template's switches, for that dataset only
        switches = record.sampling.get("chat_template_kwargs")
        assert switches == (OFF if row["dataset"] == off else None)
    by_dataset = {name: [r for r in rows if r["dataset"] == name] for name in (think, off, cut)}
    for row in by_dataset[think]:  # thought, then answered
        assert row["reasoning"] and row["text"] and not row["unfinished"]
        assert 0 < row["reasoning_tokens"] < row["completion_tokens"]
    for row in by_dataset[off]:  # answered straight away
        assert row["reasoning"] is None and row["reasoning_tokens"] == 0 and row["text"]
    unfinished = [r for r in by_dataset[cut] if r["unfinished"]]
    assert unfinished and all(r["text"] == "" and r["reasoning"] for r in unfinished)
    # counted, and still against the budget: the GPU made them
    assert sample("tokenbudget_unfinished_answers_total", dataset=cut) == before[
        "unfinished"
    ] + len(unfinished)
    assert report.datasets[cut].completion_tokens == sum(
        r["completion_tokens"] for r in by_dataset[cut]
    )
    thinking = sum(r["reasoning_tokens"] for r in by_dataset[think])
    answered = sum(r["completion_tokens"] for r in by_dataset[think]) - thinking
    assert sample(parts, dataset=think, part="reasoning") == before["reasoning"] + thinking
    assert sample(parts, dataset=think, part="answer") == before["answer"] + answered
    check_exports(tmp_path, configs[0], rows)


def check_exports(tmp_path: Path, config: Any, rows: list[dict[str, Any]]) -> None:
    """From the files and replayed from the topic, every record's assistant turn holds
    the row's answer and reasoning; --drop-unfinished leaves out exactly the rows
    marked unfinished."""
    by_prompt = {r["prompt_id"]: r for r in rows}
    options = ExportOptions("conversations", tmp_path / "c.jsonl", tmp_path / "out")
    export(options)
    export_from_topic(config, dataclasses.replace(options, to=tmp_path / "t.jsonl"))
    export(dataclasses.replace(options, format="messages", to=tmp_path / "m.jsonl"))
    for name, key in (("c.jsonl", "conversations"), ("t.jsonl", "conversations"),
                      ("m.jsonl", "messages")):  # fmt: skip
        records = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        assert len(records) == len(rows), name
        for record in records:
            row = by_prompt[record["prompt_id"]]
            reply = {"role": "assistant", "content": row["text"]}
            if row["reasoning"] is not None:
                reply["reasoning_content"] = row["reasoning"]
            assert record[key][-1] == reply, name
            assert record["unfinished"] is row["unfinished"]
    dropped = dataclasses.replace(options, to=tmp_path / "d.jsonl", drop_unfinished=True)
    summary = export_from_topic(config, dropped)
    lines = (tmp_path / "d.jsonl").read_text().splitlines()
    kept = {json.loads(line)["prompt_id"] for line in lines}
    assert kept == {r["prompt_id"] for r in rows if not r["unfinished"]}
    assert sum(summary.unfinished.values()) == sum(r["unfinished"] for r in rows) > 0


def test_generate_with_a_local_template_keeps_the_thinking_markers_in_the_ids(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    tokenizer_dir = build_tokenizer(
        tmp_path / "tokenizer",
        ["question 0 1 2 3 4 5 6 7 8 9", "#short"],
        whole_words=["#short"],
        thinking=True,
    )
    tokenizer = load_tokenizer(tokenizer_dir)
    [opens], [closes] = (tokenizer.encode(m, special=False) for m in ("<think>", "</think>"))
    write(tmp_path, "raw", 6)
    write(tmp_path, "raw_off", 3)
    datasets = [
        # "save": the rows are read for the end of the thinking (they carry it inline)
        {"name": "raw", "path": "raw.jsonl", "budget": "1M", "template": True,
         "reasoning": "save", "max_new_tokens": 150},
        {"name": "raw_off", "path": "raw_off.jsonl", "budget": "1M", "template": True,
         "reasoning": "disable"},
    ]  # fmt: skip
    configs: list[Any] = []

    def config_for(url: str) -> Any:
        configs.append(
            make_config(
                tmp_path, kafka_bootstrap, namespace, url, datasets, api="sglang",
                tokenizer=str(tokenizer_dir),
            )
        )  # fmt: skip
        return configs[-1]

    server = SimulatorConfig(
        port=0, tokens_per_second=50_000, seed=31, reasoning_style="reasoning_content",
        tokenizer=str(tokenizer_dir),
    )  # fmt: skip
    [(_, served)] = asyncio.run(run_with_simulator(server, [config_for]))
    by_rid = {record.rid: record for record in served}
    rows = read_rows(tmp_path / "out").to_pylist()
    assert len(rows) == 9
    for row in rows:
        record = by_rid[row["request_id"]]
        messages = tuple(ChatMessage(**m) for m in row["messages"])
        switches = OFF if row["dataset"] == "raw_off" else None
        # the prompt ids are the template's, thinking block opened (and closed when off)
        assert row["prompt_ids"] == tokenizer.apply_chat_template(messages, switches)
        assert ids_crc(row["prompt_ids"]) == record.prompt_crc
        assert ids_crc(row["output_ids"]) == record.output_crc
        # /generate reports no split: the thinking is in the text and ids, as generated
        assert row["reasoning"] is None and row["reasoning_tokens"] is None
        assert text_crc(row["text"]) == record.content_crc
        thinking = record.reasoning_tokens
        assert thinking is not None  # a thinking server always says
        if 0 < thinking < row["completion_tokens"]:  # thought, then answered
            assert row["output_ids"].count(closes) == 1
        assert row["unfinished"] is cut_while_thinking(record), row
    raw = [r for r in rows if r["dataset"] == "raw"]
    assert all(r["prompt_ids"][-1] == opens for r in raw)
    assert {r["unfinished"] for r in raw} == {True, False}  # 150 cuts some while thinking
    for row in (r for r in rows if r["dataset"] == "raw_off"):
        assert row["prompt_ids"][-2:] == [opens, closes] and closes not in row["output_ids"]
        assert by_rid[row["request_id"]].reasoning_tokens == 0 and not row["unfinished"]
    # --with-ids: the template's markers and the model's, where they were generated
    options = ExportOptions("conversations", tmp_path / "ids.jsonl", tmp_path / "out",
                            with_ids=True, datasets=frozenset({"raw"}))  # fmt: skip
    export(options)
    for line in (tmp_path / "ids.jsonl").read_text().splitlines():
        record = json.loads(line)
        row = next(r for r in raw if r["prompt_id"] == record["prompt_id"])
        assert record["input_ids"] == row["prompt_ids"] + row["output_ids"]
        assert opens in record["input_ids"]
        assert (closes in record["input_ids"]) is (closes in row["output_ids"])
