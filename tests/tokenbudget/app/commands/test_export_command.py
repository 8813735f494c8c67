"""``tokenbudget export`` as a user types it: the tokenizer it loads (``--tokenizer``,
else ``[inference] tokenizer``, its own code only when trusted) gives a text prompt
its ids, and the summary says what the export did to the rows: ids computed, thinking
split off, tools left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.producers.tokenizer_fixture import build_tokenizer
from tests.sinks.test_export import WHOLE, completion, write_rows
from tokenbudget.cli import main
from tokenbudget.core.tokenizer import load_pretrained
from tokenbudget.dev.tiny_tokenizer import ship_own_code

PROMPT = "tell me a story about the sea"


def seed_rows(out: Path, tokenizer: Path) -> list[int]:
    """Answers of SGLang's /generate to a text prompt: no prompt ids, the server's
    count of them, the thinking inline."""
    expected = load_pretrained(tokenizer, "test").encode(PROMPT, add_special_tokens=True)
    rows = [
        completion(i, messages=None, prompt=PROMPT, prompt_ids=None,
                   prompt_tokens=len(expected), text=f" hm </think> answer {i}")
        for i in range(2)
    ]  # fmt: skip
    write_rows(out, rows)
    return list(expected)


def test_a_text_prompt_takes_its_ids_from_the_tokenizer_and_the_summary_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = build_tokenizer(tmp_path / "tok")
    expected = seed_rows(tmp_path / "out", tokenizer)
    target = tmp_path / "spec.jsonl"
    common = ["export", "--from", str(tmp_path / "out"), "--tokenizer", str(tokenizer)]
    assert main([*common, "--format", "speculators", "--to", str(target)]) == 0
    out = capsys.readouterr().out
    assert "2 prompts sent as text had no ids from the server: computed" in out
    for record in map(json.loads, target.read_text().splitlines()):
        assert record["input_ids"][: len(expected)] == expected
        assert record["loss_mask"] == [0] * len(expected) + [1, 1]
    # without a tokenizer: today's one-line refusal, naming the flag and the key
    bare = ["export", "--from", str(tmp_path / "out"), "--format", "speculators"]
    assert main([*bare, "--to", str(tmp_path / "no.jsonl")]) == 2
    error = capsys.readouterr().err
    assert (
        error.count("\n") == 1 and "--tokenizer DIR" in error and "[inference] tokenizer" in error
    )
    # the text formats split the inline thinking, and say how many
    assert main([*common, "--format", "specforge", "--to", str(tmp_path / "sf.jsonl")]) == 0
    assert "2 answers had their thinking inline: split at '</think>'" in capsys.readouterr().out


def test_a_tokenizer_shipping_its_own_code_is_run_only_when_trusted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = ship_own_code(build_tokenizer(tmp_path / "kimi-like"))
    expected = seed_rows(tmp_path / "out", build_tokenizer(tmp_path / "same"))
    target = tmp_path / "spec.jsonl"
    args = ["export", "--from", str(tmp_path / "out"), "--format", "speculators",
            "--to", str(target), "--tokenizer", str(tokenizer)]  # fmt: skip
    assert main(args) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--trust-remote-code" in error
    assert "tokenization_tiny.py" in error and not target.exists()
    assert main([*args, "--trust-remote-code"]) == 0
    first = json.loads(target.read_text().splitlines()[0])
    assert first["input_ids"][: len(expected)] == expected


def test_modelopt_warns_in_one_line_of_the_tools_it_leaves_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_rows(tmp_path / "out", WHOLE)
    target = tmp_path / "mo.jsonl"
    args = ["export", "--from", str(tmp_path / "out"), "--format", "modelopt", "--to", str(target)]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Model-Optimizer never passes tools" in captured.err
    assert "1 records (conv 1)" in captured.err
    assert "exported 1 rows (conv 1)" in captured.out
