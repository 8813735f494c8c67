"""The rows shared by the live sink and the replay: decoding, the first-completion
rule, table building, files and the readers training code uses."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from tests.sinks.tables import completions_to_table
from tokenbudget.core.errors import EventDecodeError
from tokenbudget.sinks import audit, replay, replay_range
from tokenbudget.sinks.parquet import (
    PartitionedWriter,
    WriterSettings,
    load_fenced_leases,
    remove_stale_temporaries,
    row_group_size,
    save_fenced_leases,
)
from tokenbudget.sinks.rows import (
    CompletionRecord,
    FirstCompletion,
    LegacyCompletionRecord,
    decode_records,
    keep_first,
)
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics


def completion(
    i: int, *, dataset: str = "ds", n: int | None = None, rid: str = ""
) -> ev.CompletionEvent:
    n = (i % 9) if n is None else n
    return ev.CompletionEvent(
        request_id=rid or f"r{i}",
        prompt_id=f"p{i}",
        dataset=dataset,
        prompt_tokens=10 + i,
        completion_tokens=n,
        output_ids=[(i * 7919 + k * 31) % 151_643 for k in range(n)],
        finish_reason="length" if i % 2 else "stop",
        max_new_tokens=4096,
        text=f'text "{i}" é\n',
        count_source="server" if i % 3 else "tokenizer",
        attempts=1 + i % 3,
        dispatched_at=100.0 + i,
        first_token_at=None if i % 4 == 0 else 100.5 + i,
        finished_at=101.0 + i,
    )


def v1_wire(event: ev.CompletionEvent, **changes: object) -> bytes:
    """The bytes a version 1 writer produced: ids as a JSON array of numbers."""
    wire = json.loads(codec.encode(event))
    wire.update(v=1, output_ids=list(event.output_ids))
    wire.update(changes)
    return msgspec.json.encode(wire)


def v2_wire(event: ev.CompletionEvent, **changes: object) -> bytes:
    wire = json.loads(codec.encode(event))
    wire.update(changes)
    return msgspec.json.encode(wire)


def kept_table(values: list[bytes], first: FirstCompletion | None = None):
    kept = keep_first(decode_records(values), first or FirstCompletion())
    return kept, {d: t for d, t in kept.tables.items()}


@pytest.mark.parametrize("wire", ["v2", "v1", "mixed"])
def test_fast_path_equals_full_decoding(wire: str) -> None:
    events = [completion(i, dataset=f"d{i % 3}") for i in range(60)]
    events.append(completion(99, n=0))
    events.append(completion(98, n=3))
    events.append(completion(97, n=4000))
    old = {"v2": (), "v1": range(len(events)), "mixed": range(0, len(events), 2)}[wire]
    values = [v1_wire(e) if i in old else codec.encode(e) for i, e in enumerate(events)]
    kept, tables = kept_table(values)
    assert not kept.errors
    assert kept.rows == len(events)
    for dataset, table in tables.items():
        expected = completions_to_table([e for e in events if e.dataset == dataset])
        assert table.equals(expected), dataset


def test_v1_and_v2_topics_give_identical_files(tmp_path: Path) -> None:
    """An old topic (ids as JSON numbers) and a new one (int32 bytes) holding the
    same completions, duplicates included, are written to the same rows."""
    events = [completion(i, dataset=f"d{i % 3}", n=(i * 37) % 300) for i in range(50)]
    events += [completion(4, rid="again-4", n=9), completion(7, n=2)]  # second completions
    for wire, encode in (("v1", v1_wire), ("v2", codec.encode)):
        assert isinstance(
            decode_records([encode(events[1])]).records[0],
            (LegacyCompletionRecord if wire == "v1" else CompletionRecord),
        )
        writer = PartitionedWriter(tmp_path / wire, WriterSettings(rotate_rows=16))
        first = FirstCompletion()
        values = [encode(e) for e in events]
        for start in range(0, len(values), 11):
            writer.add(keep_first(decode_records(values[start : start + 11]), first).tables)
        writer.flush()
        assert first.duplicates == 2
    old = pq.read_table(tmp_path / "v1").sort_by("request_id")
    new = pq.read_table(tmp_path / "v2").sort_by("request_id")
    assert old.num_rows == new.num_rows == 50
    assert old.equals(new)
    assert old.schema.field("output_ids").type == pa.list_(pa.int32())


def test_first_completion_wins_and_duplicates_are_dropped() -> None:
    events = [
        completion(1),
        completion(2),
        completion(1, rid="again-1", n=5),  # a second completion of p1: dropped
        completion(2, rid="r2"),  # the same event re-sent: dropped
        completion(3),
    ]
    first = FirstCompletion()
    _, tables = kept_table([codec.encode(e) for e in events], first)
    assert tables["ds"].column("request_id").to_pylist() == ["r1", "r2", "r3"]
    assert first.duplicates == 2
    # a later batch: already seen prompts stay dropped
    _kept, tables = kept_table(
        [codec.encode(completion(3, rid="late")), codec.encode(completion(4))], first
    )
    assert tables["ds"].column("request_id").to_pylist() == ["r4"]
    assert first.duplicates == 3


def test_bad_values_are_errors_and_do_not_shadow_a_valid_completion() -> None:
    good = [codec.encode(completion(i)) for i in range(5)]
    bad_ids = v1_wire(completion(7)).replace(b'"output_ids":[', b'"output_ids":["x",')
    huge = v1_wire(completion(8)).replace(b'"output_ids":[', b'"output_ids":[4000000000,')
    spaced = v1_wire(completion(10)).replace(b'"output_ids":[', b'"output_ids":[ ')
    values = [
        good[0],
        b"not json",
        codec.encode(ev.PromptSkipped(prompt_id="x", dataset="ds", reason="halted")),
        bad_ids,  # p7, invalid ...
        codec.encode(completion(7, rid="valid-7")),  # ... so this one is p7's first
        huge,
        spaced,  # unusual spacing is still a valid completion
        good[1],
        b'{"type":"completion","v":99}',
    ]
    first = FirstCompletion()
    kept, tables = kept_table(values, first)
    assert [i for i, _ in kept.errors] == [1, 2, 3, 5, 8]
    assert "version 99" in dict(kept.errors)[8]
    assert "int32" in dict(kept.errors)[5]
    table = tables["ds"]
    assert table.column("request_id").to_pylist() == ["r0", "valid-7", "r10", "r1"]
    assert table.column("output_ids").to_pylist()[2] == list(completion(10).output_ids)
    assert kept.positions["ds"] == [0, 4, 6, 7]
    assert first.duplicates == 0
    assert first.seen == {"p0", "p7", "p10", "p1"}


@pytest.mark.parametrize(
    ("output_ids", "reason"),
    [
        ("AQAAAAI=", "5 bytes is not a whole number of int32 token ids"),
        ("AQAA*AAA", "not base64"),
        ("AQAAAA", "not base64"),
        (17, "expected base64 int32 bytes or an array"),
        (None, "output_ids is null, but count_source 'server'"),
    ],
)
def test_malformed_binary_ids_are_errors_with_the_reason(output_ids: object, reason: str) -> None:
    """The sink dead-letters these (ParquetSink._take sends every error); a valid
    completion of the same prompt after one is kept."""
    values = [
        codec.encode(completion(1)),
        v2_wire(completion(2), output_ids=output_ids),
        codec.encode(completion(2, rid="valid-2")),
        v1_wire(completion(3)),
    ]
    first = FirstCompletion()
    kept, tables = kept_table(values, first)
    assert [i for i, _ in kept.errors] == [1]
    assert reason in kept.errors[0][1] and "output_ids" in kept.errors[0][1]
    assert tables["ds"].column("request_id").to_pylist() == ["r1", "valid-2", "r3"]
    assert first.duplicates == 0


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"completion_tokens": -1, "output_ids": ""}, r">= 0 - at `\$\.completion_tokens`"),
        ({"prompt_tokens": -3}, r">= 0 - at `\$\.prompt_tokens`"),
        # past any request, and past int64: the sink's Parquet, the ledger's msgpack
        (
            {"completion_tokens": 2**63, "max_new_tokens": 0, "output_ids": ""},
            r"<= 2147483647 - at `\$\.completion_tokens`",
        ),
        ({"prompt_tokens": 2**63}, r"<= 2147483647 - at `\$\.prompt_tokens`"),
        ({"completion_tokens": 9}, "completion_tokens 9 but 2 output_ids"),
        ({"max_new_tokens": 1}, "above max_new_tokens 1"),
    ],
)
@pytest.mark.parametrize("version", [1, 2])
def test_impossible_counts_are_errors_for_the_sink_as_for_the_ledger(
    changes: dict[str, object], reason: str, version: int
) -> None:
    """A completion whose counts cannot be true is dead-lettered by every reader, so
    the sink never keeps an answer the ledger refused to count."""
    bad = completion(4, n=2)
    if version == 1 and changes.get("output_ids") == "":
        changes = {**changes, "output_ids": []}
    wire = (v1_wire if version == 1 else v2_wire)(bad, **changes)
    with pytest.raises(EventDecodeError, match=reason):
        codec.decode(wire)
    values = [codec.encode(completion(1)), wire, codec.encode(completion(4, rid="valid-4"))]
    first = FirstCompletion()
    kept, tables = kept_table(values, first)
    assert [i for i, _ in kept.errors] == [1]
    assert re.search(reason, kept.errors[0][1])
    assert tables["ds"].column("request_id").to_pylist() == ["r1", "valid-4"]


def test_stale_temporaries_are_removed(tmp_path: Path) -> None:
    folder = tmp_path / "dataset=a"
    folder.mkdir()
    (folder / ".part-1-x.parquet.tmp").write_bytes(b"half")
    (folder / "part-2-y.parquet").write_bytes(b"kept")
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == [".part-1-x.parquet.tmp"]
    assert sorted(p.name for p in folder.iterdir()) == ["part-2-y.parquet"]


def test_row_groups_are_sized_by_bytes_and_rows() -> None:
    table = completions_to_table([completion(i, n=4000) for i in range(100)])
    per_row = table.nbytes // 100
    assert row_group_size(table, 1000, 10 * per_row) == 10
    assert row_group_size(table, 7, 1 << 30) == 7
    assert row_group_size(table, 1000, 1) == 1


def write_tree(root: Path) -> list[ev.CompletionEvent]:
    events = [completion(i, dataset=f"d{i % 3}") for i in range(90)]
    writer = PartitionedWriter(root, WriterSettings(rotate_rows=40, row_group_rows=16))
    values = [codec.encode(e) for e in events]
    first = FirstCompletion()
    for start in range(0, len(values), 20):
        writer.add(keep_first(decode_records(values[start : start + 20]), first).tables)
        if writer.full():
            writer.flush()
    writer.flush()
    assert sum(writer.rows_written.values()) == 90
    assert len(writer.files) >= 6  # rotated
    return events


def expected_rows(events: list[ev.CompletionEvent]) -> set[tuple[str, str, int]]:
    return {(e.request_id, e.dataset, e.completion_tokens) for e in events}


def test_the_tree_reads_as_one_table_with_pyarrow(tmp_path: Path) -> None:
    events = write_tree(tmp_path)
    for table in (
        pq.read_table(tmp_path),
        pads.dataset(tmp_path, format="parquet").to_table(),
        pads.dataset(
            tmp_path,
            format="parquet",
            partitioning=pads.HivePartitioning.discover(infer_dictionary=True),
        ).to_table(),
    ):
        rows = zip(
            table.column("request_id").to_pylist(),
            table.column("dataset").to_pylist(),
            table.column("completion_tokens").to_pylist(),
            strict=True,
        )
        assert set(rows) == expected_rows(events)
        assert table.num_rows == 90
    one = pq.read_table(next(tmp_path.glob("dataset=d1/*.parquet")))
    assert set(one.column("dataset").to_pylist()) == {"d1"}
    meta = pq.ParquetFile(next(tmp_path.glob("dataset=d1/*.parquet"))).metadata
    assert all(meta.row_group(g).num_rows <= 16 for g in range(meta.num_row_groups))
    back = pq.read_table(tmp_path)
    by_id = {e.request_id: e for e in events}
    for rid, ids in zip(
        back.column("request_id").to_pylist(), back.column("output_ids").to_pylist(), strict=True
    ):
        assert ids == by_id[rid].output_ids


def test_the_tree_reads_with_polars(tmp_path: Path) -> None:
    pl = pytest.importorskip("polars")
    events = write_tree(tmp_path)
    frame = pl.read_parquet(f"{tmp_path}/**/*.parquet")
    rows = set(frame.select("request_id", "dataset", "completion_tokens").iter_rows())
    assert rows == expected_rows(events)
    lazy = pl.scan_parquet(f"{tmp_path}/", hive_partitioning=True).collect()
    assert lazy.height == 90


def test_the_tree_reads_with_duckdb(tmp_path: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    events = write_tree(tmp_path)
    for hive in ("true", "false"):
        rows = duckdb.sql(
            "select request_id, dataset, completion_tokens from "
            f"read_parquet('{tmp_path}/**/*.parquet', hive_partitioning={hive})"
        ).fetchall()
        assert set(rows) == expected_rows(events)
    total = duckdb.sql(
        f"select sum(len(output_ids)) from read_parquet('{tmp_path}/**/*.parquet')"
    ).fetchall()
    assert total[0][0] == sum(len(e.output_ids) for e in events)


def test_the_tree_reads_with_hf_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    events = write_tree(tmp_path / "out")
    datasets.disable_progress_bars()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = datasets.load_dataset(
            "parquet",
            data_files=str(tmp_path / "out" / "**" / "*.parquet"),
            split="train",
            cache_dir=str(tmp_path / "hf-cache"),
        )
    rows = set(zip(data["request_id"], data["dataset"], data["completion_tokens"], strict=True))
    assert rows == expected_rows(events)
    data = data.with_format("numpy", columns=["output_ids"])
    assert len(data[0]["output_ids"]) == len(
        next(
            e for e in events if e.request_id == data.with_format(None)[0]["request_id"]
        ).output_ids
    )
    assert os.path.isdir(tmp_path / "hf-cache")


def on_lease(event: ev.CompletionEvent, lease_id: str) -> ev.CompletionEvent:
    return msgspec.structs.replace(event, lease_id=lease_id)


def fence(lease_id: str, dataset: str = "ds") -> bytes:
    return codec.encode(ev.LeaseFenced(dataset=dataset, lease_id=lease_id))


def test_a_completion_after_its_lease_fence_is_kept_by_no_one() -> None:
    """The fence orders itself among the lease's completions: before it they are
    kept, after it they are not (the ledger counts them as skipped), in the batch and
    in every later batch, while other leases are unaffected."""
    values = [
        codec.encode(on_lease(completion(1), "A")),
        codec.encode(on_lease(completion(2), "B")),
        fence("A"),
        codec.encode(on_lease(completion(3), "A")),  # a frozen holder woke up: too late
        codec.encode(on_lease(completion(4), "B")),
        codec.encode(on_lease(completion(3, rid="claimed-3"), "C")),  # its claim, anew
    ]
    first = FirstCompletion()
    kept, tables = kept_table(values, first)
    assert kept.errors == []
    assert tables["ds"].column("request_id").to_pylist() == ["r1", "r2", "r4", "claimed-3"]
    assert kept.positions["ds"] == [0, 1, 4, 5]
    assert first.fenced == {"A"} and first.rejected == {"p3": "ds"}
    later, _ = kept_table([codec.encode(on_lease(completion(5), "A"))], first)
    assert later.rows == 0 and "p5" in first.rejected


def test_fenced_leases_survive_a_restart_of_the_sink(tmp_path: Path) -> None:
    assert load_fenced_leases(tmp_path) == set()
    save_fenced_leases(tmp_path, {"h1:ds:3", "h2:ds:1"})
    assert load_fenced_leases(tmp_path) == {"h1:ds:3", "h2:ds:1"}
    # not a file any reader of the dataset tree picks up
    assert pads.dataset(tmp_path, format="parquet", partitioning="hive").files == []


def test_a_thinking_models_rows_replay_as_written_and_recount_with_their_reasoning() -> None:
    """The reasoning, its tokens and the unfinished mark take the sink's fast path to
    the same row as the full decoder; --recount-with counts the thinking the answer's
    completion_tokens count (it stands beside the text, not in it)."""
    thinking = [
        msgspec.structs.replace(
            completion(i, n=4), reasoning=f"hm {i}" if i % 2 else None,
            reasoning_tokens=i % 5 if i % 2 else None, unfinished=i % 3 == 0,
        )
        for i in range(12)
    ]  # fmt: skip
    _, tables = kept_table([codec.encode(e) for e in thinking])
    assert tables["ds"].equals(completions_to_table(thinking))
    assert tables["ds"].column("reasoning").to_pylist()[:2] == [None, "hm 1"]

    def words(texts: list[str], add_special_tokens: bool) -> dict[str, list[list[str]]]:
        return {"input_ids": [t.split() for t in texts]}

    summary = audit.ReplaySummary(topic="ns.completions")
    options = replay_range.ReplayOptions(bootstrap="-", topics=Topics("ns"))
    processor = replay._Processor(options, summary, FirstCompletion(), set(), None, None, words)
    processor.take([], decode_records([codec.encode(e) for e in thinking]))
    processor.close()
    expected = sum(len(((e.reasoning or "") + e.text).split()) for e in thinking)
    assert summary.datasets["ds"].recounted_tokens == expected
    assert expected > sum(len(e.text.split()) for e in thinking)
