"""Dataset formats: ShareGPT, OpenAI messages, Hugging Face on disk; turns, shuffle,
limit, chat templates, and the config keys that choose them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.producers.tokenizer_fixture import build_tokenizer
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ConfigError, DatasetError
from tokenbudget.producers.prompts.datasets import read_options, read_prompts
from tokenbudget.producers.prompts.readers import reader_for
from tokenbudget.producers.prompts.resume import skip_done
from tokenbudget.producers.prompts.rows import PromptRow
from tokenbudget.producers.templates import load_tokenizer
from tokenbudget.streams.fields import ChatMessage


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read(path: Path, **kwargs: Any) -> list[PromptRow]:
    return list(read_prompts("ds", path, **kwargs))


def conversation(i: int, *, answered: bool = True) -> dict[str, Any]:
    turns = [
        {"from": "system", "value": "you are a helpful assistant"},
        {"from": "human", "value": f"question {i}"},
        {"from": "gpt", "value": f"answer {i}"},
        {"from": "human", "value": f"follow-up {i}"},
    ]
    if answered:
        turns.append({"from": "gpt", "value": f"second answer {i}"})
    return {"conversations": turns}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


# ---- ShareGPT and turns -----------------------------------------------------------


def test_sharegpt_first_turn(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [conversation(0), conversation(1)])
    rows = read(path, format="sharegpt")
    assert [r.messages for r in rows] == [
        (
            ChatMessage("system", "you are a helpful assistant"),
            ChatMessage("user", f"question {i}"),
        )
        for i in range(2)
    ]
    assert all(r.text is None for r in rows)
    assert [r.source for r in rows] == [f"{path}:1", f"{path}:2"]
    # auto recognises the rows too, with the same ids
    assert [r.prompt_id for r in read(path)] == [r.prompt_id for r in rows]


def test_sharegpt_and_openai_forms_of_one_conversation_share_ids(tmp_path: Path) -> None:
    sharegpt = write_jsonl(tmp_path / "s.jsonl", [conversation(3)])
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    messages = [
        {"role": roles[t["from"]], "content": t["value"]} for t in conversation(3)["conversations"]
    ]
    openai = write_jsonl(tmp_path / "o.jsonl", [{"messages": messages}])
    assert read(sharegpt, format="sharegpt")[0].prompt_id == read(openai)[0].prompt_id


def test_turns_all_regenerates_every_assistant_turn(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [conversation(0), conversation(1, answered=False)])
    rows = read(path, format="sharegpt", turns="all")
    # conversation 0: two assistant turns; conversation 1: one, plus its open follow-up
    assert len(rows) == 4
    first, second = rows[0].messages, rows[1].messages
    assert first is not None and second is not None
    assert [m.role for m in first] == ["system", "user"]
    assert [m.role for m in second] == ["system", "user", "assistant", "user"]
    assert second[-1].content == "follow-up 0"
    assert rows[3].messages is not None and rows[3].messages[-1].content == "follow-up 1"
    assert len({r.prompt_id for r in rows}) == 4
    # stable, and none collides with the first-turn id of the same row
    assert [r.prompt_id for r in read(path, format="sharegpt", turns="all")] == [
        r.prompt_id for r in rows
    ]
    firsts = {r.prompt_id for r in read(path, format="sharegpt")}
    assert firsts.isdisjoint(r.prompt_id for r in rows)


def test_turns_all_on_openai_messages_and_prompt_rows(tmp_path: Path) -> None:
    rows = [
        {"prompt": "plain prompt"},
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d"},
            ]
        },
    ]
    got = read(write_jsonl(tmp_path / "o.jsonl", rows), turns="all")
    assert got[0].text == "plain prompt"
    assert [len(r.messages or ()) for r in got[1:]] == [1, 3]


BAD_SHAREGPT = [
    ('{"conversations": []}', "'conversations' must be a non-empty list"),
    ('{"conversations": [{"from": "human"}]}', "conversations[0]"),
    ('{"conversations": [{"from": "alien", "value": "hi"}]}', "unknown speaker 'alien'"),
    ('{"conversations": [{"from": "gpt", "value": "only an answer"}]}', "no user turn"),
    ('{"prompt": "not a conversation"}', "format 'sharegpt'"),
]


@pytest.mark.parametrize(("line", "message"), BAD_SHAREGPT)
def test_bad_sharegpt_rows_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(conversation(0)) + "\n" + line + "\n")
    with pytest.raises(DatasetError) as info:
        read(path, format="sharegpt")
    assert f"{path}:2" in str(info.value)
    assert message in str(info.value)
    reported: list[DatasetError] = []
    assert len(read(path, format="sharegpt", on_bad_row=reported.append)) == 1
    assert [e.line for e in reported] == [2]


def test_format_prompt_and_openai_refuse_other_rows(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "p"}, {"messages": [{"role": "user", "content": "m"}]}],
    )
    with pytest.raises(DatasetError, match="format 'prompt'") as info:
        read(path, format="prompt")
    assert info.value.line == 2
    with pytest.raises(DatasetError, match="format 'openai'") as info:
        read(path, format="openai")
    assert info.value.line == 1


# ---- shuffle and limit ------------------------------------------------------------


def test_shuffle_seed_is_deterministic_and_keeps_ids(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(50)])
    plain = read(path)
    one = read(path, shuffle_seed=7)
    again = read(path, shuffle_seed=7)
    other = read(path, shuffle_seed=8)
    assert [r.prompt_id for r in one] == [r.prompt_id for r in again]
    assert [r.prompt_id for r in one] != [r.prompt_id for r in plain]
    assert [r.prompt_id for r in one] != [r.prompt_id for r in other]
    # the order changes, never an id (or the row it names)
    assert {(r.prompt_id, r.text, r.source) for r in one} == {
        (r.prompt_id, r.text, r.source) for r in plain
    }


def test_limit_with_shuffle_takes_a_fixed_sample(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(50)])
    sample = read(path, shuffle_seed=1, limit=5)
    assert len(sample) == 5
    assert [r.text for r in sample] == [r.text for r in read(path, shuffle_seed=1, limit=5)]
    assert [r.text for r in sample] == [r.text for r in read(path, shuffle_seed=1)][:5]
    assert [r.text for r in read(path, limit=3)] == ["p0", "p1", "p2"]


def test_limit_counts_prompts_after_turns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [conversation(i) for i in range(3)])
    assert len(read(path, format="sharegpt", turns="all", limit=3)) == 3


def test_skip_done_counts_what_it_drops(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    rows = read(path)
    done = {rows[1].prompt_id, rows[4].prompt_id}

    class Report:
        already_done = 0

    report = Report()
    left = list(skip_done(iter(rows), done, report))
    assert [r.text for r in left] == ["p0", "p2", "p3", "p5"]
    assert report.already_done == 2


# ---- Hugging Face datasets saved to disk ------------------------------------------


def test_hf_dataset_on_disk(tmp_path: Path) -> None:
    import datasets

    folder = tmp_path / "hf"
    rows = [conversation(i) for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    got = read(folder, format="hf")
    assert len(got) == 4
    assert got[2].messages is not None and got[2].messages[1].content == "question 2"
    assert got[2].source == f"{folder}:3"
    assert [r.prompt_id for r in read(folder)] == [r.prompt_id for r in got]  # auto: a folder
    jsonl = write_jsonl(tmp_path / "same.jsonl", rows)
    assert [r.prompt_id for r in read(jsonl)] == [r.prompt_id for r in got]


def test_hf_dataset_dict_splits(tmp_path: Path) -> None:
    import datasets

    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "t1"}, {"prompt": "t2"}]),
            "test": datasets.Dataset.from_list([{"prompt": "x1"}]),
        }
    ).save_to_disk(str(folder))
    assert [r.text for r in read(folder, format="hf")] == ["t1", "t2"]  # train by default
    test = read(folder, format="hf", split="test")
    assert [r.text for r in test] == ["x1"]
    assert test[0].source == f"{folder}[test]:1"
    with pytest.raises(DatasetError, match="no split 'dev'"):
        read(folder, format="hf", split="dev")


def test_hf_bad_folder_and_bad_row(tmp_path: Path) -> None:
    import datasets

    with pytest.raises(DatasetError, match="load_from_disk"):
        read(tmp_path, format="hf")
    folder = tmp_path / "bad"
    datasets.Dataset.from_list([{"prompt": "ok"}, {"prompt": "  "}]).save_to_disk(str(folder))
    with pytest.raises(DatasetError) as info:
        read(folder, format="hf")
    assert f"{folder}:2" in str(info.value)


def test_an_hf_value_python_cannot_hold_is_a_bad_row_and_the_reader_goes_on(
    tmp_path: Path,
) -> None:
    import datasets
    import pyarrow as pa

    count = 1030  # two batches of the reader; the bad row in the second
    days = [0] * count
    days[1025] = 2**31 - 1  # row 1,026: past the year 9999
    table = pa.table(
        {"prompt": [f"p{i}" for i in range(count)], "day": pa.array(days, pa.date32())}
    )
    folder = tmp_path / "hf"
    datasets.Dataset(datasets.table.InMemoryTable(table)).save_to_disk(str(folder))
    reported: list[DatasetError] = []
    got = read(folder, format="hf", on_bad_row=reported.append)
    assert len(got) == count - 1 and got[-1].source == f"{folder}:{count}"
    assert [r.text for r in got[1024:1026]] == ["p1024", "p1026"]
    (bad,) = reported
    assert bad.where == f"{folder}:1026" and "OverflowError" in bad.message


def test_a_folder_is_only_read_as_hf(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="Hugging Face"):
        reader_for(tmp_path)


# ---- chat templates ---------------------------------------------------------------


def test_template_fills_input_ids(tmp_path: Path, tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir)
    path = write_jsonl(tmp_path / "s.jsonl", [conversation(0), {"prompt": "hello how are you"}])
    rows = read(path, template=tokenizer.apply_chat_template)
    assert rows[0].messages is not None
    assert rows[0].input_ids == tuple(tokenizer.apply_chat_template(rows[0].messages))
    rendered = tokenizer.render_chat(rows[0].messages)
    assert rendered.startswith("<s><|system|> you are a helpful assistant </s>")
    assert rendered.endswith("<|assistant|>")
    # a plain prompt is templated as one user turn
    assert rows[1].input_ids == tuple(
        tokenizer.apply_chat_template([ChatMessage("user", "hello how are you")])
    )
    assert rows[1].input_ids is not None and len(rows[1].input_ids) == 8
    # ids do not depend on the template
    assert [r.prompt_id for r in rows] == [r.prompt_id for r in read(path)]


def test_template_errors_are_bad_rows(tmp_path: Path) -> None:
    def template(messages: Any) -> list[int]:
        if messages[-1].content == "boom":
            raise ValueError("roles must alternate")
        return [1, 2]

    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "fine"}, {"prompt": "boom"}])
    with pytest.raises(DatasetError, match="chat template failed: roles must alternate") as info:
        read(path, template=template)
    assert info.value.line == 2
    reported: list[DatasetError] = []
    assert len(read(path, template=template, on_bad_row=reported.append)) == 1


def test_tokenizer_counts(tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir)
    assert load_tokenizer(tokenizer_dir) is tokenizer  # loaded once
    assert tokenizer.count_completion(" w1 w22 w333") == 3  # unknown words: one each
    assert tokenizer.count_completion("") == 0
    messages = [ChatMessage("user", "hello")]
    assert tokenizer.count_prompt(None, messages) == len(tokenizer.apply_chat_template(messages))


# ---- config -----------------------------------------------------------------------


def build(tmp_path: Path, inference: dict[str, Any], **dataset: Any) -> config_module.Config:
    data = {
        "inference": inference,
        "datasets": [{"name": "d", "path": "d.jsonl", "budget": "1M", **dataset}],
    }
    return config_module.build(data, base_dir=tmp_path, environ={})


def test_config_new_keys(tmp_path: Path, tokenizer_dir: Path) -> None:
    config = build(
        tmp_path,
        {"stream": True, "tokenizer": str(tokenizer_dir), "api_key_env": "MY_KEY"},
        format="sharegpt",
        template=True,
        turns="all",
        shuffle_seed=3,
        limit=10,
    )
    assert config.inference.stream is True
    assert config.inference.check_server is True
    assert config.tokenizer_path == tokenizer_dir
    d = config.datasets[0]
    assert (d.format, d.template, d.turns, d.shuffle_seed, d.limit) == (
        "sharegpt",
        True,
        "all",
        3,
        10,
    )
    options = read_options(config, d)
    assert options["format"] == "sharegpt" and callable(options["template"])
    defaults = build(tmp_path, {})
    assert defaults.inference.stream is False
    assert defaults.inference.api_key_env == "TOKENBUDGET_API_KEY"
    assert defaults.tokenizer_path is None
    assert read_options(defaults, defaults.datasets[0])["template"] is None


def test_config_relative_tokenizer_path(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "tok")
    assert build(tmp_path, {"tokenizer": "tok"}).tokenizer_path == tmp_path / "tok"


@pytest.mark.parametrize(
    ("inference", "dataset", "key"),
    [
        ({}, {"template": True}, "datasets[0].template"),
        ({"api": "openai-chat", "tokenizer": "TOK"}, {"template": True}, "datasets[0].template"),
        ({}, {"format": "prompt", "turns": "all"}, "datasets[0].turns"),
        ({}, {"format": "sharegpt", "split": "train"}, "datasets[0].split"),
        ({}, {"format": "xml"}, "datasets[0].format"),
        ({}, {"turns": "last"}, "datasets[0].turns"),
        ({}, {"limit": 0}, "datasets[0].limit"),
        ({"tokenizer": "absent"}, {}, "inference.tokenizer"),
        ({"stream": "maybe"}, {}, "inference.stream"),
        ({"api_key": "secret"}, {}, "inference.api_key"),
    ],
)
def test_config_errors_name_the_key(
    tmp_path: Path,
    tokenizer_dir: Path,
    inference: dict[str, Any],
    dataset: dict[str, Any],
    key: str,
) -> None:
    if inference.get("tokenizer") == "TOK":
        inference = {**inference, "tokenizer": str(tokenizer_dir)}
    with pytest.raises(ConfigError) as info:
        build(tmp_path, inference, **dataset)
    assert info.value.key == key


def test_template_needs_a_chat_template(tmp_path: Path, tokenizer_dir: Path) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tokenizer_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config_json = bare / "tokenizer_config.json"
    settings = json.loads(config_json.read_text())
    settings.pop("chat_template", None)
    config_json.write_text(json.dumps(settings))
    config = build(tmp_path, {"tokenizer": str(bare)}, template=True)
    with pytest.raises(ConfigError, match="no chat_template") as info:
        read_options(config, config.datasets[0])
    assert info.value.key == "inference.tokenizer"
