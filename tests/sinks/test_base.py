"""The sink seam's door (:class:`tokenbudget.sinks.base.CompletionSink`, through the
Parquet sink): what it does with records it cannot keep (without a broker: the
records are handed to it as its consumer would, its dead letters caught)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tokenbudget.sinks import rows
from tokenbudget.sinks.parquet import ParquetSink, SinkSettings, read_rows
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

TOPIC = "ns.completions"


def completion(i: int, dataset: str = "ds") -> ev.CompletionEvent:
    return ev.CompletionEvent(
        request_id=f"r{i}",
        prompt_id=f"p{i}",
        dataset=dataset,
        prompt_tokens=3,
        completion_tokens=2,
        output_ids=[i, i + 1],
        finish_reason="stop",
        max_new_tokens=16,
    )


def records(*values: bytes) -> list[Any]:
    return [
        SimpleNamespace(topic=TOPIC, partition=1, offset=100 + i, key=b"ds", value=value)
        for i, value in enumerate(values)
    ]


class Letters:
    """Stands in for the sink's dead-letter producer."""

    def __init__(self) -> None:
        self.sent: list[ev.DeadLetter] = []

    def send(self, topic: str, key: bytes | None, value: bytes) -> None:
        assert topic == "ns.deadletter"
        letter = codec.decode(value, topic)
        assert isinstance(letter, ev.DeadLetter)
        self.sent.append(letter)

    def flush(self) -> None:
        pass


def sink(
    root: Path, datasets: frozenset[str] | None = frozenset({"ds"})
) -> tuple[ParquetSink, Letters]:
    made = ParquetSink("127.0.0.1:9", Topics("ns"), SinkSettings(root, datasets=datasets))
    letters = Letters()
    made._dlq = letters  # type: ignore[assignment]
    return made, letters


def wire(event: ev.Event, **changes: Any) -> bytes:
    return json.dumps({**json.loads(codec.encode(event)), **changes}).encode()


def test_a_completion_whose_dataset_is_a_path_is_dead_lettered_and_nothing_is_written_outside(
    tmp_path: Path,
) -> None:
    root = tmp_path / "out"
    root.mkdir()
    taken, letters = sink(root, datasets=None)  # even without the job's names
    taken._take(
        records(
            codec.encode(completion(1)),
            wire(completion(2), dataset="x/../../../escaped"),
            wire(completion(3), dataset="a\x00b"),
            wire(completion(4), dataset="d" * 256),
            codec.encode(completion(5)),
        )
    )
    taken.writer.flush()
    assert [letter.offset for letter in letters.sent] == [101, 102, 103]
    assert all("at `$.dataset`" in letter.reason for letter in letters.sent)
    assert sorted(read_rows(root).column("prompt_id").to_pylist()) == ["p1", "p5"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in root.iterdir()] == ["dataset=ds"]


def test_a_completion_of_a_dataset_that_is_not_the_jobs_is_dead_lettered(tmp_path: Path) -> None:
    taken, letters = sink(tmp_path)
    taken._take(records(codec.encode(completion(1)), codec.encode(completion(2, dataset="other"))))
    taken.writer.flush()
    assert [(d.offset, d.reason) for d in letters.sent] == [
        (101, "dataset 'other' is not one of this job's")
    ]
    assert read_rows(tmp_path).column("prompt_id").to_pylist() == ["p1"]


def test_a_record_the_table_building_raises_on_is_dead_lettered_and_the_rest_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a record makes the sink raise, it is that record's fault: the batch
    is taken again one by one, the record is dead-lettered (its offset committed
    with the others, so a rerun never meets it), every other one is kept once."""
    real = rows._column_arrays

    def breaks_on_p2(batch: Any, ids: Any) -> Any:
        if any(r.prompt_id == "p2" for r in batch):
            raise OverflowError("Python int too large to convert to C long")
        return real(batch, ids)

    monkeypatch.setattr(rows, "_column_arrays", breaks_on_p2)
    taken, letters = sink(tmp_path)
    taken._take(records(*(codec.encode(completion(i)) for i in (1, 2, 3))))
    taken.writer.flush()
    [letter] = letters.sent
    assert (letter.offset, letter.reason) == (
        101,
        "cannot be kept: OverflowError: Python int too large to convert to C long",
    )
    assert sorted(read_rows(tmp_path).column("prompt_id").to_pylist()) == ["p1", "p3"]
    assert taken.first.duplicates == 0 and "p2" not in taken.first.seen
    assert taken.where() == f"at {TOPIC}[1]@100..102"
