"""Resumable runs: which prompts of a namespace already have a completion.

The ledger's outcome table (``tokenbudget.streams.ledger_worker``, table ``outcomes``) records, per
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
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import msgspec
from kafka import KafkaConsumer

from tokenbudget.core.errors import BrokerError
from tokenbudget.core.kafka import (
    consumer_options,
    kafka_python_options,
    read_to_ends,
    read_topic,
    wait_for_partitions,
)
from tokenbudget.producers.prompts.rows import PromptRow
from tokenbudget.streams.ledger import FENCE_KEY, is_prompt_key, load_outcome
from tokenbudget.streams.topics import OUTCOME_TABLE, Topics

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
    topic = topics.changelog(OUTCOME_TABLE)
    records: dict[str, str] = {}

    def apply(record: Any) -> None:
        key = _text(record.key)
        if key is None or not is_prompt_key(key):
            return  # a fenced lease or a copy noted beside the prompts
        if record.value is None:  # a tombstone
            records.pop(key, None)
            return
        records[key] = load_outcome(record.value).outcome

    read_topic(
        bootstrap,
        topic,
        apply,
        timeout=timeout,
        metadata_timeout=timeout,
        missing=_no_metadata(topic),
        max_records=10_000,
    )
    return records


class OutcomeView:
    """The prompts the ledger has recorded as completed, read from the outcome
    table's changelog and brought up to date on :meth:`refresh` (blocking: run it in
    a thread), and those with a completion on the topic the ledger has not applied
    yet (it stopped, with a killed run, before it did). A dispatcher consults it so
    that a prompt handed to it again (its previous dispatcher crashed after
    publishing, before committing) is not generated a second time."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.topic = topics.changelog(OUTCOME_TABLE)
        self.completed: set[str] = set()
        self._fenced: set[str] = set()  # leases the ledger fenced (FENCE_KEY entries)
        self._consumer: Any = None

    def refresh(self, timeout: float = 60.0) -> None:
        # The topic's tail first: what the ledger commits meanwhile is then in the
        # changelog read after it (it writes the changelog before it commits).
        try:
            tail = unapplied_completions(self.bootstrap, self.topics, timeout)
        except BrokerError as exc:  # a ledger far behind: as before, by its table alone
            log.warning("completions the ledger has not applied yet are not known: %s", exc)
            tail = {}
        self._read_changelog(timeout)
        # An answer of a lease fenced before it is kept by no one (a fence recorded
        # here is before every answer of its lease in the tail, or, if in the tail
        # itself, the ledger has applied those before it: they are in the changelog).
        self.completed.update(p for p, lease in tail.items() if lease not in self._fenced)

    def _read_changelog(self, timeout: float) -> None:
        if self._consumer is None:
            consumer = KafkaConsumer(
                **kafka_python_options(consumer_options(self.bootstrap)),
                group_id=None,
                enable_auto_commit=False,
            )
            tps = wait_for_partitions(
                consumer,
                self.topic,
                timeout=timeout,
                interval=0.5,
                missing=_no_metadata(self.topic),
            )
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            self._consumer = consumer
        read_to_ends(self._consumer, self._apply, timeout=timeout, max_records=10_000)

    def _apply(self, record: Any) -> None:
        key = _text(record.key)
        if key is not None and record.value is not None and key.startswith(FENCE_KEY):
            self._fenced.add(key.removeprefix(FENCE_KEY))
        if key is None or record.value is None or not is_prompt_key(key):
            return
        if load_outcome(record.value).outcome == "completed":
            self.completed.add(key)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


def unapplied_completions(bootstrap: str, topics: Topics, timeout: float = 60.0) -> dict[str, str]:
    """The completions after the ledger's committed offsets on the completions topic
    (published, perhaps not recorded in the outcome table yet), as prompt id -> lease
    id, less those of a lease fenced before them there (blocking: run it in a
    thread). Usually few: the ledger keeps up."""
    consumer = KafkaConsumer(
        **kafka_python_options(consumer_options(bootstrap)),
        group_id=topics.ledger_app_id,
        enable_auto_commit=False,
    )
    found: dict[str, str] = {}
    fenced: set[str] = set()

    def apply(record: Any) -> None:
        try:
            head = _completion_head(record.value)
        except Exception:  # any record is input (a RecursionError for one nested deep)
            return
        if head.type == "lease_fenced":
            fenced.add(head.lease_id)
        elif head.type == "completion" and head.prompt_id and head.lease_id not in fenced:
            found.setdefault(head.prompt_id, head.lease_id)

    try:
        tps = wait_for_partitions(
            consumer,
            topics.completions,
            timeout=timeout,
            interval=0.5,
            missing=_no_metadata(topics.completions),
        )
        consumer.assign(tps)
        starts = consumer.beginning_offsets(tps)
        for tp in tps:
            committed = consumer.committed(tp)
            consumer.seek(tp, max(starts[tp], committed if committed is not None else 0))
        read_to_ends(consumer, apply, timeout=timeout, max_records=10_000)
    finally:
        consumer.close(autocommit=False)
    return found


def _no_metadata(topic: str) -> str:
    """The error when ``topic`` never shows partitions: it is created with the
    namespace's others before any run, so that is a broker not answering, not a
    namespace with no history."""
    return f"no metadata for {topic}: cannot tell which prompts are done"


class _PromptHead(msgspec.Struct):
    prompt_id: str = ""
    dataset: str = ""


_prompt_head = msgspec.json.Decoder(_PromptHead).decode


class _CompletionHead(msgspec.Struct):
    type: str = ""
    prompt_id: str = ""
    lease_id: str = ""


_completion_head = msgspec.json.Decoder(_CompletionHead).decode


def queued_prompt_ids(bootstrap: str, topics: Topics, group: str) -> set[str]:
    """The prompts on the prompts topic that the dispatchers' group has not
    committed yet: they will be dispatched (again), so a rerun does not produce them
    a second time (blocking: run it in a thread)."""
    consumer = KafkaConsumer(
        **kafka_python_options(consumer_options(bootstrap)),
        group_id=group,
        enable_auto_commit=False,
    )
    queued: set[str] = set()

    def apply(record: Any) -> None:
        try:
            head = _prompt_head(record.value)
        except Exception:  # any record is input: the dispatcher dead-letters it
            return
        if head.prompt_id:
            queued.add(head.prompt_id)

    try:
        tps = wait_for_partitions(
            consumer,
            topics.prompts,
            timeout=60.0,
            interval=0.5,
            missing=_no_metadata(topics.prompts),
        )
        consumer.assign(tps)
        starts = consumer.beginning_offsets(tps)
        for tp in tps:
            committed = consumer.committed(tp)
            consumer.seek(tp, max(starts[tp], committed if committed is not None else 0))
        read_to_ends(consumer, apply, timeout=60.0, max_records=10_000)
    finally:
        consumer.close(autocommit=False)
    return queued


def completed_prompt_ids(
    bootstrap: str, topics: Topics, stored: Callable[[], set[str]] = set
) -> set[str]:
    """The prompt_ids earlier runs completed: recorded so by the ledger of this
    namespace, or already in the output (``stored``: the application passes the
    sink's reader, which producers do not import)."""
    records = outcome_records(bootstrap, topics)
    done = {pid for pid, outcome in records.items() if outcome == "completed"}
    kept = stored()
    log.info(
        "resume: %d prompts completed in %s, %d already in the output",
        len(done),
        topics.changelog(OUTCOME_TABLE),
        len(kept),
    )
    return done | kept


class _Counted(Protocol):
    already_done: int
    already_queued: int


def skip_done(
    rows: Iterator[PromptRow],
    done: set[str],
    report: _Counted,
    queued: frozenset[str] | set[str] = frozenset(),
) -> Iterator[PromptRow]:
    """Drop the prompts in ``done`` and in ``queued`` (on the prompts topic still,
    to be dispatched), counting them in ``report.already_done`` / ``already_queued``."""
    for row in rows:
        if row.prompt_id in done:
            report.already_done += 1
            continue
        if row.prompt_id in queued:
            report.already_queued += 1
            continue
        yield row
