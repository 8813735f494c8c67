"""A fleet of inference servers behind one job, on the real broker, graded from each
server's own request log (:mod:`tokenbudget.dev.oracle`), the dataset files, the
Parquet rows and the events on the budgets topic, never the ledger's books.

One job, ``run --dispatchers 2`` over four simulators of unequal speed, lives
through what a fleet lives through, each at a share of the budgets kept (so the
order holds on any machine): a server answering 429 with ``Retry-After`` to half
its requests from the start; one SIGKILLed, and later started again on its port
(away for a while, and back); one drained; one added. Each server's log tells its
part apart. Another job loses every server past the
outage timeout: it ends in one line, and a rerun finishes it.
"""

from __future__ import annotations

import subprocess
import time
import zlib
from pathlib import Path

import pytest

from tokenbudget.app.children import cli_command
from tokenbudget.core import kafka_admin
from tokenbudget.dev import oracle
from tokenbudget.dev.jobs import (
    Simulator,
    Watch,
    end_run,
    rows,
    run_output,
    start_run,
    start_simulator,
    wait_until,
    write_job,
)
from tokenbudget.producers.prompts.resume import outcome_records
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration

CONCURRENCY = 4  # per server and dispatcher
MAX_NEW_TOKENS = 4096


def datasets(workdir: Path) -> dict[str, tuple[Path, int]]:
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    return {
        "code": (rows(data / "code.jsonl", "#code", 150), 60_000),
        "short": (rows(data / "short.jsonl", "#short", 250), 25_000),
        "chat": (rows(data / "chat.jsonl", "#chat", 80, chat=True), 40_000),
        "small": (rows(data / "small.jsonl", "#code", 6), 1_000_000),  # runs out first
    }


def requests(sim: Simulator) -> list[dict[str, object]]:
    """Every request in the server's own log (faults included), as it wrote them."""
    import json

    return [json.loads(line) for line in sim.log.read_text().splitlines() if line.strip()]


def answered(sim: Simulator) -> list[dict[str, object]]:
    return [r for r in requests(sim) if r["finish"] != "fault"]


def kept_tokens(watch: Watch) -> int:
    views = list(watch.board.views.values())
    return sum(v.snapshot.completion_tokens for v in views if v.snapshot is not None)


def servers_command(config: Path, *args: str) -> None:
    done = subprocess.run(
        cli_command("servers", *args, "--config", str(config)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def fleet_events(bootstrap: str, namespace: str) -> list[ev.Event]:
    """The fleet's changes (the control topic), then the dispatchers' reports (their
    reservations topic)."""
    found: list[ev.Event] = []
    for topic in (Topics(namespace).control, Topics(namespace).reservations):
        read_to_end(bootstrap, topic, found.append)
    return found


def assert_exact(verdict: oracle.Verdict, jobs: dict[str, tuple[Path, int]]) -> None:
    printed = "\n".join(verdict.lines())
    assert verdict.ok, printed
    for name, (_, budget) in jobs.items():
        if budget < 1_000_000:
            assert verdict.datasets[name].kept_tokens == budget, printed  # to the token


@pytest.mark.timeout(600)
def test_a_job_over_a_changing_fleet_of_unequal_servers_stays_exact(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())
    jobs = datasets(tmp_path)
    tps = ("--tokens-per-second",)
    fast = start_simulator(tmp_path, *tps, "400", name="fast")
    slow = start_simulator(tmp_path, *tps, "100", name="slow")  # drained half way
    busy = start_simulator(  # answers 429 to half its requests, Retry-After 1 s
        tmp_path, *tps, "400", "--fail-busy", "0.5", "--retry-after", "1", name="busy"
    )
    killed = start_simulator(tmp_path, *tps, "200", name="killed")  # SIGKILLed, back later
    added = start_simulator(tmp_path, *tps, "200", name="added")  # joins half way
    fleet = [fast, slow, busy, killed]
    config = write_job(
        tmp_path,
        kafka_bootstrap,
        namespace,
        [s.url for s in fleet],
        jobs,
        inference={"concurrency": CONCURRENCY, "max_new_tokens": MAX_NEW_TOKENS},
    )
    total = sum(budget for _, budget in jobs.values() if budget < 1_000_000)
    watch = Watch(kafka_bootstrap, namespace)
    log = tmp_path / "run.out"
    run = start_run(config, "--dispatchers", "2", log=log)

    def at(share: float) -> None:
        wait_until(
            lambda: kept_tokens(watch) >= share * total or run.poll() is not None,
            f"{share:.0%} of the budgets kept",
            timeout=240,
        )
        assert run.poll() is None, f"the job ended before {share:.0%}: {log.read_text()[-3000:]}"

    try:
        at(0.15)
        killed.process.kill()  # SIGKILL, with its requests in flight
        killed.process.wait()
        in_flight_at_kill = 2 * CONCURRENCY  # its places, over both dispatchers
        at(0.3)
        servers_command(config, "drain", slow.url)
        at(0.4)
        servers_command(config, "add", added.url)
        at(0.5)
        restarted = start_simulator(
            tmp_path, *tps, "200", port=killed.port, name="killed"
        )  # the same port: the dispatchers find it again
        restarted_at = time.time()
        assert run.wait(300) == 0, log.read_text()[-3000:]
        report = run_output(run, log)
    finally:
        end_run(run)
        watch.close()
        for sim in [*fleet, added]:
            sim.stop()
        if "restarted" in locals():
            restarted.stop()

    logs = [s.log for s in [fast, slow, busy, killed, added]]
    outcomes = outcome_records(kafka_bootstrap, Topics(namespace))
    verdict = oracle.judge(tmp_path / "out", logs, jobs, outcomes)
    # Exact over the whole fleet: each prompt kept once, every row an answer a server
    # gave, nothing lost, no budget overshot, each used to the token.
    assert_exact(verdict, jobs)
    assert sum(d["failed"] for d in report["datasets"].values()) == 0  # no prompt failed
    kept = oracle.kept_request_ids(tmp_path / "out")

    # Spread by speed: the fast server answered more than the slow one, each its part.
    assert len(answered(fast)) > len(answered(slow)) > 0

    # 429 with Retry-After: its share shrank against the fast one of the same speed,
    # its window was cut (as the dispatchers reported it), and no prompt failed.
    assert any(r["fault"] == "busy" for r in requests(busy))
    assert len(answered(busy)) < len(answered(fast))
    events = fleet_events(kafka_bootstrap, namespace)
    reports = [e for e in events if isinstance(e, ev.FleetReport)]
    seen = [s for r in reports for s in r.servers if s.url == busy.url]
    assert min(s.limit for s in seen) < CONCURRENCY

    # SIGKILLed: what it was generating when it died is all that was lost (its
    # answers logged but never received, at most its places' worth), and it came back.
    lost = [r for r in answered(killed) if r["rid"] not in kept and r["received_at"] < restarted_at]
    wasted = sum(int(r["completion_tokens"]) for r in lost)  # type: ignore[call-overload]
    assert wasted <= in_flight_at_kill * MAX_NEW_TOKENS, verdict.lines()
    assert verdict.waste <= in_flight_at_kill * MAX_NEW_TOKENS, verdict.lines()
    assert [r for r in answered(killed) if r["received_at"] > restarted_at], "it did not rejoin"

    # Drained: it finished what it had (every answer of it kept), and got nothing once
    # each dispatcher had it drained with nothing in flight.
    assert all(r["rid"] in kept for r in answered(slow))
    drained_at = {
        r.holder: r.at
        for r in reversed(reports)
        for s in r.servers
        if s.url == slow.url and s.state == "drained"
    }
    assert len(drained_at) == 2, "each dispatcher reports it drained"
    assert all(float(r["received_at"]) < max(drained_at.values()) for r in requests(slow))  # type: ignore[arg-type]

    # Added: it got requests, none before it was added.
    [add] = [e for e in events if isinstance(e, ev.ServerAdded)]
    assert add.url == added.url and answered(added)
    assert all(float(r["received_at"]) > add.at for r in requests(added))  # type: ignore[arg-type]


@pytest.mark.timeout(600)
def test_every_server_away_past_the_timeout_ends_the_run_in_one_line_and_a_rerun_finishes(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())
    jobs = {"code": datasets(tmp_path)["code"]}
    # An answer of "#code" (~3.8k tokens) takes ~9 s: the first ones are kept with
    # more still in flight when both servers go.
    sims = [start_simulator(tmp_path, "--tokens-per-second", "400", name=f"s{i}") for i in range(2)]
    config = write_job(
        tmp_path,
        kafka_bootstrap,
        namespace,
        [s.url for s in sims],
        jobs,
        inference={"concurrency": CONCURRENCY, "outage_timeout_s": 3.0},
    )
    watch = Watch(kafka_bootstrap, namespace)
    log = tmp_path / "run.out"
    run = start_run(config, log=log)
    try:
        wait_until(lambda: kept_tokens(watch) >= 10_000 or run.poll() is not None, "a start")
        assert run.poll() is None, log.read_text()[-3000:]
        for sim in sims:
            sim.process.kill()
            sim.process.wait()
        assert run.wait(120) == 2, log.read_text()[-3000:]
        last = log.read_text().strip().splitlines()[-1]
        assert last.startswith("tokenbudget: error: every inference server has been away for")
        assert all(sim.url in last for sim in sims) and "outage_timeout_s" in last
        # Back on their ports, the same command finishes the job: nothing lost, nothing
        # generated twice.
        sims = [
            start_simulator(tmp_path, "--tokens-per-second", "600", port=sim.port, name=f"s{i}")
            for i, sim in enumerate(sims)
        ]
        run = start_run(config, log=log)
        assert run.wait(300) == 0, log.read_text()[-3000:]
    finally:
        end_run(run)
        watch.close()
        for sim in sims:
            sim.stop()
    outcomes = outcome_records(kafka_bootstrap, Topics(namespace))
    verdict = oracle.judge(tmp_path / "out", [s.log for s in sims], jobs, outcomes)
    assert_exact(verdict, jobs)


@pytest.mark.timeout(300)
def test_a_server_added_without_a_key_variable_is_sent_no_key_and_one_naming_another_is_refused(
    tmp_path: Path, kafka_bootstrap: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())
    monkeypatch.setenv("TOKENBUDGET_API_KEY", "the-jobs-main-key")  # run inherits it
    monkeypatch.setenv("OTHER_SECRET", "not-for-servers")
    jobs = {"code": (rows(tmp_path / "code.jsonl", "#code", 60), 30_000)}
    # Slow enough that the job is still running after two CLI calls at 6k kept.
    configured = start_simulator(tmp_path, "--tokens-per-second", "300", name="configured")
    added = start_simulator(tmp_path, "--tokens-per-second", "300", name="added")
    config = write_job(
        tmp_path,
        kafka_bootstrap,
        namespace,
        [configured.url],
        jobs,
        inference={"concurrency": CONCURRENCY},
    )
    watch = Watch(kafka_bootstrap, namespace)
    log = tmp_path / "run.out"
    run = start_run(config, log=log)
    try:
        wait_until(lambda: kept_tokens(watch) >= 6_000 or run.poll() is not None, "a start")
        assert run.poll() is None, log.read_text()[-3000:]
        # Naming a variable the config does not name: refused before it is published.
        refused = subprocess.run(
            cli_command(
                "servers",
                "add",
                "http://127.0.0.1:9",
                "--api-key-env",
                "OTHER_SECRET",
                "--config",
                str(config),
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2
        assert "inference.added_server_keys" in refused.stderr and "$OTHER_SECRET" in refused.stderr
        servers_command(config, "add", added.url)  # no --api-key-env
        assert run.wait(240) == 0, log.read_text()[-3000:]
    finally:
        end_run(run)
        watch.close()
        configured.stop()
        added.stop()
    outcomes = outcome_records(kafka_bootstrap, Topics(namespace))
    verdict = oracle.judge(tmp_path / "out", [configured.log, added.log], jobs, outcomes)
    assert_exact(verdict, jobs)
    # What each server received, from its own log: the configured one the job's key,
    # the added one none at all.
    main_key = zlib.crc32(b"Bearer the-jobs-main-key")
    assert {r["authorization_crc"] for r in requests(configured)} == {main_key}
    assert answered(added), "the added server got no request"
    assert {r["authorization_crc"] for r in requests(added)} == {0}
    adds = [e for e in fleet_events(kafka_bootstrap, namespace) if isinstance(e, ev.ServerAdded)]
    assert [(e.url, e.api_key_env) for e in adds] == [(added.url, None)]
