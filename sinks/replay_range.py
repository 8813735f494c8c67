"""What a replay reads: its options, the offsets of the topic they select, the
records it keeps of them, and the decoded batches it hands to a :class:`Processor`
(the replay's, in :mod:`tokenbudget.sinks.replay`, applies the rule and feeds the
targets).

The range is read with aiokafka, in async code: it parses record batches in C, for
about half kafka-python's CPU time per GB (:func:`read_range`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer
from aiokafka import TopicPartition as AIOTopicPartition
from aiokafka.errors import KafkaConnectionError
from rich.console import Console
from rich.progress import BarColumn, TextColumn
from rich.progress import Progress as RichProgress

from tokenbudget.core import sizes
from tokenbudget.core.errors import BrokerError, TokenBudgetError
from tokenbudget.core.kafka import consumer_options, wait_for_partitions_aio
from tokenbudget.sinks.audit import ReplaySummary
from tokenbudget.sinks.parquet import WriterSettings
from tokenbudget.sinks.rows import Decoded, decode_records
from tokenbudget.streams.topics import Topics

REPLAY_WRITER = WriterSettings(rotate_rows=20_000, rotate_bytes=256 * 1024 * 1024)


# ---------------------------------------------------------------------------- options


def parse_time(text: str) -> float:
    """Seconds since the epoch from ``1733140000``, ``1733140000.5`` or ISO 8601
    (``2026-12-02T10:00:00Z``; a time without a zone is UTC)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise TokenBudgetError(
            f"{text!r} is not a time: use seconds since the epoch or ISO 8601"
        ) from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def parse_offsets(text: str) -> dict[int, int] | int:
    """``--from-offset``: ``N`` (every partition) or ``P:N,P:N``."""
    try:
        if ":" not in text:
            return int(text)
        out = {}
        for part in text.split(","):
            partition, offset = part.split(":")
            out[int(partition)] = int(offset)
        return out
    except ValueError as exc:
        raise TokenBudgetError(f"--from-offset {text!r}: use N or PARTITION:N,...") from exc


@dataclass(frozen=True)
class ReplayOptions:
    bootstrap: str
    topics: Topics
    topic: str = ""  # default: the namespace's completions topic
    from_offset: dict[int, int] | int | None = None
    since: float | None = None
    until: float | None = None
    datasets: frozenset[str] = frozenset()
    to_parquet: Path | None = None
    writer: WriterSettings = field(default_factory=lambda: REPLAY_WRITER)
    ledger: bool = False
    to_topic: str | None = None
    recount_with: Path | None = None
    trust_remote_code: bool = False  # the recount tokenizer's own code may run
    batch_records: int = 2000
    # Batches stay below glibc's largest mmap threshold (32 MiB), so their buffers
    # come from the reused heap instead of fresh, page-faulting mappings.
    batch_bytes: int = 12 * 1024 * 1024
    compression: sizes.Compression = sizes.DEFAULT_COMPRESSION  # of --to-topic

    @property
    def source(self) -> str:
        return self.topic or self.topics.completions

    @property
    def whole_topic(self) -> bool:
        return self.from_offset is None and self.since is None and self.until is None


# --------------------------------------------------------------------------- progress


class Progress:
    """Events, MB and rate on stderr: a rich bar on a terminal, else a line every
    few seconds."""

    def __init__(self, total: int, *, enabled: bool = True, interval: float = 5.0) -> None:
        self.total = total
        self.enabled = enabled
        self.interval = interval
        self.started = time.monotonic()
        self._last_line = self.started
        self._rich: Any = None
        self._task: Any = None
        if enabled and sys.stderr.isatty():
            self._rich = RichProgress(
                TextColumn("replay"),
                BarColumn(),
                TextColumn("{task.completed:,}/{task.total:,} events"),
                TextColumn("{task.fields[mb]:,.1f} MB"),
                TextColumn("{task.fields[rate]:,.0f} ev/s"),
                console=Console(stderr=True),
                transient=True,
            )
            self._task = self._rich.add_task("replay", total=total, mb=0.0, rate=0.0)
            self._rich.start()

    def update(self, events: int, nbytes: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        rate = events / max(now - self.started, 1e-9)
        if self._rich is not None:
            self._rich.update(self._task, completed=events, mb=nbytes / 1e6, rate=rate)
        elif now - self._last_line >= self.interval:
            self._last_line = now
            print(
                f"replay: {events:,}/{self.total:,} events, {nbytes / 1e6:,.1f} MB, "
                f"{rate:,.0f} events/s, {nbytes / 1e6 / max(now - self.started, 1e-9):,.1f} MB/s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


# ----------------------------------------------------------------------------- reading


class Processor(Protocol):
    """Where the decoded batches go, in topic order per partition."""

    def submit(self, records: list[Any], decoded: Decoded) -> None: ...


async def _started_consumer(bootstrap: str) -> AIOKafkaConsumer:
    """An aiokafka consumer of no group, started; :class:`BrokerError` if Kafka at
    ``bootstrap`` does not answer."""
    consumer = AIOKafkaConsumer(
        **consumer_options(bootstrap),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    try:
        await consumer.start()
    except KafkaConnectionError as exc:
        await consumer.stop()
        raise BrokerError(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
    return consumer


@dataclass(frozen=True)
class _Range:
    """What a replay reads: offsets ``starts[tp]`` (included) to ``ends[tp]``
    (excluded) of each partition of the topic, in partition order."""

    starts: dict[AIOTopicPartition, int]
    ends: dict[AIOTopicPartition, int]

    @property
    def active(self) -> list[AIOTopicPartition]:
        """The partitions with anything to read."""
        return [tp for tp in self.starts if self.starts[tp] < self.ends[tp]]

    @property
    def events(self) -> int:
        return sum(self.ends[tp] - self.starts[tp] for tp in self.starts)


def _start_offsets(
    tps: list[AIOTopicPartition],
    begins: dict[AIOTopicPartition, int],
    from_offset: dict[int, int] | int | None,
) -> dict[AIOTopicPartition, int]:
    """Where each partition's range starts: ``--from-offset`` (one offset for all
    partitions, or per partition; the beginning for a partition not named), never
    before the partition's beginning. Raises :class:`TokenBudgetError` for a
    partition the topic does not have."""
    if isinstance(from_offset, int):
        return {tp: max(begins[tp], from_offset) for tp in tps}
    if isinstance(from_offset, dict):
        unknown = set(from_offset) - {tp.partition for tp in tps}
        if unknown:
            raise TokenBudgetError(f"--from-offset: no partition {sorted(unknown)}")
        return {tp: max(begins[tp], from_offset.get(tp.partition, begins[tp])) for tp in tps}
    return dict(begins)


async def _aio_offsets_at(
    consumer: AIOKafkaConsumer,
    tps: list[AIOTopicPartition],
    seconds: float,
    default: dict[Any, int],
) -> dict[AIOTopicPartition, int]:
    """The first offset whose timestamp is at or after ``seconds``, per partition."""
    found = await consumer.offsets_for_times({tp: int(seconds * 1000) for tp in tps})
    return {tp: (found[tp].offset if found.get(tp) is not None else default[tp]) for tp in tps}


async def _plan_range(consumer: AIOKafkaConsumer, options: ReplayOptions) -> _Range:
    """The offsets ``options`` select: from the beginning, ``--from-offset`` or
    ``--since`` (the latest of them) to the end as of now or ``--until``."""
    tps = await wait_for_partitions_aio(consumer, options.source, timeout=15)
    begins = await consumer.beginning_offsets(tps)
    ends = await consumer.end_offsets(tps)
    starts = _start_offsets(tps, begins, options.from_offset)
    if options.since is not None:
        at = await _aio_offsets_at(consumer, tps, options.since, ends)
        starts = {tp: max(starts[tp], at[tp]) for tp in tps}
    if options.until is not None:
        # an offset past --until (timestamps are roughly monotonic); records are
        # also filtered one by one (_RecordFilter)
        after = await _aio_offsets_at(consumer, tps, options.until + 0.001, ends)
        ends = {tp: min(ends[tp], after[tp]) for tp in tps}
    return _Range({tp: min(starts[tp], ends[tp]) for tp in tps}, ends)


@dataclass(frozen=True)
class _RecordFilter:
    """The records a replay keeps of its range: those keyed by one of ``keys``
    (``--dataset``; any key when empty) and stamped within ``--since``/``--until``
    (milliseconds; no bound when None)."""

    keys: frozenset[bytes]
    since_ms: float | None
    until_ms: float | None

    @classmethod
    def of(cls, options: ReplayOptions) -> _RecordFilter:
        return cls(
            frozenset(name.encode() for name in options.datasets),
            None if options.since is None else options.since * 1000,
            None if options.until is None else options.until * 1000,
        )

    @property
    def keeps_all(self) -> bool:
        return not self.keys and self.since_ms is None and self.until_ms is None

    def __call__(self, records: list[Any]) -> list[Any]:
        """The kept ``records``, in order (``records`` itself when all are kept)."""
        if self.keeps_all:
            return records
        return [
            r
            for r in records
            if (not self.keys or r.key in self.keys)
            and (self.since_ms is None or r.timestamp >= self.since_ms)
            and (self.until_ms is None or r.timestamp <= self.until_ms)
        ]


def _value_bytes(records: Sequence[Any]) -> int:
    return sum(len(r.value) for r in records if r.value is not None)


class _Batches:
    """Gathers each partition's records into batches, and decodes and submits a
    batch to the processor once it holds ``batch_records`` records or
    ``batch_bytes`` bytes, or its partition is read to the end."""

    def __init__(
        self, options: ReplayOptions, summary: ReplaySummary, processor: Processor
    ) -> None:
        self.options = options
        self.summary = summary
        self.processor = processor
        self._records: dict[AIOTopicPartition, list[Any]] = {}
        self._bytes: dict[AIOTopicPartition, int] = {}

    def add(self, tp: AIOTopicPartition, records: list[Any], *, last: bool) -> None:
        """Add ``tp``'s next ``records``; ``last``: the partition has no more."""
        batch = self._records.setdefault(tp, [])
        batch.extend(records)
        self._bytes[tp] = self._bytes.get(tp, 0) + _value_bytes(records)
        if batch and (
            last
            or len(batch) >= self.options.batch_records
            or self._bytes[tp] >= self.options.batch_bytes
        ):
            self._records[tp], self._bytes[tp] = [], 0
            clock = time.perf_counter()
            decoded = decode_records([r.value for r in batch])
            self.summary.stages["decode"] += time.perf_counter() - clock
            # blocks the event loop while the processor is behind: nothing else
            # runs on it, and the fetcher simply waits
            self.processor.submit(batch, decoded)


async def _read_batches(
    consumer: AIOKafkaConsumer,
    plan: _Range,
    options: ReplayOptions,
    summary: ReplaySummary,
    batches: _Batches,
    bar: Progress,
) -> None:
    """Read the partitions ``consumer`` is assigned (at their starts) up to their
    ends in ``plan``, counting what is read and filtered in ``summary`` and handing
    the kept records to ``batches``."""
    keep = _RecordFilter.of(options)
    remaining = set(plan.active)
    while remaining:
        clock = time.perf_counter()
        polled = await consumer.getmany(timeout_ms=1000, max_records=options.batch_records)
        summary.stages["read"] += time.perf_counter() - clock
        for tp, records in polled.items():
            if tp not in remaining:
                continue
            end = plan.ends[tp]
            last = records[-1].offset >= end - 1
            if last:
                records = [r for r in records if r.offset < end]
                remaining.discard(tp)
                consumer.pause(tp)
            summary.events += len(records)
            summary.bytes += _value_bytes(records)
            kept = keep(records)
            summary.filtered += len(records) - len(kept)
            batches.add(tp, kept, last=last)
        bar.update(summary.events, summary.bytes)


async def read_range(
    options: ReplayOptions, summary: ReplaySummary, processor: Processor, progress: bool
) -> None:
    """Read the topic range, decode it batch by batch and hand each batch to the
    processor thread.

    With aiokafka rather than kafka-python: it parses record batches in C and reads
    a whole fetch response at once, where kafka-python 3 reads the socket 4 KB at a
    time in Python; reading the topic took about half the CPU time per GB.
    """
    consumer = await _started_consumer(options.bootstrap)
    bar: Progress | None = None
    try:
        plan = await _plan_range(consumer, options)
        for tp, start in plan.starts.items():
            summary.partitions[tp.partition] = (start, plan.ends[tp])
        bar = Progress(plan.events, enabled=progress)
        consumer.assign(plan.active)
        for tp in plan.active:
            consumer.seek(tp, plan.starts[tp])
        batches = _Batches(options, summary, processor)
        await _read_batches(consumer, plan, options, summary, batches, bar)
    finally:
        if bar is not None:
            bar.close()
        await consumer.stop()
