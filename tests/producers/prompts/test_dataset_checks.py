"""Before a job starts, one pass over the first rows of each dataset: a dataset at
all, each file there with a type tokenbudget reads, rows that give prompts through
the format and column mapping (else the fields the rows have and the key to set),
an ``id_field`` present. Every error names the config key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ConfigError
from tokenbudget.producers.prompts import dataset_checks, readers
from tokenbudget.producers.prompts.dataset_checks import check_datasets
from tokenbudget.producers.prompts.datasets import read_options, read_prompts

ALPACA = {"instruction": "Add the numbers", "input": "1 2 3", "output": "6"}
METAMATH = {"query": "What is 2+2?", "response": "4", "type": "GSM_AnsAug"}
GSM = {"question": "What is 2+2?", "answer": "4"}
DIALOG = {"dialog": [{"role": "user", "content": "hi"}], "source": "x"}
TURNS = {"turns": [{"from": "human", "value": "hi"}]}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def build(folder: Path, api: str = "openai-chat", **dataset: Any) -> config_module.Config:
    data = {
        "inference": {"api": api},
        "datasets": [
            {"name": "plain", "path": "plain.jsonl", "budget": "1M"},
            {"name": "d", "path": "d.jsonl", "budget": "1M", **dataset},
        ],
    }
    write_jsonl(folder / "plain.jsonl", [{"prompt": "tell me a story"}])
    return config_module.build(data, base_dir=folder, environ={}, source="job.toml")


def check_error(config: config_module.Config) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check_datasets(config)
    message = str(info.value)
    assert "\n" not in message and message.startswith("job.toml: config key ")
    return info.value


def toml_value(message: str, key: str) -> Any:
    """The value the message says to set ``key`` to, read as TOML reads it."""
    text = message.split(f"set {key} = ", 1)[1]
    return json.loads(text[: text.index('"', 1) + 1])


def test_a_config_without_datasets_stops(tmp_path: Path) -> None:
    config = config_module.build({}, base_dir=tmp_path, environ={}, source="job.toml")
    assert check_error(config).key == "datasets"


@pytest.mark.parametrize(
    ("row", "key", "value"),
    [
        (ALPACA, "prompt_template", "{instruction}\n\n{input?}"),
        ({"instruction": "Add the numbers", "output": "6"}, "prompt_field", "instruction"),
        (METAMATH, "prompt_field", "query"),
        (GSM, "prompt_field", "question"),
        ({"problem": "Prove it", "solution": "..."}, "prompt_field", "problem"),
        (DIALOG, "messages_field", "dialog"),
        (TURNS, "messages_field", "turns"),
    ],
    ids=["alpaca", "instruction", "metamath", "gsm8k", "math", "dialog", "sharegpt"],
)
def test_auto_rows_it_does_not_know_stop_with_their_fields_and_the_key_to_set(
    tmp_path: Path, row: dict[str, Any], key: str, value: str
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [row, row])
    error = check_error(build(tmp_path))
    assert error.key == f"datasets[1].{key}"
    message = str(error)
    assert f"no prompt in the 2 rows (first problem: {path}:1: row has neither 'prompt'" in message
    assert f"; their fields: {', '.join(row)}: set {key} = " in message
    assert toml_value(message, key) == value
    # the key it names, set to the value it gives, reads the rows
    fixed = build(tmp_path, **{key: value})
    check_datasets(fixed)
    dataset = fixed.datasets[1]
    options = read_options(fixed, dataset)
    assert len(list(read_prompts("d", dataset.path, **options))) == 2


def test_rows_with_nothing_to_suggest_name_the_keys_that_map(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"a": 1, "b": [1, 2]}])
    error = check_error(build(tmp_path))
    assert error.key == "datasets[1].prompt_field"
    assert "no prompt in the only row" in str(error) and "their fields: a, b" in str(error)
    assert 'prompt_field = "<field>", prompt_template = "<text with {field}' in str(error)
    assert 'or messages_field = "<field>"' in str(error)


def test_a_mapping_that_finds_nothing_names_its_key_and_what_the_rows_hold(
    tmp_path: Path,
) -> None:
    write_jsonl(tmp_path / "d.jsonl", [METAMATH])
    error = check_error(build(tmp_path, prompt_field="question"))
    assert error.key == "datasets[1].prompt_field"
    assert "field 'question' is missing" in str(error)
    assert 'set prompt_field = "query"' in str(error)
    write_jsonl(tmp_path / "d.jsonl", [ALPACA])
    error = check_error(build(tmp_path, prompt_field="question"))
    assert error.key == "datasets[1].prompt_template"
    assert str(error).endswith(
        'set prompt_template = "{instruction}\\n\\n{input?}" in place of prompt_field'
        " (docs/datasets.md: Column mapping)"
    )


@pytest.mark.parametrize(
    ("row", "format", "key", "fix"),
    [
        ({"messages": DIALOG["dialog"]}, "sharegpt", "format", 'set format = "auto"'),
        (GSM, "prompt", "prompt_field", 'set prompt_field = "question" (docs/datasets.md'),
        (DIALOG, "prompt", "messages_field", 'messages_field = "dialog" and format = "auto"'),
        (GSM, "openai", "prompt_field", 'prompt_field = "question" and format = "auto"'),
    ],
)
def test_an_explicit_format_the_rows_do_not_have_says_what_to_set(
    tmp_path: Path, row: dict[str, Any], format: str, key: str, fix: str
) -> None:
    write_jsonl(tmp_path / "d.jsonl", [row])
    error = check_error(build(tmp_path, format=format))
    assert error.key == f"datasets[1].{key}" and fix in str(error)


def test_a_few_bad_rows_are_left_to_the_reader(tmp_path: Path) -> None:
    # bad rows are reported one by one while reading; only no prompt at all stops
    write_jsonl(tmp_path / "d.jsonl", ["{not json", {"nothing": 1}, {"prompt": "hi"}])
    check_datasets(build(tmp_path))
    write_jsonl(tmp_path / "d.jsonl", ["{not json", "[1, 2]"])
    error = check_error(build(tmp_path))
    assert "d.jsonl:1: not valid JSON" in str(error) and "their fields" not in str(error)


def test_only_the_first_rows_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def endless(self: readers.JsonlReader) -> Iterator[tuple[int, Any]]:
        for line in range(1, dataset_checks.PEEK_ROWS + 1):
            yield line, {"prompt": f"row {line}"}
        raise AssertionError("read past the first rows")

    monkeypatch.setattr(readers.JsonlReader, "rows", endless)
    write_jsonl(tmp_path / "d.jsonl", [])
    check_datasets(build(tmp_path))
    # nothing in the first rows: stops, with row PEEK_ROWS + 1 never read
    error = check_error(build(tmp_path, prompt_field="missing"))
    assert f"no prompt in the first {dataset_checks.PEEK_ROWS} rows" in str(error)


def test_rows_that_prompt_through_parquet_and_hf_are_checked_alike(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist([ALPACA]), tmp_path / "d.parquet")
    error = check_error(build(tmp_path, path="d.parquet"))
    assert error.key == "datasets[1].prompt_template"
    check_datasets(build(tmp_path, path="d.parquet", prompt_template="{instruction}"))
    hf = pytest.importorskip("datasets")
    hf.Dataset.from_list([METAMATH]).save_to_disk(str(tmp_path / "saved"))
    error = check_error(build(tmp_path, path="saved"))
    assert error.key == "datasets[1].prompt_field" and 'prompt_field = "query"' in str(error)
    check_datasets(build(tmp_path, path="saved", prompt_field="query"))
    error = check_error(build(tmp_path, path="saved", split="test"))
    assert error.key == "datasets[1].split" and "a single Dataset has no split 'test'" in str(error)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("absent.jsonl", "absent.jsonl does not exist (a relative path is read from the config"),
        ("d.csv", "d.csv: CSV is not read (its values have no types); convert it, e.g. python"),
        ("d.txt", "d.txt: unknown file type '.txt'; tokenbudget reads JSON lines (.jsonl,"),
        ("folder", "folder: a folder is read only as a saved Hugging Face dataset"),
        ("broken.parquet", "broken.parquet: cannot read as Parquet"),
    ],
)
def test_a_file_that_cannot_be_read_names_the_path_key(
    tmp_path: Path, path: str, message: str
) -> None:
    (tmp_path / "d.csv").write_text("prompt\nhi\n")
    (tmp_path / "d.txt").write_text("hi\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "broken.parquet").write_text("not parquet")
    error = check_error(build(tmp_path, path=path))
    assert error.key == "datasets[1].path"
    assert f"config key 'datasets[1].path': {tmp_path / path}" in str(error)
    assert message in str(error)


def test_an_id_field_must_be_in_the_rows(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "qid": 1, "level": 2}])
    check_datasets(build(tmp_path, id_field="qid"))
    error = check_error(build(tmp_path, id_field="task_id"))
    assert error.key == "datasets[1].id_field"
    assert "no field 'task_id' in the only row of" in str(error)
    assert "(their fields: prompt, qid, level)" in str(error)
    # a kept column no row has is kept as null (docs/datasets.md), not refused
    check_datasets(build(tmp_path, keep_columns=["level", "topic"]))


def test_chat_found_in_a_mapped_field_still_needs_a_template_on_raw_text_apis(
    tmp_path: Path,
) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}, {"messages": DIALOG["dialog"]}])
    error = check_error(build(tmp_path, api="sglang"))
    assert error.key == "datasets[1].template" and "d.jsonl:2 holds messages" in str(error)
