"""Replay and the exactly-once sink on the real broker: crashes at every point of a
flush, planted duplicates, a planted ledger discrepancy, and the replay targets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pyarrow.parquet as pq
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from tokenbudget.app.runner import start_ledger_process, stop_process
from tokenbudget.cli import main as cli_main
from tokenbudget.core import kafka_admin
from tokenbudget.dev.tiny_tokenizer import ship_own_code
from tokenbudget.sinks.parquet import ParquetSink, SinkSettings
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration

DATASETS = ("alpha", "beta", "gamma")


def completion(
    dataset: str, i: int, *, tokens: int | None = None, rid: str = ""
) -> ev.CompletionEvent:
    n = tokens if tokens is not None else 5 + (i * 7) % 40
    return ev.CompletionEvent(
        request_id=rid or f"{dataset}-r{i}",
        prompt_id=f"{dataset}-p{i}",
        dataset=dataset,
        prompt_tokens=20 + i,
        completion_tokens=n,
        output_ids=[(i * 131 + k) % 151_643 for k in range(n)],
        finish_reason="stop",
        max_new_tokens=4096,
        text=" ".join(["hello", "world"] * (n // 2)) + (" x" if n % 2 else ""),
        dispatched_at=1.0,
        finished_at=2.0,
    )


def publish(bootstrap: str, topic: str, events: list[ev.Event]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    for event in events:
        producer.send(topic, key=codec.event_key(event), value=codec.encode(event))
    producer.flush()
    producer.close()


def with_duplicates(count: int, offset: int = 0) -> tuple[list[ev.Event], list[ev.CompletionEvent]]:
    """Completions of every dataset, interleaved, with duplicates planted: re-sent
    events and second completions of a prompt. Returns (all events, the first
    completion of each prompt)."""
    events: list[ev.Event] = []
    firsts: list[ev.CompletionEvent] = []
    for i in range(offset, offset + count):
        for dataset in DATASETS:
            event = completion(dataset, i)
            events.append(event)
            firsts.append(event)
            if i % 5 == 0:
                events.append(event)  # the same event again (a producer retry)
            if i % 7 == 0:
                # a second completion of the prompt (a dispatcher that crashed
                # before committing), different tokens: never kept
                events.append(completion(dataset, i, tokens=99, rid=f"{dataset}-again{i}"))
    return events, firsts


def rows(root: Path) -> dict[str, tuple[Any, ...]]:
    """request_id -> (prompt_id, dataset, tokens, ids) over the whole tree, asserting
    that no request_id or prompt_id appears twice."""
    table = pq.read_table(root)
    out: dict[str, tuple[Any, ...]] = {}
    prompts = set()
    for row in table.to_pylist():
        assert row["request_id"] not in out, f"duplicate request_id {row['request_id']}"
        assert row["prompt_id"] not in prompts, f"duplicate prompt_id {row['prompt_id']}"
        prompts.add(row["prompt_id"])
        out[row["request_id"]] = (
            row["prompt_id"],
            row["dataset"],
            row["completion_tokens"],
            row["prompt_tokens"],
            tuple(row["output_ids"]),
        )
    return out


def expected(firsts: list[ev.CompletionEvent]) -> dict[str, tuple[Any, ...]]:
    return {
        e.request_id: (
            e.prompt_id,
            e.dataset,
            e.completion_tokens,
            e.prompt_tokens,
            tuple(e.output_ids),
        )
        for e in firsts
    }


def run_sink_to_end(
    bootstrap: str, topics: Topics, out: Path, group: str, rotate_rows: int = 1000
) -> ParquetSink:
    sink = ParquetSink(
        bootstrap,
        topics,
        SinkSettings(path=out, rotate_rows=rotate_rows, row_group_rows=8, flush_interval=60),
        group_id=group,
    )
    sink.start()
    try:
        deadline = time.monotonic() + 60
        while not sink.caught_up():
            assert time.monotonic() < deadline, "sink did not catch up"
            sink.poll_once(timeout_ms=200)
        sink.flush()
    finally:
        sink.close()
    return sink


def replay_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = cli_main(["replay", *args, "--json", "--quiet"])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def topic_with_duplicates(
    kafka_bootstrap: str, namespace: str
) -> tuple[Topics, list[ev.CompletionEvent], int]:
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
    events, firsts = with_duplicates(40)
    publish(kafka_bootstrap, topics.completions, events)
    return topics, firsts, len(events)


def test_replay_equals_the_live_sink_and_drops_planted_duplicates(
    tmp_path: Path,
    kafka_bootstrap: str,
    topic_with_duplicates: tuple[Topics, list[ev.CompletionEvent], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    topics, firsts, total = topic_with_duplicates
    live = run_sink_to_end(kafka_bootstrap, topics, tmp_path / "live", "live", rotate_rows=25)
    assert live.duplicates_dropped == total - len(firsts)

    code, summary = replay_json(
        capsys, "--bootstrap", kafka_bootstrap, "--namespace", topics.namespace,
        "--to-parquet", str(tmp_path / "replayed"), "--rotate-rows", "30",
    )  # fmt: skip
    assert code == 0
    assert summary["events"] == total
    assert summary["kept"] == len(firsts)
    assert summary["duplicates"] == total - len(firsts)
    assert summary["undecodable"] == 0
    assert summary["parquet"]["files"] >= 3  # one per dataset at least
    assert rows(tmp_path / "replayed") == rows(tmp_path / "live") == expected(firsts)
    tokens = sum(e.completion_tokens for e in firsts if e.dataset == "beta")
    assert summary["datasets"]["beta"]["completion_tokens"] == tokens

    # Replaying into the same folder again adds nothing (the files are scanned).
    code, again = replay_json(
        capsys, "--bootstrap", kafka_bootstrap, "--namespace", topics.namespace,
        "--to-parquet", str(tmp_path / "replayed"),
    )  # fmt: skip
    assert code == 0 and again["already_in_parquet"] == len(firsts)
    assert again["parquet"]["files"] == 0
    assert rows(tmp_path / "replayed") == expected(firsts)


def v1_wire(event: ev.CompletionEvent, **changes: object) -> bytes:
    """The bytes a version 1 writer produced: ids as a JSON array of numbers."""
    wire = json.loads(codec.encode(event))
    wire.update(v=1, output_ids=list(event.output_ids))
    wire.update(changes)
    return msgspec.json.encode(wire)


def test_a_topic_of_v1_and_v2_completions_replays_as_the_live_sink_writes_it(
    tmp_path: Path,
    kafka_bootstrap: str,
    namespace: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The completions topic is the permanent record: events written before the
    ids became int32 bytes (v1, JSON numbers) give the same rows; a v2 event whose
    ids are not whole int32s is dead-lettered by the sink, skipped by the replay."""
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
    events, firsts = with_duplicates(30)
    upgrade = len(events) // 2  # v1 before, v2 after; duplicates straddle it
    bad = json.loads(codec.encode(completion("beta", 999)))
    bad["output_ids"] = "AQAAAAI="  # 5 bytes
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=5)
    for i, event in enumerate(events):
        assert isinstance(event, ev.CompletionEvent)
        value = v1_wire(event) if i < upgrade else codec.encode(event)
        producer.send(topics.completions, key=codec.event_key(event), value=value)
        if i == upgrade + 3:
            producer.send(topics.completions, key=b"beta", value=msgspec.json.encode(bad))
    producer.flush()
    producer.close()

    run_sink_to_end(kafka_bootstrap, topics, tmp_path / "live", "live", rotate_rows=25)
    code, summary = replay_json(
        capsys, "--bootstrap", kafka_bootstrap, "--namespace", topics.namespace,
        "--to-parquet", str(tmp_path / "replayed"),
    )  # fmt: skip
    assert code == 0
    assert summary["events"] == len(events) + 1
    assert summary["undecodable"] == 1 and summary["kept"] == len(firsts)
    assert rows(tmp_path / "replayed") == rows(tmp_path / "live") == expected(firsts)
    letters: list[ev.Event] = []
    read_to_end(kafka_bootstrap, topics.dead_letter, letters.append)
    assert len(letters) == 1
    letter = letters[0]
    assert isinstance(letter, ev.DeadLetter)
    assert letter.source_topic == topics.completions and letter.key == "beta"
    assert "output_ids" in letter.reason and "not a whole number of int32" in letter.reason
    assert json.loads(letter.payload)["request_id"] == "beta-r999"


class Crash(Exception):
    """The sink process dying at this point."""


@pytest.mark.parametrize(
    "point",
    [
        "after-temp-file-before-rename",
        "between-two-dataset-files",
        "after-rename-before-commit",
        "rows-read-nothing-written",
    ],
)
def test_sink_crash_at_any_point_resumes_exactly_once(
    point: str,
    tmp_path: Path,
    kafka_bootstrap: str,
    topic_with_duplicates: tuple[Topics, list[ev.CompletionEvent], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topics, firsts, _ = topic_with_duplicates
    out = tmp_path / "out"
    sink = ParquetSink(
        kafka_bootstrap,
        topics,
        SinkSettings(
            path=out,
            rotate_rows=10_000 if point == "rows-read-nothing-written" else 20,
            row_group_rows=8,
            flush_interval=60,
        ),
        group_id="crashy",
    )
    sink.start()
    assert sink._consumer is not None
    real_replace = os.replace
    renames = 0

    def replace(src: Any, dst: Any) -> None:
        nonlocal renames
        renames += 1
        if point == "after-temp-file-before-rename" and renames == 3:
            raise Crash(point)
        if point == "between-two-dataset-files" and renames == 2:
            raise Crash(point)
        real_replace(src, dst)

    def commit(*args: Any, **kwargs: Any) -> None:
        raise Crash(point)

    monkeypatch.setattr(os, "replace", replace)
    if point == "after-rename-before-commit":
        monkeypatch.setattr(sink._consumer, "commit", commit)
    try:
        with pytest.raises(Crash):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                sink.poll_once(timeout_ms=200)
                if point == "rows-read-nothing-written" and sink.writer.rows:
                    raise Crash(point)
                assert not sink.caught_up(), "read everything without crashing"
    finally:
        monkeypatch.undo()
        sink.close()  # no flush, no commit: what a killed process leaves
    if point == "after-temp-file-before-rename":
        assert list(out.glob("dataset=*/.part-*.tmp")), "the crash left a temporary"
    if point in ("after-rename-before-commit", "between-two-dataset-files"):
        assert list(out.glob("dataset=*/part-*.parquet")), "files were renamed before the crash"
    if point == "rows-read-nothing-written":
        assert not list(out.glob("dataset=*/*")), "nothing was written before the crash"

    restarted = run_sink_to_end(kafka_bootstrap, topics, out, "crashy", rotate_rows=20)
    assert not list(out.rglob("*.tmp")), "no temporary left for readers"
    assert rows(out) == expected(firsts)
    assert sum(restarted.rows_written.values()) <= len(firsts)


def test_sink_command_killed_mid_run_equals_an_uninterrupted_replay(
    tmp_path: Path,
    kafka_bootstrap: str,
    namespace: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
    config = tmp_path / "tokenbudget.toml"
    config.write_text(
        f'[kafka]\nbootstrap = "{kafka_bootstrap}"\nnamespace = "{namespace}"\n'
        '[sink]\npath = "out"\nrotate_rows = 10\nflush_interval_s = 0.2\n'
    )
    first_half, firsts_a = with_duplicates(150)
    second_half, firsts_b = with_duplicates(30, offset=150)
    publish(kafka_bootstrap, topics.completions, first_half)
    expected_rows = expected(firsts_a + firsts_b)
    out = tmp_path / "out"

    command = [sys.executable, "-m", "tokenbudget", "sink", "--config", str(config)]
    process = subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        assert b"sink:" in process.stderr.readline()  # signal handlers are installed
        deadline = time.monotonic() + 60
        while len(list(out.glob("dataset=*/part-*.parquet"))) < 3:
            assert time.monotonic() < deadline and process.poll() is None, "sink wrote nothing"
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGKILL)  # mid-run: files written, rows uncommitted
        process.wait()
        assert len(rows(out)) < len(firsts_a), "the sink was killed before it finished"
        publish(kafka_bootstrap, topics.completions, second_half)

        # restarted, it resumes; SIGTERM once it has everything: flush, commit, exit 0
        process = subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE)
        assert process.stderr is not None
        assert b"sink:" in process.stderr.readline()
        deadline = time.monotonic() + 90
        while len(rows(out)) < len(expected_rows):
            assert time.monotonic() < deadline and process.poll() is None, "sink did not finish"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert b"stopped" in process.stderr.read()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    code, _ = replay_json(
        capsys, "--config", str(config), "--to-parquet", str(tmp_path / "replayed")
    )
    assert code == 0
    assert rows(tmp_path / "out") == rows(tmp_path / "replayed") == expected_rows
    assert not list((tmp_path / "out").rglob("*.tmp"))


def test_replay_ledger_detects_a_planted_discrepancy(
    kafka_bootstrap: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
    events, firsts = with_duplicates(12)
    budgets = [ev.BudgetSet(dataset=d, budget=10_000_000) for d in DATASETS]
    skipped = [
        ev.PromptSkipped(prompt_id="alpha-p500", dataset="alpha", reason="halted"),
        ev.PromptFailed(prompt_id="beta-p501", dataset="beta", reason="500", attempts=3),
        # skipped, then completed: counts as completed only
        ev.PromptSkipped(prompt_id="gamma-p3", dataset="gamma", reason="halted"),
    ]
    publish(kafka_bootstrap, topics.control, budgets)
    publish(kafka_bootstrap, topics.completions, events)
    publish(kafka_bootstrap, topics.outcomes, skipped)
    per_dataset = len(firsts) // len(DATASETS)
    ledger = start_ledger_process(kafka_bootstrap, namespace, 0.2)
    try:
        deadline = time.monotonic() + 90
        while True:
            code, summary = replay_json(
                capsys, "--bootstrap", kafka_bootstrap, "--namespace", namespace, "--ledger"
            )
            live = summary["ledger"]["live"]
            settled = len(live) == 3 and all(v["samples"] == per_dataset for v in live.values())
            if settled and live["alpha"]["skipped"] == 1 and live["beta"]["failed"] == 1:
                break
            assert time.monotonic() < deadline, f"ledger never caught up: {live}"
            time.sleep(0.5)
    finally:
        stop_process(ledger)
    assert code == 0, summary["ledger"]
    assert summary["ledger"]["match"] and summary["ok"]
    tokens = sum(e.completion_tokens for e in firsts if e.dataset == "gamma")
    assert summary["ledger"]["live"]["gamma"]["completion_tokens"] == tokens

    # Plant a discrepancy: a snapshot newer than the ledger's, with wrong totals, as
    # the dataset's current owner would write it (readers drop older owners' events).
    real = summary["ledger"]["live"]["beta"]
    written: list[ev.Event] = []
    read_to_end(kafka_bootstrap, topics.budgets, written.append)
    owner = max(
        e.epoch for e in written if isinstance(e, ev.LedgerSnapshot) and e.dataset == "beta"
    )
    fake = ev.LedgerSnapshot(
        dataset="beta",
        budget=10_000_000,
        unit="completion_tokens",
        completion_tokens=real["completion_tokens"] - 17,
        prompt_tokens=real["prompt_tokens"],
        samples=real["samples"],
        skipped=0,
        failed=1,
        produced=None,
        halted=False,
        status="open",
        at=time.time() + 1,
        epoch=owner,
    )
    publish(kafka_bootstrap, topics.budgets, [fake])
    code, summary = replay_json(
        capsys, "--bootstrap", kafka_bootstrap, "--namespace", namespace, "--ledger"
    )
    assert code == 1 and not summary["ok"]
    assert summary["ledger"]["differences"] == [
        {
            "dataset": "beta",
            "field": "completion_tokens",
            "replay": real["completion_tokens"],
            "live": real["completion_tokens"] - 17,
        }
    ]
    capsys.readouterr()
    assert cli_main(["replay", "--bootstrap", kafka_bootstrap, "--namespace", namespace,
                     "--ledger", "--quiet"]) == 1  # fmt: skip
    text = capsys.readouterr().out
    assert "MISMATCH" in text and "beta.completion_tokens" in text and "diff +17" in text

    # --ledger needs the whole topic
    capsys.readouterr()
    code = cli_main(["replay", "--bootstrap", kafka_bootstrap, "--namespace", namespace,
                     "--ledger", "--from-offset", "3"])  # fmt: skip
    assert code == 2 and "whole topics" in capsys.readouterr().err


def tiny_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_replay_targets_and_ranges(
    tmp_path: Path,
    kafka_bootstrap: str,
    topic_with_duplicates: tuple[Topics, list[ev.CompletionEvent], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    topics, firsts, total = topic_with_duplicates
    common = ["--bootstrap", kafka_bootstrap, "--namespace", topics.namespace]

    # --to-topic: the kept completions, byte for byte, keyed by dataset
    target = f"{topics.namespace}.replayed"
    code, summary = replay_json(capsys, *common, "--to-topic", target)
    assert code == 0 and summary["to_topic"] == {"topic": target, "events": len(firsts)}
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=None)
    tps = [TopicPartition(target, p) for p in sorted(consumer.partitions_for_topic(target) or ())]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    got: list[ev.CompletionEvent] = []
    deadline = time.monotonic() + 30
    while len(got) < len(firsts) and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            for record in records:
                event = codec.decode(record.value)
                assert isinstance(event, ev.CompletionEvent)
                assert record.key == event.dataset.encode()
                got.append(event)
    consumer.close()
    assert sorted(e.request_id for e in got) == sorted(e.request_id for e in firsts)

    # --dataset (repeatable) keeps only those datasets
    code, summary = replay_json(capsys, *common, "--dataset", "alpha", "--dataset", "gamma")
    assert sorted(summary["datasets"]) == ["alpha", "gamma"]
    assert summary["kept"] == 2 * len(firsts) // 3
    assert summary["filtered"] > 0
    assert summary["kept"] + summary["duplicates"] + summary["filtered"] == total

    # --from-offset: per partition, or for every partition
    code, summary = replay_json(capsys, *common, "--from-offset", "10000")
    assert code == 0 and summary["events"] == 0
    code, whole = replay_json(capsys, *common)
    part = next(p for p, (start, end) in whole["partitions"].items() if end > 5)
    code, summary = replay_json(capsys, *common, "--from-offset", f"{part}:5")
    assert summary["partitions"][part][0] == 5
    assert summary["events"] == whole["events"] - 5

    # --since / --until: record timestamps
    cut = time.time()
    time.sleep(0.05)
    more, more_firsts = with_duplicates(5, offset=1000)
    publish(kafka_bootstrap, topics.completions, more)
    code, summary = replay_json(capsys, *common, "--since", str(cut))
    assert summary["kept"] == len(more_firsts) and summary["events"] == len(more)
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(cut - 1)) + "Z"
    code, summary = replay_json(capsys, *common, "--until", iso)
    assert summary["kept"] <= len(firsts)
    code, summary = replay_json(capsys, *common, "--until", str(cut))
    assert summary["kept"] == len(firsts)

    # --recount-with: a local tokenizer; "hello world" pairs are its only words
    folder = tiny_tokenizer(tmp_path / "tok")
    code, summary = replay_json(capsys, *common, "--recount-with", str(folder), "--dataset", "beta")
    recount = summary["recount"]["datasets"]["beta"]
    beta = [e for e in [*firsts, *more_firsts] if e.dataset == "beta"]
    assert recount["stored_completion_tokens"] == sum(e.completion_tokens for e in beta)
    assert recount["recounted_tokens"] == sum(len(e.text.split()) for e in beta)
    assert recount["rows_without_text"] == 0
    # a folder that ships its own tokenizer code (as Kimi-K2's) runs it only when trusted
    ship_own_code(folder)
    capsys.readouterr()
    recount_args = [*common, "--recount-with", str(folder), "--dataset", "beta"]
    assert cli_main(["replay", *recount_args, "--quiet"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--trust-remote-code" in error
    code, summary = replay_json(capsys, *recount_args, "--trust-remote-code")
    assert code == 0 and summary["recount"]["datasets"]["beta"] == recount


def test_bench_smoke(kafka_bootstrap: str, tmp_path: Path) -> None:
    """A tiny run of bench/replay.py (the real one replays 200,000 completions)."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "replay.py"
    result = subprocess.run(
        [sys.executable, str(bench), "--bootstrap", kafka_bootstrap, "--events", "40", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(result.stdout)
    assert report["events"] == 40
    assert report["rows_written"] == report["kept"] == 40 - report["duplicates"]
    assert report["replay_events_per_s"] > 0 and report["pyarrow_ceiling_s"] > 0
    assert report["ratio"] > 0
