"""A dataset's file, read row by row, one reader per file type: JSONL (``.jsonl``,
``.json``, ``.ndjson``), Parquet (``.parquet``, ``.pq``) and a Hugging Face dataset
saved with ``save_to_disk`` (a folder, read with ``datasets.load_from_disk``); each
yields ``(line, row)``.

A row the readers refuse before any rule sees it is a bad row: a JSONL line over
:data:`ROW_BYTES` (found by its length: never held whole), one nested deeper than
:data:`~tokenbudget.producers.prompts.rows.MAX_ROW_DEPTH`, and any row whose parsing or
conversion raised (a 5,000-digit number, a Parquet date past the year 9999): whatever
went wrong, only that row is lost.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow.parquet as pq

from tokenbudget.core import sizes
from tokenbudget.core.errors import DatasetError
from tokenbudget.core.extras import require
from tokenbudget.core.formats import DEFAULT_FORMAT, FORMAT_TRAITS, DatasetFormat
from tokenbudget.producers.prompts.rows import MAX_ROW_DEPTH, TOO_DEEP, deeper_than


class DatasetReader(ABC):
    """Yields ``(line, row)`` pairs or raises DatasetError for rows it cannot parse.

    Row-level errors are yielded as DatasetError instances so the caller decides
    whether one bad row stops the run.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def name(self) -> str:
        return str(self.path)

    @abstractmethod
    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]: ...


# A JSONL line longer than this is a bad row found by its length, never parsed: what
# a row gives its prompt event (prompt, id, kept columns, tools) takes at most
# PROMPT_EVENT_BYTES once the event is encoded, and a file may write each of those
# bytes as a JSON escape of up to six ("\u0041" for "A"), so a longer line cannot
# give an event that fits unless most of it is fields the job never reads (drop those).
ROW_BYTES = 6 * sizes.PROMPT_EVENT_BYTES
# What a line is read in, so that one over ROW_BYTES is never held whole.
_PIECE_BYTES = 1024 * 1024


class JsonlReader(DatasetReader):
    """Lines are read in bounded pieces: one over :data:`ROW_BYTES` is a bad row
    and its remainder is passed over unread into memory; a line that cannot be
    parsed, or nests deeper than :data:`MAX_ROW_DEPTH`, is a bad row, whatever the
    parser raised."""

    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]:
        try:
            handle = self.path.open("rb")
        except OSError as exc:
            raise DatasetError(str(self.path), f"cannot open: {exc.strerror}") from exc
        with handle:
            number = 0
            while line := _bounded_line(handle):
                number += 1
                if len(line) - line.endswith(b"\n") > ROW_BYTES:
                    yield number, self._too_long(line, handle, number)
                elif line.strip():
                    yield number, self._parsed(line, number)

    def _parsed(self, raw: bytearray, number: int) -> Any | DatasetError:
        try:
            row = json.loads(raw)
        except RecursionError:
            message = TOO_DEEP
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, 5,000-digit ints
            message = f"not valid JSON: {exc}"
        except Exception as exc:  # MemoryError and the like: still this row's problem
            message = f"cannot be parsed: {type(exc).__name__}: {exc}"
        else:
            if not (_may_nest(raw) and deeper_than(row, MAX_ROW_DEPTH)):
                return row
            message = TOO_DEEP
        text = raw.decode("utf-8", "replace").rstrip("\n")
        return DatasetError(
            str(self.path), message, line=number, excerpt=sizes.excerpt(text), size=len(raw)
        )

    def _too_long(self, head: bytearray, handle: BinaryIO, number: int) -> DatasetError:
        """The bad row of a line over :data:`ROW_BYTES` (``head``: what was read of
        it), its remainder read past and dropped piece by piece."""
        size = len(head)
        while not head.endswith(b"\n") and (piece := handle.readline(_PIECE_BYTES)):
            size += len(piece)
            if piece.endswith(b"\n"):
                break
        shown = head[: sizes.EXCERPT_CHARS].decode("utf-8", "ignore")
        return DatasetError(
            str(self.path),
            f"the line is {size:,} bytes, over the {ROW_BYTES:,} a row may take (six times "
            f"the {sizes.PROMPT_EVENT_BYTES:,} of its prompt event); split the row, or drop "
            "the fields the job does not read",
            line=number,
            excerpt=f"{shown}... (the rest of its {size:,} bytes not read)",
            size=size,
        )


def _bounded_line(handle: BinaryIO) -> bytearray:
    """The next line, or as much of it as goes past :data:`ROW_BYTES` (empty at the
    end of the file), read in pieces so that no more is ever held."""
    line = bytearray()
    while len(line) <= ROW_BYTES and (piece := handle.readline(_PIECE_BYTES)):
        line += piece
        if line.endswith(b"\n"):
            break
    return line


def _may_nest(raw: bytearray) -> bool:
    """Whether a line holds enough brackets to nest past :data:`MAX_ROW_DEPTH` (the
    common row does not, and is not walked)."""
    return raw.count(b"[") + raw.count(b"{") > MAX_ROW_DEPTH


def _batch_rows(
    name: str,
    before: int,
    count: int,
    whole: Callable[[], list[Any]],
    one: Callable[[int], Any],
) -> Iterator[tuple[int, Any | DatasetError]]:
    """The rows of a batch of a table (rows ``before + 1`` on), converted to Python
    at once, or one by one when that fails (``one(i)``: its row ``i``), so that a
    value Python cannot hold (a date past the year 9999) is a bad row with its
    number, not the end of the reader."""
    try:
        rows: list[Any] | None = whole()
    except Exception:
        rows = None
    if rows is not None and len(rows) != count:
        rows = None
    for i in range(count):
        number = before + i + 1
        if rows is not None:
            yield number, rows[i]
            continue
        try:
            row = one(i)
        except Exception as exc:
            row = as_row_error(exc, name, number)
        yield number, row


def _row_of(batch: Any) -> Callable[[int], Any]:
    """Row ``i`` of a record batch, converted alone."""

    def one(i: int) -> Any:
        return batch.slice(i, 1).to_pylist()[0]

    return one


class ParquetReader(DatasetReader):
    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]:
        try:
            parquet = pq.ParquetFile(self.path)
        except Exception as exc:  # OSError, ArrowInvalid, a schema nested too deep
            raise DatasetError(str(self.path), f"cannot read as Parquet: {exc}") from exc
        number = 0
        batches = parquet.iter_batches(batch_size=1024)
        while True:
            try:
                batch = next(batches, None)
            except (OSError, ValueError) as exc:  # a corrupt page: the rest is unreadable
                raise DatasetError(
                    str(self.path), f"cannot read past row {number:,}: {exc}"
                ) from exc
            if batch is None:
                return
            yield from _batch_rows(
                self.name, number, batch.num_rows, batch.to_pylist, _row_of(batch)
            )
            number += batch.num_rows


class SplitError(DatasetError):
    """A saved Hugging Face dataset has no such split, or needs one chosen."""


# Rows of a saved Hugging Face dataset converted at once.
_HF_BATCH = 1024


class HFDiskReader(DatasetReader):
    """A dataset saved with ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.

    Rows are numbered from 1; a ``DatasetDict`` needs ``split`` unless it has only
    one split or a ``train`` split.
    """

    def __init__(self, path: Path, split: str = "") -> None:
        super().__init__(path)
        self.split = split

    @property
    def name(self) -> str:
        return f"{self.path}[{self.split}]" if self.split else str(self.path)

    def _load(self) -> Any:
        if not self.path.is_dir():
            raise DatasetError(str(self.path), "a Hugging Face dataset on disk is a folder")
        datasets = require("datasets", f"{self.path}: format 'hf'")
        try:
            loaded = datasets.load_from_disk(str(self.path))
        except Exception as exc:  # OSError, ValueError, RecursionError of a deep schema
            raise DatasetError(
                str(self.path), f"cannot load with datasets.load_from_disk: {exc}"
            ) from exc
        if isinstance(loaded, datasets.DatasetDict):
            splits = list(loaded)
            split = self.split or ("train" if "train" in loaded else "")
            if not split and len(splits) == 1:
                split = splits[0]
            if split not in loaded:
                raise SplitError(
                    str(self.path),
                    f"choose a split with 'split' (this dataset has {', '.join(splits)})"
                    if not self.split
                    else f"no split {self.split!r} (this dataset has {', '.join(splits)})",
                )
            self.split = split
            return loaded[split]
        if self.split:
            raise SplitError(str(self.path), f"a single Dataset has no split {self.split!r}")
        return loaded

    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]:
        dataset = self._load()
        for start in range(0, len(dataset), _HF_BATCH):
            count = min(_HF_BATCH, len(dataset) - start)
            yield from _batch_rows(self.name, start, count, *_hf_batch(dataset, start, count))


def _hf_batch(
    dataset: Any, start: int, count: int
) -> tuple[Callable[[], list[Any]], Callable[[int], Any]]:
    """The rows ``start``.. of a Hugging Face dataset, all at once and one at a time."""

    def whole() -> list[Any]:
        columns = dataset[start : start + count]
        return [
            dict(zip(columns, values, strict=True))
            for values in zip(*columns.values(), strict=True)
        ]

    def one(i: int) -> Any:
        return dataset[start + i]

    return whole, one


def _is_hf_folder(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def as_row_error(exc: Exception, name: str, line: int) -> DatasetError:
    if isinstance(exc, DatasetError):
        return exc
    return DatasetError(name, f"cannot be read: {type(exc).__name__}: {exc}", line=line)


def reader_for(
    path: Path, format: DatasetFormat = DEFAULT_FORMAT, split: str = ""
) -> DatasetReader:
    folder = FORMAT_TRAITS[format].folder
    if folder or (folder is None and _is_hf_folder(path)):
        return HFDiskReader(path, split)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return JsonlReader(path)
    if suffix in (".parquet", ".pq"):
        return ParquetReader(path)
    if path.is_dir():
        raise DatasetError(
            str(path), "a folder is read only as a saved Hugging Face dataset (format 'hf')"
        )
    raise DatasetError(str(path), f"{_unknown_type(path)}; {SUPPORTED}")


SUPPORTED = (
    "tokenbudget reads JSON lines (.jsonl, .json, .ndjson), Parquet (.parquet, .pq) "
    'and a folder saved by Hugging Face datasets\' save_to_disk (format = "hf")'
)


def _unknown_type(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return (
            "CSV is not read (its values have no types); convert it, e.g. python -c "
            '"import pyarrow.csv as c, pyarrow.parquet as p; '
            f"p.write_table(c.read_csv('{path.name}'), '{path.stem}.parquet')\""
        )
    return f"unknown file type {suffix!r}" if suffix else "a file without a suffix"
