"""The hot-path switches, and the stock Faust parts the ledger keeps on its hot path:
the source topics' schema hands events over as the bytes they arrived as."""

from __future__ import annotations

import asyncio

import pytest
from faust.types import Message

from tokenbudget.streams.faust_adapt import HotPath
from tokenbudget.streams.ledger_worker import LedgerSettings, build_app
from tokenbudget.streams.topics import Topics


def test_faust_hands_the_ledger_its_source_events_as_the_bytes_they_arrived_as() -> None:
    app = build_app(LedgerSettings("127.0.0.1:9", Topics("unit")))
    source = app.agents["ledger"].channel
    # JSON on the wire: a json serializer anywhere on the way would parse it.
    message = Message("unit.completions", 1, 7, 0.0, 0, [], b'"d0"', b'{"a": 1}', None)
    event = asyncio.run(source.schema.decode(app, message, propagate=True))
    assert (event.key, event.value) == (b'"d0"', b'{"a": 1}')
    assert event.message is message


def test_a_misspelt_cut_is_refused() -> None:
    assert HotPath.without({"fast_delivery"}) == HotPath(fast_delivery=False)
    assert HotPath.without(set()) == HotPath()
    with pytest.raises(ValueError, match="fast_delivry"):
        HotPath.without({"fast_delivry"})
