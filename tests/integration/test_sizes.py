"""Sizes end to end, on the real broker, graded by the server's own request log.

A prompt far beyond any model's context is a bad row, not a dead job: the other rows
are answered, it is dead-lettered and counted. Long prompts with answers of a long
context's full length pass through every topic, are kept to the budget's token and
replay to the same rows.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tokenbudget.app.runner import cli_command
from tokenbudget.dev import oracle
from tokenbudget.dev.jobs import start_simulator, write_job
from tokenbudget.sinks.parquet import read_rows
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.sinks.replay import replay
from tokenbudget.sinks.replay_range import ReplayOptions
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration

BIG_BYTES = 1_500_000  # the reported prompt: over aiokafka's 1 MiB request size too


def run_job(config: Path) -> subprocess.CompletedProcess[str]:
    """``tokenbudget run --json`` as a user runs it: exit code, stdout and stderr."""
    return subprocess.run(
        cli_command("run", "--config", str(config), "--json"),
        capture_output=True,
        text=True,
        timeout=400,
    )


def served_heads(log: Path) -> list[str]:
    """The prompt heads the server saw, one per request, from its own log."""
    return [json.loads(line)["text_head"] for line in log.read_text().splitlines() if line]


def dead_letters(bootstrap: str, namespace: str) -> list[ev.DeadLetter]:
    letters: list[ev.Event] = []
    read_to_end(bootstrap, Topics(namespace).dead_letter, letters.append)
    return [letter for letter in letters if isinstance(letter, ev.DeadLetter)]


def mixed_rows(path: Path) -> list[str]:
    """Ordinary rows with one 1.5 MB prompt as the third line; the ordinary prompts."""
    ordinary = [f"#short sizes task {i}" for i in range(8)]
    lines = [json.dumps({"prompt": text}) for text in ordinary]
    lines.insert(2, json.dumps({"prompt": "BIG " + "x" * (BIG_BYTES - 4)}))
    path.write_text("\n".join(lines) + "\n")
    return ordinary


@pytest.mark.timeout(600)
def test_a_prompt_over_the_limit_is_dead_lettered_and_the_other_rows_are_answered(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    data = tmp_path / "mixed.jsonl"
    ordinary = mixed_rows(data)
    server = start_simulator(tmp_path, "--tokens-per-second", "100000")
    try:
        config = write_job(
            tmp_path, kafka_bootstrap, namespace, server.url, {"mixed": (data, 1_000_000)}
        )
        done = run_job(config)
    finally:
        server.stop()

    assert done.returncode == 0, done.stderr[-3000:]
    # Every ordinary row was answered once; the big one never reached the server.
    heads = served_heads(server.log)
    assert sorted(heads) == sorted(ordinary)
    assert not any(head.startswith("BIG ") for head in heads)
    kept = read_rows(tmp_path / "out").to_pylist()
    assert sorted(row["prompt"] for row in kept) == sorted(ordinary)
    # Dead-lettered with where it is, its size and the fix; not its megabytes.
    (letter,) = dead_letters(kafka_bootstrap, namespace)
    assert letter.source == f"{data}:3"
    assert letter.key == "mixed"
    assert letter.size == BIG_BYTES
    assert "max_prompt_bytes" in letter.reason and "correct or remove the row" in letter.reason
    assert letter.payload.startswith("BIG xxx") and len(letter.payload) < 10_000
    # Counted in --json and said on stderr, where the letters went.
    report = json.loads(done.stdout)
    assert report["datasets"]["mixed"]["bad_rows"] == 1
    assert report["bad_rows"] == 1
    assert report["datasets"]["mixed"]["samples"] == len(ordinary)
    said = [line for line in done.stderr.splitlines() if "bad row" in line and "skipped" in line]
    assert said and Topics(namespace).dead_letter in said[-1]


@pytest.mark.timeout(600)
def test_with_on_bad_row_fail_the_run_stops_with_one_line_naming_dataset_line_and_fix(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    data = tmp_path / "mixed.jsonl"
    mixed_rows(data)
    server = start_simulator(tmp_path, "--tokens-per-second", "100000")
    try:
        config = write_job(
            tmp_path,
            kafka_bootstrap,
            namespace,
            server.url,
            {"mixed": (data, 1_000_000)},
            producer={"on_bad_row": "fail"},
        )
        done = run_job(config)
    finally:
        server.stop()

    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("tokenbudget: error")]
    assert len(errors) == 1, done.stderr[-3000:]
    (error,) = errors
    assert f"{data}:3:" in error and "(dataset mixed)" in error
    assert "max_prompt_bytes" in error and 'on_bad_row = "skip"' in error
    (letter,) = dead_letters(kafka_bootstrap, namespace)
    assert letter.source == f"{data}:3"


HUGE_LINE = 200_000_000  # bytes: a line no row may be, written as a sparse file


def hostile_rows(path: Path) -> list[str]:
    """Ordinary rows, with a 200 MB line as the third line and a row nested 10,000
    deep as the sixth."""
    ordinary = [f"#short hostile task {i}" for i in range(6)]
    lines = [json.dumps({"prompt": text}).encode() + b"\n" for text in ordinary]
    with path.open("wb") as handle:
        for number, line in enumerate(lines, start=1):
            if number == 3:
                handle.write(b'{"prompt": "HUGE ')
                handle.seek(HUGE_LINE - len(b'{"prompt": "HUGE ') - len(b'"}\n'), 1)
                handle.write(b'"}\n')
            if number == 5:
                handle.write(b'{"prompt": "DEEP", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}\n")
            handle.write(line)
    return ordinary


@pytest.mark.timeout(600)
def test_a_200_mb_line_and_a_row_nested_10000_deep_are_bad_rows_and_the_rest_is_answered(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    data = tmp_path / "hostile.jsonl"
    ordinary = hostile_rows(data)
    server = start_simulator(tmp_path, "--tokens-per-second", "100000")
    try:
        config = write_job(
            tmp_path, kafka_bootstrap, namespace, server.url, {"hostile": (data, 1_000_000)}
        )
        done = run_job(config)
    finally:
        server.stop()

    assert done.returncode == 0, done.stderr[-3000:]
    heads = served_heads(server.log)  # the server's own account
    assert sorted(heads) == sorted(ordinary)
    kept = read_rows(tmp_path / "out").to_pylist()
    assert sorted(row["prompt"] for row in kept) == sorted(ordinary)
    huge, deep = sorted(dead_letters(kafka_bootstrap, namespace), key=lambda d: d.source)
    assert (huge.source, huge.size) == (f"{data}:3", HUGE_LINE)
    assert "a row may take" in huge.reason and len(huge.payload) < 10_000
    assert deep.source == f"{data}:6" and "nested more than 64 deep" in deep.reason
    report = json.loads(done.stdout)
    assert report["datasets"]["hostile"]["bad_rows"] == 2
    assert report["datasets"]["hostile"]["samples"] == len(ordinary)


def long_rows(path: Path, count: int, prompt_bytes: int) -> None:
    """``count`` prompts of about ``prompt_bytes`` of words each."""
    with path.open("w") as handle:
        for i in range(count):
            words = " ".join(f"w{i}x{j}" for j in range(prompt_bytes // 8))
            handle.write(json.dumps({"id": f"long-{i}", "prompt": f"#long row {i} {words}"}) + "\n")


def table_rows(table: pa.Table) -> dict[str, dict[str, Any]]:
    return {row["request_id"]: row for row in table.to_pylist()}


@pytest.mark.timeout(600)
def test_long_prompts_and_answers_are_kept_to_the_budget_and_replay_equal(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    """~250 KB prompts, ~100k-token answers through SGLang's /generate: completion
    events of about 2 MB (prompt, its answer's text and ids)."""
    data = tmp_path / "long.jsonl"
    long_rows(data, 4, 250_000)
    budget = 250_000
    server = start_simulator(tmp_path, "--profile", "long", "--tokens-per-second", "5000000")
    try:
        config = write_job(
            tmp_path,
            kafka_bootstrap,
            namespace,
            server.url,
            {"long": (data, budget)},
            inference={"max_new_tokens": 131_072, "concurrency": 4},
        )
        done = run_job(config)
    finally:
        server.stop()

    assert done.returncode == 0, done.stderr[-3000:]
    verdict = oracle.judge(tmp_path / "out", server.log, {"long": (data, budget)})
    printed = "\n".join(verdict.lines())
    assert verdict.ok, printed
    assert verdict.datasets["long"].kept_tokens == budget, printed  # to the token
    live = read_rows(tmp_path / "out")
    assert max(live.column("completion_tokens").to_pylist()) > 80_000
    assert min(len(p) for p in live.column("prompt").to_pylist()) > 240_000

    rebuilt = tmp_path / "rebuilt"
    replay(
        ReplayOptions(bootstrap=kafka_bootstrap, topics=Topics(namespace), to_parquet=rebuilt),
        progress=False,
    )
    assert table_rows(read_rows(rebuilt)) == table_rows(live)
