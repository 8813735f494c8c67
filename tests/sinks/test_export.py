"""``tokenbudget export``: the sink's rows as JSONL conversations, OpenAI messages or
a Parquet folder, each loaded back with Hugging Face ``datasets``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets as hf
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.sinks.tables import completions_to_table
from tokenbudget.core.errors import ExportError
from tokenbudget.sinks.export import ExportOptions, export
from tokenbudget.sinks.parquet import dataset_dir, write_atomically
from tokenbudget.sinks.schema import COLUMNS
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import ChatMessage, ToolCall


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
        "messages": (ChatMessage("system", "be brief"), ChatMessage("user", f"q{i}")),
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
    from tokenbudget.sinks.parquet import read_rows
    from tokenbudget.sinks.schema import SCHEMA

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


# --- conversations regenerated turn by turn ----------------------------------------------

M = ChatMessage
SEARCH = ToolCall("call_9", "search", '{"query": "weather"}')


def turns_of(
    conversation: str, answers: list[dict[str, Any]], **last: Any
) -> list[ev.CompletionEvent]:
    """The rows of a conversation regenerated turn by turn: each turn's prompt is the
    one before, its answer (as the next history holds it: no reasoning), then the
    recorded user turn."""
    history: tuple[ChatMessage, ...] = (M("system", "be brief"), M("user", "u0"))
    rows = []
    for k, answer in enumerate(answers):
        fields: dict[str, Any] = {
            "text": answer.get("text", ""),
            "reasoning": answer.get("reasoning"),
            "tool_calls": answer.get("calls"),
            "messages": history,
            "conversation_id": conversation,
            "turn": k,
            "turns": 3,
            "tool_mismatch": False,
            "stop_reason": "stop",
            "unfinished": False,
            "prompt_id": f"{conversation}-{k}",
            "request_id": f"r-{conversation}-{k}",
            "row_id": conversation,
            "tools": [{"type": "function", "function": {"name": "search"}}],
        }
        if k == len(answers) - 1:
            fields.update(last)
        rows.append(completion(0, "conv", **fields))
        said = M("assistant", fields["text"], tool_calls=fields["tool_calls"])
        after = (
            (M("tool", "sunny", tool_call_id="call_9"),)
            if fields["tool_calls"]
            else (M("user", f"u{k + 1}"),)
        )
        history = (*history, said, *after)
    return rows


WHOLE = turns_of("whole", [
    {"calls": (SEARCH,), "reasoning": "look it up"},
    {"text": "It is sunny.", "reasoning": "read the result"},
    {"text": "You're welcome.", "reasoning": None},
])  # fmt: skip
CUT = turns_of("cut", [{"text": "a0"}, {"text": "a1 cut"}], stop_reason="budget")
MISMATCH = turns_of("mismatch", [{"calls": (SEARCH,)}], tool_mismatch=True)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_regenerated_conversation_is_one_record_with_every_turn_in_order(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # its turns in two files, the later first: the record is in turn order anyway
    write_rows(out, [*WHOLE[2:], *CUT])
    write_rows(out, [*WHOLE[:2], *MISMATCH, completion(7, "conv")])
    summary = export(ExportOptions("messages", tmp_path / "m.jsonl", out))
    assert summary.rows == {"conv": 4} and summary.conversations == {"conv": 3}
    records = {r["id"]: r for r in read_jsonl(tmp_path / "m.jsonl")}
    whole = records["whole"]
    assert whole["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "u0"},
        {"role": "assistant", "content": "", "reasoning_content": "look it up",
         "tool_calls": [{"id": "call_9", "type": "function",
                         "function": {"name": "search", "arguments": '{"query": "weather"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_9"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "read the result"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "You're welcome."},
    ]  # fmt: skip
    assert whole["tools"] == [{"type": "function", "function": {"name": "search"}}]
    assert whole["prompt_ids"] == ["whole-0", "whole-1", "whole-2"]
    assert (whole["turns"], whole["turns_in_dataset"], whole["complete"]) == (3, 3, True)
    assert whole["tool_mismatch"] is False
    cut, mismatch = records["cut"], records["mismatch"]
    assert (cut["turns"], cut["complete"], cut["stop_reason"]) == (2, False, "budget")
    assert [m["content"] for m in cut["messages"] if m["role"] == "assistant"] == ["a0", "a1 cut"]
    assert (mismatch["complete"], mismatch["tool_mismatch"]) == (False, True)
    assert records["id7"]["messages"][-1] == {"role": "assistant", "content": "answer 7"}
    # the JSONL loads for a trainer
    assert len(load_jsonl(tmp_path / "m.jsonl")) == 4


def test_drop_incomplete_leaves_out_conversations_not_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_rows(out, [*WHOLE, *CUT, *MISMATCH, completion(7, "conv")])
    summary = export(
        ExportOptions("conversations", tmp_path / "c.jsonl", out, drop_incomplete=True)
    )
    assert [r["id"] for r in read_jsonl(tmp_path / "c.jsonl")] == ["id7", "whole"]
    assert summary.incomplete == {"conv": 2}
    # Parquet keeps a row per turn, of the whole conversations only
    summary = export(ExportOptions("parquet", tmp_path / "p", out, drop_incomplete=True))
    table = pa.concat_tables(
        [pq.read_table(f) for f in sorted((tmp_path / "p" / "data").glob("*.parquet"))]
    )
    assert sorted(table.column("prompt_id").to_pylist()) == ["p7", "whole-0", "whole-1", "whole-2"]
    assert summary.incomplete == {"conv": 2}


def test_regenerated_conversations_take_their_ids_per_turn(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_rows(out, WHOLE)
    with pytest.raises(ExportError, match="--format parquet --with-ids"):
        export(ExportOptions("messages", tmp_path / "m.jsonl", out, with_ids=True))
    summary = export(ExportOptions("parquet", tmp_path / "p", out, with_ids=True))
    assert summary.rows == {"conv": 3}
