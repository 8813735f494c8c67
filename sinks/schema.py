"""The row schema: a Parquet row's columns, their Arrow types, and how a table read
from any version's file is brought to today's schema.

:data:`COLUMNS` is the one declaration of a row; the table building
(:mod:`tokenbudget.sinks.rows`), the sink's files (:mod:`tokenbudget.sinks.parquet`),
the replay and the exports all take it from here.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import pyarrow as pa

from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import SamplingParams

DATASET_TYPE = pa.dictionary(pa.int32(), pa.string())
IDS_TYPE = pa.list_(pa.int32())
TOOL_CALLS_TYPE = pa.list_(
    pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())])
)
# A message's tool fields are null unless it has them (files written before them
# lack them: reading casts them in as nulls).
MESSAGES_TYPE = pa.list_(
    pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("tool_calls", TOOL_CALLS_TYPE),
            ("tool_call_id", pa.string()),
            ("name", pa.string()),
        ]
    )
)
# How a sampling setting (tokenbudget.core.sampling) is stored, by its Python type; the
# free-form tables (dict) as JSON text.
_SAMPLING_ARROW = {float: pa.float64(), int: pa.int64(), str: pa.string()}


def _set_type(hint: Any) -> Any:
    """The type of a setting when set (every one is optional)."""
    if typing.get_origin(hint) is typing.Annotated:  # its description for the docs
        hint = typing.get_args(hint)[0]
    (value,) = [t for t in typing.get_args(hint) if t is not type(None)]
    return value


def _sampling_arrow_type(hint: Any) -> pa.DataType:
    value = _set_type(hint)
    if typing.get_origin(value) is typing.Annotated:  # its bounds (streams/events.py)
        value = typing.get_args(value)[0]
    if typing.get_origin(value) is list:
        (item,) = typing.get_args(value)
        return pa.list_(_SAMPLING_ARROW[item])
    if typing.get_origin(value) is dict:
        return pa.string()
    return _SAMPLING_ARROW[value]


# The event's fields, ``max_new_tokens`` first: where the files written so far hold it.
_SAMPLING_FIELDS = sorted(
    msgspec.structs.fields(SamplingParams), key=lambda f: f.name != "max_new_tokens"
)
JSON_SAMPLING = tuple(
    f.name for f in _SAMPLING_FIELDS if typing.get_origin(_set_type(f.type)) is dict
)
SAMPLING_TYPE = pa.struct([(f.name, _sampling_arrow_type(f.type)) for f in _SAMPLING_FIELDS])

# The one declaration of a Parquet row's columns, in file order: each is the
# CompletionEvent field of that name, with the Arrow type it is stored as. The
# lean records the sink decodes and the table builder both derive from it, and
# ``_check_columns`` ties it to the event at import, so a field added to the event
# without a column here fails every test. Columns after ``text`` came with
# completion v3, ``stop_reason`` with v4, the reasoning with v5, the tools and the
# conversation's turn with v6; older files lack them and :func:`conform` fills
# them with nulls.
COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("request_id", pa.string()),
    ("prompt_id", pa.string()),
    ("dataset", DATASET_TYPE),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("output_ids", IDS_TYPE),
    ("finish_reason", pa.string()),
    ("max_new_tokens", pa.int64()),
    ("count_source", pa.string()),
    ("attempts", pa.int32()),
    ("dispatched_at", pa.float64()),
    ("first_token_at", pa.float64()),
    ("finished_at", pa.float64()),
    ("text", pa.string()),
    ("prompt", pa.string()),
    ("messages", MESSAGES_TYPE),
    ("prompt_ids", IDS_TYPE),
    ("model", pa.string()),
    ("sampling", SAMPLING_TYPE),
    ("row_id", pa.string()),
    ("input_columns", pa.string()),  # the row's keep_columns, as a JSON object
    ("sample_index", pa.int32()),
    ("stop_reason", pa.string()),  # "stop" | "length" | "budget" | "abort"
    ("reasoning", pa.string()),  # the thinking the server split off ``text``
    ("reasoning_tokens", pa.int64()),  # of completion_tokens, as the server reported
    ("unfinished", pa.bool_()),  # cut while still thinking: no answer
    ("tools", pa.string()),  # the tool definitions offered, as JSON
    ("tool_calls", TOOL_CALLS_TYPE),  # the calls the model answered with
    ("conversation_id", pa.string()),  # turns = "regenerate": the conversation
    ("turn", pa.int32()),  # which of its turns (from 0)
    ("turns", pa.int32()),  # how many turns it has to regenerate
    ("tool_mismatch", pa.bool_()),  # called other functions than the dataset recorded
)
# Event fields that are not row columns: how the ledger accounted for the answer.
NOT_COLUMNS = frozenset({"type", "v", "lease_id", "cost"})

SCHEMA = pa.schema(COLUMNS)


def _check_columns() -> None:
    fields = {f.name for f in msgspec.structs.fields(ev.CompletionEvent)} - NOT_COLUMNS
    columns = {name for name, _ in COLUMNS}
    if fields != columns:  # pragma: no cover - a development error, caught by any test
        raise TypeError(
            f"tokenbudget.sinks.schema.COLUMNS and CompletionEvent disagree: "
            f"only in the event {sorted(fields - columns)}, only here {sorted(columns - fields)}"
        )


_check_columns()


def conform(table: pa.Table) -> pa.Table:
    """A table read from any version's file, in today's :data:`SCHEMA`: columns a
    file written before them lacks are nulls; unknown columns are dropped."""
    arrays = []
    for name, kind in COLUMNS:
        if name in table.column_names:
            arrays.append(table.column(name).cast(kind))
        else:
            arrays.append(pa.nulls(table.num_rows, kind))
    return pa.Table.from_arrays(arrays, schema=SCHEMA)
