"""The Faust ledger worker: the single writer of per-dataset budget state.

It reads completions, prompt outcomes and budget commands (all keyed by dataset,
co-partitioned with its tables), applies :mod:`streams.ledger`, and publishes
``BudgetExceeded`` / ``BudgetRaised`` the moment a dataset crosses its line, plus a
``LedgerSnapshot`` of every dataset that changed, a few times a second.

Undecodable events go to the dead-letter topic; the worker never stops for them.
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
from faust.transport.producer import ProducerBuffer

from streams import events as ev
from streams import faust_ownership, ledger
from streams.faust_flow import LedgerApp, LedgerConsumer, LedgerProducer
from streams.faust_hot_path import (
    QuietMonitor,
    RawSchema,
    changelog_key_encoder,
    kafka_producer,
    write_changelog,
)
from streams.topics import LEDGER_TABLE, OUTCOME_TABLE, Topics
from tokenbudget import metrics
from tokenbudget.errors import EventDecodeError
from tokenbudget.security import faust_brokers, faust_credentials

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LedgerSettings:
    bootstrap: str
    topics: Topics
    snapshot_interval: float = 0.5
    on_state: Callable[[ledger.DatasetLedger], None] | None = None  # metrics hook
    # Of the topics Faust may create itself (every other one exists before it starts).
    replication_factor: int = 1


# Faust holds every message delivery while more than this many of its own sends
# (announcements, snapshots, dead letters) are unsent; its default of 100 stalls
# the ledger whenever the broker is slow, as in a broker restart.
ProducerBuffer.max_messages = 20_000


BATCH = 1000
BATCH_WAIT_S = 0.01
SESSION_TIMEOUT_S = 10.0
IGNORED = (
    ev.BudgetExceeded,
    ev.BudgetRaised,
    ev.LedgerSnapshot,
    ev.LeaseGranted,
    ev.LeaseDenied,
    ev.LeaseRevoked,
    ev.DeadLetter,
    ev.PromptEvent,
)


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
    # same partition delivered (the race streams/faust_flow.py has since closed;
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


def build_app(settings: LedgerSettings) -> faust.App:
    topics = settings.topics
    datadir = Path(tempfile.gettempdir()) / "tokenbudget-faust" / topics.ledger_app_id
    datadir.mkdir(parents=True, exist_ok=True)
    app = LedgerApp(
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
        # A killed worker's partitions move to its replacement after this long;
        # Faust's default (60 s) would stall a restarted ledger for a minute.
        broker_session_timeout=SESSION_TIMEOUT_S,
        broker_heartbeat_interval=1.0,
        key_serializer="raw",
        value_serializer="raw",
        Monitor=QuietMonitor,
    )
    # The worker builds its consumer from this class when it starts.
    app.transport.Consumer = LedgerConsumer  # type: ignore[misc]
    app.transport.Producer = LedgerProducer  # type: ignore[misc]
    datasets = app.Table(
        LEDGER_TABLE,
        partitions=topics.partitions,
        key_type=str,
        value_type=bytes,
    )
    outcomes = app.Table(
        OUTCOME_TABLE,
        partitions=topics.partitions,
        key_type=str,
        value_type=bytes,
    )
    datasets_changelog = datasets.changelog_topic.get_topic_name()
    sources = [topics.completions, topics.outcomes, topics.budgets, topics.reservations]
    ownership = faust_ownership.Ownership(app, sources, datasets_changelog, SESSION_TIMEOUT_S)
    faust_ownership.recover_preferring(datasets, ledger.newer_owner)
    faust_ownership.recover_preferring(outcomes, ledger.not_a_lost_completion)
    outcomes_changelog = outcomes.changelog_topic.get_topic_name()
    dataset_key = changelog_key_encoder(datasets)
    outcome_key = changelog_key_encoder(outcomes)
    source = app.topic(
        *sources,
        schema=RawSchema(key_type=bytes, value_type=bytes),
        partitions=topics.partitions,
    )
    budgets_out = app.topic(topics.budgets, key_serializer="raw", value_serializer="raw")
    completions_out = app.topic(topics.completions, key_serializer="raw", value_serializer="raw")
    dead_letter = app.topic(topics.dead_letter, key_serializer="raw", value_serializer="raw")
    reservations = app.topic(topics.reservations, key_serializer="raw", value_serializer="raw")

    dirty: set[str] = set()
    # Table writes not yet on the broker: a snapshot waits for them, so that no reader
    # ever sees counts a restarted (or the next) owner would not recover.
    unwritten: list[asyncio.Future[Any]] = []
    received = ReceivedOffsets()
    # No snapshot leaves between a state's write and its announcements: a dispatcher
    # takes a snapshot showing a lowered budget as the end of that lowering's
    # revocations (streams/halts.py).
    announcing = asyncio.Lock()
    ticks = 0
    full_every = max(1, round(5.0 / settings.snapshot_interval))

    def load(dataset: str) -> ledger.DatasetLedger:
        raw = datasets.data.get(dataset)
        return ledger.load_ledger(raw) if raw else ledger.DatasetLedger(dataset=dataset)

    async def publish(events: list[ev.Event]) -> None:
        """Announce, stamped with this worker's epoch for each dataset's partition;
        nothing for a partition it may no longer speak for (a rebalance started)."""
        for event in events:
            epoch = ownership.epoch(dataset_partition(str(getattr(event, "dataset", ""))))
            if epoch is None:
                log.info("not announcing %s: its partition is being handed over", event)
                continue
            event = msgspec.structs.replace(event, epoch=epoch)  # type: ignore[type-var]
            # A fence goes where the lease's completions go, to order itself among them.
            fenced = isinstance(event, ev.LeaseFenced)
            out = completions_out if fenced else budgets_out
            fut = await out.send(key=ev.event_key(event), value=ev.encode(event))
            await fut  # a halt that was not delivered is a budget overshot
            metrics.EVENTS_PRODUCED.labels(topic="completions" if fenced else "budgets").inc()

    def dataset_partition(dataset: str) -> int:
        return faust_ownership.partition_of(dataset, topics.partitions)

    async def still_owner() -> None:
        """Before writing state: a worker frozen past its session may have been
        expelled; its next heartbeat says. Expelled, it must not write: it exits and
        starts again from what is durable (committed offsets, the changelog)."""
        if ownership.current() or await ownership.confirmed(timeout=SESSION_TIMEOUT_S):
            return
        log.critical(
            "ledger: no longer sure to own its partitions (a heartbeat older than the "
            "session); exiting so it rejoins the group and recovers"
        )
        os._exit(75)

    async def process(batch: list[Any]) -> None:
        """Apply a batch of events, persist, then announce.

        Each dataset's entry records the last offset applied per source partition, and
        each prompt's outcome entry the offset of the event that set it, so events
        Faust hands over again after a crash are recognised whichever of the two
        writes made it out before the crash. Announcements (grants, halts) leave
        only after the state they describe is written to the changelog.
        """
        at = ev.now()
        states: dict[str, ledger.DatasetLedger] = {}
        partition_of: dict[str, int] = {}
        outcome_entries: dict[str, tuple[int, bytes]] = {}
        announce: list[ev.Event] = []
        per_topic: dict[str, int] = {}
        for event in batch:
            message = event.message
            per_topic[message.topic] = per_topic.get(message.topic, 0) + 1
            # Per topic *and* partition: clients with different partitioners may
            # put one dataset's events on different partitions of a topic.
            source = f"{message.topic}:{message.partition}"
            skipped = received.record(app.consumer_generation_id, source, message.offset)
            if skipped is not None:
                _exit_after_skipped_delivery(message.topic, message.partition, skipped)
            try:
                decoded = ev.decode(event.value)
            except EventDecodeError as exc:
                await send_dead_letter(event, exc)
                continue
            name = getattr(decoded, "dataset", None)
            if not isinstance(name, str) or isinstance(decoded, IGNORED):
                continue  # our own announcements and snapshots come back on this topic
            state = states.get(name) or load(name)
            if message.offset <= state.applied.get(source, -1):
                continue  # applied before a restart
            transition, entries = apply(state, decoded, message, at, outcome_entries)
            state = msgspec.structs.replace(
                transition.state, applied={**state.applied, source: message.offset}
            )
            states[name] = state
            partition_of[name] = message.partition
            for key, value in entries:
                outcome_entries[key] = (message.partition, value)
            announce.extend(transition.emit)
        for topic, count in per_topic.items():
            metrics.consumed(topic, "ledger", count)
        if not states:
            return
        await still_owner()
        outcome_writes: dict[int, list[tuple[bytes, bytes]]] = {}
        for prompt_id, (partition, value) in outcome_entries.items():
            outcomes.data[prompt_id] = value
            outcome_writes.setdefault(partition, []).append((outcome_key(prompt_id), value))
        sent = await write_changelogs(outcomes_changelog, outcome_writes)
        async with announcing:
            ledger_writes: dict[int, list[tuple[bytes, bytes]]] = {}
            for name, state in states.items():
                epoch = ownership.write_epoch(partition_of[name])
                value = ledger.dump_ledger(msgspec.structs.replace(state, epoch=epoch))
                datasets.data[name] = value
                ledger_writes.setdefault(partition_of[name], []).append((dataset_key(name), value))
                dirty.add(name)  # metrics and snapshots follow on the timer
            sent += await write_changelogs(datasets_changelog, ledger_writes)
            # A batch's events are acked when this returns, and Faust flushes its
            # producer before every offset commit, so a commit never covers table
            # writes still in flight. A write that *failed* (after the client's
            # retries: a broker gone too long) would be committed past all the same:
            # the worker exits instead, before the commit can be sent, and starts
            # again from what is durable (committed offsets and the changelog).
            for future in sent:
                future.add_done_callback(_exit_unless_written)
            unwritten[:] = [f for f in unwritten if not f.done()] + sent
            if announce:
                await asyncio.gather(*sent)  # a halt announces only what is durable
                await publish(announce)

    async def write_changelogs(
        topic: str, writes: dict[int, list[tuple[bytes, bytes]]]
    ) -> list[asyncio.Future[Any]]:
        """Queue table changes (key, value per partition); the futures say when each
        batch is on the broker. The tables' in-memory data is already updated."""
        producer = kafka_producer(app)
        sent: list[asyncio.Future[Any]] = []
        try:
            for partition, entries in writes.items():
                sent += await write_changelog(producer, topic, partition, entries)
        except Exception as exc:  # not queued: a timeout, a closed or failed producer
            _exit_after_failed_write(repr(exc))
        return sent

    def recorded(key: str, pending: dict[str, tuple[int, bytes]]) -> ledger.OutcomeEntry | None:
        # .data: the local store, without Faust's per-read sensors
        raw = pending[key][1] if key in pending else outcomes.data.get(key)
        return ledger.load_outcome(raw) if raw else None

    def apply(
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
                return apply_outcome(state, event, message, at, pending)
            case ev.LeaseFenced():
                entry = ledger.OutcomeEntry("fenced", None, message.topic, message.offset)
                key = ledger.FENCE_KEY + event.lease_id
                written = [] if recorded(key, pending) else [(key, ledger.dump_outcome(entry))]
                return ledger.apply_lease_fenced(state, event, at), written
            case ev.BudgetSet():
                return ledger.apply_budget_set(state, event, at), []
            case ev.ProducerDone():
                return ledger.apply_producer_done(state, event), []
            case ev.LeaseRequested():
                fenced = recorded(ledger.FENCE_KEY + event.lease_id, pending) is not None
                return ledger.apply_lease_request(state, event, at, fenced=fenced), []
            case ev.LeaseRenewed():
                return ledger.apply_lease_renewed(state, event, at), []
            case ev.LeaseReleased():
                return ledger.apply_lease_released(state, event, at), []
            case ev.LeaseExpired():
                return ledger.apply_lease_expired(state, event, at), []
        return ledger.Transition(state), []

    def apply_outcome(
        state: ledger.DatasetLedger,
        event: ev.CompletionEvent | ev.PromptSkipped | ev.PromptFailed,
        message: Any,
        at: float,
        pending: dict[str, tuple[int, bytes]],
    ) -> tuple[ledger.Transition, list[tuple[str, bytes]]]:
        pid = event.prompt_id
        entry = recorded(pid, pending)
        if entry and entry.topic == message.topic and entry.offset == message.offset:
            previous = entry.prior  # recorded, but the dataset entry was not
        else:
            previous = entry.outcome if entry else None
        written: list[tuple[str, bytes]] = []
        fenced = new_copy = False
        if isinstance(event, ev.CompletionEvent) and event.lease_id:
            fenced = recorded(ledger.FENCE_KEY + event.lease_id, pending) is not None
            copy_key = ledger.COPY_KEY + event.request_id
            new_copy = (
                not fenced
                and previous == "completed"
                and entry is not None
                and entry.request != event.request_id
                and recorded(copy_key, pending) is None
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

    async def send_dead_letter(event: Any, exc: EventDecodeError) -> None:
        message = event.message
        letter = ev.dead_letter(
            str(exc),
            source_topic=message.topic,
            payload=event.value,
            partition=message.partition,
            offset=message.offset,
            key=event.key,
        )
        await dead_letter.send(key=event.key, value=ev.encode(letter))
        metrics.DEAD_LETTERED.labels(topic=metrics.topic_role(message.topic)).inc()
        log.warning(
            "dead-lettered %s[%d]@%d: %s", message.topic, message.partition, message.offset, exc
        )

    @app.agent(source, name="ledger")
    async def ledger_agent(stream: Any) -> None:
        async for batch in stream.take_events(BATCH, within=BATCH_WAIT_S):
            await process(list(batch))

    @app.timer(settings.snapshot_interval)
    async def publish_snapshots() -> None:
        nonlocal ticks
        if ticks % full_every == 0:
            # Every few seconds, and so soon after any restart or recovery, tell
            # every reader where each dataset stands, changed or not.
            dirty.update(str(key) for key in datasets)
        ticks += 1
        if not dirty:
            return
        async with announcing:
            await asyncio.gather(*unwritten)  # only what a recovery would find again
            at = ev.now()
            names = sorted(dirty)
            dirty.clear()
            for name in names:
                epoch = ownership.epoch(dataset_partition(name))
                if epoch is None:
                    continue  # not ours (any more): its owner speaks for it
                state = load(name)
                snap = msgspec.structs.replace(ledger.snapshot(state, at), epoch=epoch)
                await budgets_out.send(key=name.encode(), value=ev.encode(snap))
                metrics.EVENTS_PRODUCED.labels(topic="budgets").inc()
                if settings.on_state:
                    settings.on_state(state)

    @app.timer(1.0)
    async def expire_leases() -> None:
        # Tables can only be written while processing an event, so expiry goes
        # through the reservations topic like any other lease change.
        now = ev.now()
        for name in list(datasets):
            if ownership.epoch(dataset_partition(str(name))) is None:
                continue
            for lease_id in ledger.expired_leases(load(str(name)), now):
                expired = ev.LeaseExpired(dataset=str(name), lease_id=lease_id, at=now)
                await reservations.send(key=str(name).encode(), value=ev.encode(expired))

    app.tokenbudget_tables = {"datasets": datasets, "outcomes": outcomes}  # type: ignore[attr-defined]
    return app


def run_worker(settings: LedgerSettings, *, loglevel: str = "warning") -> None:
    """Run the ledger until SIGTERM/SIGINT (Faust handles both gracefully)."""
    app = build_app(settings)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.spinner = None  # its terminal spinner would draw over `run`'s progress bars
    worker.execute_from_commandline()
