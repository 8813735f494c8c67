"""A job left to run on its own, as a user does: under ``nohup`` with its output in a
file, stopped with Ctrl-C and run again, with a budget set between two runs.

Each test runs ``tokenbudget run`` and the simulator as processes of their own on the
real broker and grades what happened from the simulator's request log, the dataset
files and the Parquet rows (:mod:`tokenbudget.dev.oracle`), not from the ledger's
books; the log is read as a user reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tokenbudget.app.runner import cli_command
from tokenbudget.core import kafka_admin, lifetime
from tokenbudget.dev import oracle
from tokenbudget.dev.jobs import (
    Watch,
    children_of,
    end_run,
    rows,
    run_output,
    snapshots,
    start_simulator,
    survivors,
    wait_until,
    write_job,
)
from tokenbudget.producers.prompts.resume import outcome_records
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration

# Runs here serve no /metrics (other jobs on the machine may hold its ports), and
# write their progress lines often.
METRICS = {"port": 0, "progress_interval_s": 0.5}


def judge(workdir: Path, bootstrap: str, namespace: str, jobs: dict) -> oracle.Verdict:
    outcomes = outcome_records(bootstrap, Topics(namespace))
    return oracle.judge(workdir / "out", workdir / "server-requests.jsonl", jobs, outcomes)


def assert_exact(verdict: oracle.Verdict, jobs: dict[str, tuple[Path, int]]) -> None:
    printed = "\n".join(verdict.lines())
    assert verdict.ok, printed
    for name, (_, budget) in jobs.items():
        if budget < 1_000_000:  # enough rows: the budget is used to the token
            assert verdict.datasets[name].kept_tokens == budget, printed


def quiet_env() -> dict[str, str]:
    """A user's environment: the default log level."""
    return {k: v for k, v in os.environ.items() if k != "TOKENBUDGET_LOG"}


def start_quiet_run(config: Path, *args: str, log: Path) -> subprocess.Popen[bytes]:
    """``tokenbudget run --json`` as :func:`~tokenbudget.dev.jobs.start_run` starts it,
    at the default log level."""
    with log.open("ab") as out:
        return lifetime.spawn(
            cli_command("run", "--config", str(config), "--json", *args),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=quiet_env(),
        )


@contextlib.contextmanager
def sigint_reaches_children() -> Iterator[None]:
    """A child inherits an ignored SIGINT (pytest started with ``&``); a handled one
    is reset to the default when it starts."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(600)
def test_a_run_under_nohup_logs_progress_per_dataset_and_its_halts(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    jobs = {
        "short": (rows(data / "short.jsonl", "#short", 60), 3000),  # halts
        "code": (rows(data / "code.jsonl", "#code", 6), 1_000_000),  # runs out of rows
    }
    sim = start_simulator(tmp_path, "--tokens-per-second", "1500")
    config = write_job(tmp_path, kafka_bootstrap, namespace, sim.url, jobs, metrics=METRICS)
    log = tmp_path / "nohup.out"
    run: subprocess.Popen[bytes] | None = None
    try:
        with log.open("ab") as out:
            run = lifetime.spawn(
                ["nohup", *cli_command("run", "--config", str(config))],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=quiet_env(),
            )
        assert run.wait(300) == 0, log.read_text()[-3000:]
    finally:
        end_run(run)
        sim.stop()
    text = log.read_text()
    progress = r" INFO tokenbudget\.progress: {}: \S+/\S+ completion_tokens \(\d+%\), \S+/s, ETA "
    for name in jobs:
        ticks = re.findall(progress.format(name), text)
        assert len(ticks) >= 2, text  # a line per dataset, again and again
    halted = re.findall(
        r" INFO tokenbudget\.progress: short: halted, its budget is reached: 3k/3k "
        r"completion_tokens \(samples \d+, skipped \d+, failed 0\)\n",
        text,
    )
    assert len(halted) == 1, text
    assert "code: exhausted, every prompt has an outcome" in text
    assert text.index("short: halted") < text.index("\ndataset ")  # then the table
    for noise in ("NotLeaderForPartitionError", "RebalanceInProgressError", " ERROR "):
        assert noise not in text, text
    assert_exact(judge(tmp_path, kafka_bootstrap, namespace, jobs), jobs)


def requests_by_prompt(server_log: Path) -> dict[str, list[dict]]:
    """The server's requests, by prompt text."""
    by_prompt: dict[str, list[dict]] = {}
    for line in server_log.read_text().splitlines():
        request = json.loads(line)
        by_prompt.setdefault(request["text_head"], []).append(request)
    return by_prompt


def completed_prompts(bootstrap: str, namespace: str) -> set[str]:
    completed: set[str] = set()

    def keep(event: ev.Event) -> None:
        if isinstance(event, ev.CompletionEvent):
            completed.add(event.prompt_id)

    read_to_end(bootstrap, Topics(namespace).completions, keep)
    return completed


def parquet_prompts(root: Path) -> list[str]:
    ids: list[str] = []
    for file in root.glob("dataset=*/*.parquet"):
        ids += pq.read_table(file, columns=["prompt_id"]).column("prompt_id").to_pylist()
    return ids


# How long after the server finished an answer a loaded dispatcher may still not have
# read it: such an answer was in flight when the signal came, and may be generated again.
READ_SLACK_S = 2.0


@pytest.mark.timeout(600)
def test_ctrl_c_stops_in_order_and_a_rerun_ends_exact_generating_again_only_what_was_in_flight(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    jobs = {
        "short": (rows(data / "short.jsonl", "#short", 120), 15_000),
        "code": (rows(data / "code.jsonl", "#code", 30), 20_000),
        "small": (rows(data / "small.jsonl", "#code", 6), 1_000_000),
    }
    sim = start_simulator(tmp_path, "--tokens-per-second", "400")
    config = write_job(tmp_path, kafka_bootstrap, namespace, sim.url, jobs, metrics=METRICS)
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())  # to watch them
    watch = Watch(kafka_bootstrap, namespace)
    log = tmp_path / "run.out"
    run: subprocess.Popen[bytes] | None = None
    try:
        with sigint_reaches_children():
            run = start_quiet_run(config, "--dispatchers", "2", log=log)
        wait_until(lambda: watch.samples() > 5 or run.poll() is not None, "some completions")
        assert run.poll() is None, log.read_text()[-3000:]
        wait_until(lambda: len(children_of(run.pid)) == 2, "the ledger and a dispatcher")
        children = children_of(run.pid)
        interrupted_at = time.time()
        os.kill(run.pid, signal.SIGINT)
        assert run.wait(120) == 130, log.read_text()[-3000:]
        assert survivors(children, grace=1) == {}
        said = log.read_text()
        assert said.count("tokenbudget: interrupted (SIGINT): stopping (in-flight requests") == 1
        # What the first run generated and kept is on Parquet: the sink flushed.
        stored = parquet_prompts(tmp_path / "out")
        assert sorted(stored) == sorted(completed_prompts(kafka_bootstrap, namespace))

        rerun_at = time.time()
        run = start_quiet_run(config, "--dispatchers", "2", log=log)
        assert run.wait(300) == 0, log.read_text()[-3000:]
        report = run_output(run, log)
    finally:
        end_run(run)
        watch.close()
        sim.stop()
    verdict = judge(tmp_path, kafka_bootstrap, namespace, jobs)
    assert_exact(verdict, jobs)
    for name, result in report["datasets"].items():
        assert result["completion_tokens"] == verdict.datasets[name].kept_tokens
    again: list[str] = []
    # A prompt generated by both runs was at the server when the first was stopped.
    for text, requests in requests_by_prompt(sim.log).items():
        before = [r for r in requests if r["received_at"] < rerun_at]
        if before and len(before) < len(requests):
            again.append(text)
            assert max(r["finished_at"] for r in before) >= interrupted_at - READ_SLACK_S, text
    assert len(again) <= 2 * 8  # at most what two dispatchers had in flight


def budget_set(config: Path, dataset: str, budget: str) -> str:
    done = subprocess.run(
        cli_command("budget", "set", dataset, budget, "--config", str(config)),
        capture_output=True,
        text=True,
        timeout=120,
        env=quiet_env(),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.timeout(600)
def test_a_budget_set_between_runs_holds_until_the_config_changes(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    short = rows(data / "short.jsonl", "#short", 80)
    jobs = {"A": (short, 3000), "B": (rows(data / "b.jsonl", "#short", 4), 1_000_000)}
    sim = start_simulator(tmp_path, "--tokens-per-second", "4000")
    config = write_job(tmp_path, kafka_bootstrap, namespace, sim.url, jobs, metrics=METRICS)
    log = tmp_path / "run.out"
    run: subprocess.Popen[bytes] | None = None
    try:
        said = budget_set(config, "A", "4k")  # no job runs: it is kept for the next
        assert said == (
            "A: budget set to 4,000 completion_tokens; a running job applies it now, later "
            "jobs keep it while the config's 3,000 is unchanged\n"
        )
        run = start_quiet_run(config, log=log)
        assert run.wait(300) == 0, log.read_text()[-3000:]
        first = run_output(run, log)
        set_value = {**jobs, "A": (short, 4000)}
        assert_exact(judge(tmp_path, kafka_bootstrap, namespace, set_value), set_value)
        assert snapshots(kafka_bootstrap, namespace)["A"].budget == 4000
        assert first["datasets"]["A"]["budget"] == 4000
        assert "tokenbudget: A: budget 4,000 completion_tokens as set by" in log.read_text()

        # The config's own value changes: it wins over the value set before.
        config.write_text(config.read_text().replace("budget = 3000", "budget = 5000"))
        run = start_quiet_run(config, log=log)
        assert run.wait(300) == 0, log.read_text()[-3000:]
    finally:
        end_run(run)
        sim.stop()
    config_value = {**jobs, "A": (short, 5000)}
    assert_exact(judge(tmp_path, kafka_bootstrap, namespace, config_value), config_value)
    assert snapshots(kafka_bootstrap, namespace)["A"].budget == 5000
    assert (
        "tokenbudget: A: budget 5,000 completion_tokens from the config (changed from 3,000), "
        "replacing 4,000 set by `tokenbudget budget set`"
    ) in log.read_text()
