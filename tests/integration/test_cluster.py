"""tokenbudget on a real three-node Kafka cluster (replication 3, min.insync.replicas
2), given as a bootstrap list, as users who outgrew one machine run it.

Each job is ``tokenbudget run`` and the simulator as processes of their own, graded
by :mod:`tokenbudget.dev.oracle` from the server's request log, the dataset files and the
outcomes topic: every kept row is an answer the server produced, nothing kept twice,
no budget overshot, nothing lost, and the ledger's books agree with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka.admin import KafkaAdminClient

from tokenbudget.core.kafka import GroupLag
from tokenbudget.dev import oracle
from tokenbudget.dev.cluster import LocalCluster
from tokenbudget.dev.jobs import (
    Watch,
    children_of,
    end_run,
    rows,
    run_output,
    start_run,
    start_simulator,
    wait_until,
    write_job,
)
from tokenbudget.producers.prompts.resume import outcome_records
from tokenbudget.streams.topics import Topics

# One worker runs them all (ONE_WORKER in tests/conftest.py): their module fixture is costly.
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three KRaft nodes (replication 3, min.insync.replicas 2) from the same jars,
    for this module only: three JVMs would slow every later test on two cores. A test
    that takes a node down heals the cluster before it ends."""
    cluster = LocalCluster.create(Path(tmp_path_factory.mktemp("cluster")))
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


def datasets(workdir: Path) -> dict[str, tuple[Path, int]]:
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    return {
        "long": (rows(data / "long.jsonl", "#long-code", 40), 20_000),
        "short": (rows(data / "short.jsonl", "#short", 120), 8_000),
        "chat": (rows(data / "chat.jsonl", "#chat", 60, chat=True), 12_000),
        # runs out of rows before its budget: every row must be kept
        "small": (rows(data / "small.jsonl", "#code", 6), 1_000_000),
    }


def replicas(bootstrap: str, namespace: str) -> dict[str, set[int]]:
    """Replica counts of every topic of the job, Faust's own included."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        topics = [t for t in admin.list_topics() if t.startswith(namespace)]
        described = admin.describe_topics(topics)
    finally:
        admin.close()
    return {t["name"]: {len(p["replica_nodes"]) for p in t["partitions"]} for t in described}


def assert_graded_exact(
    workdir: Path, bootstrap: str, namespace: str, jobs: dict, report: dict[str, Any]
) -> None:
    outcomes = outcome_records(bootstrap, Topics(namespace))
    verdict = oracle.judge(workdir / "out", workdir / "server-requests.jsonl", jobs, outcomes)
    printed = "\n".join(verdict.lines())
    assert verdict.ok, printed  # nothing lost, duplicated or overshot
    for name, (_, budget) in jobs.items():
        kept = verdict.datasets[name].kept_tokens
        if budget < 1_000_000:
            assert kept == budget, printed  # enough rows: used to the token
        # the ledger counted each answer once: its books match the server's
        assert report["datasets"][name]["completion_tokens"] == kept, printed


def run_job(
    workdir: Path,
    cluster: LocalCluster,
    namespace: str,
    *args: str,
    fault: Any = None,
) -> dict[str, Any]:
    """Run a job to its end on ``cluster``; ``fault(run, watch)`` is called once the
    first answers are counted."""
    jobs = datasets(workdir)
    sim = start_simulator(workdir, "--tokens-per-second", "1000")
    config = write_job(workdir, cluster.bootstrap, namespace, sim.url, jobs)
    log = workdir / "run.out"
    run: subprocess.Popen[bytes] | None = None
    watch: Watch | None = None
    try:
        run = start_run(config, *args, log=log)
        if fault is not None:
            # The run creates the topics; follow the budgets once they exist.
            wait_until(
                lambda: namespace + ".budgets" in replicas(cluster.bootstrap, namespace), "topics"
            )
            watch = Watch(cluster.bootstrap, namespace)
            wait_until(lambda: watch.samples() > 5 or run.poll() is not None, "first answers")
            assert run.poll() is None, log.read_text()[-3000:]
            fault(run, watch)
        assert run.wait(400) == 0, log.read_text()[-3000:]
        report = run_output(run, log)
    finally:
        end_run(run)
        if watch is not None:
            watch.close()
        sim.stop()
    assert_graded_exact(workdir, cluster.bootstrap, namespace, jobs, report)
    return report


@pytest.mark.timeout(300)
def test_a_run_on_a_healthy_cluster_replicates_every_topic_it_creates(
    tmp_path: Path, kafka_cluster: LocalCluster, namespace: str
) -> None:
    """Given the cluster as a bootstrap list, a run ends exact, and every topic it
    created (Faust's changelogs and assignor topic included) has the cluster's
    default replication, 3, not 1."""
    report = run_job(tmp_path, kafka_cluster, namespace, "--dispatchers", "2")
    assert report["restarts"] == []
    created = replicas(kafka_cluster.bootstrap, namespace)
    assert {spec.name for spec in Topics(namespace).specs()} <= set(created)
    assert created == {key: {3} for key in created}, created


@pytest.mark.timeout(400)
def test_a_broker_killed_mid_run_loses_nothing_and_overshoots_nothing(
    tmp_path: Path, kafka_cluster: LocalCluster, namespace: str
) -> None:
    """SIGKILL of the first node of the bootstrap list mid-run (a lost machine): its
    partitions' leaders move, clients reconnect through the other addresses, and the
    run ends with exit 0, exact, with nothing lost or duplicated."""
    killed: list[int] = []

    def kill_a_broker(run: subprocess.Popen[bytes], watch: Watch) -> None:
        killed.append(kafka_cluster.kill(1))

    try:
        report = run_job(tmp_path, kafka_cluster, namespace, fault=kill_a_broker)
        assert killed and kafka_cluster.pid(1) is None  # it stayed down to the end
        # A client given the list still finds the cluster with its first node gone.
        lag = GroupLag(kafka_cluster.bootstrap)
        try:
            assert lag.lag(Topics(namespace).ledger_app_id, [Topics(namespace).completions]) == 0
        finally:
            lag.close()
    finally:
        kafka_cluster.heal()
    assert report["restarts"] == []


@pytest.mark.timeout(400)
def test_two_ledger_workers_share_the_datasets_and_one_killed_loses_nothing(
    tmp_path: Path, kafka_cluster: LocalCluster, namespace: str
) -> None:
    """``run --ledgers 2``: both workers join one group and share the datasets; one is
    SIGKILLed mid-run. Its datasets move to the other (and back when run starts it
    again), and the job ends exact: no answer counted twice, no budget lost."""
    app_id = Topics(namespace).ledger_app_id
    killed: list[int] = []

    def kill_a_ledger(run: subprocess.Popen[bytes], watch: Watch) -> None:
        lag = GroupLag(kafka_cluster.bootstrap)
        try:
            wait_until(lambda: lag.members(app_id) == 2, "two ledger workers in one group")
        finally:
            lag.close()
        ledgers = [pid for pid, cmd in children_of(run.pid).items() if " ledger " in cmd]
        assert len(ledgers) == 2, children_of(run.pid)
        seen = watch.samples()
        wait_until(lambda: watch.samples() > seen or run.poll() is not None, "more answers")
        os.kill(ledgers[0], signal.SIGKILL)
        killed.append(ledgers[0])

    report = run_job(tmp_path, kafka_cluster, namespace, "--ledgers", "2", fault=kill_a_ledger)
    restarts = report["restarts"]
    assert killed[0] in [r["pid"] for r in restarts], restarts
    assert all(r["name"].startswith("ledger worker") for r in restarts), restarts
    # Besides the kill, only the ledger's designed exit (75: restart from what is
    # durable) is allowed: a crash (exit 1) in the rebalances is a bug.
    assert {r["code"] for r in restarts if r["pid"] != killed[0]} <= {75}, restarts
