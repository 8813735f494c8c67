"""The prompt producer's bookkeeping, with a recording stand-in for the Kafka producer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from producers import resume
from producers.datasets import read_prompts
from producers.prompts import PromptProducer
from streams import events as ev
from streams.halts import BudgetBoard
from streams.topics import Topics
from tokenbudget import config as config_module


class RecordingProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, ev.Event]] = []

    async def send(self, topic: str, *, key: bytes, value: bytes) -> None:
        self.sent.append((topic, ev.decode(value)))

    async def send_and_wait(self, topic: str, *, key: bytes, value: bytes) -> None:
        await self.send(topic, key=key, value=value)

    async def flush(self) -> None:
        return None


def make_config(tmp_path: Path, rows: list[str]) -> config_module.Config:
    (tmp_path / "d.jsonl").write_text("".join(line + "\n" for line in rows))
    return config_module.build(
        {
            "kafka": {"bootstrap": "127.0.0.1:1", "namespace": "t"},
            "datasets": [{"name": "d", "path": "d.jsonl", "budget": 1000}],
        },
        base_dir=tmp_path,
        environ={},
    )


@pytest.fixture(autouse=True)
def nothing_done_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resume, "completed_prompt_ids", lambda *a, **k: set())
    monkeypatch.setattr(resume, "queued_prompt_ids", lambda *a, **k: set())


def test_rows_of_a_halted_dataset_are_recorded_as_skipped_not_sent(tmp_path: Path) -> None:
    rows = [json.dumps({"prompt": f"p{i}"}) for i in range(5)]
    rows.insert(2, '{"prompt": ""}')  # a bad row gets no outcome: it is not a prompt
    config = make_config(tmp_path, rows)
    board = BudgetBoard()
    board.apply(ev.BudgetExceeded(dataset="d", budget=1000, used=1000))
    recorder = RecordingProducer()
    producer = PromptProducer(config, "127.0.0.1:1", board, producer=recorder)  # type: ignore[arg-type]

    reports = asyncio.run(producer.run())

    report = reports["d"]
    assert (report.produced, report.not_sent, report.bad_rows) == (0, 5, 1)
    skipped = [e for topic, e in recorder.sent if isinstance(e, ev.PromptSkipped)]
    assert len({e.prompt_id for e in skipped}) == 5
    assert {topic for topic, e in recorder.sent if isinstance(e, ev.PromptSkipped)} == {
        Topics("t").outcomes
    }
    done = [e for _, e in recorder.sent if isinstance(e, ev.ProducerDone)]
    # Every row accounted for: the ledger's "exhausted" needs outcomes == produced.
    assert [(d.reason, d.produced) for d in done] == [("halted", 5)]


def test_rows_read_to_the_end_are_produced_not_skipped(tmp_path: Path) -> None:
    config = make_config(tmp_path, [json.dumps({"prompt": f"p{i}"}) for i in range(3)])
    recorder = RecordingProducer()
    producer = PromptProducer(config, "127.0.0.1:1", BudgetBoard(), producer=recorder)  # type: ignore[arg-type]

    reports = asyncio.run(producer.run())

    assert (reports["d"].produced, reports["d"].not_sent) == (3, 0)
    assert not [e for _, e in recorder.sent if isinstance(e, ev.PromptSkipped)]
    prompts = [e for _, e in recorder.sent if isinstance(e, ev.PromptEvent)]
    assert len(prompts) == 3


def test_interrupt_stops_without_recording_the_rest(tmp_path: Path) -> None:
    config = make_config(tmp_path, [json.dumps({"prompt": f"p{i}"}) for i in range(10)])
    interrupt = asyncio.Event()

    class InterruptedAfterTwo(RecordingProducer):
        flushed = False

        async def send(self, topic: str, *, key: bytes, value: bytes) -> None:
            await super().send(topic, key=key, value=value)
            if len(self.sent) == 2:
                interrupt.set()  # SIGTERM arrives

        async def flush(self) -> None:
            self.flushed = True

    recorder = InterruptedAfterTwo()
    producer = PromptProducer(config, "127.0.0.1:1", BudgetBoard(), producer=recorder)  # type: ignore[arg-type]

    reports = asyncio.run(producer.run(interrupt=interrupt))

    assert (reports["d"].produced, reports["d"].reason) == (2, "interrupted")
    assert recorder.flushed
    # Not done, not skipped: a restart produces the other rows.
    assert [type(e) for _, e in recorder.sent] == [ev.PromptEvent, ev.PromptEvent]


def test_prompts_still_queued_from_a_killed_run_are_not_produced_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed after producing leaves prompts on the topic that its dispatchers
    never committed: the rerun's dispatchers get them, so the rerun's producer must
    not publish them a second time (each would be generated twice)."""
    config = make_config(tmp_path, [json.dumps({"prompt": f"p{i}"}) for i in range(4)])
    ids = [row.prompt_id for row in read_prompts("d", tmp_path / "d.jsonl")]
    monkeypatch.setattr(resume, "queued_prompt_ids", lambda *a, **k: {ids[1], ids[3]})
    recorder = RecordingProducer()
    producer = PromptProducer(config, "127.0.0.1:1", BudgetBoard(), producer=recorder)  # type: ignore[arg-type]

    report = asyncio.run(producer.run())["d"]

    sent = [e.prompt_id for _, e in recorder.sent if isinstance(e, ev.PromptEvent)]
    assert sent == [ids[0], ids[2]]
    assert (report.produced, report.already_queued) == (2, 2)
    done = [e for _, e in recorder.sent if isinstance(e, ev.ProducerDone)]
    assert [d.produced for d in done] == [4]  # every row gets an outcome, once
