"""The one tokenizer loader: a local folder, offline, transformers imported only
when a folder is loaded; its errors name where the folder came from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.producers.tokenizer_fixture import build_tokenizer
from tokenbudget.core.errors import TokenizerCodeError, TokenizerError
from tokenbudget.core.tokenizer import OFFLINE_ENV, TRUST_FLAG, load_pretrained, shipped_code
from tokenbudget.dev.tiny_tokenizer import ship_own_code


def test_importing_the_loader_does_not_import_transformers() -> None:
    code = "import sys, tokenbudget.core.tokenizer; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_saved_tokenizer_loads_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = build_tokenizer(tmp_path / "tok")
    for name in OFFLINE_ENV:
        monkeypatch.delenv(name, raising=False)
    tokenizer = load_pretrained(folder, "--flag")
    words = "the capital of france"
    assert tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)) == words
    assert {name: os.environ[name] for name in OFFLINE_ENV} == OFFLINE_ENV


def test_what_the_user_set_in_the_environment_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    load_pretrained(build_tokenizer(tmp_path / "tok"), "--flag")
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"


def test_a_missing_folder_names_its_origin(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError) as error:
        load_pretrained(tmp_path / "absent", "replay --recount-with")
    assert str(error.value) == f"replay --recount-with {tmp_path / 'absent'}: not a folder"
    assert error.value.origin == "replay --recount-with"


def test_a_folder_without_a_tokenizer_says_it_cannot_load_one(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"^export --tokenizer .*: cannot load a tokenizer"):
        load_pretrained(tmp_path, "export --tokenizer")


# --- a folder that ships its own tokenizer code (Kimi-K2's is tiktoken code, auto_map) ---


def test_a_folder_shipping_its_own_code_loads_only_when_trusted(tmp_path: Path) -> None:
    folder = ship_own_code(build_tokenizer(tmp_path / "kimi-like"))
    with pytest.raises(TokenizerCodeError) as error:
        load_pretrained(folder, "export --tokenizer")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"export --tokenizer {folder}: ")
    assert "tokenization_tiny.py" in message and "auto_map" in message
    assert "[inference] trust_remote_code = true" in message  # the key that trusts it
    tokenizer = load_pretrained(folder, "export --tokenizer", trust_remote_code=True)
    assert type(tokenizer).__name__ == "TinyCodeTokenizer" and tokenizer.ran_folder_code
    words = "the capital of france"
    assert tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)) == words


def test_a_command_with_a_flag_of_its_own_names_it(tmp_path: Path) -> None:
    folder = ship_own_code(build_tokenizer(tmp_path / "kimi-like"))
    with pytest.raises(TokenizerCodeError, match=r"runs only with --trust-remote-code \(or"):
        load_pretrained(folder, "replay --recount-with", trusted_by=TRUST_FLAG)


def test_a_folder_without_code_loads_trusted_or_not(tmp_path: Path) -> None:
    folder = build_tokenizer(tmp_path / "tok")
    assert shipped_code(folder) == []
    trusted = load_pretrained(folder, "--flag", trust_remote_code=True)
    assert type(trusted) is type(load_pretrained(folder, "--flag"))
