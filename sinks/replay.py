"""``tokenbudget replay``: read the completion stream again, exactly once, fast.

A replay reads a completions topic (by default from the beginning, up to its end
as of the start, so it always terminates) without a consumer group, and feeds the
kept completions to any of its targets in one pass:

* ``--to-parquet DIR``: the live sink's layout and schema; rows are kept with the
  sink's own rule (:class:`tokenbudget.sinks.parquet.FirstCompletion`, the first completion of
  each prompt in partition order) and built by the same code, so the result equals
  the live sink's output whatever duplicates the topic holds. Prompts already in
  ``DIR`` are skipped, so an interrupted replay into the same folder resumes;
* ``--ledger``: per-dataset totals recomputed with the ledger's rules (first
  completion of a prompt counts; otherwise its first skip or failure), compared
  with the live ledger's latest snapshot on the budgets topic;
* ``--to-topic NAME``: the kept completions, byte for byte, keyed by dataset;
* ``--recount-with PATH``: each kept completion's ``text`` counted again with a
  ``transformers`` tokenizer loaded from a local folder (with the ``reasoning`` the
  server split off before it, which ``completion_tokens`` counts too; the markers
  the server's parser took out are not in either text).

Where "first" matters (duplicates), a replay that starts later than the
beginning (``--from-offset``, ``--since``) may keep a different completion than
the live sink did; ``--ledger`` therefore needs the whole topic.

One Kafka client library per job. The range is read with aiokafka, in async code:
it parses record batches in C, for about half kafka-python's CPU time per GB
(:func:`_read_range`). kafka-python serves the two jobs that need a blocking client:
:func:`read_to_end` (the small budgets and outcomes topics, through
:func:`tokenbudget.core.kafka.read_topic`), which runs after the event loop has ended
and is called from plain code elsewhere, and ``--to-topic``'s producer, which sends
from the processor thread, where no event loop runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
from aiokafka import AIOKafkaConsumer
from aiokafka import TopicPartition as AIOTopicPartition
from aiokafka.errors import KafkaConnectionError
from kafka import KafkaProducer
from rich.console import Console
from rich.progress import BarColumn, TextColumn
from rich.progress import Progress as RichProgress

from tokenbudget.core import sizes
from tokenbudget.core.errors import BrokerError, EventDecodeError, TokenBudgetError
from tokenbudget.core.kafka import (
    consumer_options,
    kafka_python_producer_options,
    read_topic,
    wait_for_partitions_aio,
)
from tokenbudget.core.kafka_admin import TopicSpec, ensure_topics
from tokenbudget.core.tokenizer import TRUST_FLAG, load_pretrained
from tokenbudget.sinks.parquet import (
    RECEIVE_BUFFER,
    Decoded,
    FirstCompletion,
    PartitionedWriter,
    WriterSettings,
    decode_records,
    existing_prompt_ids,
    keep_first,
    load_fenced_leases,
    remove_stale_temporaries,
    save_fenced_leases,
)
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.ledger import Outcome, outcome_change
from tokenbudget.streams.topics import Topics, completion_topic_configs

REPLAY_WRITER = WriterSettings(rotate_rows=20_000, rotate_bytes=256 * 1024 * 1024)
LEDGER_FIELDS = ("samples", "completion_tokens", "prompt_tokens", "skipped", "failed")


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


# ---------------------------------------------------------------------------- results


@dataclass
class Totals:
    samples: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    output_ids: int = 0
    skipped: int = 0
    failed: int = 0
    recounted_tokens: int = 0
    recounted_rows: int = 0
    rows_without_text: int = 0


@dataclass
class ReplaySummary:
    topic: str
    partitions: dict[int, tuple[int, int]] = field(default_factory=dict)  # start, end
    events: int = 0  # read from the topic (after the time/offset range)
    bytes: int = 0
    filtered: int = 0  # other datasets (--dataset) or outside --since/--until
    kept: int = 0
    duplicates: int = 0
    already_in_parquet: int = 0
    undecodable: int = 0
    seconds: float = 0.0
    datasets: dict[str, Totals] = field(default_factory=dict)
    parquet: dict[str, Any] | None = None
    to_topic: dict[str, Any] | None = None
    ledger: dict[str, Any] | None = None
    recount: dict[str, Any] | None = None
    # busy seconds per stage: read (Kafka), decode (JSON), build (rule + columns),
    # write (Parquet files, fsync included); stages overlap in three threads
    stages: dict[str, float] = field(
        default_factory=lambda: {"read": 0.0, "decode": 0.0, "build": 0.0, "write": 0.0}
    )

    @property
    def ok(self) -> bool:
        return self.ledger is None or bool(self.ledger["match"])

    def to_json(self) -> dict[str, Any]:
        seconds = max(self.seconds, 1e-9)
        return {
            "topic": self.topic,
            "partitions": {str(p): list(r) for p, r in sorted(self.partitions.items())},
            "events": self.events,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "events_per_s": round(self.events / seconds, 1),
            "mb_per_s": round(self.bytes / seconds / 1e6, 2),
            "kept": self.kept,
            "duplicates": self.duplicates,
            "already_in_parquet": self.already_in_parquet,
            "undecodable": self.undecodable,
            "filtered": self.filtered,
            "datasets": {
                name: {
                    "samples": t.samples,
                    "completion_tokens": t.completion_tokens,
                    "prompt_tokens": t.prompt_tokens,
                    "output_ids": t.output_ids,
                }
                for name, t in sorted(self.datasets.items())
            },
            "parquet": self.parquet,
            "to_topic": self.to_topic,
            "ledger": self.ledger,
            "recount": self.recount,
            "stage_seconds": {k: round(v, 3) for k, v in self.stages.items()},
            "ok": self.ok,
        }


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


def read_to_end(
    bootstrap: str, topic: str, apply: Callable[[ev.Event], None], timeout: float = 60
) -> None:
    """Decode every event of a (small) topic, from the beginning to its current end,
    and ``apply`` it; an event that does not decode is passed over. Raises
    :class:`BrokerError` if the topic is missing or not read within ``timeout``
    seconds (:func:`tokenbudget.core.kafka.read_topic`). Blocking."""

    def decode(record: Any) -> None:
        with contextlib.suppress(EventDecodeError):
            apply(codec.decode(record.value, record.topic))

    read_topic(bootstrap, topic, decode, timeout=timeout, extra_options=RECEIVE_BUFFER)


class _Head(msgspec.Struct):
    type: str = ""
    dataset: str = ""
    prompt_id: str = ""
    lease_id: str = ""


_read_head = msgspec.json.Decoder(_Head).decode

# Reading a whole completions topic may take long on a long job; a broker away for
# longer than this is not waited for.
KEPT_READ_TIMEOUT_S = 3600.0


def kept_completions(
    bootstrap: str, topics: Topics, datasets: frozenset[str]
) -> dict[str, ev.CompletionEvent]:
    """The completions of ``datasets`` the sink keeps (:class:`FirstCompletion`: the
    first of each prompt, none of a lease fenced before it), by prompt id, read from
    the completions topic as it is now: what a rerun of conversations regenerated
    turn by turn resumes from (the topic is the record; the sink's files may lag).
    Other datasets' events are passed over unread. Blocking."""
    rule = FirstCompletion()
    kept: dict[str, ev.CompletionEvent] = {}

    def apply(record: Any) -> None:
        try:
            head = _read_head(record.value)
        except Exception:  # any record is input (a RecursionError for one nested deep)
            return
        if head.dataset not in datasets:
            return
        if head.type == "lease_fenced":
            rule.fence(head.lease_id)
            return
        if head.type != "completion":
            return
        try:
            event = codec.decode(record.value)
        except EventDecodeError:
            return  # dead-lettered by the sink, kept by no one
        if isinstance(event, ev.CompletionEvent) and rule.keep(
            event.prompt_id, event.lease_id, event.dataset
        ):
            kept[event.prompt_id] = event

    read_topic(
        bootstrap,
        topics.completions,
        apply,
        timeout=KEPT_READ_TIMEOUT_S,
        extra_options=RECEIVE_BUFFER,
    )
    return kept


# ----------------------------------------------------------------------------- ledger


def live_snapshots(bootstrap: str, topics: Topics) -> dict[str, ev.LedgerSnapshot]:
    """The latest ledger snapshot of every dataset on the budgets topic."""
    board = BudgetBoard()
    read_to_end(bootstrap, topics.budgets, board.apply)
    return {name: view.snapshot for name, view in board.views.items() if view.snapshot is not None}


def outcome_counts(
    bootstrap: str,
    topics: Topics,
    completed: set[str],
    datasets: frozenset[str],
    rejected: dict[str, str] | None = None,
) -> dict[str, tuple[int, int]]:
    """(skipped, failed) per dataset with the ledger's rule: a prompt's first skip
    or failure counts unless the prompt has a completion. An answer no one kept
    because its lease was fenced (``rejected``: prompt -> dataset) counts as a skip
    of a prompt with no other outcome."""
    first: dict[str, tuple[str, Outcome]] = {}  # prompt_id -> (dataset, outcome)

    def record(prompt_id: str, dataset: str, outcome: Outcome) -> None:
        previous = first.get(prompt_id)
        if outcome_change(None if previous is None else previous[1], outcome):
            first[prompt_id] = (dataset, outcome)

    def apply(event: ev.Event) -> None:
        if isinstance(event, ev.PromptSkipped | ev.PromptFailed):
            if datasets and event.dataset not in datasets:
                return
            kind: Outcome = "skipped" if isinstance(event, ev.PromptSkipped) else "failed"
            record(event.prompt_id, event.dataset, kind)

    read_to_end(bootstrap, topics.outcomes, apply)
    for prompt_id, dataset in (rejected or {}).items():
        if not datasets or dataset in datasets:
            record(prompt_id, dataset, "skipped")
    counts: dict[str, list[int]] = {}
    for prompt_id, (dataset, kind) in first.items():
        if prompt_id in completed:
            continue  # a completion replaces a skip or a failure (outcome_change)
        entry = counts.setdefault(dataset, [0, 0])
        entry[0 if kind == "skipped" else 1] += 1
    return {name: (c[0], c[1]) for name, c in counts.items()}


def compare_ledger(
    replayed: dict[str, Totals],
    snapshots: dict[str, ev.LedgerSnapshot],
    datasets: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Field-by-field differences between replayed totals and live snapshots."""
    names = set(replayed) | set(snapshots)
    if datasets:
        names &= datasets
    differences = []
    for name in sorted(names):
        mine = replayed.get(name, Totals())
        snap = snapshots.get(name)
        if snap is None:
            differences.append({"dataset": name, "field": "snapshot", "replay": None, "live": None})
            continue
        for key in LEDGER_FIELDS:
            a, b = getattr(mine, key), getattr(snap, key)
            if a != b:
                differences.append({"dataset": name, "field": key, "replay": a, "live": b})
    return {
        "match": not differences,
        "datasets": sorted(names),
        "differences": differences,
        "live": {
            name: {key: getattr(snap, key) for key in LEDGER_FIELDS} | {"at": snap.at}
            for name, snap in sorted(snapshots.items())
            if name in names
        },
    }


# ------------------------------------------------------------------------------ replay


class _BackgroundWriter:
    """Writes Parquet files in one thread while the main thread reads and decodes
    (pyarrow releases the GIL); at most ``depth`` batches wait, bounding memory."""

    def __init__(self, writer: PartitionedWriter, depth: int = 2) -> None:
        self.writer = writer
        self.depth = depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="parquet")
        self._pending: list[Future[list[Path]]] = []
        self.seconds = 0.0

    def submit(self) -> None:
        buffers = self.writer.take()
        self._pending.append(self._pool.submit(self._write, buffers))
        while len(self._pending) > self.depth:
            self._pending.pop(0).result()

    def _write(self, buffers: Any) -> list[Path]:
        clock = time.perf_counter()
        try:
            return self.writer.write(buffers)
        finally:
            self.seconds += time.perf_counter() - clock

    def finish(self) -> None:
        try:
            if self.writer.rows:
                self.submit()
            for future in self._pending:
                future.result()
        finally:
            self._pending.clear()
            self._pool.shutdown(wait=True)


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
        self, options: ReplayOptions, summary: ReplaySummary, processor: _Processor
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


async def _read_range(
    options: ReplayOptions, summary: ReplaySummary, processor: _Processor, progress: bool
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


def replay(options: ReplayOptions, *, progress: bool = True) -> ReplaySummary:
    """Read the topic range once and feed every target; see the module docstring."""
    if options.ledger and not options.whole_topic:
        raise TokenBudgetError("--ledger compares whole topics: drop --from-offset/--since/--until")
    summary = ReplaySummary(topic=options.source)
    started = time.monotonic()
    tokenizer = (
        load_pretrained(
            options.recount_with,
            "replay --recount-with",
            trust_remote_code=options.trust_remote_code,
            trusted_by=TRUST_FLAG,
        )
        if options.recount_with
        else None
    )
    first = FirstCompletion()
    writer, already = _open_parquet(options, first)
    producer: KafkaProducer | None = None
    if options.to_topic:
        ensure_topics(
            options.bootstrap, [TopicSpec(options.to_topic, configs=completion_topic_configs())]
        )
        producer = KafkaProducer(
            **kafka_python_producer_options(options.bootstrap, options.compression),
            linger_ms=20,
            batch_size=1024 * 1024,
        )
    processor = _Processor(options, summary, first, already, writer, producer, tokenizer)
    try:
        try:
            asyncio.run(_read_range(options, summary, processor, progress))
        finally:
            processor.close()
        if writer is not None:
            _finish_parquet(writer, first, options, summary)
            writer = None
        if producer is not None:
            producer.flush()
            summary.to_topic = {"topic": options.to_topic, "events": summary.kept}
    finally:
        if writer is not None:
            writer.finish()
        if producer is not None:
            producer.close()
    summary.duplicates = first.duplicates
    if options.ledger:
        summary.ledger = _compare_with_live_ledger(options, summary, first)
    if tokenizer is not None:
        summary.recount = _recount_report(options.recount_with, summary.datasets)
    summary.seconds = time.monotonic() - started
    return summary


def _open_parquet(
    options: ReplayOptions, first: FirstCompletion
) -> tuple[_BackgroundWriter | None, set[str]]:
    """For ``--to-parquet``: the folder's writer, after its crash leftovers are
    removed and its fenced leases loaded into ``first``, and the prompts already in
    it (skipped, so a replay into the same folder resumes). ``(None, set())``
    without the option."""
    if options.to_parquet is None:
        return None, set()
    remove_stale_temporaries(options.to_parquet)
    already = existing_prompt_ids(options.to_parquet)
    first.fenced.update(load_fenced_leases(options.to_parquet))
    return _BackgroundWriter(PartitionedWriter(options.to_parquet, options.writer)), already


def _finish_parquet(
    writer: _BackgroundWriter,
    first: FirstCompletion,
    options: ReplayOptions,
    summary: ReplaySummary,
) -> None:
    """Write what ``writer`` still holds and the fenced leases beside the files (a
    later replay into the folder keeps fencing them); note the files in
    ``summary``."""
    writer.finish()
    if first.fenced:
        save_fenced_leases(writer.writer.root, first.fenced)
    summary.stages["write"] = writer.seconds
    summary.parquet = {
        "path": str(options.to_parquet),
        "files": len(writer.writer.files),
        "rows": dict(sorted(writer.writer.rows_written.items())),
    }


def _compare_with_live_ledger(
    options: ReplayOptions, summary: ReplaySummary, first: FirstCompletion
) -> dict[str, Any]:
    """``--ledger``: complete the replayed totals with the skips and failures of the
    outcomes topic, then compare them with the live ledger's snapshots
    (:func:`compare_ledger`)."""
    outcomes = outcome_counts(
        options.bootstrap, options.topics, first.seen, options.datasets, first.rejected
    )
    for name, (skipped, failed) in outcomes.items():
        totals = summary.datasets.setdefault(name, Totals())
        totals.skipped, totals.failed = skipped, failed
    return compare_ledger(
        summary.datasets, live_snapshots(options.bootstrap, options.topics), options.datasets
    )


def _recount_report(tokenizer_path: Path | None, datasets: dict[str, Totals]) -> dict[str, Any]:
    """``--recount-with``: per dataset, the stored and recounted tokens and their
    ratio (None for a dataset with no stored tokens)."""
    return {
        "tokenizer": str(tokenizer_path),
        "datasets": {
            name: {
                "stored_completion_tokens": t.completion_tokens,
                "recounted_tokens": t.recounted_tokens,
                "ratio": (
                    round(t.recounted_tokens / t.completion_tokens, 4)
                    if t.completion_tokens
                    else None
                ),
                "rows_without_text": t.rows_without_text,
            }
            for name, t in sorted(datasets.items())
        },
    }


class _Processor:
    """Applies the first-completion rule and feeds the targets, in a thread of its
    own, batch by batch in topic order, while the main thread reads and decodes the
    next batch (Arrow's parsing and pyarrow's writing run without the GIL)."""

    def __init__(
        self,
        options: ReplayOptions,
        summary: ReplaySummary,
        first: FirstCompletion,
        already: set[str],
        writer: _BackgroundWriter | None,
        producer: KafkaProducer | None,
        tokenizer: Any,
    ) -> None:
        self.options = options
        self.summary = summary
        self.first = first
        self.already = already
        self.writer = writer
        self.producer = producer
        self.tokenizer = tokenizer
        self._queue: queue.Queue[tuple[list[Any], Decoded] | None] = queue.Queue(maxsize=3)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="replay", daemon=True)
        self._thread.start()

    def submit(self, records: list[Any], decoded: Decoded) -> None:
        while True:
            if self._error is not None:
                raise self._error
            try:
                self._queue.put((records, decoded), timeout=0.5)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        """Wait for every submitted batch; re-raise what failed in the thread."""
        if self._thread.is_alive():
            while True:
                try:
                    self._queue.put(None, timeout=0.5)
                    break
                except queue.Full:
                    if not self._thread.is_alive():
                        break
            self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                clock = time.perf_counter()
                self.take(*item)
                self.summary.stages["build"] += time.perf_counter() - clock
                if self.writer is not None and self.writer.writer.full():
                    self.writer.submit()
        except BaseException as exc:
            self._error = exc
            while self._queue.get() is not None:  # unblock the reader until close()
                pass

    def take(self, records: Sequence[Any], decoded: Decoded) -> None:
        summary = self.summary
        kept = keep_first(decoded, self.first)
        summary.undecodable += len(kept.errors)
        summary.kept += kept.rows
        texts: list[str] = []
        text_datasets: list[str] = []
        for dataset, rows in kept.records.items():
            totals = summary.datasets.get(dataset)
            if totals is None:
                totals = summary.datasets[dataset] = Totals()
            table = kept.tables[dataset]
            totals.samples += len(rows)
            totals.completion_tokens += int(pc.sum(table.column("completion_tokens")).as_py())
            totals.prompt_tokens += int(pc.sum(table.column("prompt_tokens")).as_py())
            totals.output_ids += int(
                pc.sum(pc.list_value_length(table.column("output_ids"))).as_py() or 0
            )
            if self.tokenizer is not None:
                for r in rows:
                    if r.text or r.reasoning:
                        texts.append((r.reasoning or "") + r.text)
                        text_datasets.append(dataset)
                    else:
                        totals.rows_without_text += 1
        if self.writer is not None:
            tables = kept.tables
            if self.already:
                tables = {}
                for dataset, table in kept.tables.items():
                    fresh = [r.prompt_id not in self.already for r in kept.records[dataset]]
                    summary.already_in_parquet += fresh.count(False)
                    if any(fresh):
                        tables[dataset] = table.filter(pa.array(fresh))
            self.writer.writer.add(tables)
        if self.producer is not None:
            positions = sorted(p for ps in kept.positions.values() for p in ps)
            for position in positions:
                record = records[position]
                self.producer.send(self.options.to_topic, key=record.key, value=record.value)
        if texts:
            encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            for name, tokens in zip(text_datasets, encoded, strict=True):
                totals = summary.datasets[name]
                totals.recounted_tokens += len(tokens)
                totals.recounted_rows += 1
