"""A buggy or hostile inference server, on the real broker, graded by its own request log.

The job runs as a user runs it (``tokenbudget run`` and ``tokenbudget simulate`` as
processes of their own) against a server that lies about one answer's counts in four
(negative, not an integer, 2**63: :data:`tokenbudget.dev.simulator.config.BAD_COUNTS`) and
sends a body, or a streamed line, that never ends to one request in ten. Every such
answer is refused and its prompt asked again; the budgets end exact, judged with
:mod:`tokenbudget.dev.oracle` from the server's log and the dataset files.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tokenbudget.core import kafka_admin
from tokenbudget.dev import oracle
from tokenbudget.dev.jobs import end_run, rows, run_output, start_run, start_simulator, write_job
from tokenbudget.producers.prompts.resume import outcome_records
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration

LIMIT = 1024 * 1024  # the job's [inference] max_reply_bytes: an endless body costs this


def datasets(workdir: Path) -> dict[str, tuple[Path, int]]:
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    return {
        "long": (rows(data / "long.jsonl", "#long-code", 20), 20_000),  # cut at the line
        "short": (rows(data / "short.jsonl", "#short", 80), 10_000),
        "small": (rows(data / "small.jsonl", "#code", 6), 1_000_000),  # every row kept
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_lying_counts_and_endless_replies_are_refused_and_the_budgets_end_exact(
    tmp_path: Path, kafka_bootstrap: str, namespace: str, stream: bool
) -> None:
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())
    jobs = datasets(tmp_path)
    sim = start_simulator(
        tmp_path,
        "--tokens-per-second", "4000",
        "--fail-bad-counts", "0.25",
        "--fail-endless", "0.1",
    )  # fmt: skip
    # Bad answers count against retries (a malformed body): enough that no prompt
    # meets more in a row than that.
    inference = {"stream": stream, "retries": 10, "max_reply_bytes": LIMIT}
    config = write_job(tmp_path, kafka_bootstrap, namespace, sim.url, jobs, inference=inference)
    log = tmp_path / "run.out"
    run: subprocess.Popen[bytes] | None = None
    try:
        run = start_run(config, log=log)
        assert run.wait(300) == 0, log.read_text()[-3000:]
        report = run_output(run, log)
    finally:
        end_run(run)
        sim.stop()
    faults = [answer.fault for answer in oracle.read_server_log(sim.log).values()]
    assert faults.count("bad_counts") >= 4 and faults.count("endless") >= 2, faults
    assert all(r["failed"] == 0 for r in report["datasets"].values()), report
    outcomes = outcome_records(kafka_bootstrap, Topics(namespace))
    verdict = oracle.judge(tmp_path / "out", sim.log, jobs, outcomes)
    printed = "\n".join(verdict.lines())
    # No kept row is a refused answer (those are faults in the server's log), none is
    # kept twice, no budget is overshot, and no row is lost.
    assert verdict.ok, printed
    for name, (_, budget) in jobs.items():
        if budget < 1_000_000:
            assert verdict.datasets[name].kept_tokens == budget, printed  # to the token
    for name, result in report["datasets"].items():
        assert result["completion_tokens"] == verdict.datasets[name].kept_tokens, report
    said = log.read_text()
    assert "not a token count" in said and f"max_reply_bytes = {LIMIT:,}" in said
