"""The config's tokenizer (``[inference] tokenizer``): a folder that ships its own
tokenizer code (as Kimi-K2's does) loads with ``[inference] trust_remote_code = true``
and, without it, stops the command in one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.producers.tokenizer_fixture import build_tokenizer
from tokenbudget import cli
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ConfigError
from tokenbudget.dev.tiny_tokenizer import ship_own_code
from tokenbudget.producers.prompts.datasets import read_options
from tokenbudget.producers.templates import config_tokenizer
from tokenbudget.streams.fields import ChatMessage

QUESTION = "what is the capital of france"


def job(tmp_path: Path, *, trusted: bool | None) -> Path:
    ship_own_code(build_tokenizer(tmp_path / "kimi-like"))
    row = {"id": "q", "messages": [{"role": "user", "content": QUESTION}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(row) + "\n")
    trust = [] if trusted is None else [f"trust_remote_code = {str(trusted).lower()}"]
    lines = [
        "[kafka]",
        'bootstrap = "127.0.0.1:1"',  # plan without a pilot touches no broker
        "[inference]",
        'api = "sglang"',
        'url = "http://127.0.0.1:1"',
        'tokenizer = "kimi-like"',
        *trust,
        "[[datasets]]",
        'name = "chat"',
        'path = "chat.jsonl"',
        'budget = "1k"',
        "template = true",
    ]
    (tmp_path / "job.toml").write_text("\n".join(lines) + "\n")
    return tmp_path / "job.toml"


@pytest.mark.parametrize("trusted", [None, False])
def test_without_the_key_the_folder_is_refused_naming_it(
    tmp_path: Path, trusted: bool | None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_module.load(job(tmp_path, trusted=trusted))
    with pytest.raises(ConfigError) as error:
        config_tokenizer(config)
    assert error.value.key == "inference.trust_remote_code"
    assert "tokenization_tiny.py" in str(error.value)
    # a command that loads it stops in one line naming the key
    assert cli.main(["plan", "--config", str(tmp_path / "job.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "inference.trust_remote_code" in err


def test_with_the_key_its_own_code_applies_the_template(tmp_path: Path) -> None:
    config = config_module.load(job(tmp_path, trusted=True))
    tokenizer = config_tokenizer(config)
    assert tokenizer is not None and type(tokenizer._tokenizer).__name__ == "TinyCodeTokenizer"
    template = read_options(config, config.datasets[0])["template"]
    ids = template((ChatMessage("user", QUESTION),))
    # the folder's own template, by the folder's own tokenizer class
    rendered = tokenizer._tokenizer.decode(ids, skip_special_tokens=False)
    assert rendered.split() == ["<s>", "<|user|>", *QUESTION.split(), "</s>", "<|assistant|>"]
