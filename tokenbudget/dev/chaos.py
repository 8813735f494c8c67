"""Chaos: jobs run as a user runs them, hit by faults from outside, graded by the
inference server's own request log.

Each job is ``tokenbudget run --dispatchers N`` (with its ledger and extra
dispatchers as children) on a broker of the harness's own, against the simulator
failing a share of requests (429 and 503 with Retry-After, 500, streams reset half
way). While a job runs, the harness places faults one at a time, spread over the
job's phases (before the first halt, after it, during the final drain):

* ``run``: SIGKILL of ``tokenbudget run`` alone (as the OOM killer does); every
  process it started must end with it, and the same command is run again;
* ``ledger`` / ``dispatcher``: SIGKILL of one of its children (``run`` restarts it);
* ``broker``: SIGKILL of the Kafka broker's JVM, started again moments later;
* ``freeze``: SIGSTOP of the ledger for twice the leases' TTL, then SIGCONT;
* ``outage``: the server answers 503 to everything, ``/health`` included, for a while.

Then the job is let finish and judged by :mod:`tokenbudget.dev.oracle` from the server's
log and the dataset files: lost, duplicated, overshoot, rows not from the server.
Also counted: orphans (a process that outlived a killed ``run``) and unexpected
crashes (a ``run`` that failed, or a child ``run`` restarted that the harness did
not kill). Job 0 runs without faults: the baseline for time and waste.

``bench/chaos.py`` runs 100+ faults; the test suite runs a short version. Both call
:func:`run_chaos`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tokenbudget.core import kafka_admin
from tokenbudget.dev import oracle
from tokenbudget.dev.jobs import (
    Simulator,
    Watch,
    children_of,
    end_run,
    kill_tree_root,
    rows,
    start_run,
    start_simulator,
    survivors,
    write_job,
)
from tokenbudget.dev.ports import free_ports
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.producers.prompts.resume import outcome_records
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)

FAULTS = ("run", "ledger", "dispatcher", "broker", "freeze")
PHASES = ("before the first halt", "after a halt", "during the drain")

# Rows no reader accepts; each must be reported and skipped, not lost or counted.
BAD_ROWS = ('{"prompt": "cut off', '{"id": "no-prompt-field"}', '{"prompt": ""}')


@dataclass(frozen=True)
class ChaosSettings:
    workdir: Path
    faults: int = 100  # placed in all, over as many jobs as it takes
    per_job: int = 6  # faults placed in one job
    outage_every: int = 25  # every so many faults, a server outage
    outage_s: float = 60.0
    seed: int = 7
    dispatchers: int = 2
    concurrency: int = 8  # per dispatcher
    fault_share: float = 0.10  # of requests: 429, 503, 500, reset mid-stream evenly
    tokens_per_second: float = 1500.0  # per request, in the simulator
    lease_ttl_s: float = 3.0
    scale: int = 1  # multiplies every dataset's rows and budget
    broker_down_s: tuple[float, float] = (1.0, 4.0)
    job_deadline_s: float = 480.0  # a job still running after this is a failure
    baseline: bool = True  # a job without faults first


@dataclass
class Placed:
    kind: str
    phase: str
    at: float  # wall clock, comparable with the server log
    pid: int = 0


@dataclass
class JobResult:
    number: int
    verdict: oracle.Verdict
    seconds: float
    placed: list[Placed] = field(default_factory=list)
    runs: int = 0
    orphans: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    in_flight_at_faults: int = 0  # tokens of the answers the server was generating


@dataclass
class ChaosReport:
    jobs: list[JobResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def faulted(self) -> list[JobResult]:
        return [j for j in self.jobs if j.placed]

    @property
    def baseline(self) -> JobResult | None:
        return next((j for j in self.jobs if not j.placed), None)

    def total(self, attribute: str) -> int:
        return sum(getattr(j.verdict, attribute) for j in self.jobs)

    @property
    def faults(self) -> Counter[str]:
        return Counter(p.kind for j in self.jobs for p in j.placed)

    @property
    def phases(self) -> Counter[str]:
        return Counter(p.phase for j in self.jobs for p in j.placed)

    @property
    def orphans(self) -> int:
        return sum(len(j.orphans) for j in self.jobs)

    @property
    def crashes(self) -> int:
        return sum(len(j.crashes) for j in self.jobs)

    @property
    def ok(self) -> bool:
        return (
            bool(self.jobs)
            and all(j.verdict.ok for j in self.jobs)
            and self.orphans == 0
            and self.crashes == 0
        )

    def lines(self) -> list[str]:
        out = []
        for j in self.jobs:
            kinds = Counter(p.kind for p in j.placed)
            out.append(
                f"job {j.number}: {j.seconds:.0f} s, {j.runs} run(s), faults "
                f"{dict(kinds) or 'none (baseline)'}; kept {j.verdict.kept_tokens:,} of "
                f"{j.verdict.generated_tokens:,} generated (waste {j.verdict.waste:,}; in "
                f"flight at its faults {j.in_flight_at_faults:,}); "
                f"{'ok' if j.verdict.ok else 'NOT OK: ' + '; '.join(j.verdict.lines()[-1:])}"
            )
        faulted = self.faulted
        waste = sum(j.verdict.waste for j in faulted)
        in_flight = sum(j.in_flight_at_faults for j in faulted)
        generated = sum(j.verdict.generated_tokens for j in faulted)
        base = self.baseline
        out += [
            f"faults placed: {sum(self.faults.values())} "
            f"({', '.join(f'{k} {n}' for k, n in sorted(self.faults.items()))}) "
            f"in {len(faulted)} jobs",
            "by phase: " + ", ".join(f"{p} {self.phases[p]}" for p in PHASES),
            f"lost {self.total('lost')}, duplicated {self.total('duplicates')}, "
            f"overshoot {self.total('overshoot')} (from the server log and the dataset files); "
            f"rows not from the server {self.total('rows_not_from_server')}, unlike it "
            f"{self.total('rows_unlike_server')}; orphans {self.orphans}; "
            f"unexpected crashes {self.crashes}"
            + (f" ({'; '.join(c for j in self.jobs for c in j.crashes)})" if self.crashes else ""),
            f"waste under faults: {waste:,} of {generated:,} generated tokens "
            f"({waste / generated if generated else 0:.1%}); work in flight at the faults "
            f"{in_flight:,} tokens; waste / in flight = "
            f"{waste / in_flight if in_flight else 0:.2f}",
        ]
        if base is not None:
            mean = sum(j.seconds for j in faulted) / len(faulted) if faulted else 0
            out.append(
                f"baseline job without faults: {base.seconds:.0f} s, waste "
                f"{base.verdict.waste:,} of {base.verdict.generated_tokens:,}; "
                f"jobs with faults: {mean:.0f} s on average"
            )
        out.append(f"{self.seconds:.0f} s; {'OK' if self.ok else 'FAILED'}")
        return out

    def to_json(self) -> str:
        return json.dumps(
            {
                "ok": self.ok,
                "lost": self.total("lost"),
                "duplicated": self.total("duplicates"),
                "overshoot": self.total("overshoot"),
                "orphans": self.orphans,
                "unexpected_crashes": self.crashes,
                "faults": dict(self.faults),
                "phases": dict(self.phases),
                "jobs": [
                    {
                        "seconds": round(j.seconds, 1),
                        "faults": [p.kind for p in j.placed],
                        "generated": j.verdict.generated_tokens,
                        "kept": j.verdict.kept_tokens,
                        "in_flight_at_faults": j.in_flight_at_faults,
                        "ok": j.verdict.ok,
                    }
                    for j in self.jobs
                ],
            },
            indent=2,
        )


def job_datasets(workdir: Path, scale: int) -> dict[str, tuple[Path, int]]:
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    jobs = {
        "long": (rows(data / "long.jsonl", "#long-code", 60 * scale), 60_000 * scale),
        "short": (rows(data / "short.jsonl", "#short", 150 * scale), 20_000 * scale),
        "chat": (rows(data / "chat.jsonl", "#chat", 80 * scale, chat=True), 40_000 * scale),
        # runs out of rows before its budget: every valid row must be kept
        "small": (rows(data / "small.jsonl", "#code", 6), 1_000_000),
    }
    small = jobs["small"][0]
    lines = small.read_text().splitlines()
    for offset, row in enumerate(BAD_ROWS):
        lines.insert(1 + 2 * offset, row)
    small.write_text("\n".join(lines) + "\n")
    return jobs


def phase(statuses: dict[str, str], datasets: int) -> int:
    """0 before any budget is reached, 1 while some datasets are still open, 2 once
    none is (halted at its budget, or out of rows)."""
    if len(statuses) == datasets and "open" not in statuses.values():
        return 2
    return 1 if "halted" in statuses.values() else 0


_RESTART = re.compile(r"the (\w[\w -]*) \(pid (\d+)\) exited with code (-?\d+|None)")


def unexpected_restarts(run_log: Path, harmed: set[int]) -> list[str]:
    """Children ``run`` restarted (from its log) that the harness did not kill or
    freeze."""
    text = run_log.read_text(errors="replace") if run_log.exists() else ""
    return [
        f"{m.group(1)} exited {m.group(3)}"
        for m in _RESTART.finditer(text)
        if int(m.group(2)) not in harmed
    ]


class Chaos:
    def __init__(self, settings: ChaosSettings) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.workdir = settings.workdir.resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        defaults = BrokerSettings.from_env()
        port, controller_port = free_ports(2)
        self.broker = BrokerSettings(
            home=self.workdir / "broker",
            port=port,
            controller_port=controller_port,
            kafka_version=defaults.kafka_version,
            jars_root=defaults.jars_root,
            quick_start=True,
        )
        self.bootstrap = ""
        self.report = ChaosReport()
        self.placed_total = 0
        self.rotated = 0  # faults other than outages placed, for the rotation

    def run(self) -> ChaosReport:
        started = time.monotonic()
        self.bootstrap = broker.up(self.broker, [])
        try:
            if self.settings.baseline:
                self.report.jobs.append(self._job(0, faults=0))
            number = 1
            while self.placed_total < self.settings.faults:
                want = min(self.settings.per_job, self.settings.faults - self.placed_total)
                self.report.jobs.append(self._job(number, want))
                number += 1
        finally:
            broker.down(self.broker)
        self.report.seconds = time.monotonic() - started
        return self.report

    # ---- one job -------------------------------------------------------------------

    def _job(self, number: int, faults: int) -> JobResult:
        s = self.settings
        workdir = self.workdir / f"job-{number}"
        workdir.mkdir(parents=True, exist_ok=True)
        namespace = f"chaos{s.seed}j{number}x{int(time.time())}"
        kafka_admin.ensure_topics(self.bootstrap, Topics(namespace).specs())
        datasets = job_datasets(workdir, s.scale)
        share = f"{s.fault_share / 4:g}"
        sim = start_simulator(
            workdir,
            "--tokens-per-second", str(s.tokens_per_second),
            "--seed", str(s.seed + number),
            "--fail-busy", share,
            "--fail-unavailable", share,
            "--fail-500", share,
            "--fail-reset-mid-stream", share,
            "--retry-after", "0.5",
        )  # fmt: skip
        config = write_job(
            workdir,
            self.bootstrap,
            namespace,
            sim.url,
            datasets,
            inference={"stream": True, "concurrency": s.concurrency, "retries": 2},
            budget={"lease_ttl_s": s.lease_ttl_s},
            producer={"on_bad_row": "skip"},
        )
        result = JobResult(number, oracle.Verdict(), 0.0)
        started = time.monotonic()
        watch = Watch(self.bootstrap, namespace)
        try:
            self._drive(result, config, sim, watch, faults, len(datasets))
        finally:
            watch.close()
            sim.stop()
        result.seconds = time.monotonic() - started
        outcomes = outcome_records(self.bootstrap, Topics(namespace))
        result.verdict = oracle.judge(workdir / "out", sim.log, datasets, outcomes)
        answers = oracle.read_server_log(sim.log).values()
        result.in_flight_at_faults = sum(
            a.completion_tokens
            for p in result.placed
            for a in answers
            if a.received_at <= p.at < a.finished_at
        )
        log.info("job %d: %s", number, result.verdict.lines()[-1])
        return result

    def _drive(
        self,
        result: JobResult,
        config: Path,
        sim: Simulator,
        watch: Watch,
        faults: int,
        datasets: int,
    ) -> None:
        """Run the job to its end, placing ``faults`` faults on the way: the first
        third before the first halt, the next after it, the rest during the drain."""
        s = self.settings
        run_log = config.parent / "run.out"
        deadline = time.monotonic() + s.job_deadline_s
        harmed: set[int] = set()
        plan = [min(2, i * 3 // faults) for i in range(faults)]
        run: subprocess.Popen[bytes] | None = None
        try:
            while True:
                if time.monotonic() > deadline:
                    result.crashes.append(f"job {result.number} did not finish in time")
                    return
                if run is None:
                    run = start_run(config, "--dispatchers", str(s.dispatchers), log=run_log)
                    result.runs += 1
                code = run.poll()
                if code is not None:
                    if code == 0:
                        return
                    result.crashes.append(f"run exited {code} by itself")
                    run = None
                    continue
                if plan and phase(watch.statuses(), datasets) >= plan[0]:
                    time.sleep(self.rng.uniform(0.0, 1.5))
                    if run.poll() is None:
                        plan.pop(0)
                        run = self._place(result, run, sim, watch, harmed, datasets)
                time.sleep(0.1)
        finally:
            end_run(run)
            result.crashes += unexpected_restarts(run_log, harmed)

    def _place(
        self,
        result: JobResult,
        run: subprocess.Popen[bytes],
        sim: Simulator,
        watch: Watch,
        harmed: set[int],
        datasets: int,
    ) -> subprocess.Popen[bytes] | None:
        """Place the next fault; the run still going after it (None: it was killed)."""
        s = self.settings
        self.placed_total += 1
        if self.placed_total % s.outage_every == 0:
            kind = "outage"
        else:
            kind = FAULTS[self.rotated % len(FAULTS)]
            self.rotated += 1
        placed = Placed(kind, PHASES[phase(watch.statuses(), datasets)], time.time())
        result.placed.append(placed)
        log.info("job %d: %s %s", result.number, kind, placed.phase)
        children = children_of(run.pid)
        ledger = [p for p, cmd in children.items() if " ledger " in cmd]
        extra = [p for p, cmd in children.items() if " dispatch " in cmd]
        if kind == "run":
            orphans = survivors(kill_tree_root(run))
            result.orphans += [f"{cmd} (pid {pid})" for pid, cmd in orphans.items()]
            return None
        if kind == "outage":
            sim.outage(s.outage_s)
        elif kind == "broker":
            self._kill_broker()
        elif kind in ("ledger", "dispatcher", "freeze"):
            victims = ledger if kind != "dispatcher" else extra
            if not victims:
                return run  # between a child's death and its restart: placed on nothing
            placed.pid = victims[0]
            harmed.add(placed.pid)
            if kind == "freeze":
                os.kill(placed.pid, signal.SIGSTOP)
                time.sleep(2 * s.lease_ttl_s)
                os.kill(placed.pid, signal.SIGCONT)
            else:
                os.kill(placed.pid, signal.SIGKILL)
        return run

    def _kill_broker(self) -> None:
        pid_file = self.broker.home / "broker.pid"
        pid = int(pid_file.read_text().strip())
        os.kill(pid, signal.SIGKILL)
        time.sleep(self.rng.uniform(*self.settings.broker_down_s))
        broker.up(self.broker, [])


def run_chaos(settings: ChaosSettings) -> ChaosReport:
    return Chaos(settings).run()
