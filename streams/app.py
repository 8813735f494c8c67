"""The Faust ledger worker: the single writer of per-dataset budget state.

It reads completions, prompt outcomes and budget commands (all keyed by dataset,
co-partitioned with its tables), applies :mod:`streams.ledger`, and publishes
``BudgetExceeded`` / ``BudgetRaised`` the moment a dataset crosses its line, plus a
``LedgerSnapshot`` of every dataset that changed, a few times a second.

Undecodable events go to the dead-letter topic; the worker never stops for them.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faust
from faust.transport.producer import ProducerBuffer

from sinks import metrics
from streams import events as ev
from streams import ledger
from streams.topics import LEDGER_TABLE, OUTCOME_TABLE, PARTITIONS, Topics
from tokenbudget.errors import EventDecodeError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LedgerSettings:
    bootstrap: str
    topics: Topics
    snapshot_interval: float = 0.5
    on_state: Callable[[ledger.DatasetLedger], None] | None = None  # metrics hook


# Every event writes two table entries, each a changelog message. Faust makes the
# agent wait whenever more than 100 are unsent, checking every 0.1 s, which caps
# the ledger near a thousand events per second; the aiokafka producer batches far
# more than that on its own.
ProducerBuffer.max_messages = 20_000


def build_app(settings: LedgerSettings) -> faust.App:
    topics = settings.topics
    datadir = Path(tempfile.gettempdir()) / "tokenbudget-faust" / topics.ledger_app_id
    datadir.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        topics.ledger_app_id,
        broker=f"kafka://{settings.bootstrap}",
        store="memory://",
        # Faust keeps a data folder even for the memory store; not in the cwd.
        datadir=str(datadir),
        web_enabled=False,
        topic_partitions=PARTITIONS,
        topic_allow_declare=True,
        table_standby_replicas=0,
        consumer_auto_offset_reset="earliest",
        broker_commit_every=1000,
        broker_commit_interval=0.5,
        stream_wait_empty=False,
        producer_acks=-1,
        # two changelog messages per event: batch them instead of one request each
        producer_linger=0.005,
        # A killed worker's partitions move to its replacement after this long;
        # Faust's default (60 s) would stall a restarted ledger for a minute.
        broker_session_timeout=10.0,
        broker_heartbeat_interval=1.0,
        key_serializer="raw",
        value_serializer="raw",
    )
    datasets = app.Table(
        LEDGER_TABLE,
        partitions=PARTITIONS,
        key_type=str,
        value_type=bytes,
    )
    outcomes = app.Table(
        OUTCOME_TABLE,
        partitions=PARTITIONS,
        key_type=str,
        value_type=bytes,
    )
    source = app.topic(
        topics.completions,
        topics.outcomes,
        topics.budgets,
        topics.reservations,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
        partitions=PARTITIONS,
    )
    budgets_out = app.topic(topics.budgets, key_serializer="raw", value_serializer="raw")
    dead_letter = app.topic(topics.dead_letter, key_serializer="raw", value_serializer="raw")
    reservations = app.topic(topics.reservations, key_serializer="raw", value_serializer="raw")

    dirty: set[str] = set()
    ticks = 0
    full_every = max(1, round(5.0 / settings.snapshot_interval))

    def load(dataset: str) -> ledger.DatasetLedger:
        raw = datasets.get(dataset)
        return ledger.load_ledger(raw) if raw else ledger.DatasetLedger(dataset=dataset)

    async def publish(events: list[ev.Event]) -> None:
        for event in events:
            fut = await budgets_out.send(key=ev.event_key(event), value=ev.encode(event))
            await fut  # a halt that was not delivered is a budget overshot
            metrics.EVENTS_PRODUCED.labels(topic="budgets").inc()

    async def handle(event: ev.Event) -> None:
        at = ev.now()
        transition: ledger.Transition
        prompt_id: str | None = None
        match event:
            case ev.CompletionEvent() | ev.PromptSkipped() | ev.PromptFailed():
                prompt_id = event.prompt_id
                raw_prev = outcomes.get(prompt_id)
                previous = raw_prev.decode() if raw_prev else None
                transition = ledger.apply_outcome(
                    load(event.dataset),
                    event,
                    previous,  # type: ignore[arg-type]
                    at,
                )
            case ev.BudgetSet():
                transition = ledger.apply_budget_set(load(event.dataset), event, at)
            case ev.ProducerDone():
                transition = ledger.apply_producer_done(load(event.dataset), event)
            case ev.LeaseRequested():
                transition = ledger.apply_lease_request(load(event.dataset), event, at)
            case ev.LeaseRenewed():
                transition = ledger.apply_lease_renewed(load(event.dataset), event, at)
            case ev.LeaseReleased():
                transition = ledger.apply_lease_released(load(event.dataset), event, at)
            case ev.LeaseExpired():
                transition = ledger.apply_lease_expired(load(event.dataset), event, at)
            case _:
                return  # our own announcements and snapshots come back on this topic
        if transition.changed:
            datasets[transition.state.dataset] = ledger.dump_ledger(transition.state)
            dirty.add(transition.state.dataset)
        if prompt_id is not None and transition.outcome is not None:
            outcomes[prompt_id] = transition.outcome.encode()
        if transition.emit:
            await publish(transition.emit)
        if settings.on_state and transition.changed:
            settings.on_state(transition.state)

    @app.agent(source, name="ledger")
    async def ledger_agent(stream: Any) -> None:
        async for event in stream.events():
            message = event.message
            metrics.consumed(message.topic, "ledger")
            try:
                decoded = ev.decode(event.value)
            except EventDecodeError as exc:
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
                    "dead-lettered %s[%d]@%d: %s",
                    message.topic,
                    message.partition,
                    message.offset,
                    exc,
                )
                continue
            await handle(decoded)

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
        at = ev.now()
        names = sorted(dirty)
        dirty.clear()
        for name in names:
            state = load(name)
            snap = ledger.snapshot(state, at)
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
