"""The sink's pure parts: table building, atomic writes, resuming from files on disk."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.sinks.tables import completions_to_table
from tokenbudget.sinks.parquet import dataset_dir, existing_prompt_ids, write_atomically
from tokenbudget.sinks.schema import SCHEMA
from tokenbudget.streams.events import CompletionEvent


def completion(i: int, *, dataset: str = "ds", n_ids: int | None = None) -> CompletionEvent:
    n = (i % 7) if n_ids is None else n_ids
    return CompletionEvent(
        request_id=f"r{i}",
        prompt_id=f"p{i}",
        dataset=dataset,
        prompt_tokens=10 + i,
        completion_tokens=n,
        output_ids=[(i * 1000 + k) % 32000 for k in range(n)],
        finish_reason="length" if i % 2 else "stop",
        max_new_tokens=4096,
        text=f"text {i}",
        count_source="server" if i % 3 else "tokenizer",
        attempts=1 + i % 3,
        dispatched_at=100.0 + i,
        first_token_at=None if i % 4 == 0 else 100.5 + i,
        finished_at=101.0 + i,
    )


def test_table_schema_and_values() -> None:
    rows = [completion(i) for i in range(12)]
    table = completions_to_table(rows)
    assert table.schema == SCHEMA
    assert table.schema.field("output_ids").type == pa.list_(pa.int32())
    assert table.num_rows == 12
    assert table.column("output_ids").to_pylist() == [r.output_ids for r in rows]
    assert table.column("request_id").to_pylist() == [r.request_id for r in rows]
    assert table.column("prompt_id").to_pylist() == [r.prompt_id for r in rows]
    assert table.column("dataset").to_pylist() == ["ds"] * 12
    assert table.schema.field("dataset").type == pa.dictionary(pa.int32(), pa.string())
    assert table.column("prompt_tokens").to_pylist() == [r.prompt_tokens for r in rows]
    assert table.column("completion_tokens").to_pylist() == [r.completion_tokens for r in rows]
    assert table.column("finish_reason").to_pylist() == [r.finish_reason for r in rows]
    assert table.column("count_source").to_pylist() == [r.count_source for r in rows]
    assert table.column("attempts").to_pylist() == [r.attempts for r in rows]
    assert table.column("dispatched_at").to_pylist() == [r.dispatched_at for r in rows]
    assert table.column("first_token_at").to_pylist() == [r.first_token_at for r in rows]
    assert table.column("finished_at").to_pylist() == [r.finished_at for r in rows]
    assert table.column("text").to_pylist() == [r.text for r in rows]
    assert table.column("first_token_at").null_count == 3  # i = 0, 4, 8


def test_table_handles_empty_and_large_ids() -> None:
    rows = [
        completion(0, n_ids=0),
        CompletionEvent(
            request_id="big",
            prompt_id="pbig",
            dataset="ds",
            prompt_tokens=1,
            completion_tokens=3,
            output_ids=[0, 2**31 - 1, 151_643],
            finish_reason="stop",
            max_new_tokens=3,
        ),
        completion(1, n_ids=0),
    ]
    table = completions_to_table(rows)
    assert table.column("output_ids").to_pylist() == [[], [0, 2**31 - 1, 151_643], []]


def test_empty_table() -> None:
    table = completions_to_table([])
    assert table.num_rows == 0
    assert table.schema == SCHEMA


def test_write_atomically_leaves_only_the_final_file(tmp_path: Path) -> None:
    rows = [completion(i) for i in range(50)]
    folder = dataset_dir(tmp_path, "ds")
    assert folder == tmp_path / "dataset=ds"
    path = write_atomically(completions_to_table(rows), folder, row_group_rows=1000)
    assert path.parent == folder
    assert path.suffix == ".parquet"
    assert not path.name.startswith(".")
    assert sorted(p.name for p in folder.iterdir()) == [path.name]  # no temp file left
    back = pq.read_table(path)
    assert back.schema.equals(SCHEMA)
    assert back.column("output_ids").to_pylist() == [r.output_ids for r in rows]
    assert back.column("prompt_id").to_pylist() == [r.prompt_id for r in rows]


def test_write_atomically_twice_gives_two_files(tmp_path: Path) -> None:
    folder = tmp_path / "dataset=ds"
    a = write_atomically(completions_to_table([completion(1)]), folder, 1000)
    b = write_atomically(completions_to_table([completion(2)]), folder, 1000)
    assert a != b
    assert sorted(p.name for p in folder.iterdir()) == sorted([a.name, b.name])


@pytest.mark.parametrize(("rows", "group", "expected"), [(2500, 1000, 3), (1000, 1000, 1)])
def test_row_groups(tmp_path: Path, rows: int, group: int, expected: int) -> None:
    table = completions_to_table([completion(i) for i in range(rows)])
    path = write_atomically(table, tmp_path / "dataset=ds", row_group_rows=group)
    metadata = pq.ParquetFile(path).metadata
    assert metadata.num_rows == rows
    assert metadata.num_row_groups == expected
    assert all(metadata.row_group(g).num_rows <= group for g in range(metadata.num_row_groups))


def test_existing_prompt_ids(tmp_path: Path) -> None:
    assert existing_prompt_ids(tmp_path) == set()
    assert existing_prompt_ids(tmp_path / "does-not-exist") == set()
    write_atomically(
        completions_to_table([completion(i, dataset="a") for i in range(3)]),
        dataset_dir(tmp_path, "a"),
        1000,
    )
    write_atomically(
        completions_to_table([completion(i, dataset="b") for i in range(10, 12)]),
        dataset_dir(tmp_path, "b"),
        1000,
    )
    expected = {"p0", "p1", "p2", "p10", "p11"}
    assert existing_prompt_ids(tmp_path) == expected

    # A crash mid-write leaves a hidden temporary file: it is not a finished part.
    folder = dataset_dir(tmp_path, "a")
    (folder / ".part-1-deadbeef.parquet.tmp").write_bytes(b"PAR1 half a file")
    (folder / ".part-2-deadbeef.parquet").write_bytes(b"PAR1 half a file")
    hidden_ok = completions_to_table([completion(99, dataset="a")])
    pq.write_table(hidden_ok, folder / ".hidden.parquet")
    # Files outside dataset=* folders are not ours either.
    pq.write_table(hidden_ok, tmp_path / "stray.parquet")
    assert existing_prompt_ids(tmp_path) == expected
