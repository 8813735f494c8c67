"""Completions into rows: the decoding of a completions-topic value, the
first-completion rule, and the building of each dataset's table (:data:`SCHEMA`).

Shared by every sink (:mod:`tokenbudget.sinks.base`), the replay
(:mod:`tokenbudget.sinks.replay`) and whoever reads the topic to know what the sink
keeps, so a replay of the topic gives the same rows as the live sink, whatever
duplicates the topic holds.

Speed: no Python object is made per token id. A completion (v2) carries its
``output_ids`` as little-endian int32 bytes (base64 in the JSON, decoded by msgspec
in C, :class:`CompletionRecord`); a batch's id bytes are joined into the int32
values buffer of the ``list<int32>`` column. Older completions (v1, ids as JSON
numbers, :class:`LegacyCompletionRecord`) keep their ids as raw JSON, parsed per
batch by Arrow's CSV reader. A batch whose v1 ids do not parse cleanly that way is
decoded event by event with the full decoder instead, with the same result.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from tokenbudget.core.errors import EventDecodeError
from tokenbudget.sinks.schema import (
    COLUMNS,
    IDS_TYPE,
    JSON_SAMPLING,
    MESSAGES_TYPE,
    SAMPLING_TYPE,
    SCHEMA,
    TOOL_CALLS_TYPE,
)
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import TOKEN_ID, SamplingParams, TokenIds, ToolCall
from tokenbudget.streams.ledger import Outcome, outcome_change

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
    the full decoder (:func:`tokenbudget.streams.events.decode`), which says what is wrong.
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
        for name in JSON_SAMPLING:
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
