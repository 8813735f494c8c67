"""The command line as a user meets it: one line and exit 2 for any failure, exit 3
when prompts failed, --version, log levels in any case, a quiet terminal."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
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
    assert quiet.filter(record("tokenbudget.producers.dispatch.dispatcher", logging.INFO))
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


def every_parser(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """The whole command line: each parser with the words that reach it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_parser(sub, (*path, name))


def test_every_option_of_every_command_has_a_help_line_and_every_command_an_example() -> None:
    missing, without_example = [], []
    walked = list(every_parser(cli.build_parser()))
    for path, parser in walked:
        parser.format_help()  # every help line expands (a bare % would raise)
        for action in parser._actions:
            name = " ".join(
                [*path, action.dest if not action.option_strings else action.option_strings[-1]]
            )
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:  # the subcommands' one-line help
                    if not choice.help:
                        missing.append(f"{' '.join(path)} {choice.dest}")
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(name)
        if f"tokenbudget {' '.join(path)}".strip() not in (parser.epilog or ""):
            without_example.append(" ".join(path) or "tokenbudget")
    assert missing == [], f"options without a help line: {missing}"
    assert without_example == [], f"commands whose help ends without an example: {without_example}"
    commands = {path for path, _ in walked}
    assert {("budget", "set"), ("broker", "status"), ("run",), ("demo",)} <= commands


def test_help_lists_the_users_commands_apart_from_the_roles_and_the_tools(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    sections = out.split("\n\n")
    for group, title in cli.GROUPS.items():
        section = next(s for s in sections if s.startswith(f"{title}:"))
        listed = [line.split()[0] for line in section.splitlines()[1:]]
        assert listed == [name for name, c in cli.COMMANDS.items() if c.group == group]
    assert [c.group for c in cli.COMMANDS.values()][:7] == ["job"] * 7
    assert out.startswith("usage: tokenbudget [-h] [--version] COMMAND ...\n")


def test_a_commands_help_imports_only_its_own_module(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/cli_startup.py: the others' modules (Faust, pyarrow, the simulator) are not
    imported for one command's help."""
    code = (
        "import sys\nfrom tokenbudget import cli\n"
        "cli.build_parser(['status', '--help'])\n"
        "print(sorted(m for m in ('tokenbudget.dev.simulator', 'tokenbudget.sinks.export', "
        "'tokenbudget.app.commands.replay') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_the_simulators_profiles_are_listed_from_its_own_table() -> None:
    from tokenbudget.dev.simulator.config import PROFILES

    parser = cli.build_parser(["simulate"])
    simulate = next(
        sub
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
        if name == "simulate"
    )
    text = simulate.format_help()
    for name in PROFILES:
        assert f"{name}:" in text.replace("\n", " ")
