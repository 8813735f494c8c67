"""``export --format specforge | speculators | modelopt``: the sink's rows as the
records each drafter trainer's loader reads (its checks restated in
:mod:`tests.sinks.trainer_loaders`), every file loadable with ``datasets``; ids
unique across datasets, samples and turns and the same on every export; the
token ids the rows' own, masked over the answer."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import datasets as hf
import pytest

from tests.sinks import trainer_loaders as loaders
from tests.sinks.test_export import WHOLE, completion, load_jsonl, read_jsonl, turns_of, write_rows
from tokenbudget.core.errors import ExportError
from tokenbudget.sinks.export import ExportOptions, ExportSummary, export
from tokenbudget.sinks.trainers import split_reasoning
from tokenbudget.streams import events as ev

END = "</think>"


def job_rows(out: Path) -> None:
    """One of each: thinking split off by the server, thinking inline (SGLang's
    /generate), two samples of one dataset row, the same row id in another dataset,
    and a conversation regenerated turn by turn that calls a tool."""
    write_rows(
        out,
        [
            completion(0, reasoning="six times seven", reasoning_tokens=3),
            completion(1, text=" let me see </think> 42", unfinished=False),
            completion(2, prompt_id="p2", row_id="twice", sample_index=0),
            completion(3, prompt_id="p2-sample1", row_id="twice", sample_index=1),
        ],
    )
    write_rows(out, [completion(0, "other", row_id="id0")])
    write_rows(out, WHOLE)


def export_to(
    tmp_path: Path, name: str, format: str, **options: Any
) -> tuple[list[dict[str, Any]], ExportSummary]:
    path = tmp_path / name
    summary = export(
        ExportOptions(format, path, tmp_path / "out", reasoning_end=END, **options)  # type: ignore[arg-type]
    )
    assert len(load_jsonl(path)) == len(read_jsonl(path))  # datasets reads every record
    return read_jsonl(path), summary


def test_specforge_records_are_what_its_loaders_read(tmp_path: Path) -> None:
    job_rows(tmp_path / "out")
    records, summary = export_to(tmp_path, "sf.jsonl", "specforge")
    for record in records:
        loaders.specforge_conversation(record)
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records) == 6  # unique, though row ids repeat
    # the ids: the dataset, then the prompt's id (each sample has its own) or the
    # conversation's
    assert set(by_id) == {"chat-p0", "chat-p1", "chat-p2", "chat-p2-sample1", "other-p0",
                          f"conv-{WHOLE[0].conversation_id}"}  # fmt: skip
    assert by_id["chat-p0"]["conversations"][-1] == {
        "role": "assistant", "content": "answer 0", "reasoning_content": "six times seven",
    }  # fmt: skip
    # thinking inline: split at reasoning_end, as SGLang's reasoning parser splits it
    assert by_id["chat-p1"]["conversations"][-1] == {
        "role": "assistant", "content": "42", "reasoning_content": "let me see",
    }  # fmt: skip
    assert summary.split == 1
    conversation = by_id[f"conv-{WHOLE[0].conversation_id}"]
    assert json.loads(conversation["tools"]) == [
        {"type": "function", "function": {"name": "search"}}
    ]
    assert "tools" not in by_id["chat-p0"]  # only where the rows had tools
    said = [t for t in conversation["conversations"] if t["role"] == "assistant"]
    assert [t.get("reasoning_content") for t in said] == ["look it up", "read the result", None]
    assert [t["role"] for t in conversation["conversations"]] == [
        "system", "user", "assistant", "tool", "assistant", "user", "assistant"
    ]  # fmt: skip
    # the same rows export to the same ids, whatever the files' order
    again, _ = export_to(tmp_path, "again.jsonl", "specforge")
    assert sorted(map(json.dumps, again)) == sorted(map(json.dumps, records))


def test_per_turn_is_one_record_per_answer_on_the_history_it_was_sent(tmp_path: Path) -> None:
    """SpecForge's expand_reasoning_conversations.py, for train_only_last_turn: each
    answer after the history as sent (the earlier answers without their thinking),
    with its own thinking."""
    write_rows(tmp_path / "out", WHOLE)
    records, summary = export_to(tmp_path, "turns.jsonl", "specforge", per_turn=True)
    cid = f"conv-{WHOLE[0].conversation_id}"
    assert [r["id"] for r in records] == [f"{cid}#turn0", f"{cid}#turn1", f"{cid}#turn2"]
    for record, row in zip(records, WHOLE, strict=True):
        loaders.specforge_expanded(record)
        *history, last = record["conversations"]
        sent = [{"role": m.role, "content": m.content} for m in row.messages or ()]
        assert [{"role": t["role"], "content": t["content"]} for t in history] == sent
        assert last.get("reasoning_content") == row.reasoning and last["content"] == row.text
    assert records[1]["conversations"][2]["tool_calls"][0]["id"] == "call_9"
    assert summary.rows == {"conv": 3} and summary.conversations == {"conv": 1}


def test_specforge_with_ids_is_one_pre_tokenized_record_per_answer(tmp_path: Path) -> None:
    job_rows(tmp_path / "out")
    records, _ = export_to(tmp_path, "ids.jsonl", "specforge", with_ids=True)
    for record in records:
        loaders.specforge_ids(record)
    by_id = {r["id"]: r for r in records}
    cid = f"conv-{WHOLE[0].conversation_id}"
    assert len(by_id) == len(records) == 8
    assert {f"{cid}#turn{k}" for k in range(3)} <= set(by_id)
    for row in WHOLE:  # every id the row's: the prompt's, then the answer's, masked
        record = by_id[f"{cid}#turn{row.turn}"]
        assert row.prompt_ids is not None and row.output_ids is not None
        assert record["input_ids"] == [*row.prompt_ids, *row.output_ids]
        assert record["loss_mask"] == [0] * len(row.prompt_ids) + [1] * len(row.output_ids)
    assert by_id["chat-p1"]["input_ids"] == [1, 2, 3, 11, 21]  # thinking inline: as generated


def test_speculators_rows_are_one_per_generated_turn(tmp_path: Path) -> None:
    job_rows(tmp_path / "out")
    records, _ = export_to(tmp_path, "spec.jsonl", "speculators")
    for record in records:
        loaders.speculators_row(record)
    assert len({r["id"] for r in records}) == len(records) == 8
    cid = f"conv-{WHOLE[0].conversation_id}"
    turns = [r for r in records if r["primary_id"] == cid]
    assert [r["id"] for r in turns] == [f"{cid}_gen0", f"{cid}_gen1", f"{cid}_gen2"]
    for record, row in zip(turns, WHOLE, strict=True):
        assert row.prompt_ids is not None and row.output_ids is not None
        assert record["input_ids"] == [*row.prompt_ids, *row.output_ids]
        assert sum(record["loss_mask"]) == len(row.output_ids)
        meta = record["metadata"]
        assert (meta["request_id"], meta["prompt_id"], meta["turn"]) == (
            row.request_id, row.prompt_id, row.turn
        )  # fmt: skip
        assert meta["is_tool_call"] is bool(row.tool_calls)
    single = next(r for r in records if r["primary_id"] == "chat-p2-sample1")
    assert single["id"] == "chat-p2-sample1_gen0" and single["metadata"]["sample_index"] == 1


def test_modelopt_records_name_their_conversation_and_leave_tools_out(tmp_path: Path) -> None:
    job_rows(tmp_path / "out")
    records, summary = export_to(tmp_path, "mo.jsonl", "modelopt")
    for record in records:
        loaders.modelopt_record(record)
    assert len({r["conversation_id"] for r in records}) == len(records) == 6
    by_id = {r["conversation_id"]: r for r in records}
    assert by_id["chat-p1"]["messages"][-1]["reasoning_content"] == "let me see"
    conversation = by_id[f"conv-{WHOLE[0].conversation_id}"]
    assert [m["role"] for m in conversation["messages"]].count("tool") == 1  # calls kept
    assert summary.tools_dropped == {"conv": 1}  # the tools themselves: warned, counted
    with pytest.raises(ExportError, match=r"--with-ids: --format modelopt holds no token ids"):
        export(ExportOptions("modelopt", tmp_path / "x.jsonl", tmp_path / "out", with_ids=True))
    assert not (tmp_path / "x.jsonl").exists()


def test_an_id_that_cannot_name_a_file_is_hashed_the_same_every_time(tmp_path: Path) -> None:
    """Model-Optimizer names a file after each conversation_id: a prompt id from
    elsewhere than tokenbudget (whose ids are hex) must not reach a path as it is."""
    write_rows(tmp_path / "out", [completion(0, prompt_id="../../etc/x y")])
    [first], _ = export_to(tmp_path, "a.jsonl", "modelopt")
    [again], _ = export_to(tmp_path, "b.jsonl", "modelopt")
    loaders.modelopt_record(first)
    assert first["conversation_id"] == again["conversation_id"]
    assert first["conversation_id"].startswith("chat-") and "/" not in first["conversation_id"]


def test_per_turn_is_refused_where_the_format_has_no_such_records(tmp_path: Path) -> None:
    write_rows(tmp_path / "out", WHOLE)
    for format in ("messages", "modelopt", "speculators"):
        with pytest.raises(ExportError, match=r"--per-turn .* use --format specforge"):
            export(ExportOptions(format, tmp_path / "x.jsonl", tmp_path / "out", per_turn=True))  # type: ignore[arg-type]


def test_an_inline_conversation_is_split_turn_by_turn_and_hidden_in_later_history(
    tmp_path: Path,
) -> None:
    """A chat server without a reasoning parser: each answer's thinking stays in its
    text, and went back so in the next turn's history."""
    inline = turns_of("inline", [{"text": "hm </think> a0"}, {"text": "so </think> a1"}])
    write_rows(tmp_path / "out", inline)
    [whole], summary = export_to(tmp_path, "c.jsonl", "specforge")
    said = [t for t in whole["conversations"] if t["role"] == "assistant"]
    assert [(t["content"], t["reasoning_content"]) for t in said] == [("a0", "hm"), ("a1", "so")]
    assert summary.split == 2  # once per answer
    _, second = [r["conversations"] for r in export_to(tmp_path, "t.jsonl", "specforge",
                                                       per_turn=True)[0]]  # fmt: skip
    assert second[2] == {"role": "assistant", "content": "a0"}  # its thinking not shown


@pytest.mark.parametrize(
    ("text", "unfinished", "parts"),
    [
        (" w1 w2 </think> w3 w4", False, ("w1 w2", "w3 w4")),
        ("<think>\nhm\n</think>\n\nok", False, ("hm", "ok")),
        ("a </think> b </think> c", False, ("a", "b </think> c")),  # the first ends it
        ("still thinking", True, ("still thinking", "")),
        ("no marker", False, None),
    ],
)
def test_inline_thinking_splits_at_the_first_end_marker(
    text: str, unfinished: bool, parts: tuple[str, str] | None
) -> None:
    assert split_reasoning(text, END, unfinished=unfinished) == parts
    assert split_reasoning(text, "", unfinished=unfinished) is None  # no marker configured


# --- prompt ids from the text sent (SGLang's /generate returns none) --------------------


def text_rows(out: Path) -> list[ev.CompletionEvent]:
    rows = [
        completion(i, messages=None, prompt=f"tell me a story {i}", prompt_ids=None,
                   prompt_tokens=5)
        for i in range(2)
    ]  # fmt: skip
    write_rows(out, rows)
    return rows


def words(text: str) -> list[int]:
    return [len(word) for word in text.split()]


@pytest.mark.parametrize("format", ["speculators", "specforge", "conversations", "parquet"])
def test_a_text_prompt_takes_its_ids_from_the_local_tokenizer(tmp_path: Path, format: str) -> None:
    rows = text_rows(tmp_path / "out")
    to = tmp_path / ("p" if format == "parquet" else "x.jsonl")
    options = ExportOptions(format, to, tmp_path / "out", with_ids=True, encode=words)  # type: ignore[arg-type]
    summary = export(options)
    loaded = hf.load_dataset(str(to), split="train") if format == "parquet" else load_jsonl(to)
    assert summary.encoded == 2
    ids = Counter(tuple(r["input_ids"]) for r in loaded)
    assert ids == Counter(tuple(words(r.prompt or "") + list(r.output_ids or ())) for r in rows)


def test_a_text_prompt_without_a_tokenizer_is_refused_naming_the_flag_and_key(
    tmp_path: Path,
) -> None:
    text_rows(tmp_path / "out")
    with pytest.raises(ExportError) as error:
        export(ExportOptions("speculators", tmp_path / "x.jsonl", tmp_path / "out"))
    message = str(error.value)
    assert "no prompt_ids" in message and "--tokenizer DIR" in message
    assert "[inference] tokenizer" in message and "\n" not in message


def test_a_tokenizer_that_counts_otherwise_than_the_server_is_refused(tmp_path: Path) -> None:
    text_rows(tmp_path / "out")

    def one_more(text: str) -> list[int]:
        return [*words(text), 0]

    options = ExportOptions("speculators", tmp_path / "x.jsonl", tmp_path / "out", encode=one_more)
    with pytest.raises(ExportError, match="is 6 tokens with the local tokenizer, where the server "
                                          "counted 5"):  # fmt: skip
        export(options)
