"""A job knows what it is, on the real broker with ``tokenbudget run`` as a user types
it: a rerun that is another job stops before producing anything, one resumed anyway
leaves every row of the job in the folder its user named, and one that matches
resumes. Graded from outside the pipeline: the simulator's own request log, the
dataset files, the topics' end offsets, the Parquet files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from tokenbudget import cli
from tokenbudget.dev.jobs import Simulator, write_job
from tokenbudget.dev.oracle import read_server_log, valid_prompt_ids
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration


def prompts(path: Path, marker: str, ids: range) -> Path:
    path.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"#short {marker} {i}"}) + "\n" for i in ids)
    )
    return path


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        return {tp.partition: end for tp, end in consumer.end_offsets(tps).items()}
    finally:
        consumer.close()


def rows(root: Path) -> list[dict[str, Any]]:
    columns = ["request_id", "prompt_id", "prompt", "dataset"]
    return [
        row
        for file in sorted(root.glob("dataset=*/*.parquet"))
        for row in pq.read_table(file, columns=columns).to_pylist()
    ]


def prompts_served(log: Path) -> dict[str, str]:
    """request id -> the prompt text the server saw, from its own log."""
    records = (json.loads(line) for line in log.read_text().splitlines() if line.strip())
    return {r["rid"]: r["text_head"] for r in records}


def job(workdir: Path, *args: Any, **sections: dict[str, Any]) -> Path:
    workdir.mkdir(exist_ok=True)
    return write_job(workdir, *args, **sections)


def run(config: Path, *args: str) -> int:
    return cli.main(["run", "--config", str(config), "--json", *args])


def test_another_job_in_the_namespace_stops_before_producing_and_resumed_anyway_loses_no_row(
    tmp_path: Path,
    kafka_bootstrap: str,
    namespace: str,
    sim: Simulator,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The reproduction: a second job, same dataset name and row ids, another file
    # (the same 12 ids and 4 more) and another output folder.
    first_file = prompts(tmp_path / "first.jsonl", "A", range(12))
    second_file = prompts(tmp_path / "second.jsonl", "B", range(16))
    first = job(
        tmp_path / "job1", kafka_bootstrap, namespace, sim.url, {"d": (first_file, 1_000_000)}
    )
    second = job(
        tmp_path / "job2", kafka_bootstrap, namespace, sim.url, {"d": (second_file, 1_000_000)}
    )
    assert run(first) == 0
    served = read_server_log(sim.log)
    assert len(served) == 12
    topics = Topics(namespace)
    watched = (topics.prompts, topics.control, topics.budgets)
    before = {t: end_offsets(kafka_bootstrap, t) for t in watched}
    capsys.readouterr()

    assert run(second) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert f"sink.path {tmp_path / 'job1' / 'out'} → {tmp_path / 'job2' / 'out'}" in error
    assert "datasets[0] d: second.jsonl content changed" in error
    assert f"since the first run of job {namespace} (" in error
    assert "another [kafka] namespace" in error and "--resume-changed" in error
    # nothing was produced: no request reached the server, no prompt, no budget event
    assert read_server_log(sim.log) == served
    after = {t: end_offsets(kafka_bootstrap, t) for t in watched}
    assert after == before
    assert rows(tmp_path / "job2" / "out") == []

    assert run(second, "--resume-changed") == 0
    said = capsys.readouterr().err
    assert "wrote 12 rows earlier runs kept (d 12)" in said
    now = read_server_log(sim.log)
    new = {rid: answer for rid, answer in now.items() if rid not in served}
    assert len(new) == 4  # q12..q15: the ids done before are done
    kept = rows(tmp_path / "job2" / "out")
    # every row of the job is in the folder its user named, once
    assert sorted(r["prompt_id"] for r in kept) == sorted(valid_prompt_ids("d", second_file))
    assert {r["request_id"] for r in kept} == set(now)
    earlier = {r["request_id"]: r for r in rows(tmp_path / "job1" / "out")}
    assert {rid: r for rid, r in ((r["request_id"], r) for r in kept) if rid in served} == earlier

    # Recorded as the job from now on: the same command again resumes it.
    assert run(second) == 0
    resumed = "resuming the job unchanged since the run that last recorded it of job"
    assert f"{resumed} {namespace} (" in capsys.readouterr().err
    assert read_server_log(sim.log) == now


def test_a_rerun_that_matches_resumes_without_regenerating_a_finished_prompt(
    tmp_path: Path,
    kafka_bootstrap: str,
    namespace: str,
    sim: Simulator,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = prompts(tmp_path / "d.jsonl", "A", range(30))
    extra = prompts(tmp_path / "e.jsonl", "E", range(5))
    workdir = tmp_path / "job"
    # "#short" answers average 300 tokens: 2,000 halts the dataset part way
    assert run(job(workdir, kafka_bootstrap, namespace, sim.url, {"d": (data, 2000)})) == 0
    first = prompts_served(sim.log)
    done = {r["prompt"] for r in rows(workdir / "out")}
    assert 0 < len(done) < 30
    capsys.readouterr()
    # The way on: a raised budget, other operational settings, one dataset more.
    again = job(
        workdir,
        kafka_bootstrap,
        namespace,
        sim.url,
        {"d": (data, 1_000_000), "e": (extra, 1_000_000)},
        inference={"concurrency": 3, "read_timeout_s": 30.0},
    )
    assert run(again) == 0
    printed = capsys.readouterr()
    assert f"resuming the job unchanged since the first run of job {namespace} (" in (printed.err)
    assert json.loads(printed.out)["datasets"]["d"]["already_done"] == len(done)
    asked = [text for rid, text in prompts_served(sim.log).items() if rid not in first]
    # no finished prompt was sent again; the others and the new dataset were
    assert not done & set(asked)
    assert sorted(asked) == sorted(
        {f"#short A {i}" for i in range(30)} - done | {f"#short E {i}" for i in range(5)}
    )
    assert len(rows(workdir / "out")) == 35


def test_produce_resumed_anyway_into_another_folder_waits_for_the_earlier_rows_there(
    tmp_path: Path,
    kafka_bootstrap: str,
    namespace: str,
    sim: Simulator,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``produce`` writes no Parquet: a moved sink.path is refused with the command
    that writes the earlier rows there, until they are there."""
    data = prompts(tmp_path / "d.jsonl", "A", range(6))
    first = job(tmp_path / "job1", kafka_bootstrap, namespace, sim.url, {"d": (data, 1_000_000)})
    moved = job(tmp_path / "job2", kafka_bootstrap, namespace, sim.url, {"d": (data, 1_000_000)})
    assert run(first) == 0
    prompts_topic = Topics(namespace).prompts
    before = end_offsets(kafka_bootstrap, prompts_topic)
    capsys.readouterr()
    produce = ["produce", "--config", str(moved)]
    assert cli.main(produce) == 2
    assert "`tokenbudget produce --resume-changed`" in capsys.readouterr().err
    assert cli.main([*produce, "--resume-changed"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    out = tmp_path / "job2" / "out"
    replay = f"tokenbudget replay --config {moved} --to-parquet {out} --dataset d"
    assert "holds 0 of the 6 rows earlier runs kept of d" in error and replay in error
    assert end_offsets(kafka_bootstrap, prompts_topic) == before
    assert cli.main(replay.split()[1:]) == 0
    assert cli.main([*produce, "--resume-changed"]) == 0
    assert "d: 0 prompts produced (end_of_data); 6 already done" in capsys.readouterr().out
    assert len(rows(tmp_path / "job2" / "out")) == 6


def test_run_resumed_into_another_folder_refuses_while_the_topic_lacks_earlier_rows(
    tmp_path: Path,
    kafka_bootstrap: str,
    namespace: str,
    sim: Simulator,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Replaying the completions topic is how the earlier rows reach a moved
    sink.path; when its retention has dropped them, the run stops instead of
    leaving them silently missing, and goes on once they were copied there."""
    data = prompts(tmp_path / "d.jsonl", "A", range(6))
    first = job(tmp_path / "job1", kafka_bootstrap, namespace, sim.url, {"d": (data, 1_000_000)})
    moved = job(tmp_path / "job2", kafka_bootstrap, namespace, sim.url, {"d": (data, 1_000_000)})
    assert run(first) == 0
    served = read_server_log(sim.log)
    completions = Topics(namespace).completions
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:  # what a finite completion_retention_ms does in time
        ends = end_offsets(kafka_bootstrap, completions)
        admin.delete_records({TopicPartition(completions, p): end for p, end in ends.items()})
    finally:
        admin.close()
    capsys.readouterr()
    assert run(moved, "--resume-changed") == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert f"{tmp_path / 'job2' / 'out'} holds 0 of the 6 rows earlier runs kept of d" in error
    assert f"copy {tmp_path / 'job1' / 'out'}/dataset=*/ there" in error
    shutil.copytree(
        tmp_path / "job1" / "out" / "dataset=d", tmp_path / "job2" / "out" / "dataset=d"
    )
    assert run(moved, "--resume-changed") == 0
    assert read_server_log(sim.log) == served  # nothing done again
    assert sorted(r["prompt_id"] for r in rows(tmp_path / "job2" / "out")) == sorted(
        valid_prompt_ids("d", data)
    )
