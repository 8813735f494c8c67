"""The budget board: every process's local view of which datasets are halted.

It reads the budgets topic from the beginning with no consumer group (each process
needs every event, not a share of them) and keeps, per dataset, whether it is
halted and the ledger's latest snapshot. Producers consult it before publishing a
prompt and dispatchers before sending a request, so a halt takes effect as soon as
its event is read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from streams import events as ev
from streams.topics import Topics
from tokenbudget.errors import BrokerError, EventDecodeError
from tokenbudget.kafka import aiokafka_options

log = logging.getLogger(__name__)


@dataclass
class DatasetView:
    halted: bool = False
    halted_at: float | None = None  # when this process saw the halt
    snapshot: ev.LedgerSnapshot | None = None


@dataclass
class BudgetBoard:
    """Apply budget-topic events; pure state so it is testable without a broker."""

    views: dict[str, DatasetView] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Lease replies are addressed to one dispatcher: routed by holder id.
    lease_listeners: dict[str, Callable[[ev.Event], None]] = field(default_factory=dict)

    def view(self, dataset: str) -> DatasetView:
        return self.views.setdefault(dataset, DatasetView())

    def is_halted(self, dataset: str) -> bool:
        view = self.views.get(dataset)
        return view is not None and view.halted

    def snapshot(self, dataset: str) -> ev.LedgerSnapshot | None:
        view = self.views.get(dataset)
        return view.snapshot if view else None

    def apply(self, event: ev.Event, seen_at: float | None = None) -> None:
        seen_at = time.time() if seen_at is None else seen_at
        match event:
            case ev.BudgetExceeded():
                self._set_halted(event.dataset, True, seen_at)
            case ev.BudgetRaised():
                self._set_halted(event.dataset, False, seen_at)
            case ev.LeaseGranted() | ev.LeaseDenied() | ev.LeaseRevoked():
                listener = self.lease_listeners.get(event.holder)
                if listener is not None:
                    listener(event)
                return
            case ev.LedgerSnapshot():
                view = self.view(event.dataset)
                if view.snapshot is None or event.at >= view.snapshot.at:
                    view.snapshot = event
                    self._set_halted(event.dataset, event.halted, seen_at)
            case _:
                return
        self.changed.set()

    def _set_halted(self, dataset: str, halted: bool, seen_at: float) -> None:
        view = self.view(dataset)
        if halted and not view.halted:
            view.halted_at = seen_at
        if not halted:
            view.halted_at = None
        view.halted = halted


class BudgetWatcher:
    """Feeds a :class:`BudgetBoard` from the budgets topic until stopped."""

    def __init__(self, bootstrap: str, topics: Topics, board: BudgetBoard | None = None) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.board = board or BudgetBoard()
        self._consumer: AIOKafkaConsumer | None = None
        self.caught_up = asyncio.Event()

    async def start(self) -> None:
        consumer = AIOKafkaConsumer(
            **aiokafka_options(self.bootstrap),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=50,
        )
        await consumer.start()
        partitions: set[int] = set()
        deadline = time.monotonic() + 15
        while not partitions:
            # A topic created a moment ago may not be in this client's metadata yet.
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(self.topics.budgets) or set()
            if not partitions and time.monotonic() > deadline:
                await consumer.stop()
                raise BrokerError(f"topic {self.topics.budgets} does not exist: run `broker up`")
            if not partitions:
                await asyncio.sleep(0.2)
        tps = [TopicPartition(self.topics.budgets, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        self._end = await consumer.end_offsets(tps)
        self._consumer = consumer

    async def run(self) -> None:
        assert self._consumer is not None, "start() first"
        consumer = self._consumer
        if all(v == 0 for v in self._end.values()):
            self.caught_up.set()
        while True:
            batches = await consumer.getmany(timeout_ms=200, max_records=1000)
            for records in batches.values():
                for record in records:
                    try:
                        self.board.apply(ev.decode(record.value))
                    except EventDecodeError as exc:
                        # The ledger dead-letters these; a reader just moves on.
                        log.debug("ignoring undecodable budget event: %s", exc)
            if not self.caught_up.is_set():
                positions = {tp: await consumer.position(tp) for tp in self._end}
                if all(positions[tp] >= end for tp, end in self._end.items()):
                    self.caught_up.set()

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
