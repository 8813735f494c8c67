"""The dispatcher: prompt events in, inference requests out, outcomes back.

Contract, per prompt read from the prompts topic:
  * undecodable           -> dead-letter topic
  * dataset halted        -> ``PromptSkipped`` (checked when its turn comes, right
                             before the request is sent, and before each retry)
  * generated             -> ``CompletionEvent`` with the server's own token counts
  * failed after retries  -> ``PromptFailed`` plus a dead-letter event with the reason
Its offset is committed only after that outcome is acknowledged by Kafka, so a
crash re-dispatches unfinished prompts and never loses one.

:class:`Dispatcher` is the spine: it consumes prompts, gives each a place at the
server (a :class:`~tokenbudget.producers.dispatch.slots.Slot`), hands it to the steps of its path
and
commits its offset once it has its outcome; it stops by finishing what it started,
or by handing back what the server has not answered (:meth:`Dispatcher.hand_back`).
The path itself is composed in one place, :meth:`Dispatcher.compose`:

    ConversationTurns (producers/dispatch/turns.py)    what follows a conversation's turn
      -> Tries (producers/dispatch/tries.py)           admit, attempt, retry, or fail
        -> Route (producers/dispatch/route.py)         each attempt to a server of the fleet
          -> Attempt (producers/dispatch/attempt.py)   generate, fit, publish; tickets settled

with the parts they share: :class:`~tokenbudget.producers.dispatch.admission.Admission` (budget
leases),
:class:`~tokenbudget.producers.dispatch.caps.InFlight` (requests at the servers, caps of revoked
leases),
:class:`~tokenbudget.producers.dispatch.outcomes.Publisher` (outcomes to Kafka),
:class:`~tokenbudget.producers.inference.fleet.Fleet` (the servers: their places, health and pace)
and
:class:`~tokenbudget.producers.dispatch.slots.Places` (how many at once). Each step's contract is in
:mod:`tokenbudget.producers.dispatch.step` and its own module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

import kafka.errors
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from tokenbudget.core import metrics
from tokenbudget.core.config import Config, Server
from tokenbudget.core.errors import EventDecodeError
from tokenbudget.core.kafka import aiokafka_producer_options, consumer_options
from tokenbudget.core.retry import retry_until_async
from tokenbudget.core.tasks import cancel_and_wait
from tokenbudget.producers.dispatch import intake
from tokenbudget.producers.dispatch.admission import Admission
from tokenbudget.producers.dispatch.attempt import Attempt
from tokenbudget.producers.dispatch.caps import InFlight
from tokenbudget.producers.dispatch.leases import AdmissionSettings
from tokenbudget.producers.dispatch.offsets import OffsetTracker
from tokenbudget.producers.dispatch.outcomes import Publisher
from tokenbudget.producers.dispatch.route import Route
from tokenbudget.producers.dispatch.slots import Backlog, Places, Slot
from tokenbudget.producers.dispatch.step import DispatchReport
from tokenbudget.producers.dispatch.tries import Tries
from tokenbudget.producers.dispatch.turns import ConversationTurns
from tokenbudget.producers.inference.fleet import Fleet
from tokenbudget.producers.inference.generation import InferenceBackend, RetryPolicy
from tokenbudget.producers.inference.http import HttpClient
from tokenbudget.producers.inference.reasoning import ReasoningRows
from tokenbudget.producers.prompts import conversations
from tokenbudget.producers.prompts.resume import OutcomeView
from tokenbudget.streams import budget, codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)

PRODUCER_BATCH_BYTES = 512 * 1024
# How often each dispatcher publishes what it sees of the fleet (status, servers list).
FLEET_REPORT_S = 2.0
# Handing back: how long answers already in get to be published before they too are
# given up (one waiting for budget on an expired lease could wait for long).
HAND_BACK_GRACE_S = 10.0


class _CommitOnRevoke(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.dispatcher.commit()
        for tp in revoked:
            self.dispatcher.tracker.forget(tp.topic, tp.partition)
            self.dispatcher.backlog.forget(tp)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        # Prompts that come back (their dispatcher crashed between publishing and
        # committing) may be done by now: know which before dispatching them.
        with contextlib.suppress(Exception):  # then they are generated again, harmlessly
            await asyncio.to_thread(self.dispatcher.outcomes.refresh)


class Dispatcher:
    """One dispatcher process's consumer of prompts (``holder`` names it to the ledger;
    ``instance``, when given, is its static group membership). ``board`` is the
    budget board the process reads; ``backend_factory`` makes each server's inference
    backend from its HTTP client and its entry (default: the config's); ``keep_log``
    keeps every request sent in the report.

    Public contract: :meth:`run` (called once, by ``run``'s in-process dispatcher and
    by ``tokenbudget dispatch``), :meth:`hand_back` (from a signal handler),
    :meth:`commit` (the rebalance listener), :meth:`compose` (by :meth:`run`; tests
    call it with stand-ins), and after :meth:`run`: ``report``, ``refused_at``."""

    def __init__(
        self,
        config: Config,
        bootstrap: str,
        board: BudgetBoard,
        *,
        backend_factory: Callable[[HttpClient, Server], InferenceBackend] | None = None,
        keep_log: bool = False,
        holder: str | None = None,
        instance: str | None = None,
    ) -> None:
        self.config = config
        # The job's datasets (none named: a dispatcher's own config, which takes any).
        self.datasets = frozenset(d.name for d in config.datasets)
        self.bootstrap = bootstrap
        self.board = board
        self.topics = Topics(config.kafka.namespace)
        self.tracker = OffsetTracker()
        self.report = DispatchReport()
        self.keep_log = keep_log
        self.reasoning = ReasoningRows.for_config(config)
        self._backend_factory = backend_factory
        self._consumer: AIOKafkaConsumer | None = None
        self.places = Places(config.concurrency)
        # A whole dataset's queue (what the producer keeps it ahead by) may wait
        # without pausing its partition.
        self.backlog = Backlog(config.max_queued_per_dataset, self._pause, self._resume)
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # Static group membership (Kafka's group.instance.id), when named.
        self.instance = instance
        self.admission: Admission | None = None
        self.outcomes = OutcomeView(bootstrap, self.topics)
        self.refused_at: dict[str, float] = {}  # first refusal per dataset, this process
        self._handing_back = asyncio.Event()
        # No prompt is started any more: handing back, or every server is gone.
        self._no_more = asyncio.Event()

    @property
    def group_id(self) -> str:
        """The consumer group every dispatcher of the namespace shares."""
        return self.topics.dispatch_group

    async def commit(self) -> None:
        """Commit, for each partition assigned, the offsets up to the first prompt
        without an outcome yet. A failed commit is tried again on the next one; never
        raises. Called every half second while :meth:`run` runs, as it ends, and by
        the rebalance listener before partitions are taken away."""
        offsets = self.tracker.committable()
        if self._consumer is None or not offsets:
            return
        assigned = self._consumer.assignment()
        to_commit = {
            TopicPartition(topic, partition): offset
            for (topic, partition), offset in offsets.items()
            if TopicPartition(topic, partition) in assigned
        }
        if to_commit:
            with contextlib.suppress(Exception):  # retried on the next tick
                await self._consumer.commit(to_commit)

    def _pause(self, tp: Any) -> None:
        if self._consumer is not None and tp in self._consumer.assignment():
            self._consumer.pause(tp)

    def _resume(self, tp: Any) -> None:
        if self._consumer is not None and tp in self._consumer.assignment():
            self._consumer.resume(tp)

    def _clients(self) -> tuple[AIOKafkaConsumer, AIOKafkaProducer]:
        """The prompts consumer and the events producer, not started yet."""
        hold_ms = int(self.config.inference.prompt_hold_s * 1000)
        consumer = AIOKafkaConsumer(
            **consumer_options(self.bootstrap),
            group_id=self.group_id,
            # A restarted dispatcher of the same name takes its prompts straight back.
            group_instance_id=self.instance,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=self.config.concurrency,
            fetch_max_wait_ms=100,
            # A dispatcher that stops heartbeating (frozen, cut off, killed) keeps its
            # prompts this long: back within it, it claims the answers it holds
            # instead of others generating them again.
            session_timeout_ms=hold_ms,
            heartbeat_interval_ms=min(3000, hold_ms // 3),
            # Waiting for a free place at the server is not a stuck consumer: only a
            # missing heartbeat (above) takes its prompts away.
            max_poll_interval_ms=24 * 3600 * 1000,
        )
        consumer.subscribe([self.topics.prompts], listener=_CommitOnRevoke(self))
        producer = AIOKafkaProducer(
            **aiokafka_producer_options(self.bootstrap, self.config.kafka.compression),
            linger_ms=2,
            # aiokafka sends one request per broker at a time, with at most one batch
            # per partition: with its default 16 KiB batches every completion (tens of
            # KiB) would be a request of its own, and under load completions queued
            # for seconds before reaching Kafka, holding their slots meanwhile.
            max_batch_size=PRODUCER_BATCH_BYTES,
        )
        return consumer, producer

    def _admission(self, producer: AIOKafkaProducer) -> Admission:
        settings, inference = self.config.budget, self.config.inference
        return Admission(
            producer,
            self.topics,
            self.holder,
            self.board,
            AdmissionSettings(
                unit=settings.unit,
                policy=settings.on_boundary,
                cut=settings.cut,
                reserve=settings.reserve,
                min_new_tokens=settings.min_new_tokens,
                lease_size=budget.lease_size(
                    settings.unit,
                    settings.lease_tokens,
                    self.config.concurrency,
                    inference.max_new_tokens,
                ),
                lease_ttl_s=settings.lease_ttl_s,
            ),
        )

    def compose(
        self, producer: AIOKafkaProducer, admission: Admission | None, fleet: Fleet
    ) -> None:
        """Wire the steps of a prompt's path and the parts they share, in the one
        place they are wired: ``producer`` publishes the outcomes, ``admission`` (None
        when budgets are not reserved) admits, and hears its revocations through the
        register of requests in flight; ``fleet`` is the servers each attempt is
        routed to; the dispatcher's places follow its capacity, and its leases go
        back while none of its servers is up. Sets ``steps`` (the path's first step)
        and the parts a test may reach: ``publisher``, ``in_flight``, ``tries``,
        ``admission``, ``fleet``. Called by :meth:`run` once its clients are up;
        raises nothing."""
        inference = self.config.inference
        unit = self.config.budget.unit
        turns = conversations.Outcomes()  # what each conversation turn led to
        self.admission = admission
        self.fleet = fleet
        fleet.on_capacity = self.places.resize
        fleet.on_outage = self._no_more.set
        self.places.resize(fleet.capacity())
        self.publisher = Publisher(producer, self.topics, self.report, seen=turns.saw)
        self.in_flight = InFlight(admission, unit, inference.stream)
        if admission is not None:
            admission.on_revoke = self.in_flight.on_revoke
            fleet.on_idle = admission.hand_back_idle
        attempt = Attempt(
            self.publisher,
            self.in_flight,
            admission,
            self.board,
            self.reasoning,
            unit,
            self.report,
            keep_log=self.keep_log,
        )
        self.tries = Tries(
            Route(attempt, fleet),
            self.publisher,
            self.board,
            admission,
            self.outcomes,
            RetryPolicy(inference.retries, inference.backoff_s, inference.backoff_max_s),
            max_new_tokens=inference.max_new_tokens,
            report=self.report,
            refused_at=self.refused_at,
        )
        self.steps = ConversationTurns(
            self.tries,
            self.publisher,
            turns,
            max_prompt_bytes=self.config.producer.max_prompt_bytes,
        )

    async def _started_clients(self) -> tuple[AIOKafkaConsumer, AIOKafkaProducer]:
        """The clients, started once Kafka answers (a broker restarting as the
        dispatcher starts is waited out, with fresh clients each time)."""

        async def start() -> tuple[AIOKafkaConsumer, AIOKafkaProducer]:
            consumer, producer = self._clients()
            try:
                await producer.start()
                await asyncio.to_thread(self.outcomes.refresh)
                await consumer.start()
            except BaseException:
                with contextlib.suppress(Exception):
                    await consumer.stop()
                with contextlib.suppress(Exception):
                    await producer.stop()
                raise
            return consumer, producer

        def warn(exc: BaseException) -> None:
            log.warning("dispatcher: Kafka does not answer (%r); trying again", exc)

        return await retry_until_async(
            start,
            timeout=None,
            retry_on=(KafkaError, kafka.errors.KafkaError, OSError),
            interval=0.5,
            max_interval=5.0,
            on_retry=warn,
        )

    async def run(self, stop: asyncio.Event) -> DispatchReport:
        """Dispatch until ``stop`` is set (finishing what was started) or
        :meth:`hand_back` is called, then hand the leases back, commit and return
        the report. Raises :class:`~tokenbudget.core.errors.ServerOutageError` when every
        server of the fleet stays away past ``[inference] outage_timeout_s`` (after
        the same orderly stop); Kafka away at the start is waited out."""
        consumer, producer = await self._started_clients()
        self._consumer = consumer
        tasks: list[asyncio.Task[None]] = []
        admission = None
        if budget.reserves(self.config.budget.admission):
            admission = self.admission = self._admission(producer)
            tasks.append(asyncio.create_task(admission.maintain()))
        tasks.append(asyncio.create_task(self._commit_every(0.5)))
        fleet = Fleet.for_config(self.config, backend_factory=self._backend_factory)
        # The fleet's changes read so far, then each as it is read.
        changes = self.board.fleet
        changes.listeners.append(fleet.apply)
        try:
            for change in list(changes.changes):
                fleet.apply(change)
            await fleet.start()
            self.compose(producer, admission, fleet)
            tasks.append(asyncio.create_task(self._report_fleet(fleet)))
            await self._consume(consumer, stop)
            if fleet.outage is not None:
                raise fleet.outage
        finally:
            changes.listeners.remove(fleet.apply)
            for task in tasks:
                await cancel_and_wait(task)
            await fleet.close()
            if admission is not None:
                with contextlib.suppress(Exception):
                    await admission.close()
                for dataset, at in admission.refused_at.items():
                    self.refused_at.setdefault(dataset, at)
            await self.commit()
            await consumer.stop()
            await producer.stop()
            await asyncio.to_thread(self.outcomes.close)
            self._consumer = None
        return self.report

    async def _consume(self, consumer: AIOKafkaConsumer, stop: asyncio.Event) -> None:
        """Start each prompt consumed, once it has a place at the fleet, until a stop,
        a hand-back or the fleet's outage; then wind down what was started."""
        tasks: dict[asyncio.Task[None], Slot] = {}  # the prompts started, with their slots
        turns = intake.Turns()
        while not (stop.is_set() or self._no_more.is_set()):
            batches = await intake.next_prompts(consumer, turns, timeout_ms=200)
            for tp, records in batches.items():
                metrics.consumed(tp.topic, "dispatcher", len(records))
                for record in records:
                    # Started but not sent, a prompt handed back stays pending: the
                    # commit stops before it.
                    self.tracker.started(tp.topic, tp.partition, record.offset)
                    slot = await self.places.take(self._no_more)
                    if slot is None:
                        break
                    slot.on_wait = functools.partial(self.backlog.waiting, tp)
                    task = asyncio.create_task(self._handle(record, slot))
                    tasks[task] = slot
                    task.add_done_callback(lambda done: tasks.pop(done, None))
        # Graceful stop: finish what was started (handing back, only what the server
        # has answered), then commit it.
        if tasks:
            await self._wind_down(tasks)

    def hand_back(self) -> None:
        """Stop, handing back rather than finishing: no prompt is started any more,
        requests the server has not answered are given up (their prompts stay
        uncommitted, for the group's next dispatcher or a rerun), answers already in
        are published; then :meth:`run` commits and returns. Called from a signal
        handler (``run`` interrupted, or SIGINT to ``tokenbudget dispatch``)."""
        self._handing_back.set()
        self._no_more.set()

    async def _wind_down(self, tasks: dict[asyncio.Task[None], Slot]) -> None:
        """Wait for the prompts started; once handing back, cancel those the server has
        not answered (their slots say) and give the others :data:`HAND_BACK_GRACE_S` to
        be published."""
        slots = dict(tasks)
        started = list(slots)
        finished = asyncio.gather(*started, return_exceptions=True)
        handing_back = asyncio.ensure_future(self._handing_back.wait())
        either: set[asyncio.Future[Any]] = {finished, handing_back}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        handing_back.cancel()
        if not finished.done():
            for task in started:
                if not slots[task].answered:
                    task.cancel()
            _, late = await asyncio.wait(started, timeout=HAND_BACK_GRACE_S)
            for task in late:
                task.cancel()
        await finished

    async def _report_fleet(self, fleet: Fleet) -> None:
        """What this dispatcher sees of the fleet, on the reservations topic every
        :data:`FLEET_REPORT_S` (``tokenbudget status`` and ``servers list`` read it)."""

        async def publish(report: ev.FleetReport) -> None:
            key = ev.FLEET_KEY.decode()
            await self.publisher.publish(self.topics.reservations, key, report)

        await fleet.report_every(publish, self.holder, FLEET_REPORT_S)

    async def _commit_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.commit()

    async def _handle(self, record: Any, slot: Slot) -> None:
        """Give the prompt at ``record`` its outcome (through :attr:`steps`; a record
        that is not a prompt is dead-lettered), then let its offset be committed.
        Nothing but a stop (cancellation) or the fleet's outage leaves a prompt
        without an outcome (:meth:`tokenbudget.producers.dispatch.tries.Tries.submit`)."""
        try:
            try:
                prompt = codec.decode(record.value, record.topic)
                if not isinstance(prompt, ev.PromptEvent):
                    raise EventDecodeError(f"expected a prompt, got {type(prompt).__name__}")
                if self.datasets and prompt.dataset not in self.datasets:
                    # Its settings, budget and folder are the job's: another's prompt
                    # would be sent with defaults no one chose.
                    raise EventDecodeError(f"dataset {prompt.dataset!r} is not one of this job's")
            except EventDecodeError as exc:
                await self.publisher.dead_letter(str(exc), record)
            else:
                await self.steps.submit(prompt, slot)
        finally:
            slot.release()
        self.tracker.finished(record.topic, record.partition, record.offset)
