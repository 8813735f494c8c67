"""The command line as a user meets it: one line and exit 2 for any failure, exit 3
when prompts failed, --version, log levels in any case, a quiet terminal."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import NotLeaderForPartitionError
from kafka.errors import RebalanceInProgressError

from tokenbudget import cli
from tokenbudget.app.runner import DatasetResult, RunReport


@pytest.fixture(autouse=True)
def restore_log_level() -> Any:
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


def job(tmp_path: Path) -> Path:
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n')
    config = tmp_path / "job.toml"
    config.write_text('[[datasets]]\nname = "a"\npath = "a.jsonl"\nbudget = 1000\n')
    return config


def report(failed: int) -> RunReport:
    result = DatasetResult(
        budget=1000,
        completion_tokens=1010,
        prompt_tokens=40,
        samples=4,
        skipped=1,
        failed=failed,
        status="halted",
        unit="completion_tokens",
    )
    return RunReport(datasets={"a": result}, seconds=12.5)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("tokenbudget 0.")


@pytest.mark.parametrize(("raw", "level"), [("debug", 10), ("Info", 20), ("WARNING", 30)])
def test_log_levels_in_any_case(raw: str, level: int) -> None:
    cli.configure_logging({"TOKENBUDGET_LOG": raw})
    assert logging.getLogger().level == level


def test_a_bad_log_level_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENBUDGET_LOG", "loud")
    assert cli.main(["status", "--config", "job.toml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TOKENBUDGET_LOG='loud'" in err


def record(name: str, level: int) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, "message", None, None)


def test_libraries_warnings_stay_off_the_terminal_unless_asked() -> None:
    quiet = cli.log_handler("")
    for library in ("kafka.coordinator", "aiokafka", "faust.transport", "mode"):
        assert not quiet.filter(record(library, logging.WARNING)), library
        assert quiet.filter(record(library, logging.ERROR)), library
    assert quiet.filter(record("tokenbudget.app.runner", logging.WARNING))
    assert quiet.filter(record("producers.dispatcher", logging.INFO))
    # TOKENBUDGET_LOG set: everything at that level, the libraries' too
    assert cli.log_handler("info").filter(record("kafka.coordinator", logging.WARNING))


def library_error(name: str, message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, args, None)


def test_leader_elections_and_rebalances_stay_off_the_terminal_unless_asked() -> None:
    """aiokafka logs a fresh topic's leader election and a group's rebalance as
    errors, and retries them: expected, not news."""
    expected = [
        library_error(
            "aiokafka.consumer.fetcher",
            "Failed fetch offsets from %s: %s",
            1,
            NotLeaderForPartitionError(),
        ),
        library_error(
            "aiokafka.consumer.group_coordinator",
            "OffsetCommit failed for group %s due to group error (%s), will rejoin",
            "ns-sink",
            RebalanceInProgressError("ns-sink"),
        ),
        library_error("kafka.coordinator", "Heartbeat failed: %r", RebalanceInProgressError()),
    ]
    quiet = cli.log_handler("")
    for noise in expected:
        assert not quiet.filter(noise), noise.getMessage()
        assert cli.log_handler("debug").filter(noise)
    other = library_error("aiokafka.consumer.fetcher", "Failed fetch messages from %s: %s", 1, "x")
    assert quiet.filter(other)


def test_any_failure_of_a_command_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TOKENBUDGET_LOG", raising=False)

    def broken(*args: Any, **kwargs: Any) -> RunReport:
        raise RuntimeError("a dispatcher process exited")

    monkeypatch.setattr("tokenbudget.app.runner.run", broken)
    assert cli.main(["run", "--config", str(job(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err == (
        "tokenbudget: error: RuntimeError: a dispatcher process exited "
        "(TOKENBUDGET_LOG=debug shows where)\n"
    )


def test_run_exits_3_when_prompts_failed_and_json_has_what_the_table_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = job(tmp_path)
    monkeypatch.setattr("tokenbudget.app.runner.run", lambda *a, **k: report(failed=2))
    assert cli.main(["run", "--config", str(config), "--json"]) == 3
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed["failed"] == 2
    assert printed["seconds"] == 12.5
    dataset = printed["datasets"]["a"]
    assert dataset["failed"] == 2
    assert dataset["unit"] == "completion_tokens"
    assert dataset["overshoot"] == 10 and dataset["overshoot_percent"] == 1.0
    assert "2 prompt(s) failed" in captured.err

    monkeypatch.setattr("tokenbudget.app.runner.run", lambda *a, **k: report(failed=0))
    assert cli.main(["run", "--config", str(config)]) == 0
