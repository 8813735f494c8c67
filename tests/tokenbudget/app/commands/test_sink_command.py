"""``tokenbudget sink``: what it does with its arguments. The sink and the broker
are faked: it makes Kafka ready for its config, reads the config's namespace into
its sink folder until SIGTERM or SIGINT, without draining the topic (run's sink
drains it), and says what it wrote."""

from __future__ import annotations

import argparse
import functools
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.tokenbudget.app.commands.job import write_job
from tokenbudget.app import assembly
from tokenbudget.app.commands import sink
from tokenbudget.core.config import Config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sink.add_arguments(parser)
    return parser.parse_args(argv)


class Faked:
    """What the command made and set up: the sink, and its signal handlers."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.sinks: list[FakeSink] = []
        self.handlers: dict[int, Any] = {}


class FakeSink:
    def __init__(self, faked: Faked, bootstrap: str, topics: Any, settings: Any) -> None:
        self.faked = faked
        self.bootstrap, self.topics, self.settings = bootstrap, topics, settings
        self.rows_written = {"a": 3, "b": 4}
        self.duplicates_dropped = 1
        self.drain: bool | None = None
        self.stopped = False
        faked.sinks.append(self)

    def run(self, stop: threading.Event, *, drain: bool) -> None:
        self.drain = drain
        self.faked.handlers[signal.SIGTERM](signal.SIGTERM, None)  # stopped from outside
        self.stopped = stop.is_set()


@pytest.fixture
def faked(monkeypatch: pytest.MonkeyPatch) -> Faked:
    faked = Faked()

    def resolve_bootstrap(config: Config) -> str:
        faked.calls.append(("resolve", config.kafka.namespace))
        return "cluster:9092"

    monkeypatch.setattr(sink, "resolve_bootstrap", resolve_bootstrap)
    monkeypatch.setattr(
        sink.metrics, "serve", lambda *where: faked.calls.append(("metrics", where))
    )
    monkeypatch.setattr(assembly, "ParquetSink", functools.partial(FakeSink, faked))
    monkeypatch.setattr(sink.signal, "signal", lambda signum, h: faked.handlers.update({signum: h}))
    return faked


def test_it_sinks_the_namespace_into_the_folder_until_a_signal(
    tmp_path: Path, faked: Faked, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sink.main(parse("--config", str(write_job(tmp_path, namespace="ns")))) == 0
    assert faked.calls == [("resolve", "ns")]
    [made] = faked.sinks
    assert (made.bootstrap, made.topics.namespace) == ("cluster:9092", "ns")
    assert made.topics.sink_group == "ns-sink"
    assert made.settings.path == (tmp_path / "out").resolve()
    assert made.stopped and made.drain is False
    assert set(faked.handlers) == {signal.SIGTERM, signal.SIGINT}
    err = capsys.readouterr().err
    assert f"sink: ns -> {tmp_path / 'out'}" in err
    assert "7 rows written, 1 duplicates dropped" in err


def test_metrics_as_the_sink_role_only_when_asked(tmp_path: Path, faked: Faked) -> None:
    sink.main(parse("--config", str(write_job(tmp_path, namespace="ns")), "--metrics-port", "9467"))
    assert faked.calls == [("resolve", "ns"), ("metrics", ("127.0.0.1", 9467, "ns", "sink"))]
