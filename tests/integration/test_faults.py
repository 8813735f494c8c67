"""Faults from outside, on the real broker, graded by the server's own request log.

Each test runs a job as a user does (``tokenbudget run`` and the simulator as
processes of their own), does to it what no harness of ours chooses in production
(SIGKILL of ``run``, a frozen ledger or dispatcher, a server that says 429/503 or goes
away, streams reset half way), and then judges the output with
:mod:`tokenbudget.dev.oracle`: every kept row is an answer the server produced, nothing
kept twice, no budget overshot, nothing lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenbudget.app.runner import start_ledger_process
from tokenbudget.core import kafka_admin
from tokenbudget.dev import oracle
from tokenbudget.dev.jobs import (
    Watch,
    children_of,
    end_run,
    kill_tree_root,
    rows,
    run_output,
    start_run,
    start_simulator,
    survivors,
    wait_until,
    write_job,
)
from tokenbudget.producers.prompts.resume import outcome_records
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration


def datasets(workdir: Path) -> dict[str, tuple[Path, int]]:
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    return {
        # long answers, cut at the line (about 11 of them)
        "long": (rows(data / "long.jsonl", "#long-code", 40), 40_000),
        # many short answers
        "short": (rows(data / "short.jsonl", "#short", 120), 15_000),
        # chat messages
        "chat": (rows(data / "chat.jsonl", "#chat", 60, chat=True), 30_000),
        # runs out of rows before its budget: every row must be kept
        "small": (rows(data / "small.jsonl", "#code", 6), 1_000_000),
    }


def judge(workdir: Path, bootstrap: str, namespace: str, jobs: dict) -> oracle.Verdict:
    outcomes = outcome_records(bootstrap, Topics(namespace))
    return oracle.judge(workdir / "out", workdir / "server-requests.jsonl", jobs, outcomes)


def assert_exact(verdict: oracle.Verdict, jobs: dict) -> None:
    printed = "\n".join(verdict.lines())
    assert verdict.ok, printed
    for name, (_, budget) in jobs.items():
        d = verdict.datasets[name]
        assert d.kept_tokens == min(budget, d.kept_tokens), printed
        if budget < 1_000_000:
            assert d.kept_tokens == budget, printed  # enough rows: used to the token


def kill_when(
    run: subprocess.Popen[bytes],
    point: str,
    reached: Callable[[dict[str, str]], bool],
    watch: Watch,
    log: Path,
) -> None:
    """SIGKILL ``run`` alone once the statuses read reach ``point``; none of its
    children may outlive it."""
    wait_until(lambda: reached(watch.statuses()) or run.poll() is not None, point)
    assert run.poll() is None, f"run ended before {point}: {log.read_text()[-2000:]}"
    wait_until(lambda: len(children_of(run.pid)) == 2, "ledger and extra dispatcher")
    children = kill_tree_root(run)
    assert survivors(children) == {}, f"outlived run killed {point}"


@pytest.mark.timeout(600)
def test_run_killed_at_any_point_leaves_no_process_and_a_rerun_finishes_exact(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    """SIGKILL of ``run`` itself (not its process group: as the OOM killer does)
    before the first halt, right as a budget is reached, and during the final drain;
    the same command again each time. No process outlives a killed run, and the last
    run ends with exit 0 and the books of an uninterrupted one."""
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())
    jobs = datasets(tmp_path)
    sim = start_simulator(tmp_path, "--tokens-per-second", "600", "--fail-500", "0.05")
    config = write_job(tmp_path, kafka_bootstrap, namespace, sim.url, jobs)
    watch = Watch(kafka_bootstrap, namespace)
    log = tmp_path / "run.out"
    points = {
        "before the first halt": lambda s: watch.samples() > 5 and "halted" not in s.values(),
        "as a budget is reached": lambda s: "halted" in s.values(),
        "during the final drain": lambda s: len(s) == 4 and "open" not in s.values(),
    }
    try:
        for point, reached in points.items():
            run = start_run(config, "--dispatchers", "2", log=log)
            kill_when(run, point, reached, watch, log)
        run = start_run(config, "--dispatchers", "2", log=log)
        assert run.wait(300) == 0, log.read_text()[-3000:]
        report = run_output(run, log)
        assert report["restarts"] == []
    finally:
        end_run(run)
        watch.close()
        sim.stop()
    verdict = judge(tmp_path, kafka_bootstrap, namespace, jobs)
    assert_exact(verdict, jobs)
    for name, result in report["datasets"].items():
        assert result["completion_tokens"] == verdict.datasets[name].kept_tokens


@pytest.mark.timeout(600)
def test_a_sick_server_delays_the_job_and_fails_no_prompt(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    """A server answering 429 and 503 (with Retry-After) to a tenth of the requests,
    resetting streams half way, and away altogether (503, /health included) for a
    while mid-run: the job waits it out and ends exact, with no prompt failed."""
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())
    jobs = datasets(tmp_path)
    sim = start_simulator(
        tmp_path,
        "--tokens-per-second", "1500",
        "--fail-busy", "0.05",
        "--fail-unavailable", "0.05",
        "--fail-reset-mid-stream", "0.05",
        "--retry-after", "0.5",
    )  # fmt: skip
    config = write_job(
        tmp_path,
        kafka_bootstrap,
        namespace,
        sim.url,
        jobs,
        inference={"stream": True, "retries": 0, "pause_after_failures": 3},
    )
    watch = Watch(kafka_bootstrap, namespace)
    log = tmp_path / "run.out"
    run: subprocess.Popen[bytes] | None = None
    try:
        run = start_run(config, log=log)
        wait_until(lambda: watch.samples() > 5, "the first answers")
        sim.outage(6.0)
        assert run.wait(300) == 0, log.read_text()[-3000:]
        report = run_output(run, log)
    finally:
        end_run(run)
        watch.close()
        sim.stop()
    faults = [a.fault for a in oracle.read_server_log(sim.log).values()]
    assert {"busy", "unavailable", "outage", "reset_mid_stream"} <= set(faults), faults
    assert all(r["failed"] == 0 for r in report["datasets"].values()), report
    verdict = judge(tmp_path, kafka_bootstrap, namespace, jobs)
    assert_exact(verdict, jobs)
    assert "it gets no requests until it answers its health check" in log.read_text()


@pytest.mark.timeout(600)
def test_a_ledger_frozen_past_twice_the_lease_ttl_overshoots_nothing(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    """The ledger stops (SIGSTOP: a stalled VM or disk) for twice the leases' TTL while
    answers are in flight and leases expire and are released under it; when it goes
    on, no budget is handed out twice."""
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())
    jobs = datasets(tmp_path)
    sim = start_simulator(tmp_path, "--tokens-per-second", "800")
    config = write_job(
        tmp_path, kafka_bootstrap, namespace, sim.url, jobs, budget={"lease_ttl_s": 3.0}
    )
    watch = Watch(kafka_bootstrap, namespace)
    log = tmp_path / "run.out"
    run: subprocess.Popen[bytes] | None = None
    try:
        run = start_run(config, "--dispatchers", "2", log=log)
        wait_until(lambda: watch.samples() > 8, "answers flowing")
        [ledger] = [p for p, cmd in children_of(run.pid).items() if " ledger " in cmd]
        os.kill(ledger, signal.SIGSTOP)
        time.sleep(6.0)
        os.kill(ledger, signal.SIGCONT)
        assert run.wait(300) == 0, log.read_text()[-3000:]
    finally:
        end_run(run)
        watch.close()
        sim.stop()
    assert_exact(judge(tmp_path, kafka_bootstrap, namespace, jobs), jobs)


@pytest.mark.timeout(600)
def test_a_frozen_dispatcher_keeps_its_prompts_and_claims_its_answers(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    """One of three dispatchers frozen past its leases' TTL (but within the time its
    prompts are held for it), then resumed: its leases expired and their budget went
    on to others, yet the answers it held are claimed anew and kept. No prompt is
    generated twice: nothing the server generated is thrown away."""
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())
    data = tmp_path / "data"
    data.mkdir()
    jobs = {
        "long": (rows(data / "long.jsonl", "#long-code", 40), 120_000),
        "chat": (rows(data / "chat.jsonl", "#chat", 80), 80_000),
    }
    sim = start_simulator(tmp_path, "--tokens-per-second", "400")
    config = write_job(
        tmp_path, kafka_bootstrap, namespace, sim.url, jobs, budget={"lease_ttl_s": 3.0}
    )
    watch = Watch(kafka_bootstrap, namespace)
    log = tmp_path / "run.out"
    run: subprocess.Popen[bytes] | None = None
    try:
        run = start_run(config, "--dispatchers", "3", log=log)
        wait_until(lambda: watch.samples() > 3, "answers flowing")
        dispatchers = [p for p, cmd in children_of(run.pid).items() if " dispatch " in cmd]
        frozen = dispatchers[0]
        os.kill(frozen, signal.SIGSTOP)
        time.sleep(8.0)  # > TTL 3 s, < prompt_hold_s 20 s
        os.kill(frozen, signal.SIGCONT)
        assert run.wait(300) == 0, log.read_text()[-3000:]
    finally:
        end_run(run)
        watch.close()
        sim.stop()
    verdict = judge(tmp_path, kafka_bootstrap, namespace, jobs)
    assert_exact(verdict, jobs)
    assert verdict.waste == 0, "\n".join(verdict.lines())


@pytest.mark.timeout(600)
def test_a_second_ledger_worker_mid_run_then_the_first_killed_never_sends_counts_back(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    """A second ``tokenbudget ledger`` joins mid-run (the datasets are shared out
    between the two), then the first is SIGKILLed (run starts it again: another
    rebalance). Read back from the budgets topic as any reader reads it, no dataset's
    counts ever go backwards, and the job ends exact."""
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())
    jobs = datasets(tmp_path)
    sim = start_simulator(tmp_path, "--tokens-per-second", "500")
    config = write_job(tmp_path, kafka_bootstrap, namespace, sim.url, jobs)
    watch = Watch(kafka_bootstrap, namespace)
    log = tmp_path / "run.out"
    run: subprocess.Popen[bytes] | None = None
    second: subprocess.Popen[bytes] | None = None
    try:
        run = start_run(config, log=log)
        wait_until(lambda: watch.samples() > 5, "the first answers")
        [first] = [p for p, cmd in children_of(run.pid).items() if " ledger " in cmd]
        second = start_ledger_process(kafka_bootstrap, namespace, 0.5)
        seen = watch.samples()
        wait_until(lambda: watch.samples() > seen + 15, "answers counted by two workers")
        os.kill(first, signal.SIGKILL)
        assert run.wait(300) == 0, log.read_text()[-3000:]
        report = run_output(run, log)
    finally:
        end_run(run)
        end_run(second)
        watch.close()
        sim.stop()
    assert [r["name"] for r in report["restarts"]] == ["ledger worker"]

    events: list[ev.Event] = []
    read_to_end(kafka_bootstrap, Topics(namespace).budgets, events.append)
    epochs = {e.epoch for e in events if isinstance(e, ev.LedgerSnapshot)}
    assert len(epochs) >= 3, epochs  # three owners at least: the first, the second, the restarted
    board = BudgetBoard()
    counts: dict[str, tuple[int, int]] = {}
    for event in events:
        board.apply(event)
        for name, view in board.views.items():
            if view.snapshot is None:
                continue
            now = (view.snapshot.completion_tokens, view.snapshot.samples)
            before = counts.get(name, (0, 0))
            assert now[0] >= before[0] and now[1] >= before[1], (name, before, now)
            counts[name] = now
    assert_exact(judge(tmp_path, kafka_bootstrap, namespace, jobs), jobs)
