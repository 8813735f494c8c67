"""Parquet tables built from whole events, for tests to compare the sink against.

The sink decodes lean records (:func:`tokenbudget.sinks.rows.decode_records`); this builds the
same table from fully decoded :class:`~tokenbudget.streams.events.CompletionEvent` objects, by the
column code the sink uses, so a test sees where the two decoding paths differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from tokenbudget.sinks.rows import _column_arrays, _id_bytes, _ids_from_bytes
from tokenbudget.sinks.schema import SCHEMA
from tokenbudget.streams import events as ev


def completions_to_table(rows: Sequence[ev.CompletionEvent]) -> pa.Table:
    """The rows of fully decoded events (the table :func:`tokenbudget.sinks.rows.keep_first`
    builds for the same completions)."""
    ids = _ids_from_bytes([_id_bytes(r.output_ids) for r in rows])
    return pa.Table.from_arrays(_column_arrays(rows, ids), schema=SCHEMA)
