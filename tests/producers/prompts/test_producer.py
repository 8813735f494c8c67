"""The prompt producer's bookkeeping, with a recording stand-in for the Kafka producer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from tokenbudget.core import config as config_module
from tokenbudget.core import metrics, sizes
from tokenbudget.core.errors import DatasetError
from tokenbudget.producers.prompts import resume
from tokenbudget.producers.prompts.datasets import read_prompts
from tokenbudget.producers.prompts.producer import PromptProducer
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.topics import Topics


class RecordingProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, ev.Event]] = []

    async def send(self, topic: str, *, key: bytes, value: bytes) -> None:
        self.sent.append((topic, codec.decode(value)))

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


def test_near_its_budgets_end_a_dataset_is_kept_ahead_by_what_the_rest_buys(
    tmp_path: Path,
) -> None:
    """10 answers kept cost 900 of a budget of 1,000: the rest buys 2 more at their mean,
    so the queue stops at twice that and the floor, not at the window (256 here)."""
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(400))
    )
    config = config_module.build(
        {
            "kafka": {"bootstrap": "127.0.0.1:1", "namespace": "t"},
            "inference": {"concurrency": 128},
            "datasets": [{"name": "d", "path": "d.jsonl", "budget": 1000}],
        },
        base_dir=tmp_path,
        environ={},
    )
    board = BudgetBoard()
    snapshot = ev.LedgerSnapshot(
        dataset="d", budget=1000, unit="completion_tokens", completion_tokens=900,
        prompt_tokens=0, samples=10, skipped=0, failed=0, produced=None, halted=False,
        status="open", outcome_events=10, at=1.0,
    )  # fmt: skip
    board.apply(snapshot)
    recorder = RecordingProducer()
    producer = PromptProducer(config, "127.0.0.1:1", board, producer=recorder)  # type: ignore[arg-type]

    def prompts() -> int:
        return sum(isinstance(e, ev.PromptEvent) for _, e in recorder.sent)

    async def run_until_it_waits() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(producer.run(stop))
        while prompts() < 2 * 2 + 64:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # it would go on to the window meanwhile
        assert prompts() == 2 * 2 + 64
        # ten more answers kept, of 10 tokens each: the rest (0) buys none
        board.apply(
            msgspec.structs.replace(snapshot, completion_tokens=1000, samples=20, outcome_events=20)
        )
        await asyncio.sleep(0.5)
        assert prompts() == 2 * 2 + 64 + 10 - 4  # 64 ahead of 20 outcomes
        stop.set()
        await task

    asyncio.run(run_until_it_waits())


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


# ---- bad rows: counted, dead-lettered, skipped or stopping ---------------------------


def bad_rows_config(tmp_path: Path, on_bad_row: str = "skip") -> config_module.Config:
    rows = [
        json.dumps({"prompt": "p0"}),
        "{not json",
        json.dumps({"prompt": "x" * 5000}),  # over max_prompt_bytes below
        json.dumps({"prompt": "p1"}),
    ]
    (tmp_path / "d.jsonl").write_text("".join(line + "\n" for line in rows))
    return config_module.build(
        {
            "kafka": {"bootstrap": "127.0.0.1:1", "namespace": "t"},
            "producer": {"on_bad_row": on_bad_row, "max_prompt_bytes": 4096},
            "datasets": [{"name": "d", "path": "d.jsonl", "budget": 1000}],
        },
        base_dir=tmp_path,
        environ={},
    )


def bad_rows_counted() -> float:
    return metrics.BAD_ROWS.labels(dataset="d")._value.get()


def test_bad_rows_are_counted_and_dead_lettered_and_the_rest_produced(tmp_path: Path) -> None:
    config = bad_rows_config(tmp_path)
    recorder = RecordingProducer()
    producer = PromptProducer(config, "127.0.0.1:1", BudgetBoard(), producer=recorder)  # type: ignore[arg-type]
    counted = bad_rows_counted()

    report = asyncio.run(producer.run())["d"]

    assert (report.produced, report.bad_rows) == (2, 2)
    assert bad_rows_counted() == counted + 2
    prompts = [e for topic, e in recorder.sent if topic == Topics("t").prompts]
    assert [e.text for e in prompts] == ["p0", "p1"]  # type: ignore[union-attr]
    letters = [e for topic, e in recorder.sent if topic == Topics("t").dead_letter]
    assert all(isinstance(e, ev.DeadLetter) for e in letters)
    path = tmp_path / "d.jsonl"
    assert [e.source for e in letters] == [f"{path}:2", f"{path}:3"]  # type: ignore[union-attr]
    broken, oversized = letters
    assert isinstance(broken, ev.DeadLetter) and isinstance(oversized, ev.DeadLetter)
    assert broken.key == "d" and broken.payload == "{not json"
    assert "bad row of dataset d" in broken.reason and "not valid JSON" in broken.reason
    assert oversized.size == 5000
    assert "over [producer] max_prompt_bytes = 4,096" in oversized.reason
    assert "correct or remove the row" in oversized.reason  # the fix
    assert len(oversized.payload) < 5000  # an excerpt, not the row
    # The letters go out before the producer says it is done (a stopped run keeps them).
    kinds = [type(e).__name__ for _, e in recorder.sent]
    assert kinds.index("ProducerDone") > max(i for i, k in enumerate(kinds) if k == "DeadLetter")


def test_on_bad_row_fail_stops_naming_dataset_line_and_fix_after_its_letter(
    tmp_path: Path,
) -> None:
    config = bad_rows_config(tmp_path, on_bad_row="fail")
    recorder = RecordingProducer()
    producer = PromptProducer(config, "127.0.0.1:1", BudgetBoard(), producer=recorder)  # type: ignore[arg-type]

    with pytest.raises(DatasetError) as info:
        asyncio.run(producer.run())

    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'd.jsonl'}:2: not valid JSON")
    assert "(dataset d)" in message and 'on_bad_row = "skip"' in message
    assert "\n" not in message
    letters = [e for topic, e in recorder.sent if topic == Topics("t").dead_letter]
    assert len(letters) == 1
    assert producer.reports["d"].bad_rows == 1


def test_a_prompt_event_over_its_share_of_a_message_is_a_bad_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row's text is under max_prompt_bytes but its event is not (escapes, or
    template ids, take more bytes than the text): it is refused before Kafka is."""
    rows = [json.dumps({"prompt": "p0"}), json.dumps({"prompt": '"' * 300})]
    config = make_config(tmp_path, rows)
    monkeypatch.setattr(sizes, "PROMPT_EVENT_BYTES", 500)  # the 300 quotes encode as 600 bytes
    recorder = RecordingProducer()
    producer = PromptProducer(config, "127.0.0.1:1", BudgetBoard(), producer=recorder)  # type: ignore[arg-type]

    report = asyncio.run(producer.run())["d"]

    assert (report.produced, report.bad_rows) == (1, 1)
    (letter,) = [e for topic, e in recorder.sent if topic == Topics("t").dead_letter]
    assert isinstance(letter, ev.DeadLetter)
    assert letter.source.endswith("d.jsonl:2") and "over the 500 a prompt may take" in letter.reason
