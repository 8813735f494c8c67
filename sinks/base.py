"""The sink seam: what every sink of the completions topic shares.

A sink consumes the completions topic in its group and stores the first completion
of each prompt, exactly once. :class:`CompletionSink` owns the Kafka side and the
contract:

  * the consume loop: start (a broker that does not answer is waited for), poll,
    and at stop read to the end of the topic;
  * the decoding and the first-completion rule (:mod:`tokenbudget.sinks.rows`), and
    the job's datasets only;
  * dead letters: a record that does not decode, of another dataset, or that the
    table building raises on, goes to the dead-letter topic; its offset is
    committed with the others', so a rerun does not meet it again;
  * write, then commit: offsets are committed only after :meth:`CompletionSink.write`
    has made every row read before them durable, so a crash at any point re-reads,
    and never skips, completions (the rule drops the rows read again).

An implementation stores rows. It hands the base the rule seeded with what it
already holds (the prompts kept and the leases fenced by earlier runs), takes each
batch's kept rows, one Arrow table per dataset (:meth:`CompletionSink.add`), says
when it holds enough to write (:meth:`CompletionSink.full`) and writes durably
(:meth:`CompletionSink.write`). :class:`tokenbudget.sinks.parquet.ParquetSink` is one.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata
from kafka.errors import KafkaError

from tokenbudget.core import metrics, sizes
from tokenbudget.core.errors import expected_kafka_error
from tokenbudget.core.kafka import (
    consumer_options,
    kafka_python_options,
    kafka_python_producer_options,
    wait_for_partitions,
)
from tokenbudget.core.retry import retry_until
from tokenbudget.sinks.rows import Decoded, FirstCompletion, Kept, decode_records, keep_first
from tokenbudget.streams import codec, dead_letters
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)

# Fetch sizes are every consumer's (tokenbudget.core.sizes: a whole message per partition,
# four per response); measured on the local broker with ~20 KB events, larger fetches
# are slower with kafka-python (it assembles each response in Python), smaller ones
# cost round trips. A larger socket buffer takes a response in fewer reads.
RECEIVE_BUFFER = {"receive_buffer_bytes": 4 * 1024 * 1024}


class _Stopped(Exception):
    """The sink was stopped while it waited for Kafka."""


class CompletionSink(abc.ABC):
    """Consumes the completions topic into a store; see the module docstring."""

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        first: FirstCompletion,
        *,
        flush_interval: float,
        compression: sizes.Compression,  # of its dead letters
        datasets: frozenset[str] | None,
        group_id: str | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.first = first
        self.flush_interval = flush_interval
        self.compression = compression
        # The job's datasets: a completion of another is dead-lettered (None: any name
        # that passes the event's rule, for tools that read a topic without a config).
        self.datasets = datasets
        self._group_id = group_id
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

    # ------------------------------------------------------------ the implementation's

    @abc.abstractmethod
    def add(self, tables: dict[str, pa.Table]) -> None:
        """Hold a batch's kept rows, a table per dataset, until :meth:`write`."""

    @abc.abstractmethod
    def full(self) -> bool:
        """Whether it holds enough to write now, before the flush interval is up."""

    @abc.abstractmethod
    def write(self) -> None:
        """Make every row added so far durable, and the rule's fenced leases with
        them (:attr:`first`): once it returns, the offsets read are committed."""

    # ------------------------------------------------------------------- the base's

    @property
    def group_id(self) -> str:
        return self._group_id or self.topics.sink_group

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
        self._dlq = KafkaProducer(**kafka_python_producer_options(self.bootstrap, self.compression))

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
        if self.full() or time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush()
        return count

    def _take(self, records: Sequence[Any]) -> None:
        """Decode one partition's records; dead-letter the bad ones, hand the first
        completion of each prompt to :meth:`add`.

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
            self.add(kept.tables)

    def _refuse_other_datasets(self, decoded: Decoded) -> None:
        """Completions of datasets that are not the job's (:attr:`datasets`) are
        bad records: where they go would be the writer's choice, not the job's."""
        allowed = self.datasets
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
        letter = dead_letters.dead_letter_for(reason, record)
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
        """Write what it holds (:meth:`write`), then commit what was read."""
        assert self._consumer is not None
        self.write()
        offsets = {
            tp: OffsetAndMetadata(self._consumer.position(tp), "", -1)
            for tp in self._consumer.assignment()
        }
        if offsets:
            try:
                self._consumer.commit(offsets)
            except KafkaError as exc:
                # A rebalance, or the broker out of reach (restarting): the rows are
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
