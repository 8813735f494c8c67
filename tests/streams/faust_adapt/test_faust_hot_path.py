"""RawSchema and QuietMonitor against the installed Faust: the methods they
override are the ones Faust calls, with the same signatures, and the ledger app
uses them (or stock Faust's, when bench/ledger.py turns a cut off)."""

from __future__ import annotations

import asyncio
import inspect

import faust
import pytest
from faust.sensors.monitor import Monitor
from faust.serializers.schemas import Schema
from faust.types import TP, Message

from streams.app import LedgerSettings, build_app
from streams.faust_adapt import HotPath, QuietMonitor, RawSchema
from streams.topics import Topics


def shape(function: object) -> list[tuple[str, object, object]]:
    """A signature without its annotations: how callers bind the arguments."""
    parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in parameters]


def _app(hot_path: HotPath | None = None) -> faust.App:
    settings = LedgerSettings("127.0.0.1:9", Topics("unit"), hot_path=hot_path or HotPath())
    return build_app(settings)


def _message(key: bytes, value: bytes) -> Message:
    return Message("unit.completions", 1, 7, 0.0, 0, [], key, value, None)


@pytest.mark.parametrize("name", ["loads_key", "loads_value"])
def test_raw_schema_overrides_what_faust_calls_with_its_signature(name: str) -> None:
    assert shape(getattr(RawSchema, name)) == shape(getattr(Schema, name))
    # Schema.compile, which decodes every message of a topic, calls both.
    assert f"self.{name}" in inspect.getsource(Schema.compile)


def test_faust_decodes_the_ledgers_source_events_as_the_bytes_they_arrived_as() -> None:
    app = _app()
    source = app.agents["ledger"].channel
    assert isinstance(source.schema, RawSchema)
    # JSON on the wire: stock decoding with a json serializer would parse it.
    message = _message(b'"d0"', b'{"a": 1}')
    event = asyncio.run(source.schema.decode(app, message, propagate=True))
    assert (event.key, event.value) == (b'"d0"', b'{"a": 1}')
    assert event.message is message


@pytest.mark.parametrize(
    "name", ["on_message_in", "on_stream_event_in", "on_stream_event_out", "on_message_out"]
)
def test_quiet_monitor_overrides_fausts_per_message_sensors_with_their_signatures(
    name: str,
) -> None:
    assert shape(getattr(QuietMonitor, name)) == shape(getattr(Monitor, name))


def test_the_quiet_monitor_counts_nothing_per_message_where_fausts_does() -> None:
    tp, message = TP("unit.completions", 1), _message(b"k", b"v")
    counts = []
    for monitor in (QuietMonitor(), Monitor()):
        monitor.on_message_in(tp, 7, message)
        monitor.on_message_out(tp, 7, message)
        counts.append(monitor.messages_received_total)
    assert counts == [0, 1]


def test_the_ledger_app_runs_its_monitor() -> None:
    assert isinstance(_app().monitor, QuietMonitor)
    stock = _app(HotPath.without({"quiet_monitor", "raw_schema"}))
    assert type(stock.monitor) is Monitor
    assert type(stock.agents["ledger"].channel.schema) is faust.Schema


def test_a_misspelt_cut_is_refused() -> None:
    assert HotPath.without({"raw_schema"}) == HotPath(raw_schema=False)
    with pytest.raises(ValueError, match="raw_shema"):
        HotPath.without({"raw_shema"})
