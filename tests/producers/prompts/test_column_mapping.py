"""Rows that keep the prompt elsewhere, read through the dataset's column mapping
(``prompt_field``, ``prompt_template``, ``messages_field``, ``id_field``) alike from
JSONL, Parquet and a saved Hugging Face dataset; datasets without a mapping keep
their prompt ids, the key a rerun resumes by."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenbudget.core import config as config_module
from tokenbudget.core.errors import DatasetError
from tokenbudget.producers.prompts.datasets import read_options, read_prompts
from tokenbudget.producers.prompts.ids import stable_prompt_id
from tokenbudget.producers.prompts.rows import PromptRow
from tokenbudget.streams.fields import ChatMessage

ALPACA = [
    {"instruction": "Write a haiku", "input": "", "output": "..."},
    {"instruction": "Add the numbers", "input": "1 2 3", "output": "6"},
    {"instruction": "Name a colour", "input": None, "output": "red"},
]


def write_jsonl(folder: Path, rows: list[dict[str, Any]]) -> Path:
    path = folder / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(folder: Path, rows: list[dict[str, Any]]) -> Path:
    path = folder / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_hf(folder: Path, rows: list[dict[str, Any]]) -> Path:
    hf = pytest.importorskip("datasets")
    hf.Dataset.from_list(rows).save_to_disk(str(folder / "d"))
    return folder / "d"


WRITERS: dict[str, Callable[[Path, list[dict[str, Any]]], Path]] = {
    "jsonl": write_jsonl,
    "parquet": write_parquet,
    "hf": write_hf,
}


def read(
    folder: Path,
    path: Path,
    api: str = "sglang",
    on_bad_row: Callable[[DatasetError], None] | None = None,
    **keys: Any,
) -> list[PromptRow]:
    """The prompts of ``path`` read as ``[[datasets]]`` with ``keys`` asks."""
    config = config_module.build(
        {
            "inference": {"api": api},
            "datasets": [{"name": "ds", "path": str(path), "budget": "1M", **keys}],
        },
        base_dir=folder,
        environ={},
    )
    dataset = config.datasets[0]
    options = read_options(config, dataset)
    return list(read_prompts("ds", dataset.path, on_bad_row=on_bad_row, **options))


@pytest.mark.parametrize("writer", WRITERS)
def test_alpaca_rows_read_through_a_template(tmp_path: Path, writer: str) -> None:
    path = WRITERS[writer](tmp_path, ALPACA)
    rows = read(tmp_path, path, prompt_template="{instruction}\n\n{input?}")
    assert [r.text for r in rows] == ["Write a haiku", "Add the numbers\n\n1 2 3", "Name a colour"]
    assert all(r.messages is None for r in rows)
    # A mapped prompt is identified like a prompt row holding the same text.
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps({"prompt": r.text}) + "\n" for r in rows))
    assert [r.prompt_id for r in rows] == [r.prompt_id for r in read_prompts("ds", same)]


@pytest.mark.parametrize("writer", WRITERS)
def test_a_prompt_field_with_ids_and_kept_columns(tmp_path: Path, writer: str) -> None:
    source = [
        {"qid": "gsm-1", "question": "What is 2+2?", "answer": "4"},
        {"qid": "gsm-2", "question": "What is 3+3?", "answer": "6"},
    ]
    path = WRITERS[writer](tmp_path, source)
    rows = read(
        tmp_path, path, prompt_field="question", id_field="qid", keep_columns=["answer", "qid"]
    )
    assert [r.text for r in rows] == ["What is 2+2?", "What is 3+3?"]
    assert [r.row_id for r in rows] == ["gsm-1", "gsm-2"]
    assert [r.prompt_id for r in rows] == [
        stable_prompt_id("ds", "id:gsm-1"),
        stable_prompt_id("ds", "id:gsm-2"),
    ]
    assert [r.input_columns for r in rows] == [
        {"answer": "4", "qid": "gsm-1"},
        {"answer": "6", "qid": "gsm-2"},
    ]


CHAT = [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]
SHAREGPT = [{"from": "system", "value": "terse"}, {"from": "human", "value": "hi"}]
MESSAGES = (ChatMessage(role="system", content="terse"), ChatMessage(role="user", content="hi"))


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize(("turns", "format"), [(CHAT, "openai"), (SHAREGPT, "sharegpt")])
def test_chat_turns_in_another_field(
    tmp_path: Path, writer: str, turns: list[dict[str, str]], format: str
) -> None:
    path = WRITERS[writer](tmp_path, [{"id": 1, "dialog": turns}])
    formats = ["auto", format] if writer != "hf" else ["auto", "hf"]
    for chosen in formats:
        [row] = read(tmp_path, path, api="openai-chat", messages_field="dialog", format=chosen)
        assert row.messages == MESSAGES and row.text is None
        assert row.prompt_id == stable_prompt_id("ds", "id:1")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"input": "1 2 3"}, ":1: field 'instruction' is missing (write {instruction?}"),
        ({"instruction": ""}, ":1: field 'instruction' is empty"),
        ({"instruction": 3}, ":1: field 'instruction' must be a string, got int"),
    ],
)
def test_rows_the_template_cannot_fill_are_bad_rows(
    tmp_path: Path, row: dict[str, Any], message: str
) -> None:
    path = write_jsonl(tmp_path, [row, ALPACA[1]])
    bad: list[DatasetError] = []
    keys = {"prompt_template": "{instruction}\n\n{input?}"}
    rows = read(tmp_path, path, on_bad_row=bad.append, **keys)
    assert [r.text for r in rows] == ["Add the numbers\n\n1 2 3"]
    assert len(bad) == 1 and str(bad[0]).startswith(f"{path}{message}")


def test_a_template_that_leaves_every_paragraph_out_is_a_bad_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"hint": ""}])
    with pytest.raises(DatasetError, match=r":1: prompt_template left every paragraph out"):
        read(tmp_path, path, prompt_template="{hint?}")


def test_a_bad_turn_in_a_mapped_field_names_that_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"dialog": [{"role": "user"}]}])
    with pytest.raises(DatasetError, match=r":1: dialog\[0\] must be an object with string"):
        read(tmp_path, path, api="openai-chat", messages_field="dialog")


# Prompt ids of rows without a mapping, as every earlier version gave them: a rerun
# of an existing job resumes by these.
UNMAPPED = [
    ({"prompt": "Write a haiku #short"}, "b4cfa5fd33439a5e93abad7806bf2313"),
    ({"id": "x-1", "prompt": "with an id"}, "98e839cce19a1138d723831acbaa5b5b"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "d62efa642e98de5527b5d86129cf4d7e"),
    (
        {"id": 7, "conversations": [{"from": "human", "value": "hi"}]},
        "d78aa114641c6d3079cf7c4710589d9e",
    ),
]


def test_datasets_without_a_mapping_keep_their_prompt_ids(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [row for row, _ in UNMAPPED])
    ids = [r.prompt_id for r in read(tmp_path, path, api="openai-chat")]
    assert ids == [pinned for _, pinned in UNMAPPED]
