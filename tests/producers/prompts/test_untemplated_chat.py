"""No silent untemplated chat: chat rows bound for a raw-text API (SGLang /generate,
OpenAI completions) without ``template = true`` are an error before anything runs,
naming the dataset's key and both fixes; plain prompts go as they always did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.producers.tokenizer_fixture import build_tokenizer
from tokenbudget import cli
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ConfigError
from tokenbudget.producers.prompts.dataset_checks import check_datasets, first_chat_row

RAW_TEXT = ["sglang", "openai-completions"]
CHAT = {"messages": [{"role": "user", "content": "hello how are you"}]}
SHAREGPT = {"conversations": [{"from": "human", "value": "hello how are you"}]}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def build(tmp_path: Path, inference: dict[str, Any], **dataset: Any) -> config_module.Config:
    data = {
        "inference": inference,
        "datasets": [
            {"name": "plain", "path": "plain.jsonl", "budget": "1M"},
            {"name": "chatty", "path": "d.jsonl", "budget": "1M", **dataset},
        ],
    }
    write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "tell me a story"}])
    return config_module.build(data, base_dir=tmp_path, environ={})


def assert_names_key_and_fixes(error: ConfigError) -> None:
    assert error.key == "datasets[1].template"
    message = str(error)
    assert "config key 'datasets[1].template'" in message and "'chatty'" in message
    assert 'template = true with [inference] tokenizer = "<local tokenizer folder>"' in message
    assert 'api = "openai-chat"' in message


@pytest.mark.parametrize("api", RAW_TEXT)
@pytest.mark.parametrize("format", ["openai", "sharegpt"])
def test_an_explicit_chat_format_is_a_config_error(tmp_path: Path, api: str, format: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(tmp_path, {"api": api}, format=format)
    assert_names_key_and_fixes(info.value)
    assert f"format {format!r}" in str(info.value) and repr(api) in str(info.value)


@pytest.mark.parametrize("api", RAW_TEXT)
@pytest.mark.parametrize("row", [CHAT, SHAREGPT], ids=["messages", "sharegpt"])
def test_auto_detected_chat_rows_are_refused_before_the_run(
    tmp_path: Path, api: str, row: dict[str, Any]
) -> None:
    # a bad row and a plain prompt first: the peek reads on to the first conversation
    path = write_jsonl(tmp_path / "d.jsonl", ["{not json", {"prompt": "hi"}, row])
    config = build(tmp_path, {"api": api})  # "auto": the config alone cannot tell
    assert first_chat_row(path) == f"{path}:3"
    with pytest.raises(ConfigError) as info:
        check_datasets(config)
    assert_names_key_and_fixes(info.value)
    assert f"{path}:3" in str(info.value)


def test_a_hugging_face_chat_dataset_is_refused(tmp_path: Path) -> None:
    hf = pytest.importorskip("datasets")
    hf.Dataset.from_list([CHAT, CHAT]).save_to_disk(str(tmp_path / "d"))
    config = build(tmp_path, {}, path="d", format="hf")
    with pytest.raises(ConfigError) as info:
        check_datasets(config)
    assert_names_key_and_fixes(info.value)


@pytest.mark.parametrize("api", RAW_TEXT)
def test_plain_prompts_pass(tmp_path: Path, api: str) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}, "{not json", {"prompt": "hello"}])
    for format in ("auto", "prompt"):
        check_datasets(build(tmp_path, {"api": api}, format=format))


def test_templated_chat_and_openai_chat_pass(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [CHAT])
    tokenizer = str(build_tokenizer(tmp_path / "tok"))
    check_datasets(build(tmp_path, {"tokenizer": tokenizer}, template=True))
    check_datasets(build(tmp_path, {"api": "openai-chat"}))
    write_jsonl(tmp_path / "d.jsonl", [SHAREGPT])
    check_datasets(build(tmp_path, {"api": "openai-chat"}, format="sharegpt"))


def test_a_missing_dataset_is_named_by_the_same_check(tmp_path: Path) -> None:
    config = build(tmp_path, {}, path="absent.jsonl")
    assert first_chat_row(config.datasets[1].path) is None
    with pytest.raises(ConfigError) as info:
        check_datasets(config)
    assert info.value.key == "datasets[1].path"


def job(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    config = tmp_path / "job.toml"
    config.write_text(
        '[inference]\napi = "sglang"\n'
        '[[datasets]]\nname = "plain"\npath = "plain.jsonl"\nbudget = 1000\n'
        '[[datasets]]\nname = "chatty"\npath = "chat.jsonl"\nbudget = 1000\n'
    )
    write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "hi"}])
    return config


@pytest.mark.parametrize("command", ["run", "produce"])
def test_the_command_stops_with_one_line_and_exit_2_before_anything_runs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    def nothing_may_start(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("started before the dataset check")

    for started in (
        "tokenbudget.producers.inference.backends.prepare",
        "tokenbudget.app.runner.resolve_bootstrap",
        "tokenbudget.app.commands.produce.resolve_bootstrap",
    ):
        monkeypatch.setattr(started, nothing_may_start)
    assert cli.main([command, "--config", str(job(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tokenbudget: error: ")
    assert "config key 'datasets[1].template'" in err and "'chatty'" in err
    assert "template = true with [inference] tokenizer" in err and 'api = "openai-chat"' in err
