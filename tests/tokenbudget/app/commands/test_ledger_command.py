"""``tokenbudget ledger``: what it does with its arguments. The worker itself
(tokenbudget.streams.ledger_worker) and the broker are faked: a config names the broker, the
namespace, the interval and the compression; --bootstrap names them on the command
line and waits for Kafka first (Faust gives up at once on a broker restarting)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.tokenbudget.app.commands.job import write_job
from tokenbudget.app.commands import ledger
from tokenbudget.core.config import Config
from tokenbudget.core.errors import TokenBudgetError
from tokenbudget.core.kafka_admin import TopicLayout


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ledger.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """What the command asked of the broker, the metrics and the worker, in order."""
    seen: list[tuple[str, Any]] = []

    def resolve_bootstrap(config: Config) -> str:
        seen.append(("resolve", config.kafka.namespace))
        return "cluster:9092"

    def serve(bootstrap: str, namespace: str, interval: float, *, compression: str) -> None:
        seen.append(("serve", (bootstrap, namespace, interval, compression)))

    monkeypatch.setattr(ledger, "resolve_bootstrap", resolve_bootstrap)
    monkeypatch.setattr(
        ledger, "wait_ready", lambda bootstrap: seen.append(("wait_ready", bootstrap))
    )
    monkeypatch.setattr(ledger.metrics, "serve", lambda *where: seen.append(("metrics", where)))
    monkeypatch.setattr(ledger, "serve", serve)
    return seen


def test_the_defaults_of_a_worker_started_by_hand() -> None:
    args = parse("--bootstrap", "h:1")
    assert (args.namespace, args.snapshot_interval, args.compression) == (
        "tokenbudget",
        0.5,
        "zstd",
    )
    assert (args.metrics_host, args.metrics_port) == ("127.0.0.1", 0)


def test_a_config_names_everything_and_makes_kafka_ready(
    tmp_path: Path, calls: list[tuple[str, Any]]
) -> None:
    assert ledger.main(parse("--config", str(write_job(tmp_path, namespace="ns")))) == 0
    assert calls == [("resolve", "ns"), ("serve", ("cluster:9092", "ns", 0.25, "lz4"))]


def test_bootstrap_waits_for_kafka_then_serves_what_the_flags_say(
    calls: list[tuple[str, Any]],
) -> None:
    args = parse(
        "--bootstrap", "h:1", "--namespace", "ns", "--snapshot-interval", "2",
        "--compression", "gzip", "--metrics-port", "9465",
    )  # fmt: skip
    assert ledger.main(args) == 0
    assert calls == [
        ("wait_ready", "h:1"),
        ("metrics", ("127.0.0.1", 9465, "ns", "ledger")),
        ("serve", ("h:1", "ns", 2.0, "gzip")),
    ]


def test_without_a_config_or_a_bootstrap_it_says_what_it_needs(
    calls: list[tuple[str, Any]],
) -> None:
    with pytest.raises(TokenBudgetError, match="--config FILE, or --bootstrap HOST:PORT"):
        ledger.main(parse())
    assert calls == []


def test_serve_makes_missing_topics_and_runs_on_their_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layouts = iter([None, TopicLayout(partitions=8, replication_factor=3)])
    made: list[list[str]] = []
    workers: list[Any] = []
    monkeypatch.setattr(ledger, "topic_layout", lambda bootstrap, topic: next(layouts))
    monkeypatch.setattr(
        ledger, "ensure_topics", lambda bootstrap, specs: made.append([s.name for s in specs])
    )
    monkeypatch.setattr(ledger, "run_worker", workers.append)
    monkeypatch.setattr(sys, "argv", ["tokenbudget", "ledger", "--bootstrap", "h:1"])
    ledger.serve("h:1", "ns", 0.5, compression="lz4")
    assert "ns.completions" in made[0]
    [settings] = workers
    assert (settings.topics.namespace, settings.topics.partitions) == ("ns", 8)
    assert (settings.replication_factor, settings.compression) == (3, "lz4")
    assert sys.argv[1:] == ["worker"]  # what Faust's Worker reads


def test_serve_leaves_existing_topics_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    workers: list[Any] = []
    monkeypatch.setattr(ledger, "topic_layout", lambda bootstrap, topic: TopicLayout(2, 1))
    monkeypatch.setattr(ledger, "ensure_topics", lambda *a: pytest.fail("topics exist"))
    monkeypatch.setattr(ledger, "run_worker", workers.append)
    monkeypatch.setattr(sys, "argv", ["tokenbudget"])
    ledger.serve("h:1", "ns", 0.5)
    assert workers[0].topics.partitions == 2
