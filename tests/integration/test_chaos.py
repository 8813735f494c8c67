"""The short chaos run: every component SIGKILLed once, the broker restarted, a
server failing a fifth of its requests; nothing lost, nothing counted twice, no
budget overshot. ``bench/chaos.py`` is the long version."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenbudget.chaos import BAD_ROWS, KINDS, ChaosSettings, run_chaos
from tokenbudget.demo import DEMO_DATASETS

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_kills_broker_restart_and_faults_lose_nothing(tmp_path: Path) -> None:
    by_name = {d.name: d for d in DEMO_DATASETS}
    settings = ChaosSettings(
        workdir=tmp_path,
        cycles=5,  # ledger, dispatcher, sink, producer: each once, one twice
        seed=3,
        budget=25_000,
        # long answers (cut at the line), short ones (many prompts), chat messages
        datasets=tuple(by_name[n] for n in ("B2_opencodeinstruct", "B5_short_qa", "B6_chat")),
        dispatchers=1,
        concurrency=8,
        fault_share=0.2,
        kill_gap_s=(0.5, 2.0),
        restart_after_s=(0.1, 1.0),
        broker_restart_cycle=2,
    )

    report = run_chaos(settings)

    printed = "\n".join(report.lines())
    assert report.ok, printed
    assert set(report.kills) == set(KINDS), printed
    assert report.broker_restarts == 1
    assert report.bad_rows == len(BAD_ROWS)
    assert report.lost == 0 and report.duplicate_request_ids == 0 and report.overshoot == 0
    books = report.datasets
    # Each dataset has prompts enough for its budget: it is used to the token.
    assert {name: b.ledger_tokens for name, b in books.items()} == dict.fromkeys(books, 25_000)
    # Every prompt is accounted for once, whatever the faults did to it.
    for b in books.values():
        assert b.completed + b.skipped + b.failed == b.prompts_in
    assert sum(b.failed for b in books.values()) <= report.dead_letters
