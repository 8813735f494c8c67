"""The Faust ledger worker: the single writer of per-dataset budget state.

It reads completions, prompt outcomes, operators' commands (the control topic) and
lease requests (all keyed by dataset, co-partitioned with its tables), applies
:mod:`tokenbudget.streams.ledger`, and publishes ``BudgetExceeded`` / ``BudgetRaised``
the moment a dataset crosses its line, plus a ``LedgerSnapshot`` of every dataset that
changed, a few times a second, on the budgets topic, which only it writes.

Undecodable events, and events that do not travel on the topic they were read from,
go to the dead-letter topic; the worker never stops for them.

:class:`LedgerWorker` holds the worker's state and steps; :func:`build_app` puts it
on a Faust app adapted by :mod:`tokenbudget.streams.faust_adapt` (read that for what differs
from stock Faust).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import faust
import msgspec
from aiokafka.partitioner import DefaultPartitioner

from tokenbudget.core import metrics, sizes
from tokenbudget.core.errors import EventDecodeError
from tokenbudget.core.security import faust_brokers, faust_credentials
from tokenbudget.streams import codec, faust_adapt, ledger
from tokenbudget.streams import events as ev
from tokenbudget.streams.dead_letters import dead_letter
from tokenbudget.streams.faust_adapt import HotPath
from tokenbudget.streams.topics import LEDGER_TABLE, OUTCOME_TABLE, Topics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LedgerSettings:
    bootstrap: str
    topics: Topics
    snapshot_interval: float = 0.5
    on_state: Callable[[ledger.DatasetLedger], None] | None = None  # metrics hook
    # Of the topics Faust may create itself (every other one exists before it starts).
    replication_factor: int = 1
    hot_path: HotPath = field(default_factory=HotPath)  # bench/ledger.py --without turns cuts off
    compression: sizes.Compression = sizes.DEFAULT_COMPRESSION  # of all it produces


BATCH = 1000
BATCH_WAIT_S = 0.01
SESSION_TIMEOUT_S = 10.0

_partitioner = DefaultPartitioner()


def partition_of(dataset: str, partitions: int) -> int:
    """The partition of a dataset's events (keyed by its name) on every topic, as the
    producers' default partitioner (murmur2, as Java's) places them."""
    return int(_partitioner(dataset.encode(), list(range(partitions)), list(range(partitions))))


def _exit_unless_written(future: asyncio.Future[Any]) -> None:
    if future.cancelled() or future.exception() is not None:
        _exit_after_failed_write("cancelled" if future.cancelled() else repr(future.exception()))


def _exit_after_failed_write(reason: str) -> NoReturn:
    log.critical(
        "ledger: a table changelog write failed (%s); exiting so the worker restarts "
        "from its committed offsets",
        reason,
    )
    os._exit(75)


@dataclass
class ReceivedOffsets:
    """The last offset of each source partition handed to this worker, within one
    consumer generation (a rebalance seeks, so offsets may jump then)."""

    generation: int | None = None
    last: dict[str, int] = field(default_factory=dict)

    def record(self, generation: int, source: str, offset: int) -> tuple[int, int] | None:
        """Note ``offset``; return the offsets (first, last) this worker never got if
        it jumped past some. Our topics are neither compacted nor transactional, so
        within a generation every offset reaches the worker, in order."""
        if generation != self.generation:
            self.generation = generation
            self.last.clear()
        previous = self.last.get(source)
        self.last[source] = offset
        if previous is not None and offset > previous + 1:
            return previous + 1, offset - 1
        return None


def _exit_after_skipped_delivery(topic: str, partition: int, skipped: tuple[int, int]) -> NoReturn:
    # Seen in the chaos run: messages dropped around a flow stop, later ones of the
    # same partition delivered (the race streams/faust_adapt/flow.py has since closed;
    # this stays as the guard for any other). Applying them would move the
    # dataset's applied offset past events it never saw, which would then be
    # skipped as duplicates. The skipped ones were never acked, so a restart reads
    # them again, in order.
    log.critical(
        "ledger: %s[%d] offsets %d..%d were never delivered to this worker; exiting so "
        "it restarts from its committed offsets",
        topic,
        partition,
        *skipped,
    )
    os._exit(75)


def _exit_after_failed_apply(message: Any, exc: Exception) -> NoReturn:
    # An event that passed the decoder's checks and still cannot be applied is a
    # bug, not a bad record: skipping it would leave its tokens uncounted (a budget
    # overshot). The worker stops with one line naming it, and `run` says so.
    log.critical(
        "ledger: applying %s[%d]@%d failed (%s: %s); exiting without committing it",
        message.topic,
        message.partition,
        message.offset,
        type(exc).__name__,
        exc,
    )
    os._exit(70)


@dataclass
class BatchChanges:
    """What one batch of events changes, before any of it is written."""

    states: dict[str, ledger.DatasetLedger] = field(default_factory=dict)
    partition_of: dict[str, int] = field(default_factory=dict)  # dataset -> its partition
    # outcome-table key -> (partition, value)
    outcome_entries: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    announce: list[ev.Event] = field(default_factory=list)
    per_topic: dict[str, int] = field(default_factory=dict)  # events consumed


class LedgerWorker:
    """The ledger's tables, topics and steps on one Faust app.

    :meth:`process` applies a batch of source events; two timers publish snapshots
    (:meth:`publish_snapshots`) and expire leases (:meth:`expire_leases`).
    :meth:`register` puts the three on the app.
    """

    def __init__(self, app: faust.App, settings: LedgerSettings) -> None:
        topics = settings.topics
        self.app = app
        self.settings = settings
        self.datasets = app.Table(
            LEDGER_TABLE, partitions=topics.partitions, key_type=str, value_type=bytes
        )
        self.outcomes = app.Table(
            OUTCOME_TABLE, partitions=topics.partitions, key_type=str, value_type=bytes
        )
        self.datasets_changelog = self.datasets.changelog_topic.get_topic_name()
        sources = [topics.completions, topics.outcomes, topics.control, topics.reservations]
        self.ownership = faust_adapt.Ownership(
            app, sources, self.datasets_changelog, SESSION_TIMEOUT_S
        )
        faust_adapt.recover_preferring(self.datasets, ledger.newer_owner)
        faust_adapt.recover_preferring(self.outcomes, ledger.not_a_lost_completion)
        self.outcomes_changelog = self.outcomes.changelog_topic.get_topic_name()
        self.dataset_key = faust_adapt.changelog_key_encoder(self.datasets)
        self.outcome_key = faust_adapt.changelog_key_encoder(self.outcomes)
        self.source = app.topic(
            *sources,
            schema=faust.Schema(key_type=bytes, value_type=bytes),
            partitions=topics.partitions,
        )
        self.budgets_out = self._raw_topic(topics.budgets)
        self.completions_out = self._raw_topic(topics.completions)
        self.dead_letter = self._raw_topic(topics.dead_letter)
        self.reservations = self._raw_topic(topics.reservations)

        self.dirty: set[str] = set()
        # Table writes not yet on the broker: a snapshot waits for them, so that no
        # reader ever sees counts a restarted (or the next) owner would not recover.
        self.unwritten: list[asyncio.Future[Any]] = []
        self.received = ReceivedOffsets()
        # No snapshot leaves between a state's write and its announcements: a
        # dispatcher takes a snapshot showing a lowered budget as the end of that
        # lowering's revocations (streams/budget_board.py).
        self.announcing = asyncio.Lock()
        self.ticks = 0
        self.full_every = max(1, round(5.0 / settings.snapshot_interval))

    def _raw_topic(self, name: str) -> Any:
        return self.app.topic(name, key_serializer="raw", value_serializer="raw")

    def register(self) -> None:
        """Put the ledger agent and the two timers on the app."""
        self.app.agent(self.source, name="ledger")(self.consume)
        self.app.timer(self.settings.snapshot_interval)(self.publish_snapshots)
        self.app.timer(1.0)(self.expire_leases)

    async def consume(self, stream: Any) -> None:
        async for batch in stream.take_events(BATCH, within=BATCH_WAIT_S):
            await self.process(list(batch))

    # -- reading state ------------------------------------------------------------------

    def load(self, dataset: str) -> ledger.DatasetLedger:
        raw = self.datasets.data.get(dataset)
        return ledger.load_ledger(raw) if raw else ledger.DatasetLedger(dataset=dataset)

    def dataset_partition(self, dataset: str) -> int:
        return partition_of(dataset, self.settings.topics.partitions)

    def recorded(
        self, key: str, pending: dict[str, tuple[int, bytes]]
    ) -> ledger.OutcomeEntry | None:
        # .data: the local store, without Faust's per-read sensors
        raw = pending[key][1] if key in pending else self.outcomes.data.get(key)
        return ledger.load_outcome(raw) if raw else None

    # -- one batch ----------------------------------------------------------------------

    async def process(self, batch: list[Any]) -> None:
        """Apply a batch of events, persist, then announce.

        Each dataset's entry records the last offset applied per source partition, and
        each prompt's outcome entry the offset of the event that set it, so events
        Faust hands over again after a crash are recognised whichever of the two
        writes made it out before the crash. Announcements (grants, halts) leave
        only after the state they describe is written to the changelog.
        """
        changes = await self.apply_batch(batch)
        for topic, count in changes.per_topic.items():
            metrics.consumed(topic, "ledger", count)
        if not changes.states:
            return
        await self.still_owner()
        sent = await self.write_outcomes(changes)
        await self.write_states_and_announce(changes, sent)

    async def apply_batch(self, batch: list[Any]) -> BatchChanges:
        """The batch's events applied in memory (nothing written yet); undecodable
        ones dead-lettered on the way; a delivery gap ends the worker."""
        at = ev.now()
        changes = BatchChanges()
        for event in batch:
            message = event.message
            changes.per_topic[message.topic] = changes.per_topic.get(message.topic, 0) + 1
            # Per topic *and* partition: clients with different partitioners may
            # put one dataset's events on different partitions of a topic.
            source = f"{message.topic}:{message.partition}"
            skipped = self.received.record(self.app.consumer_generation_id, source, message.offset)
            if skipped is not None:
                _exit_after_skipped_delivery(message.topic, message.partition, skipped)
            try:
                decoded = codec.decode(event.value, message.topic)
            except EventDecodeError as exc:
                await self.send_dead_letter(event, exc)
                continue
            # Only what travels on its sources decodes (codec.ON_TOPIC): events without a
            # dataset (the job's identity, the fleet's changes and reports) pass by.
            name = getattr(decoded, "dataset", None)
            if not isinstance(name, str):
                continue
            state = changes.states.get(name) or self.load(name)
            if message.offset <= state.applied.get(source, -1):
                continue  # applied before a restart
            try:
                transition, entries = self.apply(
                    state, decoded, message, at, changes.outcome_entries
                )
            except Exception as exc:
                _exit_after_failed_apply(message, exc)
            changes.states[name] = msgspec.structs.replace(
                transition.state, applied={**state.applied, source: message.offset}
            )
            changes.partition_of[name] = message.partition
            for key, value in entries:
                changes.outcome_entries[key] = (message.partition, value)
            changes.announce.extend(transition.emit)
        return changes

    async def still_owner(self) -> None:
        """Before writing state: a worker frozen past its session may have been
        expelled; its next heartbeat says. Expelled, it must not write: it exits and
        starts again from what is durable (committed offsets, the changelog)."""
        ownership = self.ownership
        if ownership.current() or await ownership.confirmed(timeout=SESSION_TIMEOUT_S):
            return
        log.critical(
            "ledger: no longer sure to own its partitions (a heartbeat older than the "
            "session); exiting so it rejoins the group and recovers"
        )
        os._exit(75)

    async def write_outcomes(self, changes: BatchChanges) -> list[asyncio.Future[Any]]:
        """The batch's outcome entries, into the table and queued to its changelog."""
        writes: dict[int, list[tuple[str, bytes]]] = {}
        for prompt_id, (partition, value) in changes.outcome_entries.items():
            self.outcomes.data[prompt_id] = value
            writes.setdefault(partition, []).append((prompt_id, value))
        return await self.write_changelogs(self.outcomes, writes)

    async def write_states_and_announce(
        self, changes: BatchChanges, sent: list[asyncio.Future[Any]]
    ) -> None:
        """The batch's dataset states, into the table and queued to its changelog;
        once every write of the batch is on the broker, its announcements."""
        async with self.announcing:
            writes: dict[int, list[tuple[str, bytes]]] = {}
            for name, state in changes.states.items():
                partition = changes.partition_of[name]
                epoch = self.ownership.write_epoch(partition)
                value = ledger.dump_ledger(msgspec.structs.replace(state, epoch=epoch))
                self.datasets.data[name] = value
                writes.setdefault(partition, []).append((name, value))
                self.dirty.add(name)  # metrics and snapshots follow on the timer
            sent += await self.write_changelogs(self.datasets, writes)
            # A batch's events are acked when this returns, and Faust flushes its
            # producer before every offset commit, so a commit never covers table
            # writes still in flight. A write that *failed* (after the client's
            # retries: a broker gone too long) would be committed past all the same:
            # the worker exits instead, before the commit can be sent, and starts
            # again from what is durable (committed offsets and the changelog).
            for future in sent:
                future.add_done_callback(_exit_unless_written)
            self.unwritten[:] = [f for f in self.unwritten if not f.done()] + sent
            if changes.announce:
                await asyncio.gather(*sent)  # a halt announces only what is durable
                await self.publish(changes.announce)

    async def write_changelogs(
        self, table: Any, writes: dict[int, list[tuple[str, bytes]]]
    ) -> list[asyncio.Future[Any]]:
        """Queue ``table``'s changes (key, value per partition) to its changelog; the
        futures say when each is on the broker. Its in-memory data is already updated."""
        if not self.settings.hot_path.changelog_batches:
            return [
                table.send_changelog(partition, key, value)
                for partition, entries in writes.items()
                for key, value in entries
            ]
        if table is self.datasets:
            topic, encode = self.datasets_changelog, self.dataset_key
        else:
            topic, encode = self.outcomes_changelog, self.outcome_key
        encoded = {p: [(encode(key), value) for key, value in kv] for p, kv in writes.items()}
        producer = faust_adapt.kafka_producer(self.app)
        sent: list[asyncio.Future[Any]] = []
        try:
            for partition, entries in encoded.items():
                sent += await faust_adapt.write_changelog(producer, topic, partition, entries)
        except Exception as exc:  # not queued: a timeout, a closed or failed producer
            _exit_after_failed_write(repr(exc))
        return sent

    # -- applying one event -------------------------------------------------------------

    def apply(
        self,
        state: ledger.DatasetLedger,
        event: ev.Event,
        message: Any,
        at: float,
        pending: dict[str, tuple[int, bytes]],
    ) -> tuple[ledger.Transition, list[tuple[str, bytes]]]:
        """The event applied to the dataset's state, and the outcome-table entries it
        records (prompt outcomes, fenced leases, copies already taken off a lease)."""
        match event:
            case ev.CompletionEvent() | ev.PromptSkipped() | ev.PromptFailed():
                return self.apply_outcome(state, event, message, at, pending)
            case ev.LeaseFenced():
                entry = ledger.OutcomeEntry("fenced", None, message.topic, message.offset)
                key = ledger.FENCE_KEY + event.lease_id
                recorded = self.recorded(key, pending)
                written = [] if recorded else [(key, ledger.dump_outcome(entry))]
                return ledger.apply_lease_fenced(state, event, at), written
            case ev.BudgetSet():
                return ledger.apply_budget_set(state, event, at), []
            case ev.ProducerDone():
                return ledger.apply_producer_done(state, event), []
            case ev.SnapshotAsked():
                # Nothing changes but the offset applied: the state is written, so the
                # dataset is announced on the next tick (publish_snapshots).
                return ledger.Transition(state), []
            case ev.LeaseRequested():
                fenced = self.recorded(ledger.FENCE_KEY + event.lease_id, pending) is not None
                return ledger.apply_lease_request(state, event, at, fenced=fenced), []
            case ev.LeaseRenewed():
                return ledger.apply_lease_renewed(state, event, at), []
            case ev.LeaseReleased():
                return ledger.apply_lease_released(state, event, at), []
            case ev.LeaseExpired():
                return ledger.apply_lease_expired(state, event, at), []
        return ledger.Transition(state), []

    def apply_outcome(
        self,
        state: ledger.DatasetLedger,
        event: ev.CompletionEvent | ev.PromptSkipped | ev.PromptFailed,
        message: Any,
        at: float,
        pending: dict[str, tuple[int, bytes]],
    ) -> tuple[ledger.Transition, list[tuple[str, bytes]]]:
        pid = event.prompt_id
        entry = self.recorded(pid, pending)
        if entry and entry.topic == message.topic and entry.offset == message.offset:
            previous = entry.prior  # recorded, but the dataset entry was not
        else:
            previous = entry.outcome if entry else None
        written: list[tuple[str, bytes]] = []
        fenced = new_copy = False
        if isinstance(event, ev.CompletionEvent) and event.lease_id:
            fenced = self.recorded(ledger.FENCE_KEY + event.lease_id, pending) is not None
            copy_key = ledger.COPY_KEY + event.request_id
            new_copy = (
                not fenced
                and previous == "completed"
                and entry is not None
                and entry.request != event.request_id
                and self.recorded(copy_key, pending) is None
            )
            if new_copy:
                copy = ledger.OutcomeEntry("copy", None, message.topic, message.offset)
                written.append((copy_key, ledger.dump_outcome(copy)))
        transition = ledger.apply_outcome(
            state,
            event,
            previous,  # type: ignore[arg-type]
            at,
            fenced=fenced,
            new_copy=new_copy,
        )
        if transition.outcome is not None:
            request = event.request_id if isinstance(event, ev.CompletionEvent) else ""
            record = ledger.OutcomeEntry(
                transition.outcome, previous, message.topic, message.offset, request
            )
            written.append((pid, ledger.dump_outcome(record)))
        return transition, written

    # -- what the worker publishes ------------------------------------------------------

    async def publish(self, events: list[ev.Event]) -> None:
        """Announce, stamped with this worker's epoch for each dataset's partition;
        nothing for a partition it may no longer speak for (a rebalance started)."""
        for event in events:
            partition = self.dataset_partition(str(getattr(event, "dataset", "")))
            epoch = self.ownership.epoch(partition)
            if epoch is None:
                log.info("not announcing %s: its partition is being handed over", event)
                continue
            event = msgspec.structs.replace(event, epoch=epoch)  # type: ignore[type-var]
            # A fence goes where the lease's completions go, to order itself among them.
            fenced = isinstance(event, ev.LeaseFenced)
            out = self.completions_out if fenced else self.budgets_out
            fut = await out.send(key=codec.event_key(event), value=codec.encode(event))
            await fut  # a halt that was not delivered is a budget overshot
            metrics.EVENTS_PRODUCED.labels(topic="completions" if fenced else "budgets").inc()

    async def send_dead_letter(self, event: Any, exc: EventDecodeError) -> None:
        message = event.message
        letter = dead_letter(
            str(exc),
            source_topic=message.topic,
            payload=event.value,
            partition=message.partition,
            offset=message.offset,
            key=event.key,
        )
        await self.dead_letter.send(key=event.key, value=codec.encode(letter))
        metrics.DEAD_LETTERED.labels(topic=metrics.topic_role(message.topic)).inc()
        log.warning(
            "dead-lettered %s[%d]@%d: %s", message.topic, message.partition, message.offset, exc
        )

    async def publish_snapshots(self) -> None:
        """A snapshot of every dataset changed since the last one (of every dataset,
        every few seconds), once the table writes behind it are on the broker."""
        if self.ticks % self.full_every == 0:
            # Every few seconds, and so soon after any restart or recovery, tell
            # every reader where each dataset stands, changed or not.
            self.dirty.update(str(key) for key in self.datasets)
        self.ticks += 1
        if not self.dirty:
            return
        async with self.announcing:
            await asyncio.gather(*self.unwritten)  # only what a recovery would find again
            at = ev.now()
            names = sorted(self.dirty)
            self.dirty.clear()
            for name in names:
                epoch = self.ownership.epoch(self.dataset_partition(name))
                if epoch is None:
                    continue  # not ours (any more): its owner speaks for it
                state = self.load(name)
                snap = msgspec.structs.replace(ledger.snapshot(state, at), epoch=epoch)
                await self.budgets_out.send(key=name.encode(), value=codec.encode(snap))
                metrics.EVENTS_PRODUCED.labels(topic="budgets").inc()
                if self.settings.on_state:
                    self.settings.on_state(state)

    async def expire_leases(self) -> None:
        """Announce the expiry of every lease past its deadline on datasets this
        worker speaks for."""
        # Tables can only be written while processing an event, so expiry goes
        # through the reservations topic like any other lease change.
        now = ev.now()
        for name in list(self.datasets):
            if self.ownership.epoch(self.dataset_partition(str(name))) is None:
                continue
            for lease_id in ledger.expired_leases(self.load(str(name)), now):
                expired = ev.LeaseExpired(dataset=str(name), lease_id=lease_id, at=now)
                await self.reservations.send(key=str(name).encode(), value=codec.encode(expired))


def new_app(settings: LedgerSettings) -> faust.App:
    """The ledger's Faust app, configured, with no table, topic or agent yet."""
    topics = settings.topics
    datadir = Path(tempfile.gettempdir()) / "tokenbudget-faust" / topics.ledger_app_id
    datadir.mkdir(parents=True, exist_ok=True)
    return faust_adapt.LedgerApp(
        topics.ledger_app_id,
        broker=faust_brokers(settings.bootstrap),
        broker_credentials=faust_credentials(settings.bootstrap),
        store="memory://",
        # Faust keeps a data folder even for the memory store; not in the cwd.
        datadir=str(datadir),
        web_enabled=False,
        topic_partitions=topics.partitions,
        topic_replication_factor=settings.replication_factor,
        topic_allow_declare=True,
        table_standby_replicas=0,
        consumer_auto_offset_reset="earliest",
        broker_commit_every=1000,
        broker_commit_interval=0.5,
        stream_wait_empty=False,
        # The stream pauses fetching a partition whenever this many events wait for
        # the agent, and a paused fetch stalls the worker for a broker round trip:
        # at Faust's 4,096 the ledger sat idle a third of the time. It bounds the
        # memory of a catching-up worker at this many events (bench/ledger.py).
        stream_buffer_maxsize=16384,
        producer_acks=-1,
        producer_linger=0.005,
        # One record batch per changelog partition per processed batch: a second
        # batch for the same partition waits until the first has left.
        producer_max_batch_size=512 * 1024,
        # Faust hands both to aiokafka, whose changelog batches
        # (faust_adapt.write_changelog) are compressed as its sends are.
        producer_max_request_size=sizes.MESSAGE_BYTES,
        producer_compression_type=sizes.compression_type(settings.compression),
        consumer_max_fetch_size=sizes.MESSAGE_BYTES,
        # A killed worker's partitions move to its replacement after this long;
        # Faust's default (60 s) would stall a restarted ledger for a minute.
        broker_session_timeout=SESSION_TIMEOUT_S,
        broker_heartbeat_interval=1.0,
        key_serializer="raw",
        value_serializer="raw",
    )


def build_app(settings: LedgerSettings) -> faust.App:
    """The ledger worker's Faust app, ready to run (checks the Faust versions first:
    ``FaustVersionError``)."""
    faust_adapt.install()
    app = new_app(settings)
    faust_adapt.use_ledger_clients(app, settings.hot_path)
    LedgerWorker(app, settings).register()
    return app


def run_worker(settings: LedgerSettings, *, loglevel: str = "warning") -> None:
    """Run the ledger until SIGTERM/SIGINT (Faust handles both gracefully)."""
    app = build_app(settings)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.spinner = None  # its terminal spinner would draw over `run`'s progress bars
    worker.execute_from_commandline()
