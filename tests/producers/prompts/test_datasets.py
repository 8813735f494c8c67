"""Dataset readers: prompts with stable ids, bad rows named by file and line."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenbudget.core import sizes
from tokenbudget.core.errors import DatasetError
from tokenbudget.producers.prompts.datasets import read_prompts
from tokenbudget.producers.prompts.ids import stable_prompt_id
from tokenbudget.producers.prompts.readers import MAX_ROW_DEPTH, ROW_BYTES, reader_for
from tokenbudget.producers.prompts.rows import PromptRow
from tokenbudget.streams.fields import ChatMessage

ROWS: list[dict[str, Any]] = [
    {"prompt": "Write a haiku #short"},
    {"messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]},
    {"prompt": "same text"},
    {"prompt": "same text"},
    {"id": "x-1", "prompt": "with an id"},
    {"id": 7, "messages": [{"role": "user", "content": "numeric id"}]},
]


def write_jsonl(path: Path, rows: list[Any], raw_lines: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    for index, text in (raw_lines or {}).items():
        lines.insert(index, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def read(dataset: str, path: Path, **kwargs: Any) -> list[PromptRow]:
    return list(read_prompts(dataset, path, **kwargs))


def test_jsonl_prompt_and_messages_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    rows = read("ds", path)
    assert len(rows) == len(ROWS)
    assert rows[0].text == "Write a haiku #short"
    assert rows[0].messages is None
    assert rows[1].text is None
    assert rows[1].messages == (
        ChatMessage(role="system", content="terse"),
        ChatMessage(role="user", content="hi"),
    )
    assert [r.source for r in rows] == [f"{path}:{i}" for i in range(1, len(ROWS) + 1)]


def test_ids_are_stable_across_reads(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    first = [r.prompt_id for r in read("ds", path)]
    second = [r.prompt_id for r in read("ds", path)]
    assert first == second
    assert len(set(first)) == len(first)
    assert all(len(pid) == 32 and int(pid, 16) >= 0 for pid in first)


def test_ids_differ_across_dataset_names(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    a = {r.prompt_id for r in read("alpha", path)}
    b = {r.prompt_id for r in read("beta", path)}
    assert a.isdisjoint(b)


def test_ids_do_not_depend_on_file_location(tmp_path: Path) -> None:
    one = write_jsonl(tmp_path / "one.jsonl", ROWS)
    (tmp_path / "sub").mkdir()
    two = write_jsonl(tmp_path / "sub" / "two.jsonl", ROWS)
    assert [r.prompt_id for r in read("ds", one)] == [r.prompt_id for r in read("ds", two)]


def test_identical_rows_get_distinct_ids(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "dup"}] * 3)
    ids = [r.prompt_id for r in read("ds", path)]
    assert len(set(ids)) == 3


def test_content_ids_do_not_depend_on_position(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "first"}, {"prompt": "second"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "second"}, {"prompt": "first"}])
    ids_a = {r.text: r.prompt_id for r in read("ds", a)}
    ids_b = {r.text: r.prompt_id for r in read("ds", b)}
    assert ids_a == ids_b


def test_explicit_ids_are_used(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": "x-1", "prompt": "one"}, {"id": 7, "prompt": "two"}, {"id": "y", "prompt": "one"}],
    )
    rows = read("ds", path)
    assert rows[0].prompt_id == stable_prompt_id("ds", "id:x-1")
    assert rows[1].prompt_id == stable_prompt_id("ds", "id:7")
    # Same content, different explicit id: two prompts.
    assert rows[2].prompt_id == stable_prompt_id("ds", "id:y")
    assert rows[0].prompt_id != rows[2].prompt_id


def test_explicit_id_survives_a_content_change(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": "k", "prompt": "old wording"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": "k", "prompt": "new wording"}])
    assert read("ds", a)[0].prompt_id == read("ds", b)[0].prompt_id


def test_duplicate_explicit_id_is_a_bad_row(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"id": "k", "prompt": "a"}, {"id": "k", "prompt": "b"}]
    )
    with pytest.raises(DatasetError, match="duplicate id") as info:
        read("ds", path)
    assert info.value.line == 2
    reported: list[DatasetError] = []
    rows = read("ds", path, on_bad_row=reported.append)
    assert [r.text for r in rows] == ["a"]
    assert len(reported) == 1


BAD_ROWS: list[tuple[str, str]] = [
    ("{not json", "not valid JSON"),
    ('{"nothing": 1}', "neither 'prompt'"),
    ('{"prompt": ""}', "'prompt' is empty"),
    ('{"prompt": "   "}', "'prompt' is empty"),
    ('{"prompt": 42}', "'prompt' must be a string"),
    ('{"prompt": "x", "id": 1.5}', "'id' must be"),
    ('{"prompt": "x", "id": ["a"]}', "'id' must be"),
    ('{"messages": "hello"}', "'messages' must be a non-empty list"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', "messages[0]"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0]"),
    ('{"messages": [{"role": "user", "content": "ok"}, "x"]}', "messages[1]"),
    ('{"messages": [{"role": "user", "content": " "}]}', "empty"),
    ('["a", "list"]', "expected a JSON object"),
    ('"just a string"', "expected a JSON object"),
]


@pytest.mark.parametrize(("line", "message"), BAD_ROWS)
def test_bad_row_raises_with_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(f'{{"prompt": "good"}}\n\n{line}\n{{"prompt": "after"}}\n')
    with pytest.raises(DatasetError) as info:
        read("ds", path)
    # Line 2 is blank; the bad row is on line 3.
    assert f"{path}:3" in str(info.value)
    assert message in str(info.value)
    assert info.value.path == str(path)
    assert info.value.line == 3


def test_invalid_utf8_is_a_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(DatasetError) as info:
        read("ds", path)
    assert info.value.line == 2


def test_first_bad_row_raises_without_callback(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "ok"}, {"prompt": ""}, {"prompt": 3}],
    )
    rows = read_prompts("ds", path)
    assert next(rows).text == "ok"
    with pytest.raises(DatasetError) as info:
        next(rows)
    assert info.value.line == 2


def test_bad_rows_are_skipped_and_reported_with_callback(tmp_path: Path) -> None:
    lines = [
        '{"prompt": "one"}',
        "{broken",
        '{"prompt": ""}',
        '{"prompt": "two"}',
        '{"messages": 3}',
        '{"prompt": "three"}',
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    reported: list[DatasetError] = []
    rows = read("ds", path, on_bad_row=reported.append)
    assert [r.text for r in rows] == ["one", "two", "three"]
    assert [e.line for e in reported] == [2, 3, 5]
    assert all(str(path) in str(e) for e in reported)
    # Skipping a bad row does not shift the ids of the good ones.
    clean = write_jsonl(tmp_path / "clean.jsonl", [{"prompt": t} for t in ("one", "two", "three")])
    assert [r.prompt_id for r in rows] == [r.prompt_id for r in read("ds", clean)]


def test_limit(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    rows = read("ds", path, limit=3)
    assert [r.text for r in rows] == ["p0", "p1", "p2"]
    assert read("ds", path, limit=0) == []
    assert len(read("ds", path, limit=100)) == 10


def test_limit_counts_good_rows_only(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{bad\n{"prompt": "b"}\n{"prompt": "c"}\n')
    reported: list[DatasetError] = []
    rows = read("ds", path, limit=2, on_bad_row=reported.append)
    assert [r.text for r in rows] == ["a", "b"]
    assert len(reported) == 1


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="cannot open"):
        read("ds", tmp_path / "absent.jsonl")


def test_unknown_suffix(tmp_path: Path) -> None:
    path = tmp_path / "d.txt"
    path.write_text("prompt\nhello\n")
    with pytest.raises(DatasetError, match=r"unknown file type '\.txt'; tokenbudget reads JSON"):
        reader_for(path)


def test_a_csv_is_refused_with_the_command_that_converts_it(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("prompt\nhello\n")
    with pytest.raises(DatasetError) as info:
        reader_for(path)
    message = str(info.value)
    assert "CSV is not read" in message and "Parquet (.parquet, .pq)" in message
    command = message.split('python -c "')[1].split('"')[0]
    # the command it gives converts this very file
    subprocess.run([sys.executable, "-c", command], cwd=tmp_path, check=True)
    assert [r.text for r in read("ds", tmp_path / "d.parquet")] == ["hello"]


def _parquet_table(rows: list[dict[str, Any]]) -> pa.Table:
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema(
        [("id", pa.string()), ("prompt", pa.string()), ("messages", pa.list_(message))]
    )
    normalised = [
        {
            "id": None if r.get("id") is None else str(r["id"]),
            "prompt": r.get("prompt"),
            "messages": r.get("messages"),
        }
        for r in rows
    ]
    return pa.Table.from_pylist(normalised, schema=schema)


def test_parquet_reads_like_jsonl(tmp_path: Path) -> None:
    # Parquet has one id type per column: write the ids as strings in both files.
    rows = [{**r, "id": str(r["id"])} if "id" in r else r for r in ROWS]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    parquet = tmp_path / "d.parquet"
    pq.write_table(_parquet_table(rows), parquet)
    from_jsonl = read("ds", jsonl)
    from_parquet = read("ds", parquet)
    assert [(r.prompt_id, r.text, r.messages) for r in from_parquet] == [
        (r.prompt_id, r.text, r.messages) for r in from_jsonl
    ]
    assert [r.source for r in from_parquet] == [f"{parquet}:{i}" for i in range(1, len(rows) + 1)]


def test_parquet_bad_row_names_row_number(tmp_path: Path) -> None:
    parquet = tmp_path / "d.parquet"
    pq.write_table(
        _parquet_table([{"prompt": "fine"}, {"prompt": "  "}, {"prompt": "also fine"}]), parquet
    )
    with pytest.raises(DatasetError) as info:
        read("ds", parquet)
    assert f"{parquet}:2" in str(info.value)
    reported: list[DatasetError] = []
    assert [r.text for r in read("ds", parquet, on_bad_row=reported.append)] == [
        "fine",
        "also fine",
    ]
    assert [e.line for e in reported] == [2]


def test_parquet_many_rows_across_batches(tmp_path: Path) -> None:
    parquet = tmp_path / "big.parquet"
    pq.write_table(
        _parquet_table([{"prompt": f"p{i}"} for i in range(2500)]), parquet, row_group_size=700
    )
    rows = read("ds", parquet)
    assert len(rows) == 2500
    assert rows[-1].text == "p2499"
    assert rows[-1].source == f"{parquet}:2500"


def test_not_parquet(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    path.write_text("this is not parquet")
    with pytest.raises(DatasetError, match="Parquet"):
        read("ds", path)


# ---- sizes: a prompt over the limit is a bad row -------------------------------------


def test_a_prompt_over_max_prompt_bytes_is_a_bad_row_with_a_bounded_excerpt(
    tmp_path: Path,
) -> None:
    big = "é" * 600  # 1,200 bytes of UTF-8, 600 characters
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "short"},
            {"prompt": big},
            {"messages": [{"role": "system", "content": big}, {"role": "user", "content": "x"}]},
            {"prompt": "a" * 1000},  # exactly at the limit: kept
        ],
    )
    reported: list[DatasetError] = []
    rows = read("ds", path, on_bad_row=reported.append, max_prompt_bytes=1000)
    assert [r.text for r in rows] == ["short", "a" * 1000]
    assert [(e.line, e.size) for e in reported] == [(2, 1200), (3, 1202)]
    assert all("over [producer] max_prompt_bytes = 1,000" in e.message for e in reported)
    assert all(e.where == f"{path}:{e.line}" for e in reported)
    assert all(len(e.excerpt) <= sizes.EXCERPT_CHARS + 40 for e in reported)
    # Without the callback the first one stops the read, naming the line.
    with pytest.raises(DatasetError, match="1,200 bytes of UTF-8") as info:
        read("ds", path, max_prompt_bytes=1000)
    assert info.value.line == 2
    # No limit given: every row is a prompt.
    assert len(read("ds", path)) == 4


def test_the_excerpt_of_a_huge_bad_row_is_bounded(tmp_path: Path) -> None:
    huge = "{" + "x" * 3_000_000  # broken JSON, 3 MB on one line
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "fine"}\n' + huge + "\n")
    reported: list[DatasetError] = []
    assert len(read("ds", path, on_bad_row=reported.append)) == 1
    (bad,) = reported
    assert bad.line == 2 and bad.size == 3_000_002  # the line, its newline included
    assert bad.excerpt.startswith("{xxx") and "2,998,001 more characters" in bad.excerpt
    assert len(bad.excerpt) < sizes.EXCERPT_CHARS + 100


def test_a_row_that_is_not_a_prompt_carries_its_excerpt(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"text": "no prompt key"}])
    reported: list[DatasetError] = []
    read("ds", path, on_bad_row=reported.append)
    (bad,) = reported
    assert json.loads(bad.excerpt) == {"text": "no prompt key"}
    assert bad.size == len(bad.excerpt.encode())


def test_a_templated_prompt_over_max_prompt_tokens_is_a_bad_row(tmp_path: Path) -> None:
    def template(messages: Any) -> list[int]:
        return list(range(len(messages[-1].content.split())))

    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "one two"}, {"prompt": "a b c d e"}])
    reported: list[DatasetError] = []
    rows = read("ds", path, template=template, on_bad_row=reported.append, max_prompt_tokens=4)
    assert [r.text for r in rows] == ["one two"]
    (bad,) = reported
    assert bad.line == 2
    assert "5 tokens, over [producer] max_prompt_tokens = 4" in bad.message
    assert bad.excerpt == "a b c d e"


# ---- rows bounded before they are parsed, and rows no parser takes -----------------------


def test_a_line_over_the_row_limit_is_a_bad_row_found_by_its_length_in_bounded_memory(
    tmp_path: Path,
) -> None:
    line = 200_000_000  # bytes, its newline included
    path = tmp_path / "d.jsonl"
    with path.open("wb") as handle:
        handle.write(b'{"prompt": "before"}\n{"prompt": "')
        handle.seek(line - len(b'{"prompt": "') - len(b'"}\n'), 1)  # a hole: no disk used
        handle.write(b'"}\n{"prompt": "after"}\n')
    reported: list[DatasetError] = []
    tracemalloc.start()
    try:
        rows = read("ds", path, on_bad_row=reported.append)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(r.text, r.source) for r in rows] == [("before", f"{path}:1"), ("after", f"{path}:3")]
    (bad,) = reported
    assert (bad.line, bad.size) == (2, line)
    assert f"the line is {line:,} bytes, over the {ROW_BYTES:,} a row may take" in bad.message
    assert bad.excerpt.startswith('{"prompt": "') and len(bad.excerpt) < sizes.EXCERPT_CHARS + 80
    assert peak < line // 4, f"{peak:,} bytes held reading a {line:,}-byte line"
    with pytest.raises(DatasetError, match="a row may take") as info:
        read("ds", path)  # without the callback it stops the read, at its line
    assert info.value.line == 2


def nested(depth: int) -> str:
    """A row whose ``deep`` field makes it ``depth`` levels deep, the row's own included."""
    return '{"prompt": "deep", "deep": ' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}"


def test_rows_no_parser_takes_are_bad_rows_with_their_line_and_the_reader_goes_on(
    tmp_path: Path,
) -> None:
    deep_tools = json.dumps(nested(10_000))  # the tools as JSON text, nested as deep
    lines = [
        '{"prompt": "first"}',
        nested(10_000),  # RecursionError in the parser
        nested(MAX_ROW_DEPTH + 1),  # parses, but deeper than any row is let through
        '{"prompt": "big", "n": ' + "9" * 5000 + "}",  # ValueError: past int's digits
        '{"prompt": "tools", "tools": ' + deep_tools + "}",
        nested(MAX_ROW_DEPTH),  # at the limit: a row
        '{"prompt": "last"}',
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    reported: list[DatasetError] = []
    rows = read("ds", path, on_bad_row=reported.append)
    assert [(r.text, r.source) for r in rows] == [
        ("first", f"{path}:1"),
        ("deep", f"{path}:6"),
        ("last", f"{path}:7"),
    ]
    assert [e.where for e in reported] == [f"{path}:{n}" for n in (2, 3, 4, 5)]
    too_deep = f"nested more than {MAX_ROW_DEPTH} deep"
    assert [too_deep in e.message for e in reported] == [True, True, False, True]
    assert "not valid JSON" in reported[2].message and "digits" in reported[2].message
    assert all(len(e.excerpt) < sizes.EXCERPT_CHARS + 80 for e in reported)


def test_a_parquet_value_python_cannot_hold_is_a_bad_row_and_the_reader_goes_on(
    tmp_path: Path,
) -> None:
    parquet = tmp_path / "d.parquet"
    days = pa.array([0, 2**31 - 1, 1], pa.date32())  # row 2: past the year 9999
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "day": days}), parquet)
    reported: list[DatasetError] = []
    rows = read("ds", parquet, on_bad_row=reported.append)
    assert [(r.text, r.source) for r in rows] == [("a", f"{parquet}:1"), ("c", f"{parquet}:3")]
    (bad,) = reported
    assert bad.where == f"{parquet}:2" and "OverflowError" in bad.message
