"""The trainers' formats of real jobs on the real broker, graded by the simulator's
own request log: a thinking model's conversations regenerated turn by turn (with a
tool call) exported ``--with-ids`` as speculators' and SpecForge's per-answer records
(every kept answer once, its prompt ids the ones the server answered with, its answer
ids the ones it generated, masked over the answer), as Model-Optimizer's (which takes
no ids: refused in one line) and SpecForge's per-turn text (each record's history the
messages the server received, each answer and its thinking what it sent); and the
seed job's path, SGLang's /generate with text prompts, whose prompt ids the export
computes with the local tokenizer from the dataset's own text."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_backends import make_config, run_with_simulator
from tests.producers.tokenizer_fixture import build_tokenizer
from tests.sinks import trainer_loaders as loaders
from tokenbudget.cli import main
from tokenbudget.core.tokenizer import load_pretrained
from tokenbudget.dev.jobs import conversations
from tokenbudget.dev.oracle import text_crc
from tokenbudget.dev.simulator.config import RequestRecord, SimulatorConfig
from tokenbudget.dev.simulator.generation import ids_crc

pytestmark = pytest.mark.integration

CONVERSATIONS, TURNS = 4, 3
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {}}}


def conversation_files(folder: Path) -> None:
    conversations(folder / "chat.jsonl", CONVERSATIONS, TURNS)
    question = "#short weather in paris"
    call = {"id": "rec_1", "type": "function",
            "function": {"name": "search", "arguments": {"query": question}}}  # fmt: skip
    tool_row = {
        "id": "t0",
        "tools": [SEARCH],
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "rec_1", "content": "sunny in paris"},
            {"role": "assistant", "content": "It is sunny."},
        ],
    }
    (folder / "tools.jsonl").write_text(json.dumps(tool_row) + "\n")


def export(folder: Path, fmt: str, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    target = folder / f"{fmt}{'-'.join(extra)}.jsonl"
    code = main(["export", "--from", str(folder / "out"), "--format", fmt, "--to", str(target),
                 *extra])  # fmt: skip
    records = [json.loads(line) for line in target.read_text().splitlines()] if code == 0 else []
    return code, records


def split_ids(record: dict[str, Any]) -> tuple[list[int], list[int]]:
    mask = record["loss_mask"]
    prompt = record["input_ids"][: mask.index(1)]
    assert mask == [0] * len(prompt) + [1] * (len(mask) - len(prompt))  # the answer only
    return prompt, record["input_ids"][len(prompt) :]


def assistant_turns(record: RequestRecord) -> int:
    """Which turn of its conversation a chat request asked for."""
    return sum(m["role"] == "assistant" for m in record.messages)


@pytest.mark.timeout(300)
def test_a_regenerated_job_exports_the_servers_ids_in_each_trainers_format(
    tmp_path: Path, kafka_bootstrap: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    conversation_files(tmp_path)
    datasets = [
        {"name": "chat", "path": "chat.jsonl", "budget": "1M", "turns": "regenerate",
         "reasoning": "save"},
        {"name": "tools", "path": "tools.jsonl", "budget": "1M", "turns": "regenerate"},
    ]  # fmt: skip
    thinking = SimulatorConfig(
        port=0, tokens_per_second=50_000, seed=7, reasoning_style="reasoning_content",
        tool_calls=True,
    )  # fmt: skip
    [(_, served)] = asyncio.run(
        run_with_simulator(
            thinking,
            [lambda url: make_config(tmp_path, kafka_bootstrap, namespace, url, datasets,
                                     api="openai-chat")],
        )
    )  # fmt: skip
    by_rid = {record.rid: record for record in served}
    capsys.readouterr()

    # speculators: one row per answer the sink kept, ids exactly the server's
    code, rows = export(tmp_path, "speculators")
    assert code == 0 and len(rows) == len(served) > CONVERSATIONS + 1  # some went on
    assert len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        loaders.speculators_row(row)
        logged = by_rid[row["metadata"]["request_id"]]
        prompt, answer = split_ids(row)
        assert ids_crc(prompt) == logged.returned_prompt_crc != 0
        assert len(prompt) == logged.prompt_tokens
        assert ids_crc(answer) == logged.output_crc and len(answer) == logged.completion_tokens
        assert row["id"] == f"{row['primary_id']}_gen{assistant_turns(logged)}"
    # SpecForge's pre-tokenized rows: the same ids, one record per answer
    code, pretokenized = export(tmp_path, "specforge", "--with-ids")
    assert code == 0 and len(pretokenized) == len(rows)
    for record in pretokenized:
        loaders.specforge_ids(record)
    ids = {r["id"]: (r["input_ids"], r["loss_mask"]) for r in pretokenized}
    assert ids == {r["id"].replace("_gen", "#turn"): (r["input_ids"], r["loss_mask"]) for r in rows}
    # Model-Optimizer takes no ids: one line says so and what to use
    assert export(tmp_path, "modelopt", "--with-ids")[0] == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--format speculators" in error

    rid_of = {(r["primary_id"], r["metadata"]["turn"]): r["metadata"]["request_id"] for r in rows}
    check_texts(tmp_path, by_rid, rid_of, capsys)


def check_texts(
    folder: Path,
    by_rid: dict[str, RequestRecord],
    rid_of: dict[tuple[str, int], str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The text formats against the log: each answer's thinking and text what the
    server sent; SpecForge's per-turn history what it received."""
    code, conversations = export(folder, "modelopt")
    assert code == 0 and len(conversations) == CONVERSATIONS + 1
    assert "Model-Optimizer never passes tools" in capsys.readouterr().err  # the tools row
    for record in conversations:
        loaders.modelopt_record(record)
        said = [m for m in record["messages"] if m["role"] == "assistant"]
        logged = [by_rid[rid_of[(record["conversation_id"], k)]] for k in range(len(said))]
        assert [text_crc(m["content"]) for m in said] == [r.content_crc for r in logged]
        assert [text_crc(m.get("reasoning_content")) for m in said] == [
            r.reasoning_crc for r in logged
        ]
    code, turns = export(folder, "specforge", "--per-turn")
    assert code == 0 and len(turns) == len(rid_of)
    for record in turns:
        loaders.specforge_expanded(record)
        unit, _, turn = record["id"].rpartition("#turn")
        logged = by_rid[rid_of[(unit, int(turn))]]
        *history, answer = record["conversations"]
        assert [(t["role"], text_crc(t["content"])) for t in history] == [
            (m["role"], m["crc"]) for m in logged.messages
        ]
        assert (text_crc(answer["content"]), text_crc(answer.get("reasoning_content"))) == (
            logged.content_crc, logged.reasoning_crc
        )  # fmt: skip


@pytest.mark.timeout(300)
def test_the_seed_jobs_text_prompts_take_their_ids_from_the_local_tokenizer(
    tmp_path: Path, kafka_bootstrap: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang's /generate answers a text prompt without its ids: with the model's
    tokenizer the export computes them from the text sent, as many as the server
    counted; n = 2 samples of a row are two records."""
    prompts = [f"#short tell me a story about the sea {i}" for i in range(3)]
    (tmp_path / "seed.jsonl").write_text(
        "".join(json.dumps({"id": f"s{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts))
    )
    tokenizer = build_tokenizer(tmp_path / "tok", prompts, whole_words=["#short"])
    datasets = [{"name": "seed", "path": "seed.jsonl", "budget": "1M", "n": 2, "reasoning": "save"}]
    thinking = SimulatorConfig(
        port=0, tokens_per_second=50_000, seed=9, reasoning_style="reasoning_content"
    )
    [(_, served)] = asyncio.run(
        run_with_simulator(
            thinking,
            [lambda url: make_config(tmp_path, kafka_bootstrap, namespace, url, datasets,
                                     api="sglang", max_new_tokens=4000)],
        )
    )  # fmt: skip
    by_rid = {record.rid: record for record in served}
    encode = load_pretrained(tokenizer, "test").encode
    capsys.readouterr()
    code, rows = export(tmp_path, "speculators", "--tokenizer", str(tokenizer))
    assert code == 0 and len(rows) == len(served) == 6
    assert "6 prompts sent as text had no ids from the server" in capsys.readouterr().out
    assert len({r["id"] for r in rows}) == 6  # two samples of a row: two ids
    for row in rows:
        logged = by_rid[row["metadata"]["request_id"]]
        assert logged.prompt_crc == 0 and logged.text_crc != 0  # sent as text
        prompt, answer = split_ids(row)
        source = prompts[int(row["metadata"]["row_id"][1:])]
        assert prompt == encode(source, add_special_tokens=True)
        assert len(prompt) == logged.prompt_tokens and text_crc(source) == logged.text_crc
        assert ids_crc(answer) == logged.output_crc
    # without the tokenizer: refused in one line naming the flag and the key
    assert export(tmp_path, "speculators")[0] == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--tokenizer DIR" in error
    # the text formats: the thinking the server left inline, split off
    code, conversations = export(tmp_path, "specforge", "--tokenizer", str(tokenizer))
    assert code == 0 and "6 answers had their thinking inline" in capsys.readouterr().out
    for record in conversations:
        loaders.specforge_conversation(record)
        assert "</think>" not in record["conversations"][-1]["content"]
        assert record["conversations"][-1]["reasoning_content"]
