"""Resumable runs: which prompts of a namespace already have a completion.

The ledger's outcome table (``streams.app``, table ``outcomes``) records, per
``prompt_id``, whether the prompt was completed, skipped or failed. Its changelog is
a compacted topic keyed by ``prompt_id``, so reading it from the beginning to its end
offsets gives the record of every earlier run of the namespace. The producer skips
the prompts recorded as completed; prompts that were skipped (budget) or failed
were not generated, so they are produced again.

The Parquet sink's files are read too (their ``prompt_id`` column only): a row there
is a completion already stored, which the sink would drop as a duplicate anyway, so
a changelog that is behind (a ledger stopped before its table writes were flushed)
never costs a regeneration.

Faust serialises the table's keys and values (``str`` / ``bytes``) with its JSON
codec, so both may arrive JSON-quoted; raw bytes are accepted too.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from producers.datasets import PromptRow
from streams.ledger import is_prompt_key, load_outcome
from streams.topics import OUTCOME_TABLE, Topics
from tokenbudget.errors import BrokerError
from tokenbudget.kafka import kafka_python_options

log = logging.getLogger(__name__)


def _text(data: bytes | None) -> str | None:
    if data is None:
        return None
    raw = data.decode("utf-8", "replace")
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw


def outcome_records(bootstrap: str, topics: Topics, *, timeout: float = 60.0) -> dict[str, str]:
    """``prompt_id -> "completed" | "skipped" | "failed"`` as the ledger last recorded
    them, read from the outcome table's changelog (blocking: run it in a thread)."""
    from kafka import KafkaConsumer, TopicPartition

    topic = topics.changelog(OUTCOME_TABLE)
    consumer = KafkaConsumer(
        **kafka_python_options(bootstrap), group_id=None, enable_auto_commit=False
    )
    records: dict[str, str] = {}
    try:
        # The topic is created with the namespace's others before any run, so no
        # partitions means metadata not there yet (a busy broker), not "no history".
        deadline = time.monotonic() + timeout
        partitions = consumer.partitions_for_topic(topic)
        while not partitions:
            if time.monotonic() > deadline:
                raise BrokerError(f"no metadata for {topic}: cannot tell which prompts are done")
            time.sleep(0.5)
            partitions = consumer.partitions_for_topic(topic)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise BrokerError(f"reading {topic} to its end took longer than {timeout:.0f} s")
            for batch in consumer.poll(timeout_ms=500, max_records=10_000).values():
                for record in batch:
                    key = _text(record.key)
                    if key is None or not is_prompt_key(key):
                        continue  # a fenced lease or a copy noted beside the prompts
                    if record.value is None:  # a tombstone
                        records.pop(key, None)
                        continue
                    records[key] = load_outcome(record.value).outcome
    finally:
        consumer.close()
    return records


def completed_prompt_ids(
    bootstrap: str, topics: Topics, sink_path: Path | None = None
) -> set[str]:
    """The prompt_ids earlier runs completed: recorded so by the ledger of this
    namespace, or stored in the sink's Parquet files under ``sink_path``."""
    records = outcome_records(bootstrap, topics)
    done = {pid for pid, outcome in records.items() if outcome == "completed"}
    stored: set[str] = set()
    if sink_path is not None and sink_path.is_dir():
        from sinks.parquet import existing_prompt_ids

        stored = existing_prompt_ids(sink_path)
    log.info(
        "resume: %d prompts completed in %s, %d in Parquet under %s",
        len(done),
        topics.changelog(OUTCOME_TABLE),
        len(stored),
        sink_path,
    )
    return done | stored


class _Counted(Protocol):
    already_done: int


def skip_done(rows: Iterator[PromptRow], done: set[str], report: _Counted) -> Iterator[PromptRow]:
    """Drop the prompts in ``done``, counting them in ``report.already_done``."""
    for row in rows:
        if row.prompt_id in done:
            report.already_done += 1
            continue
        yield row
