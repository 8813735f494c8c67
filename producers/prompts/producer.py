"""The prompt producer: dataset rows in, prompt events out, paced and halt-aware.

Datasets are interleaved row by row so all of them progress together, and each is
kept at most ``max_queued`` prompts ahead of its recorded outcomes (as the ledger's
snapshots report them): when a budget halts a dataset, only that many prompts are
left queued to be skipped, and the rest of the file is never published as prompts.

Every row still gets an outcome: when a halted dataset is finished, each row not
sent is recorded as ``PromptSkipped`` (small events, no generation), so the ledger
accounts for every prompt of the file exactly once, and a later run with a raised
budget produces them again (only completed prompts are never produced twice).

A row that is not a prompt (bad JSON, no prompt, a prompt over ``[producer]
max_prompt_bytes``, or one whose event would not fit its share of a Kafka message)
is a bad row: counted (:class:`ProduceReport`, ``tokenbudget_bad_rows_total``),
dead-lettered with where it is and an excerpt, then skipped, or, with ``on_bad_row
= "fail"``, it stops the producer with one line naming dataset, file:line and fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer

from tokenbudget.core import metrics, sizes
from tokenbudget.core.config import Config, Dataset
from tokenbudget.core.errors import DatasetError
from tokenbudget.core.kafka import aiokafka_producer_options
from tokenbudget.producers.prompts import conversations, resume
from tokenbudget.producers.prompts.datasets import read_options, read_prompts, row_error
from tokenbudget.producers.prompts.ids import turn_prompt_id
from tokenbudget.producers.prompts.rows import PromptRow
from tokenbudget.streams import budget, codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.dead_letters import bad_row_letter
from tokenbudget.streams.fields import SamplingParams
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)


@dataclass
class ProduceReport:
    dataset: str
    produced: int = 0
    bad_rows: int = 0
    already_done: int = 0  # completed by an earlier run of the namespace: not produced
    # still on the prompts topic from an earlier run (dispatched when their turn
    # comes): not produced again
    already_queued: int = 0
    # rows left unread when the budget halted the dataset: recorded as skipped
    not_sent: int = 0
    # turns = "regenerate": every turn of every conversation read (each gets an
    # outcome, whichever process sends it)
    turns: int = 0
    reason: str = "end_of_data"  # or "halted", "limit", "interrupted"
    errors: list[str] = field(default_factory=list)


# What a bad row's dead letter and error say to do about it.
SKIPPED_FIX = (
    'skipped ([producer] on_bad_row = "skip"): correct or remove the row and run '
    "again to produce it"
)
FAIL_FIX = (
    'fix: correct or remove the row, or set [producer] on_bad_row = "skip" to skip '
    "bad rows (counted and dead-lettered)"
)


# Near a budget's end, a dataset is kept ahead by twice the answers the rest of its
# budget buys at its mean cost so far (answers vary), and this many more, rather than
# by the whole window: prompts past that can only wait for budget and be skipped.
# Waiting, they take the room aside and, a partition's worth of them, pause their
# partition, whose other datasets then get no place (bench/fleet.py: as two datasets
# ended together, one sharing a partition with them fell from 599 to 9 of 1,024
# requests in flight for 40 s with budget left).
QUEUE_PER_ANSWER_LEFT = 2
QUEUE_FLOOR = 64


@dataclass
class _Cursor:
    dataset: Dataset
    rows: Iterator[PromptRow]
    report: ProduceReport
    baseline_outcomes: int
    done: bool = False
    letters: list[ev.DeadLetter] = field(default_factory=list)  # bad rows, to publish
    # conversations' turns that will never be sent (tokenbudget.producers.prompts.conversations),
    # to publish
    skips: list[ev.PromptSkipped] = field(default_factory=list)
    # prompts produced and the turns they lead to: what the outcomes are paced against
    ahead: int = 0


class PromptProducer:
    def __init__(
        self,
        config: Config,
        bootstrap: str,
        board: BudgetBoard,
        *,
        producer: AIOKafkaProducer | None = None,
        stored_prompt_ids: Callable[[], set[str]] = set,
        kept_completions: Callable[[frozenset[str]], Mapping[str, ev.CompletionEvent]] = (
            lambda datasets: {}
        ),
    ) -> None:
        self.config = config
        # prompt_ids already in the output (the sink's files), and the completions the
        # sink keeps of some datasets (the topic replayed): the application's to pass,
        # producers do not read the sink's format
        self._stored_prompt_ids = stored_prompt_ids
        self._kept_completions = kept_completions
        self._finished: Mapping[str, ev.CompletionEvent] = {}
        self.bootstrap = bootstrap
        self.topics = Topics(config.kafka.namespace)
        self.board = board
        self._producer = producer
        self.reports: dict[str, ProduceReport] = {}
        # completed by earlier runs (tokenbudget.producers.prompts.resume)
        self._done: set[str] = set()
        self._queued: set[str] = set()  # on the prompts topic, not yet dispatched
        self._cursors: list[_Cursor] = []

    def _outcomes(self, dataset: str) -> int:
        snap = self.board.snapshot(dataset)
        return snap.outcome_events if snap else 0

    def _queue_limit(self, dataset: str, window: float) -> float:
        """``window``, or fewer near the budget's end: :data:`QUEUE_PER_ANSWER_LEFT`
        times the answers its rest buys, and :data:`QUEUE_FLOOR`."""
        snap = self.board.snapshot(dataset)
        left = None if snap is None else budget.answers_left(snap.budget, snap)
        if left is None:
            return window
        return min(window, QUEUE_PER_ANSWER_LEFT * left + QUEUE_FLOOR)

    def _open_cursor(self, dataset: Dataset) -> _Cursor:
        report = ProduceReport(dataset.name)
        letters: list[ev.DeadLetter] = []
        skips: list[ev.PromptSkipped] = []
        rows = read_prompts(
            dataset.name,
            dataset.path,
            on_bad_row=functools.partial(self._bad_row, dataset.name, report, letters),
            limit=dataset.limit,
            **read_options(self.config, dataset),
        )
        if dataset.turns == "regenerate":
            rows = conversations.resumed_rows(
                dataset.name,
                rows,
                self._finished,
                self._done,
                self._queued,
                report,
                skips,
                max_prompt_bytes=self.config.producer.max_prompt_bytes,
                at=time.time(),
            )
        else:
            rows = resume.skip_done(rows, self._done, report, self._queued)
        self.reports[dataset.name] = report
        return _Cursor(
            dataset, rows, report, self._outcomes(dataset.name), letters=letters, skips=skips
        )

    def _bad_row(
        self, dataset: str, report: ProduceReport, letters: list[ev.DeadLetter], exc: DatasetError
    ) -> None:
        """Count a bad row and queue its dead letter (the produce loop sends it),
        then skip it, or stop with the dataset and the fix named."""
        fail = self.config.producer.on_bad_row == "fail"
        report.bad_rows += 1
        if len(report.errors) < 20:
            report.errors.append(str(exc))
        metrics.BAD_ROWS.labels(dataset=dataset).inc()
        letters.append(bad_row_letter(dataset, exc, FAIL_FIX if fail else SKIPPED_FIX))
        if fail:
            raise DatasetError(
                exc.path, f"{exc.message} (dataset {dataset}); {FAIL_FIX}", line=exc.line
            ) from exc
        log.warning(
            "dataset %s: skipping bad row %s: %s (dead-lettered to %s)",
            dataset,
            exc.where,
            exc.message,
            self.topics.dead_letter,
        )

    def settled(self) -> bool:
        """Every dataset is either read to its end or halted by its budget. A halted
        dataset only pauses here: a raised budget resumes it while the job runs."""
        return bool(self._cursors) and all(
            c.done or self.board.is_halted(c.dataset.name) for c in self._cursors
        )

    async def run(
        self, stop: asyncio.Event | None = None, interrupt: asyncio.Event | None = None
    ) -> dict[str, ProduceReport]:
        """Produce until every dataset is read to its end, or, without ``stop``,
        halted; with ``stop``, halted datasets wait for a raise until it is set.

        ``interrupt`` (SIGTERM) ends it early: what was sent is flushed, and nothing
        is recorded for the rows not read yet, so a restart carries on from there."""
        own_producer = self._producer is None
        producer = self._producer or AIOKafkaProducer(
            **aiokafka_producer_options(self.bootstrap, self.config.kafka.compression),
            linger_ms=5,
        )
        if own_producer:
            await producer.start()
        try:
            self._done = await asyncio.to_thread(
                resume.completed_prompt_ids, self.bootstrap, self.topics, self._stored_prompt_ids
            )
            self._queued = await asyncio.to_thread(
                resume.queued_prompt_ids, self.bootstrap, self.topics, self.topics.dispatch_group
            )
            regenerated = frozenset(d.name for d in self.config.datasets if d.turns == "regenerate")
            if regenerated:
                self._finished = await asyncio.to_thread(self._kept_completions, regenerated)
            cursors = [self._open_cursor(d) for d in self.config.datasets]
            self._cursors = cursors
            await self._produce(producer, cursors, stop, interrupt)
        finally:
            if own_producer:
                await producer.stop()
        return self.reports

    async def _produce(
        self,
        producer: AIOKafkaProducer,
        cursors: list[_Cursor],
        stop: asyncio.Event | None,
        interrupt: asyncio.Event | None = None,
    ) -> None:
        window = self.config.max_queued_per_dataset
        while True:
            progressed = False
            active = [c for c in cursors if not c.done]
            if interrupt is not None and interrupt.is_set():
                for cursor in active:
                    cursor.report.reason = "interrupted"
                await producer.flush()
                return
            if stop is not None and stop.is_set():
                for cursor in active:
                    await self._finish(producer, cursor, "halted")
                return
            if not active:
                return
            for cursor in active:
                name = cursor.dataset.name
                if self.board.is_halted(name):
                    if stop is None:
                        await self._finish(producer, cursor, "halted")
                    continue
                outstanding = cursor.ahead - (self._outcomes(name) - cursor.baseline_outcomes)
                if outstanding >= self._queue_limit(name, window * _turns_per_prompt(cursor)):
                    continue
                try:  # a bad row with on_bad_row = "fail" raises, with file:line
                    row = next(cursor.rows, None)
                    value = None if row is None else self._encoded(cursor, row)
                finally:
                    await self._send_letters(producer, cursor)
                if row is None:
                    await self._finish(producer, cursor, "end_of_data")
                    continue
                if value is None:
                    continue
                await producer.send(self.topics.prompts, key=name.encode(), value=value)
                cursor.report.produced += 1
                cursor.ahead += row.turns - row.turn
                metrics.EVENTS_PRODUCED.labels(topic="prompts").inc()
                progressed = True
            if not progressed:
                self.board.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.board.changed.wait(), timeout=0.2)

    def _encoded(self, cursor: _Cursor, row: PromptRow) -> bytes | None:
        """The row's prompt event, or None for an event larger than a prompt's share
        of a Kafka message (its template ids, or escapes, on top of the text): then
        it is a bad row (its letter is sent with the next row's)."""
        value = codec.encode(self._event(cursor.dataset, row))
        if len(value) <= sizes.PROMPT_EVENT_BYTES:
            return value
        exc = row_error(
            row,
            f"its prompt event is {len(value):,} bytes (text and template ids), over the "
            f"{sizes.PROMPT_EVENT_BYTES:,} a prompt may take of a Kafka message; shorten the "
            "row or drop it",
        )
        self._bad_row(cursor.dataset.name, cursor.report, cursor.letters, exc)
        return None

    def _event(self, dataset: Dataset, row: PromptRow) -> ev.PromptEvent:
        return ev.PromptEvent(
            prompt_id=row.prompt_id,
            dataset=dataset.name,
            text=row.text,
            messages=row.messages,
            sampling=sampling_for(dataset, row.sample_index),
            source=row.source,
            produced_at=time.time(),
            input_ids=list(row.input_ids) if row.input_ids is not None else None,
            row_id=row.row_id,
            input_columns=row.input_columns,
            sample_index=row.sample_index,
            tools=row.tools,
            conversation_id=row.conversation_id,
            turn=row.turn if row.conversation_id else None,
            turns=row.turns if row.conversation_id else None,
            reference=row.reference,
        )

    async def _finish(self, producer: AIOKafkaProducer, cursor: _Cursor, reason: str) -> None:
        cursor.done = True
        cursor.report.reason = reason
        if reason == "halted":
            await self._skip_rest(producer, cursor)
        report = cursor.report
        done = ev.ProducerDone(
            dataset=cursor.dataset.name,
            # prompts completed by earlier runs count (the ledger has their outcomes),
            # and so do those still queued from them (they get theirs when dispatched);
            # a conversation counts every turn (tokenbudget.producers.prompts.conversations)
            produced=report.turns
            if cursor.dataset.turns == "regenerate"
            else report.produced + report.already_done + report.already_queued + report.not_sent,
            reason=reason,  # type: ignore[arg-type]
            at=time.time(),
        )
        await producer.send_and_wait(
            self.topics.outcomes, key=cursor.dataset.name.encode(), value=codec.encode(done)
        )
        metrics.EVENTS_PRODUCED.labels(topic="outcomes").inc()
        log.info(
            "dataset %s: %d prompts produced (%s)", done.dataset, cursor.report.produced, reason
        )
        if cursor.report.already_done:
            log.info(
                "dataset %s: skipped %d prompts already done",
                done.dataset,
                cursor.report.already_done,
            )

    async def _send_letters(self, producer: AIOKafkaProducer, cursor: _Cursor) -> None:
        """Publish the dead letters of the bad rows read since the last call (and the
        skips of conversations found ended), and wait until Kafka has them (a failing
        run stops right after)."""
        if not cursor.letters and not cursor.skips:
            return
        letters, cursor.letters[:] = list(cursor.letters), []
        skips, cursor.skips[:] = list(cursor.skips), []
        key = cursor.dataset.name.encode()
        for letter in letters:
            await producer.send(self.topics.dead_letter, key=key, value=codec.encode(letter))
        for skipped in skips:
            await producer.send(self.topics.outcomes, key=key, value=codec.encode(skipped))
        await producer.flush()
        if letters:
            metrics.EVENTS_PRODUCED.labels(topic="deadletter").inc(len(letters))
        if skips:
            metrics.EVENTS_PRODUCED.labels(topic="outcomes").inc(len(skips))

    async def _skip_rest(self, producer: AIOKafkaProducer, cursor: _Cursor) -> None:
        """Record each row not sent as skipped (the budget is reached)."""
        try:
            await self._skip_rows(producer, cursor)
        finally:
            await self._send_letters(producer, cursor)

    async def _skip_rows(self, producer: AIOKafkaProducer, cursor: _Cursor) -> None:
        name = cursor.dataset.name
        for row in cursor.rows:  # bad rows are reported (or raise) as while producing
            # a conversation's turns from the one it would go on from
            ids = (
                [turn_prompt_id(name, row.conversation_id, k) for k in range(row.turn, row.turns)]
                if row.conversation_id
                else [row.prompt_id]
            )
            for prompt_id in ids:
                skipped = ev.PromptSkipped(
                    prompt_id=prompt_id,
                    dataset=name,
                    reason="budget reached: not sent",
                    at=time.time(),
                )
                await producer.send(
                    self.topics.outcomes, key=name.encode(), value=codec.encode(skipped)
                )
                cursor.report.not_sent += 1
                metrics.SKIPPED_PROMPTS.labels(dataset=name).inc()
        if cursor.report.not_sent:
            await producer.flush()
            metrics.EVENTS_PRODUCED.labels(topic="outcomes").inc(cursor.report.not_sent)


def _turns_per_prompt(cursor: _Cursor) -> float:
    """The outcomes each prompt produced leads to, on average: 1, or a conversation's
    turns. It has one turn queued at a time, so the window (of prompts queued) is
    of conversations going on."""
    produced = cursor.report.produced
    return cursor.ahead / produced if produced else 1.0


def sampling_for(dataset: Dataset, sample_index: int) -> SamplingParams:
    """The settings a prompt's request carries. With a seed, the n answers to one
    prompt get seeds seed, seed + 1, ...: the same seed would give n equal answers."""
    settings = dict(dataset.sampling)
    if sample_index and settings.get("seed") is not None:
        settings["seed"] += sample_index
    return SamplingParams(max_new_tokens=dataset.max_new_tokens, **settings)
