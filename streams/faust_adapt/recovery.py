"""Table recovery that keeps the newer owner's value, not the last record read.

Faust's recovery replays a table's changelog and lets the last record of a key win.
A worker expelled from the group (frozen past its session) may still have writes in
its producer that land after the next owner's; the last record is then the stale
one. :func:`recover_preferring` replaces the table's ``apply_changelog_batch`` (and
writes its memory store's ``data`` and ``_key_partition`` as Faust's own does) so
that the ledger's own rule picks which record a key keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def recover_preferring(table: Any, prefer: Callable[[bytes, bytes], bool]) -> None:
    """Make Faust's recovery of ``table`` (a memory store of bytes values) replace a
    key's value by a changelog record only when ``prefer(current, record)``, instead
    of letting the last record win: a write a stale worker's producer sent after the
    next owner's writes must not become the state the one after recovers."""
    store = table.data

    def apply_changelog_batch(batch: Iterable[Any]) -> None:
        for event in batch:
            key = table._to_key(event.key)
            if event.message.value is None:  # a tombstone
                store.data.pop(key, None)
                store._key_partition.pop(key, None)
                continue
            value = table._to_value(event.value)
            current = store.data.get(key)
            if current is None or prefer(current, value):
                store.data[key] = value
            store._key_partition[key] = event.message.partition

    table.apply_changelog_batch = apply_changelog_batch
