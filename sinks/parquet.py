"""The Parquet sink: completions in, training-ready files out, exactly once.

Layout: ``<path>/dataset=<name>/part-<time>-<id>.parquet``, one row per prompt. The
``dataset`` column is stored as ``dictionary<int32, string>``, the type pyarrow
infers for a hive folder, so ``pq.read_table(path)``, polars, DuckDB and Hugging
Face ``datasets`` read the whole tree as one table (docs/output.md).

Contract:
  * A file appears whole or not at all: written under a hidden temporary name in
    the same folder, fsynced, then renamed and the folder fsynced
    (:func:`tokenbudget.core.files.atomic_file`). Temporaries left by a crash are removed
    at start.
  * Offsets are committed only after every row read before them is in a renamed
    file, so a crash at any point re-reads, and never skips, completions.
  * Re-read rows are dropped by ``prompt_id`` (the files on disk are scanned at
    start), matching the ledger, which keeps the first completion of each prompt;
    so no ``request_id`` or ``prompt_id`` appears twice.
  * Undecodable events go to the dead-letter topic.

The decoding, the first-completion rule and the file writing are shared with
``tokenbudget replay`` (:mod:`tokenbudget.sinks.replay`), so a replay of the topic gives the
same rows as the live sink, whatever duplicates the topic holds.

Speed: no Python object is made per token id. A completion (v2) carries its
``output_ids`` as little-endian int32 bytes (base64 in the JSON, decoded by msgspec
in C, :class:`CompletionRecord`); a batch's id bytes are joined into the int32
values buffer of the ``list<int32>`` column. Older completions (v1, ids as JSON
numbers, :class:`LegacyCompletionRecord`) keep their ids as raw JSON, parsed per
batch by Arrow's CSV reader. A batch whose v1 ids do not parse cleanly that way is
decoded event by event with the full decoder instead, with the same result.
"""

from __future__ import annotations

import functools
import io
import logging
import threading
import time
import typing
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata
from kafka.errors import KafkaError

from tokenbudget.core import metrics, sizes
from tokenbudget.core.config import Config
from tokenbudget.core.errors import EventDecodeError, expected_kafka_error
from tokenbudget.core.files import atomic_file
from tokenbudget.core.kafka import (
    consumer_options,
    kafka_python_options,
    kafka_python_producer_options,
    wait_for_partitions,
)
from tokenbudget.core.retry import retry_until
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.dead_letters import dead_letter_for
from tokenbudget.streams.fields import TOKEN_ID, SamplingParams, TokenIds, ToolCall
from tokenbudget.streams.ledger import Outcome, outcome_change
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)

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
    if typing.get_origin(value) is typing.Annotated:  # its bounds (streams/fields.py)
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
_JSON_SAMPLING = tuple(
    f.name for f in _SAMPLING_FIELDS if typing.get_origin(_set_type(f.type)) is dict
)
SAMPLING_TYPE = pa.struct([(f.name, _sampling_arrow_type(f.type)) for f in _SAMPLING_FIELDS])

# The one declaration of a Parquet row's columns, in file order: each is the
# CompletionEvent field of that name, with the Arrow type it is stored as. The
# lean records the sink decodes and the table builder both derive from it, and
# ``_check_columns`` ties it to the event at import, so a field added to the event
# without a column here fails every test. Columns after ``text`` came with
# completion v3, ``stop_reason`` with v4, the reasoning with v5, the tools and the
# conversation's turn with v6; older files lack them and :func:`read_rows` fills
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
            f"tokenbudget.sinks.parquet.COLUMNS and CompletionEvent disagree: "
            f"only in the event {sorted(fields - columns)}, only here {sorted(columns - fields)}"
        )


_check_columns()

TEMPORARY_GLOB = "dataset=*/.part-*.tmp"
# Fetch sizes are every consumer's (tokenbudget.core.sizes: a whole message per partition,
# four per response); measured on the local broker with ~20 KB events, larger fetches
# are slower with kafka-python (it assembles each response in Python), smaller ones
# cost round trips. A larger socket buffer takes a response in fewer reads.
RECEIVE_BUFFER = {"receive_buffer_bytes": 4 * 1024 * 1024}


# --------------------------------------------------------------------------- decoding


_NULL = msgspec.Raw(b"null")


def _record_fields(output_ids: Any) -> list[tuple[str, Any, Any]]:
    """CompletionEvent's fields for a lean record: the ids as their raw bytes (no
    Python int per id), ``input_columns`` as raw JSON (stored as text), the rest as
    the event has them."""
    fields: list[tuple[str, Any, Any]] = [("type", Literal["completion"], msgspec.NODEFAULT)]
    for f in msgspec.structs.fields(ev.CompletionEvent):
        kind = {
            "output_ids": output_ids,
            "prompt_ids": bytes | None,
            "input_columns": msgspec.Raw,  # msgspec takes no Raw | None: "null" is None
        }.get(f.name, f.type)
        default = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
        if f.name == "input_columns":
            default = _NULL
        fields.append((f.name, kind, default))
    return fields


# A completion with its ids as little-endian int32 bytes (v2 and v3).
CompletionRecord: type[Any] = msgspec.defstruct(
    "CompletionRecord", _record_fields(bytes | None), kw_only=True, frozen=True
)
# A v1 completion: ``output_ids`` kept as the raw JSON array, for :func:`keep_first`
# to parse a batch of them at once.
LegacyCompletionRecord: type[Any] = msgspec.defstruct(
    "LegacyCompletionRecord", _record_fields(msgspec.Raw), kw_only=True, frozen=True
)

Record = Any  # CompletionRecord | LegacyCompletionRecord (classes made at run time)

_record_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(CompletionRecord)
_legacy_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(LegacyCompletionRecord)


def decode_completion(value: bytes) -> Record:
    """Decode one completions-topic value, or raise EventDecodeError saying why.

    The lean decoders only take what is certainly valid; anything else goes through
    the full decoder (:func:`tokenbudget.streams.codec.decode`), which says what is wrong.
    """
    record: Record | None
    # Whatever a lean decoder raises (a DecodeError, a RecursionError for a value
    # nested ~1,000 deep), the full decoder below says what it is, as an
    # EventDecodeError: a bad record never ends the sink.
    try:
        record = _record_decoder.decode(value)
        if any(ids is not None and len(ids) % 4 for ids in (record.output_ids, record.prompt_ids)):
            record = None  # not whole int32s
    except Exception:
        try:
            record = _legacy_decoder.decode(value)
            if memoryview(record.output_ids)[:1] != b"[":  # e.g. a string, not base64
                record = None
        except Exception:
            record = None
    if record is not None and record.v in ev.COMPLETION_VERSIONS:
        problem = codec.count_problem(
            record.prompt_tokens,
            record.completion_tokens,
            _id_count(record),
            record.max_new_tokens,
            record.count_source,
        )
        if problem is None:
            return record
    event = codec.decode(value)  # raises the precise EventDecodeError
    if not isinstance(event, ev.CompletionEvent):
        raise EventDecodeError(f"expected a completion, got {type(event).__name__}")
    raise EventDecodeError("not a completion event")  # pragma: no cover - decoders agree


def _id_count(record: Record) -> int | None:
    if isinstance(record, CompletionRecord):
        return None if record.output_ids is None else len(record.output_ids) >> 2
    raw = bytes(record.output_ids)
    inner = raw.strip()[1:-1].strip()
    return raw.count(b",") + 1 if inner else 0


class FirstCompletion:
    """The rule shared by the sink, the replay and the ledger: of the completions of
    one prompt, the first in topic order is kept (all events of a dataset share one
    partition, so "first" is well defined), except a completion of a lease fenced
    before it in that order (:class:`tokenbudget.streams.events.LeaseFenced`): no one keeps that.
    """

    def __init__(self, seen: Iterable[str] = (), fenced: Iterable[str] = ()) -> None:
        self.seen: set[str] = set(seen)
        self.fenced: set[str] = set(fenced)
        self.duplicates = 0
        # prompt -> dataset of answers not kept because their lease was fenced
        self.rejected: dict[str, str] = {}

    def fence(self, lease_id: str) -> None:
        self.fenced.add(lease_id)

    def keep(self, prompt_id: str, lease_id: str = "", dataset: str = "") -> bool:
        if lease_id and lease_id in self.fenced:
            self.rejected.setdefault(prompt_id, dataset)
            return False
        previous: Outcome | None = "completed" if prompt_id in self.seen else None
        if not outcome_change(previous, "completed"):
            self.duplicates += 1
            return False
        self.seen.add(prompt_id)
        return True

    def forget(self, prompt_ids: Iterable[str], duplicates: int) -> None:
        """Undo :meth:`keep` calls (their kept ids, the duplicate count before)."""
        self.seen.difference_update(prompt_ids)
        self.duplicates = duplicates


# ------------------------------------------------------------------------ table building


def _column_arrays(
    rows: Sequence[Record] | Sequence[ev.CompletionEvent], output_ids: pa.Array
) -> list[pa.Array]:
    """The table's columns (:data:`COLUMNS`) for decoded records or events."""
    special = {
        "dataset": _dataset_array,
        "output_ids": lambda _: output_ids,
        "prompt_ids": lambda rows: _ids_from_bytes([_id_bytes(r.prompt_ids) for r in rows]),
        "messages": _messages_array,
        "sampling": _sampling_array,
        "input_columns": _input_columns_array,
        "tools": _tools_array,
        "tool_calls": lambda rows: pa.array([_calls(r.tool_calls) for r in rows], TOOL_CALLS_TYPE),
    }
    return [
        special[name](rows) if name in special else pa.array([getattr(r, name) for r in rows], kind)
        for name, kind in COLUMNS
    ]


def _dataset_array(rows: Sequence[Any]) -> pa.Array:
    names = [r.dataset for r in rows]
    uniques = list(dict.fromkeys(names))
    if len(uniques) == 1:
        indices = np.zeros(len(rows), dtype=np.int32)
    else:
        position = {name: i for i, name in enumerate(uniques)}
        indices = np.fromiter((position[name] for name in names), np.int32, len(rows))
    return pa.DictionaryArray.from_arrays(pa.array(indices), pa.array(uniques, pa.string()))


def _id_bytes(ids: bytes | TokenIds | None) -> bytes | None:
    return ids.tobytes() if isinstance(ids, TokenIds) else ids


def _calls(calls: Sequence[ToolCall] | None) -> list[dict[str, str]] | None:
    if calls is None:
        return None
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]


def _messages_array(rows: Sequence[Any]) -> pa.Array:
    return pa.array(
        [
            None
            if r.messages is None
            else [
                {
                    "role": m.role,
                    "content": m.content,
                    "tool_calls": _calls(m.tool_calls),
                    "tool_call_id": m.tool_call_id,
                    "name": m.name,
                }
                for m in r.messages
            ]
            for r in rows
        ],
        MESSAGES_TYPE,
    )


def _tools_array(rows: Sequence[Any]) -> pa.Array:
    return pa.array(
        [None if r.tools is None else msgspec.json.encode(r.tools).decode() for r in rows],
        pa.string(),
    )


def _sampling_array(rows: Sequence[Any]) -> pa.Array:
    def row(sampling: SamplingParams) -> dict[str, Any]:
        values = msgspec.structs.asdict(sampling)
        for name in _JSON_SAMPLING:
            if values[name] is not None:
                values[name] = msgspec.json.encode(values[name]).decode()
        return values

    return pa.array([row(r.sampling) for r in rows], SAMPLING_TYPE)


def _input_columns_array(rows: Sequence[Any]) -> pa.Array:
    def text(value: Any) -> str | None:
        if value is None or value == _NULL:
            return None
        if isinstance(value, msgspec.Raw):
            return bytes(value).decode()
        return msgspec.json.encode(value).decode()

    return pa.array([text(r.input_columns) for r in rows], pa.string())


def _list_array(
    lengths: np.ndarray, values: np.ndarray | pa.Array, missing: np.ndarray | None = None
) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    mask = pa.array(missing) if missing is not None and missing.any() else None
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=IDS_TYPE, mask=mask)


def _ids_from_bytes(blobs: Sequence[bytes | None]) -> pa.ListArray:
    """The column from each row's little-endian int32 bytes (None: ids unknown, a
    null): one join, no per-id work."""
    n = len(blobs)
    lengths = np.fromiter((len(b) >> 2 if b is not None else 0 for b in blobs), np.int64, n)
    missing = np.fromiter((b is None for b in blobs), np.bool_, n)
    joined = b"".join(b for b in blobs if b is not None)
    values = np.frombuffer(joined, TOKEN_ID).astype(np.int32, copy=False)
    return _list_array(lengths, values, missing)


_CSV_READ = pcsv.ReadOptions(column_names=["v"], block_size=1 << 20)  # measured best
_CSV_PARSE = pcsv.ParseOptions(quote_char=False, double_quote=False, escape_char=False)
_CSV_CONVERT = pcsv.ConvertOptions(
    column_types={"v": pa.int32()}, null_values=[], strings_can_be_null=False
)
# "[", "]" and "," become line breaks: one id per line, empty lines skipped
_TO_LINES = bytes.maketrans(b"[],", b"\n\n\n")


def _ids_from_raw(raws: Sequence[msgspec.Raw]) -> pa.ListArray | None:
    """Parse every event's raw ``[1,2,...]`` in one go, or None when the batch is
    not flat arrays of int32 (the caller then decodes event by event).

    msgspec has checked each raw value is valid JSON; Arrow's int32 conversion
    rejects strings, floats, ``true``/``false``/``null``, objects and out-of-range
    ints; nesting is caught by the bracket count and the per-event id counts.
    """
    n = len(raws)
    if n == 0:
        return _list_array(np.zeros(0, np.int64), np.empty(0, np.int32))
    joined = b"\n".join(raws)  # type: ignore[arg-type]  # Raw is a buffer
    if joined.count(b"[") != n:
        return None
    count = joined.count
    lengths = np.empty(n, dtype=np.int64)
    start = 0
    for i, raw in enumerate(raws):
        end = start + len(raw)
        if joined[start] != 0x5B or joined[end - 1] != 0x5D:  # "[", "]"
            return None
        # n ids have n - 1 commas; "[]" has none
        lengths[i] = count(b",", start, end) + (end - start > 2)
        start = end + 1
    try:
        column = pcsv.read_csv(
            io.BytesIO(joined.translate(_TO_LINES)),
            read_options=_CSV_READ,
            parse_options=_CSV_PARSE,
            convert_options=_CSV_CONVERT,
        ).column(0)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    if len(column) != int(lengths.sum()) or column.null_count:
        return None
    if column.num_chunks == 0:
        values: pa.Array = pa.array([], pa.int32())
    elif column.num_chunks == 1:
        values = column.chunk(0)
    else:
        values = column.combine_chunks()
    return _list_array(lengths, values)


def _ids_of_records(rows: Sequence[Record]) -> pa.ListArray | None:
    """The ``output_ids`` column of decoded records, or None when v1 ids among them
    are not flat int32 arrays (the caller then decodes event by event)."""
    binary = [r.output_ids for r in rows if isinstance(r, CompletionRecord)]
    if len(binary) == len(rows):  # every completion written since v2
        return _ids_from_bytes(binary)
    legacy = [r.output_ids for r in rows if isinstance(r, LegacyCompletionRecord)]
    parsed = _ids_from_raw(legacy)
    if parsed is None or len(legacy) == len(rows):
        return parsed
    # v1 and v2 in one batch (the topic around an upgrade): take each row's ids
    values = parsed.values.to_numpy(zero_copy_only=False)
    offsets = parsed.offsets.to_numpy()
    blobs, j = [], 0
    for r in rows:
        if isinstance(r, CompletionRecord):
            blobs.append(r.output_ids)
        else:
            blobs.append(values[offsets[j] : offsets[j + 1]].astype(TOKEN_ID).tobytes())
            j += 1
    return _ids_from_bytes(blobs)


@dataclass
class Decoded:
    """A batch of completions-topic values (one partition's, in order), decoded."""

    values: Sequence[bytes]
    records: list[Record]
    positions: list[int]  # index in ``values`` of each record
    errors: list[tuple[int, str]]  # (index in ``values``, reason)
    fences: list[tuple[int, ev.LeaseFenced]] = field(default_factory=list)  # (index, fence)


def decode_records(values: Sequence[bytes]) -> Decoded:
    """Step 1 (holds the GIL): every value decoded, ids left as bytes (v2) or raw
    JSON (v1); the ledger's lease fences picked out."""
    records: list[Record] = []
    positions: list[int] = []
    errors: list[tuple[int, str]] = []
    fences: list[tuple[int, ev.LeaseFenced]] = []
    for i, value in enumerate(values):
        try:
            records.append(decode_completion(value))
            positions.append(i)
        except EventDecodeError as exc:
            fence = _as_fence(value)
            if fence is not None:
                fences.append((i, fence))
            else:
                errors.append((i, str(exc)))
    return Decoded(values, records, positions, errors, fences)


def _as_fence(value: bytes) -> ev.LeaseFenced | None:
    try:
        event = codec.decode(value)
    except EventDecodeError:
        return None
    return event if isinstance(event, ev.LeaseFenced) else None


@dataclass
class Kept:
    """The first completions of a batch: one table per dataset, in topic order."""

    tables: dict[str, pa.Table]
    records: dict[str, list[Record]]  # the rows of each table
    positions: dict[str, list[int]]  # index in the input values of each row
    errors: list[tuple[int, str]]  # undecodable values (index, reason)

    @property
    def rows(self) -> int:
        return sum(len(r) for r in self.records.values())


def _full_ids(value: bytes) -> bytes | None:
    event = codec.decode(value)
    if not isinstance(event, ev.CompletionEvent):  # pragma: no cover - lean decoder agrees
        raise EventDecodeError(f"expected a completion, got {type(event).__name__}")
    return _id_bytes(event.output_ids)


def keep_first(decoded: Decoded, first: FirstCompletion) -> Kept:
    """Step 2: apply the first-completion rule and build each dataset's table.

    The ids of a dataset's kept rows are joined (v2) or parsed (v1) in one go; if
    v1 ids fail to parse (not flat int32 arrays), the rule is undone for the group
    and its values are decoded one by one, so only the bad ones are dropped (as
    errors) and the rule sees exactly the valid completions, as the ledger does.
    """
    if decoded.fences:
        return _keep_first_fenced(decoded, first)
    groups: dict[str, list[int]] = {}
    for i, record in enumerate(decoded.records):
        groups.setdefault(record.dataset, []).append(i)
    errors = list(decoded.errors)
    out = Kept({}, {}, {}, errors)
    for dataset, group in groups.items():
        duplicates = first.duplicates
        chosen = [i for i in group if _keep(first, decoded.records[i])]
        rows = [decoded.records[i] for i in chosen]
        positions = [decoded.positions[i] for i in chosen]
        ids = _ids_of_records(rows) if rows else None
        if ids is None and rows:
            first.forget((r.prompt_id for r in rows), duplicates)
            rows, positions, blobs = [], [], []
            for i in group:
                record, position = decoded.records[i], decoded.positions[i]
                try:
                    ids_i = _full_ids(decoded.values[position])
                except EventDecodeError as exc:
                    errors.append((position, str(exc)))
                    continue
                if _keep(first, record):
                    rows.append(record)
                    positions.append(position)
                    blobs.append(ids_i)
            ids = _ids_from_bytes(blobs)
        if not rows or ids is None:
            continue
        out.tables[dataset] = pa.Table.from_arrays(_column_arrays(rows, ids), schema=SCHEMA)
        out.records[dataset] = rows
        out.positions[dataset] = positions
    errors.sort()
    return out


def _keep(first: FirstCompletion, record: Record) -> bool:
    return first.keep(record.prompt_id, record.lease_id, record.dataset)


def _keep_first_fenced(decoded: Decoded, first: FirstCompletion) -> Kept:
    """:func:`keep_first` for a batch with fences in it: the batch is cut at each
    fence, so the fence applies to exactly the completions after it (rare: a fence
    is written only when a lease's holder is gone or released with answers due)."""
    out = Kept({}, {}, {}, list(decoded.errors))
    start = 0
    cuts = [*decoded.fences, (len(decoded.values), None)]
    for index, fence in cuts:
        chosen = [
            (record, position)
            for record, position in zip(decoded.records, decoded.positions, strict=True)
            if start <= position < index
        ]
        part = Decoded(decoded.values, [r for r, _ in chosen], [p for _, p in chosen], [], [])
        kept = keep_first(part, first)
        out.errors.extend(kept.errors)
        for dataset, table in kept.tables.items():
            if dataset in out.tables:
                out.tables[dataset] = pa.concat_tables([out.tables[dataset], table])
            else:
                out.tables[dataset] = table
            out.records.setdefault(dataset, []).extend(kept.records[dataset])
            out.positions.setdefault(dataset, []).extend(kept.positions[dataset])
        if fence is not None:
            first.fence(fence.lease_id)
        start = index + 1
    out.errors.sort()
    return out


# ----------------------------------------------------------------------------- files


def dataset_dir(root: Path, dataset: str) -> Path:
    return root / f"dataset={dataset}"


def existing_prompt_ids(root: Path) -> set[str]:
    """prompt_ids already written by earlier runs (only renamed, complete files)."""
    seen: set[str] = set()
    for file in output_files(root):
        column = pq.read_table(file, columns=["prompt_id"]).column("prompt_id")
        seen.update(column.to_pylist())
    return seen


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


def output_files(root: Path, dataset: str | None = None) -> list[Path]:
    """The sink's complete files (renamed, not temporaries), in a stable order."""
    pattern = f"{dataset_dir(root, dataset).name}/*.parquet" if dataset else "dataset=*/*.parquet"
    return [f for f in sorted(root.glob(pattern)) if not f.name.startswith(".")]


def read_rows(root: Path, dataset: str | None = None) -> pa.Table:
    """Every row the sink wrote under ``root`` (of one dataset, or all), whatever
    version wrote each file, as one table in :data:`SCHEMA`."""
    tables = [conform(pq.read_table(file)) for file in output_files(root, dataset)]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def stored_prompt_ids(config: Config) -> Callable[[], set[str]]:
    """What a new run of ``config`` finds already written under its sink path (for
    the prompt producer, which skips those prompts)."""
    return functools.partial(existing_prompt_ids, config.sink_path)


# Leases fenced so far, kept beside the files: a sink restarted past a fence's offset
# must still refuse what a fenced lease's holder publishes later.
FENCED_LEASES = ".tokenbudget-fenced-leases"


def load_fenced_leases(root: Path) -> set[str]:
    try:
        return set((root / FENCED_LEASES).read_text().split())
    except FileNotFoundError:
        return set()


def save_fenced_leases(root: Path, fenced: set[str]) -> None:
    """Replaced whole and durably, like the Parquet files."""
    text = "".join(f"{lease}\n" for lease in sorted(fenced))
    with atomic_file(root / FENCED_LEASES, temporary=root / f"{FENCED_LEASES}.tmp") as handle:
        handle.write(text)


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Delete the hidden temporaries a crashed writer left behind (one writer per
    folder), so no reader ever sees them."""
    removed = []
    for file in root.glob(TEMPORARY_GLOB):
        file.unlink(missing_ok=True)
        removed.append(file)
    return removed


def row_group_size(table: pa.Table, row_group_rows: int, row_group_bytes: int) -> int:
    """Rows per row group: at most ``row_group_rows`` and about ``row_group_bytes``."""
    if table.num_rows == 0:
        return max(1, row_group_rows)
    per_row = max(1, table.nbytes // table.num_rows)
    return max(1, min(row_group_rows, row_group_bytes // per_row))


def write_parquet(table: pa.Table, where: Any, row_group_rows: int) -> None:
    """The one place that sets the writer's options (the bench's ceiling uses it too)."""
    pq.write_table(table, where, row_group_size=row_group_rows, compression="zstd")


def write_atomically(table: pa.Table, folder: Path, row_group_rows: int) -> Path:
    name = f"part-{time.time_ns()}-{uuid.uuid4().hex[:8]}.parquet"
    final = folder / name
    # Named so remove_stale_temporaries finds what a crash leaves.
    with atomic_file(final, binary=True, temporary=folder / f".{name}.tmp") as handle:
        write_parquet(table, handle, row_group_rows)
    return final


class _Stopped(Exception):
    """The sink was stopped while it waited for Kafka."""


@dataclass
class _Buffer:
    tables: list[pa.Table] = field(default_factory=list)
    rows: int = 0


@dataclass(frozen=True)
class WriterSettings:
    rotate_rows: int = 2000
    rotate_bytes: int = 64 * 1024 * 1024
    row_group_rows: int = 1000
    row_group_bytes: int = 32 * 1024 * 1024


class PartitionedWriter:
    """Buffers kept rows per dataset; ``flush`` writes them out.

    A flush is due when the buffered rows or bytes (of all datasets) reach the
    rotation limits (:meth:`full`); it writes each dataset's rows into files of at
    most ``rotate_rows`` rows and about ``rotate_bytes`` bytes, with row groups
    sized explicitly (:func:`row_group_size`).
    """

    def __init__(self, root: Path, settings: WriterSettings) -> None:
        self.root = root
        self.settings = settings
        self.buffers: dict[str, _Buffer] = {}
        self.rows = 0
        self.bytes = 0
        self.rows_written: dict[str, int] = {}
        self.files: list[Path] = []

    def add(self, tables: dict[str, pa.Table]) -> None:
        for dataset, table in tables.items():
            buffer = self.buffers.get(dataset)
            if buffer is None:
                buffer = self.buffers[dataset] = _Buffer()
            buffer.tables.append(table)
            buffer.rows += table.num_rows
            self.rows += table.num_rows
            self.bytes += table.nbytes

    def full(self) -> bool:
        return self.rows >= self.settings.rotate_rows or self.bytes >= self.settings.rotate_bytes

    def take(self) -> dict[str, _Buffer]:
        """Hand over the buffers (to write, maybe in another thread); start empty."""
        buffers, self.buffers = self.buffers, {}
        self.rows = self.bytes = 0
        return buffers

    def write(self, buffers: dict[str, _Buffer]) -> list[Path]:
        written = []
        for dataset, buffer in buffers.items():
            if not buffer.rows:
                continue
            table = pa.concat_tables(buffer.tables)
            group = row_group_size(
                table, self.settings.row_group_rows, self.settings.row_group_bytes
            )
            # a file holds at most rotate_rows rows and about rotate_bytes bytes
            per_file = row_group_size(table, self.settings.rotate_rows, self.settings.rotate_bytes)
            for offset in range(0, table.num_rows, per_file):
                part = table.slice(offset, per_file)
                path = write_atomically(part, dataset_dir(self.root, dataset), group)
                metrics.PARQUET_ROWS.labels(dataset=dataset).inc(part.num_rows)
                metrics.PARQUET_BYTES.labels(dataset=dataset).inc(path.stat().st_size)
                written.append(path)
            self.rows_written[dataset] = self.rows_written.get(dataset, 0) + buffer.rows
        self.files.extend(written)
        return written

    def flush(self) -> list[Path]:
        return self.write(self.take())


# ------------------------------------------------------------------------------ sink


@dataclass(frozen=True)
class SinkSettings:
    path: Path
    rotate_rows: int = 2000
    rotate_bytes: int = 64 * 1024 * 1024
    row_group_rows: int = 1000
    flush_interval: float = 5.0
    row_group_bytes: int = 32 * 1024 * 1024
    compression: sizes.Compression = sizes.DEFAULT_COMPRESSION  # of its dead letters
    # The job's datasets: a completion of another is dead-lettered (None: any name
    # that passes the event's rule, for tools that read a topic without a config).
    datasets: frozenset[str] | None = None

    @classmethod
    def from_config(cls, config: Config) -> SinkSettings:
        return cls(
            path=config.sink_path,
            rotate_rows=config.sink.rotate_rows,
            rotate_bytes=config.sink.rotate_bytes,
            row_group_rows=config.sink.row_group_rows,
            flush_interval=config.sink.flush_interval_s,
            compression=config.kafka.compression,
            # a config of the sink alone may name none: then any name is taken
            datasets=frozenset(d.name for d in config.datasets) or None,
        )

    def writer(self) -> WriterSettings:
        return WriterSettings(
            rotate_rows=self.rotate_rows,
            rotate_bytes=self.rotate_bytes,
            row_group_rows=self.row_group_rows,
            row_group_bytes=self.row_group_bytes,
        )


class ParquetSink:
    """Consumes the completions topic into Parquet; see the module docstring."""

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        settings: SinkSettings,
        *,
        group_id: str | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.settings = settings
        self._group_id = group_id
        remove_stale_temporaries(settings.path)
        self.first = FirstCompletion(
            existing_prompt_ids(settings.path), load_fenced_leases(settings.path)
        )
        self._fences_saved = len(self.first.fenced)
        self.writer = PartitionedWriter(settings.path, settings.writer())
        self._last_flush = time.monotonic()
        self._consumer: KafkaConsumer | None = None
        self._dlq: KafkaProducer | None = None
        # The records it was last taking (topic, partition, first and last offset),
        # for the line a stopped sink ends with.
        self.at: tuple[str, int, int, int] | None = None
        # pyarrow imports pandas (when installed) at its first array conversion: up
        # to a second on a loaded box. Pay it here, before `run` starts dispatching,
        # not in the first batch, where it holds the GIL the dispatcher shares.
        pa.array([0])

    @property
    def group_id(self) -> str:
        return self._group_id or self.topics.sink_group

    @property
    def rows_written(self) -> dict[str, int]:
        return self.writer.rows_written

    @property
    def duplicates_dropped(self) -> int:
        return self.first.duplicates

    def start(self) -> None:
        self._consumer = KafkaConsumer(
            **kafka_python_options(consumer_options(self.bootstrap)),
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # a restarted sink gets the partitions of its crashed self back this fast
            session_timeout_ms=10_000,
            heartbeat_interval_ms=3_000,
            **RECEIVE_BUFFER,
        )
        # Join the group only once this client's metadata has the topic: a group
        # joined without it is assigned nothing and kafka-python does not rejoin
        # until its metadata ages out (minutes).
        wait_for_partitions(self._consumer, self.topics.completions, timeout=30)
        self._consumer.subscribe([self.topics.completions])
        self._dlq = KafkaProducer(
            **kafka_python_producer_options(self.bootstrap, self.settings.compression)
        )

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close(autocommit=False)
            self._consumer = None
        if self._dlq is not None:
            self._dlq.close()
            self._dlq = None

    def poll_once(self, timeout_ms: int = 200) -> int:
        assert self._consumer is not None and self._dlq is not None, "start() first"
        batches = self._consumer.poll(timeout_ms=timeout_ms, max_records=2000)
        count = 0
        for records in batches.values():
            count += len(records)
            self._take(records)
        if (
            self.writer.full()
            or time.monotonic() - self._last_flush >= self.settings.flush_interval
        ):
            self.flush()
        return count

    def _take(self, records: Sequence[Any]) -> None:
        """Decode one partition's records; dead-letter the bad ones, buffer the first
        completion of each prompt.

        Any record is input: one that the batch's table building raises on (whatever
        it raises) is found by taking the batch again record by record, and is
        dead-lettered with what it raised; the others are kept as usual. Its offset
        is committed with the batch's, so a rerun does not meet it again."""
        self.at = (records[0].topic, records[0].partition, records[0].offset, records[-1].offset)
        decoded = decode_records([record.value for record in records])
        self._refuse_other_datasets(decoded)
        pids = [r.prompt_id for r in decoded.records]
        new = [p for p in pids if p not in self.first.seen]
        duplicates, fenced = self.first.duplicates, set(self.first.fenced)
        try:
            kept = keep_first(decoded, self.first)
        except Exception:
            self.first.forget(new, duplicates)
            self.first.fenced = fenced
            for record in records:
                self._take_one(record)
            return
        self._keep(records, kept)

    def _take_one(self, record: Any) -> None:
        decoded = decode_records([record.value])
        self._refuse_other_datasets(decoded)
        new = [r.prompt_id for r in decoded.records if r.prompt_id not in self.first.seen]
        duplicates = self.first.duplicates
        try:
            kept = keep_first(decoded, self.first)
        except Exception as exc:
            self.first.forget(new, duplicates)
            self._dead_letter(record, f"cannot be kept: {type(exc).__name__}: {exc}")
            return
        self._keep([record], kept)

    def _keep(self, records: Sequence[Any], kept: Kept) -> None:
        for i, reason in kept.errors:
            self._dead_letter(records[i], reason)
        if kept.tables:
            self.writer.add(kept.tables)

    def _refuse_other_datasets(self, decoded: Decoded) -> None:
        """Completions of datasets that are not the job's (``settings.datasets``) are
        bad records: their folder would be the writer's choice, not the job's."""
        allowed = self.settings.datasets
        if allowed is None:
            return
        keep = [i for i, r in enumerate(decoded.records) if r.dataset in allowed]
        if len(keep) == len(decoded.records):
            return
        for i, record in enumerate(decoded.records):
            if record.dataset not in allowed:
                decoded.errors.append(
                    (decoded.positions[i], f"dataset {record.dataset!r} is not one of this job's")
                )
        decoded.records = [decoded.records[i] for i in keep]
        decoded.positions = [decoded.positions[i] for i in keep]
        decoded.errors.sort()

    def _dead_letter(self, record: Any, reason: str) -> None:
        assert self._dlq is not None
        letter = dead_letter_for(reason, record)
        key = letter.key.encode() if letter.key is not None else None  # cut, as the letter's
        self._dlq.send(self.topics.dead_letter, key=key, value=codec.encode(letter))
        self._dlq.flush()
        metrics.DEAD_LETTERED.labels(topic="completions").inc()
        log.warning(
            "sink: dead-lettered %s[%d]@%d: %s",
            record.topic,
            record.partition,
            record.offset,
            reason,
        )

    def where(self) -> str:
        """The records it was last taking, as a line says them."""
        if self.at is None:
            return "before its first record"
        topic, partition, first, last = self.at
        offsets = str(first) if first == last else f"{first}..{last}"
        return f"at {topic}[{partition}]@{offsets}"

    def flush(self) -> None:
        """Write every buffer to its file, then commit what was read."""
        assert self._consumer is not None
        self.writer.flush()
        if len(self.first.fenced) != self._fences_saved:
            save_fenced_leases(self.settings.path, self.first.fenced)
            self._fences_saved = len(self.first.fenced)
        offsets = {
            tp: OffsetAndMetadata(self._consumer.position(tp), "", -1)
            for tp in self._consumer.assignment()
        }
        if offsets:
            try:
                self._consumer.commit(offsets)
            except KafkaError as exc:
                # A rebalance, or the broker out of reach (restarting): the files are
                # durable; the rows after the last commit will be read again (here or
                # by the partition's next owner) and dropped by prompt_id, so skipping
                # this commit loses and duplicates nothing. A rebalance is expected
                # (a rerun's members coming back): not worth a warning.
                level = logging.DEBUG if expected_kafka_error(exc) else logging.WARNING
                log.log(level, "sink: offsets not committed (%s); they will be re-read", exc)
        self._last_flush = time.monotonic()

    def caught_up(self) -> bool:
        """Whether everything on the topic as of now has been read."""
        assert self._consumer is not None
        assignment = self._consumer.assignment()
        if not assignment:
            return False
        ends = self._consumer.end_offsets(list(assignment))
        return all(self._consumer.position(tp) >= end for tp, end in ends.items())

    def run(self, stop: threading.Event, *, drain: bool = True) -> None:
        """Consume until ``stop`` is set, then (with ``drain``) read to the end of the
        topic; flush and commit. A broker that does not answer at start (restarting,
        say) is waited for."""

        def wait(seconds: float) -> None:
            if stop.wait(seconds):
                raise _Stopped

        try:
            retry_until(
                self.start,
                timeout=None,
                retry_on=KafkaError,
                interval=2.0,
                on_retry=lambda exc: log.warning(
                    "sink: Kafka does not answer (%r); trying again", exc
                ),
                sleep=wait,
            )
        except _Stopped:
            return
        try:
            while not stop.is_set():
                self.poll_once()
            deadline = time.monotonic() + 60
            while drain and time.monotonic() < deadline:
                self.poll_once(timeout_ms=100)
                if self.caught_up():
                    break
            self.flush()
        finally:
            self.close()
