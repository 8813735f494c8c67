"""The Faust ledger worker on the real broker: restarts, duplicates, poison events."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Callable

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from tokenbudget.app.runner import start_ledger_process, stop_process
from tokenbudget.core import kafka_admin
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetWatcher
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration


def completion(dataset: str, prompt_id: str, tokens: int, request_id: str | None = None):
    return ev.CompletionEvent(
        request_id=request_id or uuid.uuid4().hex,
        prompt_id=prompt_id,
        dataset=dataset,
        prompt_tokens=10,
        completion_tokens=tokens,
        output_ids=list(range(tokens)),
        finish_reason="stop",
        max_new_tokens=4096,
    )


def publish(bootstrap: str, topic: str, events: list[ev.Event]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for event in events:
        producer.send(topic, key=codec.event_key(event), value=codec.encode(event))
    producer.flush()
    producer.close()


def wait_for_snapshot(
    bootstrap: str,
    topics: Topics,
    dataset: str,
    predicate: Callable[[ev.LedgerSnapshot], bool],
    timeout: float = 60,
) -> ev.LedgerSnapshot:
    async def watch() -> ev.LedgerSnapshot:
        watcher = BudgetWatcher(bootstrap, topics)
        await watcher.start()
        task = asyncio.create_task(watcher.run())
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                snap = watcher.board.snapshot(dataset)
                if snap is not None and predicate(snap):
                    return snap
                await asyncio.sleep(0.1)
            raise AssertionError(f"no matching snapshot of {dataset}: last {snap}")
        finally:
            task.cancel()
            await watcher.stop()

    return asyncio.run(watch())


def test_restarted_ledger_does_not_double_count(kafka_bootstrap: str, namespace: str) -> None:
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
    first = [completion("d", f"p{i}", 100) for i in range(20)]
    publish(kafka_bootstrap, topics.control, [ev.BudgetSet(dataset="d", budget=10_000)])
    publish(kafka_bootstrap, topics.completions, first)

    ledger = start_ledger_process(kafka_bootstrap, namespace, 0.2)
    try:
        snap = wait_for_snapshot(kafka_bootstrap, topics, "d", lambda s: s.samples == 20)
        assert snap.completion_tokens == 2000
    finally:
        # SIGKILL: no graceful commit, so Faust re-reads whatever it had not committed.
        os.killpg(ledger.pid, signal.SIGKILL)
        ledger.wait()

    # The same completions again (a dispatcher that crashed before committing), a
    # second completion for an already completed prompt, and new work.
    again = [*first[:5], completion("d", "p0", 777), completion("d", "p20", 300)]
    publish(kafka_bootstrap, topics.completions, again)
    started_after = time.time()
    ledger = start_ledger_process(kafka_bootstrap, namespace, 0.2)
    try:
        snap = wait_for_snapshot(
            kafka_bootstrap,
            topics,
            "d",
            lambda s: s.at > started_after and s.samples >= 21,
        )
        time.sleep(2)  # let any reprocessing settle, then look again
        snap = wait_for_snapshot(
            kafka_bootstrap, topics, "d", lambda s: s.at > time.time() - 1 and s.samples >= 21
        )
        assert snap.samples == 21
        assert snap.completion_tokens == 2000 + 300
        assert snap.prompt_tokens == 21 * 10
    finally:
        stop_process(ledger)


def test_budget_reached_publishes_exceeded_once(kafka_bootstrap: str, namespace: str) -> None:
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
    publish(kafka_bootstrap, topics.control, [ev.BudgetSet(dataset="d", budget=1000)])
    publish(kafka_bootstrap, topics.completions, [completion("d", f"p{i}", 300) for i in range(6)])
    ledger = start_ledger_process(kafka_bootstrap, namespace, 0.2)
    try:
        snap = wait_for_snapshot(kafka_bootstrap, topics, "d", lambda s: s.samples == 6)
        assert snap.halted and snap.status == "halted"
        assert snap.completion_tokens == 1800
        exceeded = [
            e for e in read_all(kafka_bootstrap, topics.budgets) if isinstance(e, ev.BudgetExceeded)
        ]
        assert len(exceeded) == 1
        # 4 x 300 = 1200 >= 1000: the fourth completion crossed the line.
        assert exceeded[0].used == 1200 and exceeded[0].budget == 1000
    finally:
        stop_process(ledger)


def read_all(bootstrap: str, topic: str) -> list[ev.Event]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    ends = consumer.end_offsets(partitions)
    events: list[ev.Event] = []
    deadline = time.monotonic() + 30
    while any(consumer.position(tp) < ends[tp] for tp in partitions):
        assert time.monotonic() < deadline
        for records in consumer.poll(timeout_ms=200).values():
            events.extend(codec.decode(r.value) for r in records)
    consumer.close()
    return events


def test_malformed_events_go_to_dead_letter_and_worker_carries_on(
    kafka_bootstrap: str, namespace: str
) -> None:
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    producer.send(topics.completions, key=b"d", value=b"{not json")
    producer.send(
        topics.completions, key=b"d", value=b'{"type":"completion","v":99,"request_id":"x"}'
    )
    producer.flush()
    producer.close()
    publish(kafka_bootstrap, topics.completions, [completion("d", "p1", 50)])
    ledger = start_ledger_process(kafka_bootstrap, namespace, 0.2)
    try:
        snap = wait_for_snapshot(kafka_bootstrap, topics, "d", lambda s: s.samples == 1)
        assert snap.completion_tokens == 50
        deadline = time.monotonic() + 30
        letters: list[ev.Event] = []
        while len(letters) < 2 and time.monotonic() < deadline:
            letters = read_all(kafka_bootstrap, topics.dead_letter)
            time.sleep(0.2)
        assert len(letters) == 2
        assert all(isinstance(d, ev.DeadLetter) for d in letters)
        reasons = " ".join(d.reason for d in letters)  # type: ignore[union-attr]
        assert "not a tokenbudget event" in reasons
        assert "version 99" in reasons
        assert {d.source_topic for d in letters} == {topics.completions}  # type: ignore[union-attr]
        assert any(d.payload == "{not json" for d in letters)  # type: ignore[union-attr]
    finally:
        stop_process(ledger)
