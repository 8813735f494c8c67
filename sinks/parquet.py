"""The Parquet sink: completions in, training-ready files out, exactly once.

Layout: ``<path>/dataset=<name>/part-<time>-<id>.parquet``, one row per prompt. The
``dataset`` column is stored as ``dictionary<int32, string>``, the type pyarrow
infers for a hive folder, so ``pq.read_table(path)``, polars, DuckDB and Hugging
Face ``datasets`` read the whole tree as one table (docs/output.md).

:class:`ParquetSink` is an implementation of the sink seam
(:class:`tokenbudget.sinks.base.CompletionSink`, which consumes, keeps the first
completion of each prompt, dead-letters and commits only what is written). What
it adds:
  * A file appears whole or not at all: written under a hidden temporary name in
    the same folder, fsynced, then renamed and the folder fsynced
    (:func:`tokenbudget.core.files.atomic_file`). Temporaries left by a crash are removed
    at start.
  * What earlier runs kept is read back at start: the ``prompt_id`` of every file
    on disk and the fenced leases saved beside them seed the first-completion rule,
    so no ``request_id`` or ``prompt_id`` appears twice.

The files and their writer are shared with ``tokenbudget replay``
(:mod:`tokenbudget.sinks.replay`), so a replay of the topic gives the same files as the
live sink.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokenbudget.core import metrics, sizes
from tokenbudget.core.config import Config
from tokenbudget.core.files import atomic_file
from tokenbudget.sinks.base import CompletionSink
from tokenbudget.sinks.rows import FirstCompletion
from tokenbudget.sinks.schema import SCHEMA, conform
from tokenbudget.streams.topics import Topics

TEMPORARY_GLOB = "dataset=*/.part-*.tmp"


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
    datasets: frozenset[str] | None = None  # the job's (CompletionSink.datasets)

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


class ParquetSink(CompletionSink):
    """Consumes the completions topic into Parquet; see the module docstring."""

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        settings: SinkSettings,
        *,
        group_id: str | None = None,
    ) -> None:
        self.settings = settings
        remove_stale_temporaries(settings.path)
        first = FirstCompletion(
            existing_prompt_ids(settings.path), load_fenced_leases(settings.path)
        )
        self._fences_saved = len(first.fenced)
        self.writer = PartitionedWriter(settings.path, settings.writer())
        super().__init__(
            bootstrap,
            topics,
            first,
            flush_interval=settings.flush_interval,
            compression=settings.compression,
            datasets=settings.datasets,
            group_id=group_id,
        )

    @property
    def rows_written(self) -> dict[str, int]:
        return self.writer.rows_written

    def add(self, tables: dict[str, pa.Table]) -> None:
        self.writer.add(tables)

    def full(self) -> bool:
        return self.writer.full()

    def write(self) -> None:
        self.writer.flush()
        if len(self.first.fenced) != self._fences_saved:
            save_fenced_leases(self.settings.path, self.first.fenced)
            self._fences_saved = len(self.first.fenced)
