"""The Parquet sink: completions in, training-ready files out, exactly once.

Layout: ``<path>/dataset=<name>/part-<time>-<id>.parquet``, one row per prompt.

Contract:
  * A file appears whole or not at all: written under a hidden temporary name in
    the same folder, fsynced, then renamed (``os.replace``) and the folder fsynced.
  * Offsets are committed only after every row read before them is in a renamed
    file, so a crash at any point re-reads, and never skips, completions.
  * Re-read rows are dropped by ``prompt_id`` (the files on disk are scanned at
    start), matching the ledger, which keeps the first completion of each prompt;
    so no ``request_id`` or ``prompt_id`` appears twice.
  * Undecodable events go to the dead-letter topic.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition

from sinks import metrics
from streams import events as ev
from streams.topics import Topics
from tokenbudget.errors import BrokerError, EventDecodeError
from tokenbudget.kafka import kafka_python_options

log = logging.getLogger(__name__)

SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("prompt_id", pa.string()),
        ("dataset", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("output_ids", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
        ("max_new_tokens", pa.int64()),
        ("count_source", pa.string()),
        ("attempts", pa.int32()),
        ("dispatched_at", pa.float64()),
        ("first_token_at", pa.float64()),
        ("finished_at", pa.float64()),
        ("text", pa.string()),
    ]
)


@dataclass(frozen=True)
class SinkSettings:
    path: Path
    rotate_rows: int = 2000
    rotate_bytes: int = 64 * 1024 * 1024
    row_group_rows: int = 1000
    flush_interval: float = 5.0


def dataset_dir(root: Path, dataset: str) -> Path:
    return root / f"dataset={dataset}"


def existing_prompt_ids(root: Path) -> set[str]:
    """prompt_ids already written by earlier runs (only renamed, complete files)."""
    seen: set[str] = set()
    for file in sorted(root.glob("dataset=*/*.parquet")):
        if file.name.startswith("."):
            continue
        column = pq.read_table(file, columns=["prompt_id"]).column("prompt_id")
        seen.update(column.to_pylist())
    return seen


def completions_to_table(rows: list[ev.CompletionEvent]) -> pa.Table:
    """Columns from buffers: output_ids as one int32 array plus offsets."""
    lengths = np.fromiter((len(r.output_ids) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(
        itertools.chain.from_iterable(r.output_ids for r in rows),
        dtype=np.int32,
        count=int(offsets[-1]),
    )
    output_ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    first_token = [r.first_token_at for r in rows]
    columns = [
        pa.array([r.request_id for r in rows], pa.string()),
        pa.array([r.prompt_id for r in rows], pa.string()),
        pa.array([r.dataset for r in rows], pa.string()),
        pa.array(np.fromiter((r.prompt_tokens for r in rows), np.int64, len(rows))),
        pa.array(np.fromiter((r.completion_tokens for r in rows), np.int64, len(rows))),
        output_ids,
        pa.array([r.finish_reason for r in rows], pa.string()),
        pa.array(np.fromiter((r.max_new_tokens for r in rows), np.int64, len(rows))),
        pa.array([r.count_source for r in rows], pa.string()),
        pa.array(np.fromiter((r.attempts for r in rows), np.int32, len(rows))),
        pa.array(np.fromiter((r.dispatched_at for r in rows), np.float64, len(rows))),
        pa.array(first_token, pa.float64()),
        pa.array(np.fromiter((r.finished_at for r in rows), np.float64, len(rows))),
        pa.array([r.text for r in rows], pa.string()),
    ]
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def write_atomically(table: pa.Table, folder: Path, row_group_rows: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    name = f"part-{time.time_ns()}-{uuid.uuid4().hex[:8]}.parquet"
    final = folder / name
    temporary = folder / f".{name}.tmp"
    with temporary.open("wb") as handle:
        pq.write_table(table, handle, row_group_size=row_group_rows, compression="zstd")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, final)
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return final


@dataclass
class _Buffer:
    rows: list[ev.CompletionEvent] = field(default_factory=list)
    bytes: int = 0


class ParquetSink:
    """Consumes the completions topic into Parquet; see the module docstring."""

    def __init__(self, bootstrap: str, topics: Topics, settings: SinkSettings) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.settings = settings
        self.seen = existing_prompt_ids(settings.path)
        self.buffers: dict[str, _Buffer] = {}
        self.rows_written: dict[str, int] = {}
        self.duplicates_dropped = 0
        self._last_flush = time.monotonic()
        self._consumer: KafkaConsumer | None = None
        self._dlq: KafkaProducer | None = None

    @property
    def group_id(self) -> str:
        return f"{self.topics.namespace}-sink"

    def start(self) -> None:
        self._consumer = KafkaConsumer(
            **kafka_python_options(self.bootstrap),
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=16 * 1024 * 1024,
            fetch_max_bytes=64 * 1024 * 1024,
        )
        # Join the group only once this client's metadata has the topic: a group
        # joined without it is assigned nothing and kafka-python does not rejoin
        # until its metadata ages out (minutes).
        deadline = time.monotonic() + 30
        while not self._consumer.partitions_for_topic(self.topics.completions):
            if time.monotonic() > deadline:
                raise BrokerError(f"topic {self.topics.completions} does not exist")
            time.sleep(0.2)
        self._consumer.subscribe([self.topics.completions])
        self._dlq = KafkaProducer(**kafka_python_options(self.bootstrap), acks="all")

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close(autocommit=False)
            self._consumer = None
        if self._dlq is not None:
            self._dlq.close()
            self._dlq = None

    def _buffered_rows(self) -> int:
        return sum(len(b.rows) for b in self.buffers.values())

    def _buffered_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers.values())

    def poll_once(self, timeout_ms: int = 200) -> int:
        assert self._consumer is not None and self._dlq is not None, "start() first"
        batches = self._consumer.poll(timeout_ms=timeout_ms, max_records=2000)
        count = 0
        for records in batches.values():
            for record in records:
                count += 1
                self._take(record)
        if (
            self._buffered_rows() >= self.settings.rotate_rows
            or self._buffered_bytes() >= self.settings.rotate_bytes
            or time.monotonic() - self._last_flush >= self.settings.flush_interval
        ):
            self.flush()
        return count

    def _take(self, record: Any) -> None:
        value: bytes = record.value
        try:
            event = ev.decode(value)
            if not isinstance(event, ev.CompletionEvent):
                raise EventDecodeError(f"expected a completion, got {type(event).__name__}")
        except EventDecodeError as exc:
            assert self._dlq is not None
            letter = ev.dead_letter(
                str(exc),
                source_topic=record.topic,
                payload=value,
                partition=record.partition,
                offset=record.offset,
                key=record.key,
            )
            self._dlq.send(self.topics.dead_letter, key=record.key, value=ev.encode(letter))
            self._dlq.flush()
            metrics.DEAD_LETTERED.labels(topic="completions").inc()
            return
        if event.prompt_id in self.seen:
            self.duplicates_dropped += 1
            return
        self.seen.add(event.prompt_id)
        buffer = self.buffers.setdefault(event.dataset, _Buffer())
        buffer.rows.append(event)
        buffer.bytes += len(value)

    def flush(self) -> None:
        """Write every buffer to its file, then commit what was read."""
        assert self._consumer is not None
        for dataset, buffer in self.buffers.items():
            if not buffer.rows:
                continue
            table = completions_to_table(buffer.rows)
            path = write_atomically(
                table, dataset_dir(self.settings.path, dataset), self.settings.row_group_rows
            )
            metrics.PARQUET_ROWS.labels(dataset=dataset).inc(len(buffer.rows))
            metrics.PARQUET_BYTES.labels(dataset=dataset).inc(path.stat().st_size)
            self.rows_written[dataset] = self.rows_written.get(dataset, 0) + len(buffer.rows)
        self.buffers.clear()
        offsets = {
            tp: OffsetAndMetadata(self._consumer.position(tp), "", -1)
            for tp in self._consumer.assignment()
        }
        if offsets:
            self._consumer.commit(offsets)
        self._last_flush = time.monotonic()

    def caught_up(self) -> bool:
        """Whether everything on the topic as of now has been read."""
        assert self._consumer is not None
        assignment = self._consumer.assignment()
        if not assignment:
            return False
        ends = self._consumer.end_offsets(list(assignment))
        return all(self._consumer.position(tp) >= end for tp, end in ends.items())

    def run(self, stop: threading.Event) -> None:
        """Consume until ``stop`` is set, then drain to the end of the topic,
        flush and commit."""
        self.start()
        try:
            while not stop.is_set():
                self.poll_once()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                self.poll_once(timeout_ms=100)
                if self.caught_up():
                    break
            self.flush()
        finally:
            self.close()


def all_partitions(topic: str, partitions: int) -> list[TopicPartition]:
    return [TopicPartition(topic, p) for p in range(partitions)]
