"""``tokenbudget replay``: read the completion stream again, exactly once, fast.

A replay reads a completions topic (by default from the beginning, up to its end
as of the start, so it always terminates) without a consumer group, and feeds the
kept completions to any of its targets in one pass:

* ``--to-parquet DIR``: the live sink's layout and schema; rows are kept with the
  sink's own rule (:class:`tokenbudget.sinks.rows.FirstCompletion`, the first completion of
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

The pieces: what is read (the options, the range, the batches:
:mod:`tokenbudget.sinks.replay_range`), what is found and checked (the summary, the
ledger audit, the recount: :mod:`tokenbudget.sinks.audit`), and here the processor
that applies the rule and feeds the targets, and :func:`replay`, which runs them.

One Kafka client library per job. The range is read with aiokafka, in async code:
it parses record batches in C, for about half kafka-python's CPU time per GB
(:func:`tokenbudget.sinks.replay_range.read_range`). kafka-python serves the two jobs
that need a blocking client: :func:`tokenbudget.sinks.reading.read_to_end` (the small
budgets and outcomes topics, through :func:`tokenbudget.core.kafka.read_topic`), which
runs after the event loop has ended and is called from plain code elsewhere, and
``--to-topic``'s producer, which sends from the processor thread, where no event
loop runs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from kafka import KafkaProducer

from tokenbudget.core.errors import TokenBudgetError
from tokenbudget.core.kafka import kafka_python_producer_options
from tokenbudget.core.kafka_admin import TopicSpec, ensure_topics
from tokenbudget.core.tokenizer import TRUST_FLAG, load_pretrained
from tokenbudget.sinks.audit import (
    ReplaySummary,
    Totals,
    compare_ledger,
    live_snapshots,
    outcome_counts,
    recount_report,
)
from tokenbudget.sinks.parquet import (
    PartitionedWriter,
    existing_prompt_ids,
    load_fenced_leases,
    remove_stale_temporaries,
    save_fenced_leases,
)
from tokenbudget.sinks.replay_range import ReplayOptions, read_range
from tokenbudget.sinks.rows import Decoded, FirstCompletion, keep_first
from tokenbudget.streams.topics import completion_topic_configs


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
            asyncio.run(read_range(options, summary, processor, progress))
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
        summary.recount = recount_report(options.recount_with, summary.datasets)
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
        totals = summary.datasets.get(name, Totals())
        summary.datasets[name] = replace(totals, skipped=skipped, failed=failed)
    return compare_ledger(
        summary.datasets, live_snapshots(options.bootstrap, options.topics), options.datasets
    )


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
            table = kept.tables[dataset]
            without_text = 0
            if self.tokenizer is not None:
                for r in rows:
                    if r.text or r.reasoning:
                        texts.append((r.reasoning or "") + r.text)
                        text_datasets.append(dataset)
                    else:
                        without_text += 1
            summary.datasets[dataset] = summary.datasets.get(dataset, Totals()).plus(
                samples=len(rows),
                completion_tokens=int(pc.sum(table.column("completion_tokens")).as_py()),
                prompt_tokens=int(pc.sum(table.column("prompt_tokens")).as_py()),
                output_ids=int(
                    pc.sum(pc.list_value_length(table.column("output_ids"))).as_py() or 0
                ),
                rows_without_text=without_text,
            )
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
                summary.datasets[name] = summary.datasets[name].plus(
                    recounted_tokens=len(tokens), recounted_rows=1
                )
