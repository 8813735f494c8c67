"""The dispatcher on the real broker: poison prompts, failing servers, halts."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from kafka import KafkaProducer

from tests.integration.test_ledger_worker import publish, read_all
from tokenbudget.core import config as config_module
from tokenbudget.core import kafka_admin
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import Faults, SimulatorConfig
from tokenbudget.producers.dispatch.dispatcher import Dispatcher
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration


def prompt(dataset: str, i: int) -> ev.PromptEvent:
    return ev.PromptEvent(prompt_id=f"{dataset}-{i}", dataset=dataset, text=f"#short q{i}")


async def dispatch_until(
    config: config_module.Config,
    bootstrap: str,
    board: BudgetBoard,
    done: object,
    timeout: float = 60,
) -> Dispatcher:
    dispatcher = Dispatcher(config, bootstrap, board, keep_log=True)
    stop = asyncio.Event()
    task = asyncio.create_task(dispatcher.run(stop))
    deadline = time.monotonic() + timeout
    while not done(dispatcher.report) and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.1)
    stop.set()
    await task
    return dispatcher


def test_poison_prompts_failures_and_halted_datasets(kafka_bootstrap: str, namespace: str) -> None:
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    producer.send(topics.prompts, key=b"ok", value=b"\xff garbage")
    producer.flush()
    producer.close()
    publish(
        kafka_bootstrap,
        topics.prompts,
        [prompt("broken", 0), *(prompt("stopped", i) for i in range(3))],
    )

    async def scenario() -> Dispatcher:
        # Every request fails with HTTP 500: one retry, then the prompt is failed.
        sim = await sim_server.start(SimulatorConfig(port=0, faults=Faults(http_500=1.0)))
        try:
            config = config_module.build(
                {
                    "kafka": {"bootstrap": kafka_bootstrap, "namespace": namespace},
                    "inference": {"url": sim.url, "retries": 1, "backoff_s": 0.01},
                    # no ledger runs here: halts come from the board, not from leases
                    "budget": {"admission": "halt"},
                },
                environ={},
            )
            board = BudgetBoard()
            board.apply(ev.BudgetExceeded(dataset="stopped", budget=1, used=1))
            return await dispatch_until(
                config,
                kafka_bootstrap,
                board,
                lambda r: r.dead_lettered + r.failed + r.skipped >= 5,
            )
        finally:
            await sim.stop()

    dispatcher = asyncio.run(scenario())
    report = dispatcher.report
    assert report.dead_lettered == 1
    assert report.failed == 1
    assert report.skipped == 3
    assert report.completed == 0
    # A halted dataset's queued prompts never reach the server.
    assert not [d for d in report.sent if d.dataset == "stopped"]
    # The failing prompt was tried twice (1 retry), each with its own rid.
    assert len([d for d in report.sent if d.dataset == "broken"]) == 2

    outcomes = read_all(kafka_bootstrap, topics.outcomes)
    assert sorted(type(o).__name__ for o in outcomes) == ["PromptFailed", *["PromptSkipped"] * 3]
    failed = next(o for o in outcomes if isinstance(o, ev.PromptFailed))
    assert failed.attempts == 2 and "HTTP 500" in failed.reason
    letters = read_all(kafka_bootstrap, topics.dead_letter)
    assert len(letters) == 2
    assert any("HTTP 500" in d.reason for d in letters)  # type: ignore[union-attr]
    assert any(d.payload.endswith("garbage") for d in letters)  # type: ignore[union-attr]


def test_each_partitions_prompts_reach_the_fleet_in_turns(
    kafka_bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    """Read a partition's whole fetch at a time, a dataset queued behind another
    partition's prompts got no place until those were through (``bench/fleet.py``:
    a dataset had none of 1,024 requests in flight for a minute, its prompts
    queued). Graded by the order the server received them in."""
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
    # "long" and "short" are keys of different partitions of the default four
    publish(
        kafka_bootstrap,
        topics.prompts,
        [
            *(
                ev.PromptEvent(prompt_id=f"l{i}", dataset="long", text=f"#short L{i}")
                for i in range(120)
            ),
            *(
                ev.PromptEvent(prompt_id=f"s{i}", dataset="short", text=f"#short S{i}")
                for i in range(30)
            ),
        ],
    )
    log = tmp_path / "requests.jsonl"

    async def scenario() -> Dispatcher:
        sim = await sim_server.start(
            SimulatorConfig(port=0, tokens_per_second=20000, log_file=str(log))
        )
        try:
            config = config_module.build(
                {
                    "kafka": {"bootstrap": kafka_bootstrap, "namespace": namespace},
                    "inference": {"url": sim.url, "concurrency": 4},
                    "budget": {"admission": "halt"},
                },
                environ={},
            )
            return await dispatch_until(
                config, kafka_bootstrap, BudgetBoard(), lambda r: r.completed >= 150
            )
        finally:
            await sim.stop()

    assert asyncio.run(scenario()).report.completed == 150
    received = sorted(
        (json.loads(line) for line in log.read_text().splitlines()),
        key=lambda r: r["received_at"],
    )
    first = [r["text_head"].split()[-1][0] for r in received[:40]]
    # both datasets had prompts queued from the start: each got its turns
    assert first.count("L") >= 15 and first.count("S") >= 15, "".join(first)
