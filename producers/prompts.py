"""The prompt producer: dataset rows in, prompt events out, paced and halt-aware.

Datasets are interleaved row by row so all of them progress together, and each is
kept at most ``max_queued`` prompts ahead of its recorded outcomes (as the ledger's
snapshots report them): when a budget halts a dataset, only that many prompts are
left queued to be skipped, and the rest of the file is never published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer

from producers.datasets import PromptRow, read_prompts
from producers.halts import BudgetBoard
from streams import events as ev
from streams.topics import Topics
from tokenbudget.config import Config, Dataset
from tokenbudget.errors import DatasetError
from tokenbudget.kafka import aiokafka_options

log = logging.getLogger(__name__)


@dataclass
class ProduceReport:
    dataset: str
    produced: int = 0
    bad_rows: int = 0
    reason: str = "end_of_data"  # or "halted", "limit"
    errors: list[str] = field(default_factory=list)


@dataclass
class _Cursor:
    dataset: Dataset
    rows: Iterator[PromptRow]
    report: ProduceReport
    baseline_outcomes: int
    done: bool = False


class PromptProducer:
    def __init__(
        self,
        config: Config,
        bootstrap: str,
        board: BudgetBoard,
        *,
        producer: AIOKafkaProducer | None = None,
    ) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.topics = Topics(config.kafka.namespace)
        self.board = board
        self._producer = producer
        self.reports: dict[str, ProduceReport] = {}

    def _outcomes(self, dataset: str) -> int:
        snap = self.board.snapshot(dataset)
        return snap.outcome_events if snap else 0

    def _open_cursor(self, dataset: Dataset) -> _Cursor:
        report = ProduceReport(dataset.name)

        def bad_row(exc: DatasetError) -> None:
            report.bad_rows += 1
            if len(report.errors) < 20:
                report.errors.append(str(exc))
            log.warning("skipping bad row: %s", exc)

        on_bad = bad_row if self.config.producer.on_bad_row == "skip" else None
        rows = read_prompts(dataset.name, dataset.path, on_bad_row=on_bad, limit=dataset.limit)
        self.reports[dataset.name] = report
        return _Cursor(dataset, rows, report, self._outcomes(dataset.name))

    async def run(self) -> dict[str, ProduceReport]:
        own_producer = self._producer is None
        producer = self._producer or AIOKafkaProducer(
            **aiokafka_options(self.bootstrap), acks="all", linger_ms=5
        )
        if own_producer:
            await producer.start()
        try:
            cursors = [self._open_cursor(d) for d in self.config.datasets]
            await self._produce(producer, cursors)
        finally:
            if own_producer:
                await producer.stop()
        return self.reports

    async def _produce(self, producer: AIOKafkaProducer, cursors: list[_Cursor]) -> None:
        window = self.config.max_queued_per_dataset
        while True:
            progressed = False
            active = [c for c in cursors if not c.done]
            if not active:
                return
            for cursor in active:
                name = cursor.dataset.name
                if self.board.is_halted(name):
                    await self._finish(producer, cursor, "halted")
                    continue
                outstanding = cursor.report.produced - (
                    self._outcomes(name) - cursor.baseline_outcomes
                )
                if outstanding >= window:
                    continue
                row = next(cursor.rows, None)  # DatasetError propagates with file:line
                if row is None:
                    await self._finish(producer, cursor, "end_of_data")
                    continue
                await producer.send(
                    self.topics.prompts,
                    key=name.encode(),
                    value=ev.encode(self._event(cursor.dataset, row)),
                )
                cursor.report.produced += 1
                progressed = True
            if not progressed:
                self.board.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.board.changed.wait(), timeout=0.2)

    def _event(self, dataset: Dataset, row: PromptRow) -> ev.PromptEvent:
        return ev.PromptEvent(
            prompt_id=row.prompt_id,
            dataset=dataset.name,
            text=row.text,
            messages=row.messages,
            sampling=ev.SamplingParams(
                max_new_tokens=dataset.max_new_tokens,
                temperature=self.config.inference.temperature,
            ),
            source=row.source,
            produced_at=time.time(),
        )

    async def _finish(self, producer: AIOKafkaProducer, cursor: _Cursor, reason: str) -> None:
        cursor.done = True
        cursor.report.reason = reason
        done = ev.ProducerDone(
            dataset=cursor.dataset.name,
            produced=cursor.report.produced,
            reason=reason,  # type: ignore[arg-type]
            at=time.time(),
        )
        await producer.send_and_wait(
            self.topics.outcomes, key=cursor.dataset.name.encode(), value=ev.encode(done)
        )
        log.info("dataset %s: %d prompts produced (%s)", done.dataset, done.produced, reason)
