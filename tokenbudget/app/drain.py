"""When ``run``'s pipeline is drained, judged from Kafka itself: the producer has
settled, the dispatchers' group has committed the end of the prompts topic (every
prompt has an outcome), the ledger has read every completion and outcome, and has
published a snapshot of each dataset since (asked for at once, rather than waited
for with the ledger's round of every dataset every few seconds). Also the wait for
every dispatcher to join the group before prompts are handed out. Each wait
outlasts a broker restarting (Kafka not answering is waited out)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError as AIOKafkaError
from kafka.errors import KafkaError

from tokenbudget.core import roles
from tokenbudget.core.config import Config
from tokenbudget.core.errors import WorkerFailedError
from tokenbudget.core.kafka import GroupLag, aiokafka_producer_options
from tokenbudget.core.retry import retry_until_async
from tokenbudget.producers.prompts.producer import PromptProducer
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetWatcher
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)


async def _group_lag(bootstrap: str) -> GroupLag:
    """A lag reader, once Kafka answers (a broker restarting is waited out)."""
    return await retry_until_async(
        functools.partial(asyncio.to_thread, GroupLag, bootstrap),
        timeout=None,
        retry_on=KafkaError,
        interval=0.5,
        max_interval=5.0,
        on_retry=lambda exc: log.warning(
            "Kafka at %s does not answer (%r); trying again", bootstrap, exc
        ),
    )


async def _lag(lag: GroupLag, group: str, topics: list[str]) -> int | None:
    """The group's lag on ``topics``; None while Kafka does not answer."""
    try:
        return await asyncio.to_thread(lag.lag, group, topics)
    except KafkaError as exc:
        log.warning("reading the lag of %s failed (%r); trying again", group, exc)
        return None


async def wait_drained(
    config: Config, bootstrap: str, producer: PromptProducer, watcher: BudgetWatcher
) -> float:
    """Wait until the pipeline is drained (see the module's docstring); return when
    it was. A budget raised meanwhile reopens its dataset, and the wait goes on."""
    topics = Topics(config.kafka.namespace)
    lag = await _group_lag(bootstrap)
    checks = [
        (topics.dispatch_group, [topics.prompts]),
        (topics.ledger_app_id, [topics.completions, topics.outcomes]),
    ]
    names = [d.name for d in config.datasets]
    try:
        while True:
            while not producer.settled():
                await asyncio.sleep(0.1)
            lags = [await _lag(lag, group, t) for group, t in checks]
            if any(n != 0 for n in lags):
                await asyncio.sleep(0.25)
                continue
            drained_at = time.time()
            await _snapshots_since(config, bootstrap, watcher, names, drained_at)
            # A budget raised meanwhile reopens its dataset: keep going.
            if producer.settled():
                return drained_at
    finally:
        lag.close()


async def wait_ledger_applied(config: Config, bootstrap: str, watcher: BudgetWatcher) -> None:
    """Wait until the ledger has read every outcome published so far and has
    published a snapshot of each dataset since (the rows a stopped producer
    recorded as skipped belong in the report)."""
    topics = Topics(config.kafka.namespace)
    lag = await _group_lag(bootstrap)
    try:
        sources = [topics.completions, topics.outcomes]
        while await _lag(lag, topics.ledger_app_id, sources) != 0:
            await asyncio.sleep(0.25)
    finally:
        lag.close()
    names = [d.name for d in config.datasets]
    await _snapshots_since(config, bootstrap, watcher, names, time.time())


async def _snapshots_since(
    config: Config, bootstrap: str, watcher: BudgetWatcher, names: list[str], since: float
) -> None:
    """Wait until the ledger has published a snapshot of each dataset after ``since``,
    having asked for them (:func:`ask_snapshots`). The ask runs beside the wait: a
    broker that does not take it (restarting, gone) holds up only the ask, and the
    ledger's round of every dataset, every few seconds, still ends the wait."""

    def fresh() -> bool:
        return all((s := watcher.board.snapshot(n)) is not None and s.at > since for n in names)

    if fresh():
        return
    asking = asyncio.create_task(ask_snapshots(config, bootstrap, names))
    try:
        while not fresh():
            await asyncio.sleep(0.1)
    finally:
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking


async def ask_snapshots(config: Config, bootstrap: str, names: list[str]) -> None:
    """Ask each dataset's ledger owner for a snapshot (``SnapshotAsked`` on the
    outcomes topic, keyed as the dataset's outcomes are, so it reaches the worker
    that owns it), logged in as the producer, the role that writes outcomes. Only a
    shortcut: an ask Kafka refuses is logged and dropped."""
    topics = Topics(config.kafka.namespace)
    with roles.acting_as("producer"):
        options = aiokafka_producer_options(bootstrap, config.kafka.compression)
    producer = AIOKafkaProducer(**options)
    try:
        await producer.start()
        sent = []
        for name in names:
            asked = ev.SnapshotAsked(dataset=name, at=time.time())
            sent.append(
                await producer.send(topics.outcomes, codec.encode(asked), key=name.encode())
            )
        await asyncio.gather(*sent)  # a refused write raises here, not in a lost future
    except AIOKafkaError as exc:
        log.warning("asking the ledger for snapshots failed (%r); waiting for its round", exc)
    finally:
        await producer.stop()


async def wait_for_members(bootstrap: str, group: str, expected: int, timeout: float = 300) -> None:
    """Wait for ``expected`` members in ``group`` (run under
    :func:`~tokenbudget.app.supervision.supervise`, so a dispatcher that ended
    meanwhile is started again)."""
    lag = await _group_lag(bootstrap)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if await asyncio.to_thread(lag.members, group) >= expected:
                    return
            except KafkaError as exc:
                log.warning("reading the members of %s failed (%r); trying again", group, exc)
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"only some of {expected} dispatchers joined {group}")
            await asyncio.sleep(0.25)
    finally:
        lag.close()
