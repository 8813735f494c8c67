"""``tokenbudget produce``: what it does with its arguments. The producer and the
broker are faked: the datasets are checked before Kafka is asked for anything, then
it produces until done, resuming a changed job only when told."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from tests.tokenbudget.app.commands.job import write_job
from tokenbudget.app.commands import produce
from tokenbudget.core.config import Config
from tokenbudget.core.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    produce.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    seen: list[tuple[str, Any]] = []

    def resolve_bootstrap(config: Config) -> str:
        seen.append(("resolve", config.kafka.namespace))
        return "cluster:9092"

    async def produce_until_done(config: Config, bootstrap: str, *, resume_changed: bool) -> None:
        seen.append(("produce", (config.kafka.namespace, bootstrap, resume_changed)))

    monkeypatch.setattr(produce, "resolve_bootstrap", resolve_bootstrap)
    monkeypatch.setattr(produce, "produce_until_done", produce_until_done)
    return seen


def test_it_produces_the_configs_job(tmp_path: Path, calls: list[tuple[str, Any]]) -> None:
    assert produce.main(parse("--config", str(write_job(tmp_path, namespace="ns")))) == 0
    assert calls == [("resolve", "ns"), ("produce", ("ns", "cluster:9092", False))]


def test_resume_changed_is_passed_on(tmp_path: Path, calls: list[tuple[str, Any]]) -> None:
    produce.main(parse("--config", str(write_job(tmp_path)), "--resume-changed"))
    assert calls[-1] == ("produce", ("roles", "cluster:9092", True))


def test_a_dataset_it_cannot_read_stops_it_before_kafka_is_asked(
    tmp_path: Path, calls: list[tuple[str, Any]]
) -> None:
    config = write_job(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"instruction": "no prompt field"}\n')
    with pytest.raises(ConfigError):
        produce.main(parse("--config", str(config)))
    assert calls == []
