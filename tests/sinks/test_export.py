"""``tokenbudget export``: the sink's rows as JSONL conversations, OpenAI messages or
a Parquet folder, each loaded back with Hugging Face ``datasets``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets as hf
import pyarrow as pa
import pytest

from sinks.export import ExportOptions, export
from sinks.parquet import COLUMNS, dataset_dir, write_atomically
from streams import events as ev
from tests.sinks.tables import completions_to_table
from tokenbudget.errors import ExportError


def completion(i: int, dataset: str = "chat", **changes: Any) -> ev.CompletionEvent:
    fields: dict[str, Any] = {
        "request_id": f"r{i}",
        "prompt_id": f"p{i}",
        "dataset": dataset,
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "output_ids": [10 + i, 20 + i],
        "finish_reason": "stop",
        "max_new_tokens": 8,
        "text": f"answer {i}",
        "messages": (ev.ChatMessage("system", "be brief"), ev.ChatMessage("user", f"q{i}")),
        "prompt_ids": [1, 2, 3],
        "model": "m",
        "row_id": f"id{i}",
        "input_columns": {"topic": "sea", "level": i},
        "sample_index": 0,
    }
    fields.update(changes)
    return ev.CompletionEvent(**fields)


def write_rows(root: Path, events: list[ev.CompletionEvent], *, old: bool = False) -> None:
    table = completions_to_table(events)
    if old:  # a file written before completion v3: only the first 14 columns
        table = table.select([name for name, _ in COLUMNS[:14]])
    write_atomically(table, dataset_dir(root, events[0].dataset), 100)


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    return list(hf.load_dataset("json", data_files=str(path), split="train"))


def test_conversations_and_messages_load_with_datasets(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_rows(out, [completion(0), completion(1)])
    write_rows(out, [completion(2, "plain", messages=None, prompt="tell me", input_columns=None)])
    summary = export(ExportOptions("conversations", tmp_path / "c.jsonl", out))
    assert summary.rows == {"chat": 2, "plain": 1}
    rows = {r["id"]: r for r in load_jsonl(tmp_path / "c.jsonl")}
    assert rows["id0"]["conversations"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q0"},
        {"role": "assistant", "content": "answer 0"},
    ]
    assert rows["id1"]["topic"] == "sea" and rows["id1"]["level"] == 1  # kept columns, typed
    assert rows["id2"]["conversations"] == [
        {"role": "user", "content": "tell me"},
        {"role": "assistant", "content": "answer 2"},
    ]
    assert rows["id0"]["dataset"] == "chat" and rows["id0"]["prompt_id"] == "p0"
    export(ExportOptions("messages", tmp_path / "m.jsonl", out, datasets=frozenset({"plain"})))
    [only] = load_jsonl(tmp_path / "m.jsonl")
    assert only["messages"][-1] == {"role": "assistant", "content": "answer 2"}


def test_with_ids_appends_the_answer_to_the_prompt_and_masks_the_prompt(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_rows(out, [completion(0)])
    export(ExportOptions("conversations", tmp_path / "c.jsonl", out, with_ids=True))
    [row] = load_jsonl(tmp_path / "c.jsonl")
    assert row["input_ids"] == [1, 2, 3, 10, 20]
    assert row["loss_mask"] == [0, 0, 0, 1, 1]


def test_parquet_folder_loads_with_datasets_and_reads_old_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_rows(out, [completion(0), completion(1)])
    write_rows(out, [completion(5, prompt_id="p5")], old=True)
    summary = export(ExportOptions("parquet", tmp_path / "folder", out))
    assert summary.rows == {"chat": 3}
    loaded = hf.load_dataset(str(tmp_path / "folder"), split="train")
    by_id = {r["request_id"]: r for r in loaded}
    assert set(by_id) == {"r0", "r1", "r5"}
    assert by_id["r0"]["prompt_ids"] == [1, 2, 3] and by_id["r0"]["model"] == "m"
    # a message's tool fields are there, null when it has none
    assert by_id["r0"]["messages"][1] == {
        "role": "user", "content": "q0", "tool_calls": None, "tool_call_id": None, "name": None
    }  # fmt: skip
    # the old file's row: its columns as written, the newer ones empty
    assert by_id["r5"]["output_ids"] == [15, 25] and by_id["r5"]["prompt_ids"] is None
    assert by_id["r5"]["messages"] is None and by_id["r5"]["dataset"] == "chat"


def test_a_cut_answer_without_text_is_decoded_or_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_rows(out, [completion(0, text="", finish_reason="length")])
    with pytest.raises(ExportError, match=r"cut at the budget's line.*--tokenizer"):
        export(ExportOptions("conversations", tmp_path / "c.jsonl", out))
    assert not (tmp_path / "c.jsonl").exists()  # nothing half written

    def decode(ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)

    summary = export(ExportOptions("conversations", tmp_path / "c.jsonl", out, decode=decode))
    [row] = load_jsonl(tmp_path / "c.jsonl")
    assert row["conversations"][-1]["content"] == "w10 w20" and summary.decoded == 1
    export(ExportOptions("parquet", tmp_path / "folder", out, decode=decode))
    assert hf.load_dataset(str(tmp_path / "folder"), split="train")[0]["text"] == "w10 w20"


def test_why_an_answer_stopped_is_in_every_format(tmp_path: Path) -> None:
    """finish_reason stays the server's; stop_reason says where the budget ended an
    answer; a row from before stop_reason existed says nothing rather than guess."""
    out = tmp_path / "out"
    write_rows(
        out,
        [
            completion(0, stop_reason="stop"),
            completion(1, finish_reason="length", stop_reason="length"),
            completion(2, finish_reason="length", stop_reason="budget"),
        ],
    )
    write_rows(out, [completion(5, prompt_id="p5", finish_reason="length")], old=True)
    export(ExportOptions("conversations", tmp_path / "c.jsonl", out))
    rows = {r["id"]: r for r in load_jsonl(tmp_path / "c.jsonl")}
    assert {k: (r["finish_reason"], r["stop_reason"]) for k, r in rows.items()} == {
        "id0": ("stop", "stop"),
        "id1": ("length", "length"),
        "id2": ("length", "budget"),
        "p5": ("length", None),  # an old file: no row_id, the prompt_id stands in
    }
    export(ExportOptions("parquet", tmp_path / "folder", out))
    loaded = hf.load_dataset(str(tmp_path / "folder"), split="train")
    assert {r["request_id"]: r["stop_reason"] for r in loaded} == {
        "r0": "stop",
        "r1": "length",
        "r2": "budget",
        "r5": None,
    }


def thinking_rows(out: Path) -> None:
    """A thinking model's answers: one whole, one cut while still thinking, one of a
    server that split nothing off; and a row from before the reasoning existed."""
    write_rows(
        out,
        [
            completion(0, reasoning="six times seven", reasoning_tokens=1, unfinished=False),
            completion(1, text="", reasoning="let me", reasoning_tokens=2, finish_reason="length",
                       stop_reason="length", unfinished=True),
            completion(2, unfinished=False),
        ],
    )  # fmt: skip
    write_rows(out, [completion(5, prompt_id="p5")], old=True)


def test_the_assistant_turn_carries_the_reasoning_and_unfinished_rows_can_be_left_out(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    thinking_rows(out)
    export(ExportOptions("messages", tmp_path / "m.jsonl", out))
    rows = {r["id"]: r for r in load_jsonl(tmp_path / "m.jsonl")}
    assert rows["id0"]["messages"][-1] == {
        "role": "assistant", "content": "answer 0", "reasoning_content": "six times seven",
    }  # fmt: skip
    assert rows["id1"]["messages"][-1] == {
        "role": "assistant", "content": "", "reasoning_content": "let me",
    }  # fmt: skip
    for plain in ("id2", "p5"):  # no reasoning: none claimed (the key loads as null)
        assert rows[plain]["messages"][-1].get("reasoning_content") is None
    assert {k: (r["reasoning_tokens"], r["unfinished"]) for k, r in rows.items()} == {
        "id0": (1, False), "id1": (2, True), "id2": (None, False), "p5": (None, None),
    }  # fmt: skip
    # left out: only the row known to be unfinished (an old row is not known to be)
    summary = export(
        ExportOptions("conversations", tmp_path / "c.jsonl", out, drop_unfinished=True)
    )
    assert {r["id"] for r in load_jsonl(tmp_path / "c.jsonl")} == {"id0", "id2", "p5"}
    assert summary.rows == {"chat": 3} and summary.unfinished == {"chat": 1}
    summary = export(ExportOptions("parquet", tmp_path / "f", out, drop_unfinished=True))
    loaded = hf.load_dataset(str(tmp_path / "f"), split="train")
    assert sorted(r["request_id"] for r in loaded) == ["r0", "r2", "r5"]
    assert {r["request_id"]: r["reasoning"] for r in loaded} == {
        "r0": "six times seven", "r2": None, "r5": None,
    }  # fmt: skip
    assert summary.unfinished == {"chat": 1}


def test_with_ids_masks_every_generated_token_thinking_included(tmp_path: Path) -> None:
    """The ids a thinking model's server returns are its raw output, the thinking in
    them: all of it is what the drafter must learn to predict."""
    out = tmp_path / "out"
    write_rows(out, [completion(0, output_ids=[7, 8, 9, 10], completion_tokens=4,
                                reasoning="hmm", reasoning_tokens=3, text=" 42")])  # fmt: skip
    export(ExportOptions("conversations", tmp_path / "c.jsonl", out, with_ids=True))
    [row] = load_jsonl(tmp_path / "c.jsonl")
    assert row["input_ids"] == [1, 2, 3, 7, 8, 9, 10]
    assert row["loss_mask"] == [0, 0, 0, 1, 1, 1, 1]
    assert row["conversations"][-1]["reasoning_content"] == "hmm"


def test_with_ids_refuses_rows_without_ids_naming_the_fix(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_rows(out, [completion(0, prompt_ids=None)])
    with pytest.raises(ExportError, match="no prompt_ids: apply the chat template here"):
        export(ExportOptions("parquet", tmp_path / "f", out, with_ids=True))
    out2 = tmp_path / "out2"
    write_rows(out2, [completion(0, output_ids=None, count_source="usage")])
    with pytest.raises(ExportError, match="no output_ids"):
        export(ExportOptions("conversations", tmp_path / "c.jsonl", out2, with_ids=True))


def test_no_rows_is_an_error_naming_the_folder(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=str(tmp_path)):
        export(ExportOptions("conversations", tmp_path / "c.jsonl", tmp_path))


def test_read_rows_table_has_the_declared_schema(tmp_path: Path) -> None:
    from sinks.parquet import SCHEMA, read_rows

    write_rows(tmp_path, [completion(0)], old=True)
    table = read_rows(tmp_path)
    assert table.schema == SCHEMA and table.num_rows == 1
    assert table.column("sampling").type == dict(COLUMNS)["sampling"]
    assert pa.types.is_list(table.column("prompt_ids").type)


def test_the_command_exports_and_reports_errors_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenbudget.cli import main

    out = tmp_path / "out"
    write_rows(out, [completion(0), completion(1)])
    target = tmp_path / "m.jsonl"
    args = ["export", "--from", str(out), "--format", "messages", "--to", str(target)]
    assert main(args) == 0
    assert "exported 2 rows (chat 2)" in capsys.readouterr().out
    assert [r["messages"][-1]["content"] for r in load_jsonl(target)] == ["answer 0", "answer 1"]
    write_rows(out, [completion(2, text="", finish_reason="length")])
    capsys.readouterr()  # datasets' own progress lines
    assert main(args) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--tokenizer DIR" in error
    # the failed export left the earlier file as it was
    assert len(load_jsonl(target)) == 2
