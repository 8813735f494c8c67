"""The budget board: every process's local view of which datasets are halted.

It reads the budgets topic (the ledger's announcements) and the control topic (the
operators' commands) from the beginning with no consumer group (each process needs
every event, not a share of them) and keeps, per dataset, whether it is halted and
the ledger's latest snapshot; each event is believed only from the topic it travels
on (:data:`tokenbudget.streams.codec.ON_TOPIC`), which only its writers' principals
may write. Producers consult it before publishing a
prompt and dispatchers before sending a request, so a halt takes effect as soon as
its event is read.

It also tracks budgets being lowered: from a ``BudgetSet`` below the budget asked
before until a ledger snapshot shows the new budget applied, the dataset is
*lowering*. The ledger publishes its revocations before that snapshot, so a
dispatcher that waits out a lowering (:meth:`BudgetBoard.decided`) after a
:meth:`BudgetBoard.sync` knows, before it publishes a completion, every cap the
ledger had set when the completion finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from tokenbudget.core import metrics
from tokenbudget.core.errors import BrokerError, EventDecodeError
from tokenbudget.core.kafka import consumer_options, wait_for_partitions_aio
from tokenbudget.core.retry import retry_until_async
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)


@dataclass
class DatasetView:
    halted: bool = False
    halted_at: float | None = None  # when this process saw the halt
    snapshot: ev.LedgerSnapshot | None = None
    epoch: int = 0  # the highest ledger epoch seen for the dataset


@dataclass
class FleetBook:
    """The fleet's changes made at run time (``tokenbudget servers add|drain``), in
    the order they were made, and the latest report of each dispatcher; ``listeners``
    hear each change as it is read (a dispatcher's fleet applies it)."""

    changes: list[ev.ServerAdded | ev.ServerDrained] = field(default_factory=list)
    reports: dict[str, ev.FleetReport] = field(default_factory=dict)
    listeners: list[Callable[[ev.ServerAdded | ev.ServerDrained], None]] = field(
        default_factory=list
    )

    def apply(self, event: ev.ServerAdded | ev.ServerDrained | ev.FleetReport) -> None:
        if isinstance(event, ev.FleetReport):
            self.reports[event.holder] = event
            return
        self.changes.append(event)
        for listener in list(self.listeners):
            listener(event)


@dataclass
class BudgetBoard:
    """Apply budget-topic events; pure state so it is testable without a broker."""

    views: dict[str, DatasetView] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Lease replies are addressed to one dispatcher: routed by holder id.
    lease_listeners: dict[str, Callable[[ev.Event], None]] = field(default_factory=dict)
    # The latest budget asked for per dataset (BudgetSet), and the datasets whose
    # budget was lowered and the ledger has not shown it applied yet.
    requested: dict[str, int] = field(default_factory=dict)
    _lowering: dict[str, asyncio.Event] = field(default_factory=dict)
    # Set by a BudgetWatcher: returns once every event on the budgets topic when it
    # was called has been applied here.
    syncer: Callable[[], Awaitable[None]] | None = None
    # Set once the board has read the topic's history: halts it applies from then on
    # are news, and how long they took to arrive is the halt latency.
    live: bool = False
    fleet: FleetBook = field(default_factory=FleetBook)

    def view(self, dataset: str) -> DatasetView:
        return self.views.setdefault(dataset, DatasetView())

    def is_halted(self, dataset: str) -> bool:
        view = self.views.get(dataset)
        return view is not None and view.halted

    def snapshot(self, dataset: str) -> ev.LedgerSnapshot | None:
        view = self.views.get(dataset)
        return view.snapshot if view else None

    def lowering(self, dataset: str) -> bool:
        """A lower budget was asked for and the ledger has not applied it yet."""
        return dataset in self._lowering

    async def decided(self, dataset: str) -> None:
        """Return once no lowering of the dataset's budget is pending."""
        while (pending := self._lowering.get(dataset)) is not None:
            await pending.wait()

    async def sync(self) -> None:
        """Return once every budgets-topic event published before this call has
        been applied (at once without a watcher: then the board is fed by hand)."""
        if self.syncer is not None:
            await self.syncer()

    def apply(self, event: ev.Event, seen_at: float | None = None) -> None:
        seen_at = time.time() if seen_at is None else seen_at
        if isinstance(event, ev.LedgerEvents):
            view = self.view(event.dataset)
            if event.epoch < view.epoch:
                return  # from a ledger worker that had lost the dataset's partition
            view.epoch = event.epoch
        match event:
            case ev.BudgetExceeded():
                if self.live and event.at > 0 and not self.is_halted(event.dataset):
                    metrics.HALT_LATENCY.observe(max(0.0, seen_at - event.at))
                self._set_halted(event.dataset, True, seen_at)
            case ev.BudgetRaised():
                self._set_halted(event.dataset, False, seen_at)
            case ev.BudgetSet():
                self._budget_asked(event)
                return
            case ev.ServerAdded() | ev.ServerDrained() | ev.FleetReport():
                self.fleet.apply(event)
                return
            case ev.LeaseGranted() | ev.LeaseDenied() | ev.LeaseRevoked():
                listener = self.lease_listeners.get(event.holder)
                if listener is not None:
                    listener(event)
                return
            case ev.LedgerSnapshot():
                # A new owner's clock may be behind its predecessor's: its first
                # snapshot wins by epoch (an older owner's were dropped above).
                view = self.view(event.dataset)
                current = view.snapshot
                if current is None or event.epoch > current.epoch or event.at >= current.at:
                    view.snapshot = event
                    self._set_halted(event.dataset, event.halted, seen_at)
                pending = self._lowering.get(event.dataset)
                if pending is not None and event.budget == self.requested.get(event.dataset):
                    del self._lowering[event.dataset]
                    pending.set()
            case _:
                return
        self.changed.set()

    def _budget_asked(self, event: ev.BudgetSet) -> None:
        before = self.requested.get(event.dataset)
        if before is None:
            snap = self.snapshot(event.dataset)
            before = snap.budget if snap is not None else None
        self.requested[event.dataset] = event.budget
        if before is not None and event.budget < before and event.dataset not in self._lowering:
            self._lowering[event.dataset] = asyncio.Event()

    def _set_halted(self, dataset: str, halted: bool, seen_at: float) -> None:
        view = self.view(dataset)
        if halted and not view.halted:
            view.halted_at = seen_at
        if not halted:
            view.halted_at = None
        view.halted = halted


# Of the reservations topic (lease traffic, days of it) a watcher that shows the fleet
# reads only this far back: every dispatcher reports every few seconds.
FLEET_REPORTS_SINCE_S = 60.0


class BudgetWatcher:
    """Feeds a :class:`BudgetBoard` from the budgets and control topics until
    stopped; with ``fleet_reports``, also the dispatchers' latest fleet reports (from
    the reservations topic, the last :data:`FLEET_REPORTS_SINCE_S` seconds of it)."""

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        board: BudgetBoard | None = None,
        *,
        fleet_reports: bool = False,
    ) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.board = board or BudgetBoard()
        self.reads = [topics.budgets, topics.control]
        self.recent = [topics.reservations] if fleet_reports else []
        self._consumer: AIOKafkaConsumer | None = None
        self.caught_up = asyncio.Event()
        self._advanced = asyncio.Event()  # set (and replaced) after each read
        self._sync_waiters: list[asyncio.Future[None]] = []
        self._sync_task: asyncio.Task[None] | None = None
        self._told: set[str] = set()

    async def _started_consumer(self) -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(
            **consumer_options(self.bootstrap),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=50,
        )
        try:
            await consumer.start()
        except KafkaError:
            with contextlib.suppress(Exception):
                await consumer.stop()
            raise
        return consumer

    async def start(self) -> None:
        consumer = await retry_until_async(  # a broker restarting as we start is waited out
            self._started_consumer,
            timeout=None,
            retry_on=KafkaError,
            interval=0.5,
            max_interval=5.0,
            on_retry=lambda exc: log.warning(
                "budgets reader: Kafka does not answer (%r); trying again", exc
            ),
        )
        whole: list[TopicPartition] = []
        recent: list[TopicPartition] = []
        try:
            for topic in [*self.reads, *self.recent]:
                tps = await wait_for_partitions_aio(
                    consumer,
                    topic,
                    timeout=15,
                    missing=f"topic {topic} does not exist: run `broker up`",
                )
                (recent if topic in self.recent else whole).extend(tps)
        except BrokerError:
            await consumer.stop()
            raise
        consumer.assign([*whole, *recent])
        await consumer.seek_to_beginning(*whole)
        if recent:
            since = int((time.time() - FLEET_REPORTS_SINCE_S) * 1000)
            found = await consumer.offsets_for_times({tp: since for tp in recent})
            for tp in recent:
                at = found.get(tp)
                if at is None:
                    await consumer.seek_to_end(tp)
                else:
                    consumer.seek(tp, at.offset)
        self._end = await consumer.end_offsets([*whole, *recent])
        self._consumer = consumer
        self.board.syncer = self.sync

    async def run(self) -> None:
        assert self._consumer is not None, "start() first"
        consumer = self._consumer
        if all(v == 0 for v in self._end.values()):
            self.caught_up.set()
            self.board.live = True
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=200, max_records=1000)
            except Exception as exc:
                # Nobody awaits this task until it is cancelled: were it to end here,
                # the board would freeze with it, silently (no halts, no revocations).
                log.warning("reading %s failed, reading on: %r", self.topics.budgets, exc)
                await asyncio.sleep(0.5)
                continue
            for records in batches.values():
                for record in records:
                    try:
                        self.board.apply(codec.decode(record.value, record.topic))
                    except EventDecodeError as exc:
                        # The ledger dead-letters what it reads; a reader moves on.
                        self._refused(record, exc)
                    except Exception:
                        log.exception("applying a budget event failed; reading on")
            # Positions move when getmany hands records over, and these were applied
            # before any other task ran: a position is what the board has seen.
            advanced, self._advanced = self._advanced, asyncio.Event()
            advanced.set()
            if not self.caught_up.is_set():
                positions = {tp: await consumer.position(tp) for tp in self._end}
                if all(positions[tp] >= end for tp, end in self._end.items()):
                    self.caught_up.set()
                    self.board.live = True

    def _refused(self, record: Any, exc: EventDecodeError) -> None:
        """One line per topic, then quiet: a refused event is not applied, and a
        topic that carries many (a writer gone astray) must not flood the log."""
        if record.topic in self._told:
            log.debug("refused %s[%d]@%d: %s", record.topic, record.partition, record.offset, exc)
            return
        self._told.add(record.topic)
        log.warning(
            "refused %s[%d]@%d, not applied (others of this topic are logged at DEBUG): %s",
            record.topic,
            record.partition,
            record.offset,
            exc,
        )

    async def sync(self) -> None:
        """Return once every event on the budgets topic before this call is applied
        to the board: the end offsets are asked for after the call (one request
        serves every caller waiting when it is sent), then :meth:`run` reads up to
        them."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sync_waiters.append(waiter)
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.create_task(self._serve_syncs())
        await asyncio.shield(waiter)

    async def _serve_syncs(self) -> None:
        while self._sync_waiters:
            waiters, self._sync_waiters = self._sync_waiters, []
            try:
                await self._read_to(await self._end_offsets())
            except BaseException as exc:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(BrokerError(f"budgets not synced: {exc!r}"))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def _read_to(self, ends: dict[TopicPartition, int]) -> None:
        assert self._consumer is not None, "start() first"
        for tp, end in ends.items():
            while await self._consumer.position(tp) < end:
                await self._advanced.wait()

    async def _end_offsets(self) -> dict[TopicPartition, int]:
        assert self._consumer is not None, "start() first"
        attempt = 0
        while True:
            try:
                return dict(await self._consumer.end_offsets(list(self._end)))
            except Exception as exc:  # a broker hiccup: ask again, a few times
                attempt += 1
                if attempt >= 5:
                    topic = self.topics.budgets
                    raise BrokerError(f"cannot read the end of {topic}: {exc}") from exc
                await asyncio.sleep(0.1 * attempt)

    async def stop(self) -> None:
        if self.board.syncer == self.sync:
            self.board.syncer = None
        if self._sync_task is not None:
            self._sync_task.cancel()
        for waiter in self._sync_waiters:
            if not waiter.done():
                waiter.set_exception(BrokerError("the budgets watcher stopped"))
        self._sync_waiters = []
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
