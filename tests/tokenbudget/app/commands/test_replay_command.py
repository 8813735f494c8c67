"""``tokenbudget replay``'s arguments as options: ``--recount-with``'s tokenizer may run
the code its folder ships when ``--trust-remote-code`` or the config's ``[inference]
trust_remote_code`` says so, and not otherwise (the replay itself, on a real broker:
tests/integration/test_replay.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.tokenbudget.app.commands.job import write_job
from tokenbudget.app.commands import replay


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("key", "flag", "trusted"),
    [(None, False, False), ("false", True, True), ("true", False, True)],
)
def test_the_recount_tokenizer_is_trusted_by_the_flag_or_the_key(
    tmp_path: Path, key: str | None, flag: bool, trusted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replay, "resolve_bootstrap", lambda config: "127.0.0.1:1")  # no broker
    config = write_job(tmp_path)
    if key is not None:
        config.write_text(config.read_text() + f"[inference]\ntrust_remote_code = {key}\n")
    argv = ["--config", str(config), "--recount-with", "tok", *(["--trust-remote-code"] * flag)]
    assert replay.options_from_args(parse(*argv)).trust_remote_code is trusted


def test_without_a_config_only_the_flag_trusts(tmp_path: Path) -> None:
    argv = ["--bootstrap", "127.0.0.1:1", "--recount-with", "tok"]
    assert replay.options_from_args(parse(*argv)).trust_remote_code is False
    options = replay.options_from_args(parse(*argv, "--trust-remote-code"))
    assert options.trust_remote_code is True
