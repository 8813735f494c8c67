"""``tokenbudget dispatch``: what it does with its arguments. The dispatcher and
the broker are faked: it makes Kafka ready for its config, serves /metrics as the
dispatch role only when asked, and dispatches until stopped, under its static
instance name (none: a dynamic member) and writing its report where told."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from tests.tokenbudget.app.commands.job import write_job
from tokenbudget.app.commands import dispatch
from tokenbudget.core.config import Config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    dispatch.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    seen: list[tuple[str, Any]] = []

    def resolve_bootstrap(config: Config) -> str:
        seen.append(("resolve", config.kafka.namespace))
        return "cluster:9092"

    async def dispatch_until_stopped(
        config: Config, bootstrap: str, report: Path | None, instance: str | None
    ) -> None:
        seen.append(("dispatch", (config.kafka.namespace, bootstrap, report, instance)))

    monkeypatch.setattr(dispatch, "resolve_bootstrap", resolve_bootstrap)
    monkeypatch.setattr(dispatch.metrics, "serve", lambda *where: seen.append(("metrics", where)))
    monkeypatch.setattr(dispatch, "dispatch_until_stopped", dispatch_until_stopped)
    return seen


def test_a_config_is_required() -> None:
    with pytest.raises(SystemExit):
        parse()


def test_it_dispatches_as_a_dynamic_member_without_a_report_by_default(
    tmp_path: Path, calls: list[tuple[str, Any]]
) -> None:
    assert dispatch.main(parse("--config", str(write_job(tmp_path, namespace="ns")))) == 0
    assert calls == [("resolve", "ns"), ("dispatch", ("ns", "cluster:9092", None, None))]


def test_its_instance_report_and_metrics_as_the_flags_say(
    tmp_path: Path, calls: list[tuple[str, Any]]
) -> None:
    args = parse(
        "--config", str(write_job(tmp_path, namespace="ns")),
        "--report", str(tmp_path / "report.json"),
        "--metrics-port", "9466",
        "--instance", "ns-dispatch-2",
    )  # fmt: skip
    assert dispatch.main(args) == 0
    assert calls == [
        ("resolve", "ns"),
        ("metrics", ("127.0.0.1", 9466, "ns", "dispatch")),
        ("dispatch", ("ns", "cluster:9092", tmp_path / "report.json", "ns-dispatch-2")),
    ]
