"""A fleet of inference servers of unequal speed behind one job (issue 28's evidence).

    PYTHONPATH=. .venv/bin/python bench/fleet.py [--quick]
        [--phases least_work,grow,grow_any,rows,round_robin,kill,cpu]
        [--servers 8] [--concurrency 128] [--rate 50] [--spread 4] [--seconds 90]
        [--max-new-tokens 4096] [--kill-at 0.4] [--cpu-offered 1200] [--cpu-seconds 20]
        [--cpu-max-new-tokens 16] [--cpu-stream] [--cpu-loops uvloop,asyncio]
        [--cpu-bare httpx,aiohttp] [--cpu-pairs 1]
        [--profile-dispatcher PATH] [--bootstrap HOST:PORT] [--workdir bench-out/fleet]

Eight simulated servers (``tokenbudget simulate``, each a process of its own whose
request log is the ground truth), decode speeds per request spread evenly from
``--rate`` to ``--spread`` times it, each given ``concurrency = 128`` in its
``[[inference.servers]]`` table (1,024 requests in flight over the fleet, one
dispatcher). Each phase starts fresh servers and a fresh namespace on one broker (a
broker of the bench's own on free ports, unless ``--bootstrap``):

  least_work   a job shaped like the seed run (datasets of short, code, chat and math
               answers, each with a token budget worth a share of ``--seconds`` at the
               fleet's capacity, and one small dataset that runs out of rows) through
               ``tokenbudget run``, routed by the default policy
  grow         the budgeted job with ``[budget] reserve = "grow"`` and streamed
               answers: each request reserves what its dataset's answers take on
               average and grows as it streams, where ``least_work`` reserves each
               request's whole max_new_tokens; the answers the budgets' ends cut are
               counted from the kept rows
  grow_any     the same with ``[budget] cut = "any"``: no request waits at a budget's
               end, what is in flight when the budget is spent is cut there
  rows         the same datasets without budgets, each file holding about its
               budget's worth of rows (every row kept once): the routing and the
               last answers without the budgets' reservations
  round_robin  the budgeted job, ``[inference] routing = "round_robin"`` (the peers' way)
  kill         the budgeted job, least work, the fastest server SIGKILLed once
               ``--kill-at`` of the budgets is kept
  cpu          the dispatcher's CPU per 1,000 completions at 1,024 in flight (answers
               of ``--cpu-max-new-tokens``; streamed, reserving ``grow``, with
               ``--cpu-stream``), the pipeline run as separate processes
               (ledger, sink, producer, one ``tokenbudget dispatch``) so that the
               dispatcher's process is measured alone; beside it bare asyncio loops
               (1,024 workers, 128 per server, the same requests, every answer kept, no
               budget, no Kafka) on the same servers, measured the same way: through
               httpx as one writes it (a client per server, ``max_connections`` its
               concurrency), and through aiohttp (a session per server: what
               tokenbudget's HTTP client is made of); ``--cpu-loops
               uvloop,asyncio`` measures a dispatcher on each event loop

The server-bound ideal: each simulated request decodes at its server's speed whatever
else runs, so the fleet generates at most sum(concurrency x tokens/s per request)
tokens per second. Ideal time = tokens the servers generated (their logs) / that
capacity; actual = from the first request any server received to the last answer any
finished (their logs): the ramp (slots filling) and the tail (the last answers) count
against the fleet; ``run``'s start-up before the first request and its shutdown after
the last answer do not (its wall time is printed beside). Where the capacity went is
read from the same logs and the kept rows (:func:`timeline`): unused fleet-seconds in
the ramp, while every budget's rest is reserved by requests in flight, while budget
and places were free and nothing was sent, and in the drain after the last request;
per server, its share of the tokens and its last answers. With a server killed, its
capacity counts until the kill.

Every job is graded exact from the servers' logs and the dataset files
(:mod:`tokenbudget.dev.oracle`): no budget overshot, no prompt lost or kept twice. The
waste of the kill: what the killed server logged and was not kept, beside what it had in
flight (the prompts kept at a second attempt, their answers' tokens: the most its unlogged
partial decoding can have been) and the bound ``concurrency x max_new_tokens``.

The CPU figures are CPU seconds (``/proc/<pid>/stat``, every thread) over a window of
steady state (after ``--cpu-warmup`` s), per completion the servers finished in that
window; the implied ceiling of one process is 1,000 / (CPU s per 1,000). The cpu phase
gives its dispatcher a lease of ``LEASE_SECONDS`` of completions: the default lease (a
quarter of what 1,024 requests reserve) holds 256 of these answers, which use all they
reserve, and admission stalls on the ledger between leases.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pstats
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pyarrow.parquet as pq

from tokenbudget.app.children import cli_command
from tokenbudget.app.tables import format_table
from tokenbudget.core import kafka_admin, lifetime
from tokenbudget.dev import jobs, oracle
from tokenbudget.dev.demo import wait_for_simulator
from tokenbudget.dev.jobs import cpu_seconds
from tokenbudget.dev.ports import free_ports
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.producers.prompts.resume import outcome_records
from tokenbudget.streams.topics import Topics

PHASES = ("least_work", "grow", "grow_any", "rows", "round_robin", "kill", "cpu")
TICK = os.sysconf("SC_CLK_TCK")
LEASE_SECONDS = 10  # the cpu phase's lease: this many seconds of completions
FULL = 0.98  # the fleet counts as full at this capacity-weighted share of slots busy


@dataclass(frozen=True)
class Shape:
    """One dataset of the seed-shaped job: the simulator's length marker, its mean
    answer, its share of the job's tokens (0: a small dataset that runs out of rows)."""

    name: str
    marker: str
    mean_tokens: int
    share: float
    chat: bool = False
    rows: int = 0


SEED_SHAPE = (
    Shape("short_qa", "#short", 300, 0.2),
    Shape("code", "#code", 1200, 0.3),
    Shape("chat", "#chat", 1500, 0.25, chat=True),
    Shape("math", "#math", 2200, 0.25),
    Shape("small_code", "#code", 1200, 0.0, rows=40),
)


# ---- processes ------------------------------------------------------------------------


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / TICK, sum(values) / TICK


@dataclass
class Server:
    sim: jobs.Simulator
    rate: float  # tokens/s per request
    concurrency: int
    killed_at: float | None = None

    @property
    def url(self) -> str:
        return self.sim.url

    @property
    def capacity(self) -> float:
        return self.concurrency * self.rate


def rates(args: argparse.Namespace, slowest: float) -> list[float]:
    n = args.servers
    return [slowest * (1 + (args.spread - 1) * i / max(1, n - 1)) for i in range(n)]


@contextmanager
def fleet(
    workdir: Path, speeds: list[float], concurrency: int, *extra: str
) -> Iterator[list[Server]]:
    """Simulators at ``speeds``, started together (from this thread: a child's death
    signal fires when the thread that spawned it ends), stopped on the way out."""
    started: list[tuple[subprocess.Popen[bytes], int, Path, float]] = []
    try:
        for i, (rate, port) in enumerate(zip(speeds, free_ports(len(speeds)), strict=True)):
            log = workdir / f"s{i}-requests.jsonl"
            command = cli_command(
                "simulate",
                "--port",
                str(port),
                "--profile",
                "demo",
                "--log-file",
                str(log),
                "--tokens-per-second",
                f"{rate:g}",
                *extra,
            )
            with (workdir / f"s{i}.out").open("ab") as out:
                process = lifetime.spawn(command, stdout=out, stderr=subprocess.STDOUT)
            started.append((process, port, log, rate))
        for process, port, _, _ in started:
            wait_for_simulator(process, port)
        yield [
            Server(jobs.Simulator(process, port, log), rate, concurrency)
            for process, port, log, rate in started
        ]
    finally:
        for process, *_ in started:  # all at once, so that they end side by side
            if process.poll() is None:
                process.terminate()
        for process, *_ in started:
            lifetime.stop(process, 10)


class CpuWatch:
    """CPU seconds of named processes, sampled until each ends (the last sample kept)."""

    def __init__(self) -> None:
        self.pids: dict[str, list[int]] = {}
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def add(self, name: str, pid: int) -> None:
        if pid in self.first:
            return
        value = cpu_seconds(pid)
        if value is not None:
            self.pids.setdefault(name, []).append(pid)
            self.first[pid] = self.last[pid] = value

    def sample(self) -> None:
        for pid in self.first:
            value = cpu_seconds(pid)
            if value is not None:
                self.last[pid] = value

    def used(self, name: str) -> float:
        return sum(self.last[p] - self.first[p] for p in self.pids.get(name, []))


def broker_pid(settings: BrokerSettings | None) -> int | None:
    if settings is None:
        return None
    try:
        return int((settings.home / "broker.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# ---- the job --------------------------------------------------------------------------


def write_datasets(
    workdir: Path, total_tokens: float, budgets: bool = True
) -> dict[str, tuple[Path, int]]:
    """The seed-shaped job's files and budgets; without ``budgets``, each dataset's
    file holds about its budget's worth of rows and has no budget (every row once)."""
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    found: dict[str, tuple[Path, int]] = {}
    for shape in SEED_SHAPE:
        budget = int(total_tokens * shape.share) if shape.share else 10**12
        if not budgets and shape.share:
            count = math.ceil(budget / shape.mean_tokens)
            budget = 10**12
        else:
            count = shape.rows or math.ceil(1.6 * budget / shape.mean_tokens) + 50
        path = jobs.rows(data / f"{shape.name}.jsonl", shape.marker, count, chat=shape.chat)
        found[shape.name] = (path, budget)
    return found


def write_config(
    workdir: Path,
    bootstrap: str,
    namespace: str,
    servers: list[Server],
    datasets: dict[str, tuple[Path, int]],
    inference: dict[str, Any],
    budget_keys: dict[str, Any] | None = None,
) -> Path:
    """The job's config: one ``[[inference.servers]]`` table per server, each with its
    own concurrency."""
    inference = {
        "api": "sglang",
        "stream": False,
        "read_timeout_s": 900.0,
        "health_interval_s": 1.0,
        "backoff_s": 0.1,
        "backoff_max_s": 1.0,
        **inference,
    }
    chats = jobs.template_chats(workdir, datasets, inference)
    lines = ["[kafka]", f'bootstrap = "{bootstrap}"', f'namespace = "{namespace}"', "[inference]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in inference.items()]
    for server in servers:
        lines += [
            "[[inference.servers]]",
            f'url = "{server.url}"',
            f"concurrency = {server.concurrency}",
        ]
    lines += [
        "[budget]",
        *(f"{key} = {json.dumps(value)}" for key, value in (budget_keys or {}).items()),
    ]
    lines += ["[sink]", 'path = "out"', "flush_interval_s = 1.0", "[metrics]", "port = 0"]
    for name, (path, budget) in datasets.items():
        lines += ["[[datasets]]", f'name = "{name}"', f'path = "{path}"', f"budget = {budget}"]
        lines += ["template = true"] if name in chats else []
    config = workdir / "job.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


@dataclass
class Answer:
    server: int
    received: float
    finished: float
    tokens: int
    rid: str
    max_new_tokens: int
    dataset: str | None = None  # its kept row's (None: not kept)


def answers_of(servers: list[Server]) -> list[Answer]:
    found = []
    for i, server in enumerate(servers):
        if not server.sim.log.exists():
            continue
        for line in server.sim.log.read_text().splitlines():
            if not line.strip():
                continue
            raw = json.loads(line)
            if raw.get("finish") == "fault":
                continue
            found.append(
                Answer(
                    i,
                    float(raw["received_at"]),
                    float(raw["finished_at"]),
                    int(raw["completion_tokens"]),
                    raw["rid"],
                    int(raw["max_new_tokens"]),
                )
            )
    return found


def budget_cuts(out: Path) -> tuple[int, int]:
    """(rows the budget cut, rows) of the kept rows: their ``stop_reason``."""
    reasons = [
        reason
        for file in out.glob("dataset=*/*.parquet")
        for reason in pq.read_table(file, columns=["stop_reason"]).column(0).to_pylist()
    ]
    return sum(1 for r in reasons if r == "budget"), len(reasons)


def kept_rows(out: Path) -> dict[str, tuple[str, int]]:
    """Request id -> (dataset, attempts) of every kept row."""
    found = {}
    for file in out.glob("dataset=*/*.parquet"):
        table = pq.read_table(file, columns=["request_id", "dataset", "attempts"])
        for row in table.to_pylist():
            found[row["request_id"]] = (str(row["dataset"]), int(row["attempts"]))
    return found


LOSSES = ("ramp", "budget", "other", "drain")


@dataclass
class Timeline:
    """Where a job's time went, from the servers' logs (see the module docstring)."""

    start: float
    end: float
    tokens: int
    capacity: float  # tokens/s of the whole fleet
    capacity_seconds: float = 0.0  # its integral over the span (a killed server: until then)
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSSES, 0.0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSSES, 0.0))
    max_in_flight: list[int] = field(default_factory=list)
    last_answer: list[float] = field(default_factory=list)  # seconds before the end
    tail_answers: list[int] = field(default_factory=list)  # finished in the drain
    tail_longest: list[float] = field(default_factory=list)  # of those, seconds

    @property
    def span(self) -> float:
        return self.end - self.start

    @property
    def ratio(self) -> float:
        return self.tokens / self.capacity_seconds

    @property
    def ideal(self) -> float:
        return self.span * self.ratio


def timeline(
    servers: list[Server], answers: list[Answer], budgets: dict[str, int], max_new_tokens: int
) -> Timeline:
    """Sweep the answers' starts and ends in time order: the fleet's busy decode rate
    (each request in flight decodes at its server's rate) against its capacity, and
    each budgeted dataset's tokens kept and reserved (the max_new_tokens of its
    requests in flight). Capacity unused is put down to, in this order: the ramp
    (before the fleet first was FULL busy, or its first answer); the drain (after
    the last request was sent); the budgets (every budgeted dataset's budget left
    is reserved by its requests in flight, but for less than one more request);
    other (budget left and places free, but nothing sent)."""
    start = min(a.received for a in answers)
    end = max(a.finished for a in answers)
    last_sent = max(a.received for a in answers)
    full = sum(s.capacity for s in servers)
    budgeted = {name: budget for name, budget in budgets.items() if budget < 10**12}
    events: list[tuple[float, int, Any]] = []
    for a in answers:
        events += [(a.received, 1, a), (a.finished, -1, a)]
    events += [(s.killed_at, 0, s) for s in servers if s.killed_at is not None]
    events.sort(key=lambda e: (e[0], -e[1]))
    result = Timeline(start, end, sum(a.tokens for a in answers), full)
    busy, capacity = 0.0, full
    reserved = dict.fromkeys(budgeted, 0)
    kept = dict.fromkeys(budgeted, 0)
    level = [0] * len(servers)
    result.max_in_flight = [0] * len(servers)
    full_from: float | None = None
    first_answer = min(a.finished for a in answers)
    pieces: list[tuple[float, float, float, float, bool]] = []  # t0, t1, busy, cap, held
    t = start
    for when, kind, item in events:
        if when > t:
            held = bool(budgeted) and all(
                reserved[d] + max_new_tokens > budgeted[d] - kept[d] for d in budgeted
            )
            pieces.append((t, min(when, end), busy, capacity, held))
            t = when
        if kind == 0:
            capacity -= item.capacity
            continue
        busy += kind * servers[item.server].rate
        level[item.server] += kind
        result.max_in_flight[item.server] = max(
            result.max_in_flight[item.server], level[item.server]
        )
        if item.dataset in budgeted:
            reserved[item.dataset] += kind * item.max_new_tokens
            if kind < 0:
                kept[item.dataset] += item.tokens
        if full_from is None and busy >= FULL * capacity:
            full_from = when
    ramp_end = min(full_from or end, first_answer)
    for t0, t1, b, c, held in pieces:
        result.capacity_seconds += c * (t1 - t0)
        if t1 <= ramp_end:
            cause = "ramp"
        elif t0 >= last_sent:
            cause = "drain"
        elif held:
            cause = "budget"
        else:
            cause = "other"
        result.lost[cause] += max(0.0, c - b) * (t1 - t0) / full
        result.seconds[cause] += t1 - t0
    for i in range(len(servers)):
        mine = [a for a in answers if a.server == i]
        result.last_answer.append(end - max((a.finished for a in mine), default=start))
        tail = [a for a in mine if a.finished > last_sent]
        result.tail_answers.append(len(tail))
        result.tail_longest.append(max((a.finished - a.received for a in tail), default=0.0))
    return result


@dataclass
class JobResult:
    phase: str
    wall: float
    line: Timeline
    verdict: oracle.Verdict
    cpu: dict[str, float]
    machine: float  # cores busy over the machine, on average
    notes: list[str] = field(default_factory=list)


def run_job(
    phase: str,
    args: argparse.Namespace,
    bootstrap: str,
    broker_settings: BrokerSettings | None,
    *,
    routing: str = "least_work",
    kill: int | None = None,
    budgets: bool = True,
    reserve: str = "whole",
    cut: str = "last",
) -> JobResult:
    workdir = Path(args.workdir).resolve() / phase
    shutil.rmtree(workdir, ignore_errors=True)  # the simulators append to their logs
    workdir.mkdir(parents=True)
    speeds = rates(args, args.rate)
    capacity = sum(args.concurrency * r for r in speeds)
    datasets = write_datasets(workdir, capacity * args.seconds, budgets)
    namespace = f"bench-fleet-{phase}-{uuid.uuid4().hex[:8]}"
    kafka_admin.ensure_topics(bootstrap, Topics(namespace).specs())
    total = sum(budget for _, budget in datasets.values() if budget < 10**12)
    notes: list[str] = []
    with fleet(workdir, speeds, args.concurrency) as servers:
        config = write_config(
            workdir,
            bootstrap,
            namespace,
            servers,
            datasets,
            {
                "concurrency": args.concurrency,
                "max_new_tokens": args.max_new_tokens,
                "routing": routing,
                "stream": reserve == "grow",
            },
            {"reserve": reserve, "cut": cut},
        )
        cpu = CpuWatch()
        for server in servers:
            cpu.add("simulators", server.sim.process.pid)
        pid = broker_pid(broker_settings)
        if pid is not None:
            cpu.add("broker", pid)
        watch = jobs.Watch(bootstrap, namespace) if kill is not None else None
        log = workdir / "run.out"
        machine0 = machine_busy()
        started = time.monotonic()
        with log.open("ab") as out:  # the default log level: httpx logs each request at INFO
            run = lifetime.spawn(
                cli_command("run", "--config", str(config), "--json"),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        cpu.add("run", run.pid)
        try:
            while run.poll() is None:
                for child in jobs.children_of(run.pid):
                    cpu.add("ledger", child)
                cpu.sample()
                if kill is not None and watch is not None:
                    kept = sum(
                        v.snapshot.completion_tokens
                        for v in list(watch.board.views.values())
                        if v.snapshot is not None
                    )
                    if kept >= args.kill_at * total:
                        victim = servers[kill]
                        os.kill(victim.sim.process.pid, signal.SIGKILL)
                        victim.killed_at = time.time()
                        victim.sim.process.wait()
                        notes.append(
                            f"SIGKILLed server {kill} ({victim.rate:g} tokens/s per request) "
                            f"with {kept:,} of {total:,} budget tokens kept"
                        )
                        kill = None
                time.sleep(0.5)
            wall = time.monotonic() - started
            machine1 = machine_busy()
            if run.returncode != 0:
                raise SystemExit(
                    f"{phase}: run exited {run.returncode}:\n{log.read_text()[-3000:]}"
                )
        finally:
            jobs.end_run(run)
            if watch is not None:
                watch.close()
        answers = answers_of(servers)
    rows = kept_rows(workdir / "out")
    for a in answers:
        a.dataset = rows.get(a.rid, (None, 0))[0]
    budget_of = {name: budget for name, (_, budget) in datasets.items()}
    line = timeline(servers, answers, budget_of, args.max_new_tokens)
    outcomes = outcome_records(bootstrap, Topics(namespace))
    verdict = oracle.judge(workdir / "out", [s.sim.log for s in servers], datasets, outcomes)
    used = {name: cpu.used(name) for name in ("run", "ledger", "simulators", "broker")}
    machine = (machine1[0] - machine0[0]) / max(1e-9, wall)
    result = JobResult(phase, wall, line, verdict, used, machine, notes)
    if phase == "kill":
        result.notes += kill_waste(servers, answers, rows, verdict, args)
    if budgets:
        cut, kept = budget_cuts(workdir / "out")
        result.notes.append(f"answers the budgets cut: {cut:,} of {kept:,} kept rows")
    return result


def kill_waste(
    servers: list[Server],
    answers: list[Answer],
    rows: dict[str, tuple[str, int]],
    verdict: oracle.Verdict,
    args: argparse.Namespace,
) -> list[str]:
    [index] = [i for i, s in enumerate(servers) if s.killed_at is not None]
    logged = [a for a in answers if a.server == index]
    lost = [a for a in logged if a.rid not in rows]
    moved = [a for a in answers if rows.get(a.rid, ("", 0))[1] > 1]
    moved_rows, moved_tokens = len(moved), sum(a.tokens for a in moved)
    bound = args.concurrency * args.max_new_tokens
    return [
        f"killed server: {len(logged)} answers logged, {sum(a.tokens for a in logged):,} tokens; "
        f"logged and not kept: {len(lost)} answers, {sum(a.tokens for a in lost):,} tokens",
        f"in flight at the kill: {moved_rows} prompts kept at a later attempt, their answers "
        f"{moved_tokens:,} tokens (the most its unlogged partial decoding can have been); "
        f"bound concurrency x max_new_tokens = {bound:,}",
        f"waste over the fleet (generated, logged, not kept): {verdict.waste:,} tokens",
    ]


# ---- the dispatcher's CPU per completion ------------------------------------------------


@dataclass
class CpuResult:
    name: str
    completions: int
    seconds: float
    cpu: float  # the measured process
    others: dict[str, float] = field(default_factory=dict)

    @property
    def per_1000(self) -> float:
        return 1000 * self.cpu / max(1, self.completions)


def finished_between(servers: list[Server], t0: float, t1: float) -> int:
    return sum(1 for a in answers_of(servers) if t0 <= a.finished < t1)


def first_answer(servers: list[Server]) -> bool:
    return any(s.sim.log.exists() and s.sim.log.stat().st_size > 0 for s in servers)


def cpu_dispatcher(
    args: argparse.Namespace,
    bootstrap: str,
    servers: list[Server],
    workdir: Path,
    prompts: Path,
    loop: str,
) -> CpuResult:
    namespace = f"bench-fleet-cpu-{uuid.uuid4().hex[:8]}"
    kafka_admin.ensure_topics(bootstrap, Topics(namespace).specs())
    job = workdir / f"dispatch-{namespace}"
    job.mkdir(parents=True)
    config = write_config(
        job,
        bootstrap,
        namespace,
        servers,
        {"cpu": (prompts, 10**12)},
        {
            "concurrency": args.concurrency,
            "max_new_tokens": args.cpu_max_new_tokens,
            "stream": args.cpu_stream,
        },
        # A lease of a few seconds' completions: the default (a quarter of what the
        # requests in flight reserve) covers 256 of these answers, which use all they
        # reserve, and admission waits for the ledger between leases.
        {
            "lease_tokens": LEASE_SECONDS * int(args.cpu_offered) * args.cpu_max_new_tokens,
            "reserve": "grow" if args.cpu_stream else "whole",
        },
    )
    roles: dict[str, subprocess.Popen[bytes]] = {}
    env = {**os.environ, "TOKENBUDGET_LOG": "WARNING", "TOKENBUDGET_LOOP": loop}
    try:
        for role in ("ledger", "sink", "dispatch", "produce"):
            command = cli_command(role, "--config", str(config))
            if role == "dispatch" and args.profile_dispatcher:
                profile = Path(args.profile_dispatcher).resolve()
                command = [sys.executable, "-m", "cProfile", "-o", str(profile), *command[1:]]
            with (job / f"{role}.out").open("ab") as out:
                roles[role] = lifetime.spawn(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while not first_answer(servers):
            if time.monotonic() > deadline or roles["dispatch"].poll() is not None:
                raise SystemExit(
                    f"the dispatcher sent nothing: {(job / 'dispatch.out').read_text()}"
                )
            time.sleep(0.2)
        time.sleep(args.cpu_warmup)
        pids = {"dispatcher": roles["dispatch"].pid, "ledger": roles["ledger"].pid}
        pids["sink"] = roles["sink"].pid
        watched = {**pids, **{f"s{i}": s.sim.process.pid for i, s in enumerate(servers)}}
        before = {name: cpu_seconds(pid) or 0.0 for name, pid in watched.items()}
        t0 = time.time()
        time.sleep(args.cpu_seconds)
        after = {name: cpu_seconds(pid) or 0.0 for name, pid in watched.items()}
        t1 = time.time()
        if roles["dispatch"].poll() is not None:
            raise SystemExit("the dispatcher ended inside the window: give it more prompts")
    finally:
        # SIGINT: the dispatcher hands back what the servers have not answered; the
        # sink and the ledger are stopped after it, the sink reading to the end first.
        for role, sig in (
            ("produce", signal.SIGTERM),
            ("dispatch", signal.SIGINT),
            ("sink", signal.SIGTERM),
            ("ledger", signal.SIGTERM),
        ):
            if role in roles:
                lifetime.stop(roles[role], 60, sig)
    used = {name: after[name] - before[name] for name in watched}
    result = CpuResult(
        f"tokenbudget dispatch ({loop})",
        finished_between(servers, t0, t1),
        t1 - t0,
        used["dispatcher"],
    )
    result.others = {
        "ledger": used["ledger"],
        "sink": used["sink"],
        "simulators": sum(v for k, v in used.items() if k.startswith("s") and k[1:].isdigit()),
    }
    return result


async def bare_loop(
    args: argparse.Namespace, servers: list[Server], texts: list[str], library: str
) -> tuple[list[float], list[float]]:
    """1,024 workers, ``concurrency`` per server, sharing one queue of the prompts: the
    request tokenbudget's SGLang backend sends, every answer kept, through httpx (as
    one writes it) or aiohttp (what tokenbudget's client, producers/inference/http.py, is made
    of: the stricter baseline).
    Returns the window's start and end: (wall time, CPU of this process, of the
    simulators)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for text in texts:
        queue.put_nowait(text)
    kept: list[tuple[str, int, list[int]]] = []
    stop = asyncio.Event()
    window: list[list[float]] = []

    def sample() -> list[float]:
        sims = sum(cpu_seconds(s.sim.process.pid) or 0.0 for s in servers)
        return [time.time(), time.process_time(), sims]

    async def worker(url: str, client: Any) -> None:
        while not stop.is_set() and not queue.empty():
            text = queue.get_nowait()
            rid = uuid.uuid4().hex
            body = {
                "rid": rid,
                "sampling_params": {"max_new_tokens": args.cpu_max_new_tokens},
                "stream": False,
                "text": text,
            }
            if library == "aiohttp":
                async with client.post(f"{url}/generate", json=body) as answer:
                    answer.raise_for_status()
                    data = await answer.json()
            else:
                response = await client.post(f"{url}/generate", json=body)
                response.raise_for_status()
                data = response.json()
            kept.append((rid, int(data["meta_info"]["completion_tokens"]), data["output_ids"]))

    async def measure() -> None:
        while not kept:
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.cpu_warmup)
        window.append(sample())
        await asyncio.sleep(args.cpu_seconds)
        window.append(sample())
        if queue.empty():
            raise SystemExit("the bare loop ran out of prompts inside the window")
        stop.set()

    if library == "aiohttp":
        clients: list[Any] = [
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2 * s.concurrency))
            for s in servers
        ]
    else:
        clients = [
            httpx.AsyncClient(
                timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=s.concurrency)
            )
            for s in servers
        ]
    try:
        await asyncio.gather(
            measure(),
            *(
                worker(s.url, c)
                for s, c in zip(servers, clients, strict=True)
                for _ in range(s.concurrency)
            ),
        )
    finally:
        for client in clients:
            await (client.close() if library == "aiohttp" else client.aclose())
    return window[0], window[1]


def cpu_bare(
    args: argparse.Namespace, servers: list[Server], texts: list[str], library: str
) -> CpuResult:
    (t0, c0, s0), (t1, c1, s1) = asyncio.run(bare_loop(args, servers, texts, library))
    completions = finished_between(servers, t0, t1)
    result = CpuResult(f"bare asyncio+{library} loop", completions, t1 - t0, c1 - c0)
    result.others = {"simulators": s1 - s0}
    return result


def cpu_phase(args: argparse.Namespace, bootstrap: str) -> list[CpuResult]:
    workdir = Path(args.workdir).resolve() / "cpu"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    # Every answer is cut at max_new_tokens (the markers' answers are far longer), so
    # each server's requests last max_new_tokens / its rate: the slowest rate that
    # offers --cpu-offered completions/s at 1,024 in flight.
    shares = rates(args, 1.0)
    slowest = args.cpu_offered * args.cpu_max_new_tokens / (args.concurrency * sum(shares))
    count = int(args.cpu_offered * (args.cpu_warmup + args.cpu_seconds + 30) * 1.5)
    texts = [f"#code cpu task {i}: write a function" for i in range(count)]
    prompts = workdir / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts))
    )
    results: list[CpuResult] = []
    with fleet(workdir, [slowest * s for s in shares], args.concurrency) as servers:
        print(
            f"\ncpu: {len(servers)} servers at {slowest:.2f}..{slowest * args.spread:.2f} tokens/s"
            f" per request, max_new_tokens {args.cpu_max_new_tokens} (every answer that long),"
            f" {args.concurrency * len(servers):,} in flight: {args.cpu_offered:,.0f} completions/s"
            f" offered; window {args.cpu_seconds:g} s after {args.cpu_warmup:g} s",
            flush=True,
        )
        for pair in range(args.cpu_pairs):
            loops = args.cpu_loops.split(",")
            order = [*loops, *filter(None, args.cpu_bare.split(","))]
            for which in order if pair % 2 == 0 else order[::-1]:
                if which in loops:
                    result = cpu_dispatcher(args, bootstrap, servers, workdir, prompts, which)
                else:
                    result = cpu_bare(args, servers, texts, which)
                print(
                    f"  {result.name}: {result.completions:,} completions in"
                    f" {result.seconds:.1f} s, {result.cpu:.2f} CPU s",
                    flush=True,
                )
                results.append(result)
    if args.profile_dispatcher:
        print(f"\nprofile of the dispatcher ({args.profile_dispatcher}), top by own time:")
        stats = pstats.Stats(str(Path(args.profile_dispatcher).resolve()))
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
    return results


# ---- printing -------------------------------------------------------------------------


def print_jobs(results: list[JobResult], args: argparse.Namespace) -> None:
    headers = [
        "phase",
        "run wall",
        "span (logs)",
        "tokens",
        "ideal",
        "ideal/actual",
        *(f"lost: {cause}" if cause == LOSSES[0] else cause for cause in LOSSES),
        "exact",
        "overshoot",
        "waste",
    ]
    rows = []
    for r in results:
        line, v = r.line, r.verdict
        rows.append(
            [
                r.phase,
                f"{r.wall:.1f} s",
                f"{line.span:.1f} s",
                f"{line.tokens:,}",
                f"{line.ideal:.1f} s",
                f"{line.ratio:.3f}",
                *(f"{line.lost[c]:.1f} / {line.seconds[c]:.1f} s" for c in LOSSES),
                "yes" if v.ok else "NO",
                f"{v.overshoot:,}",
                f"{v.waste:,}",
            ]
        )
    print()
    print(format_table(headers, rows))
    print(
        "ideal: tokens the servers logged / sum(concurrency x tokens/s per request) (a killed"
        " server's counted until its kill); actual: the span from the first request received"
        " to the last answer finished. lost: fleet-seconds of capacity unused / seconds of the"
        f" span, in the ramp (until {FULL:.0%} busy or the first answer), with every budget's"
        " rest reserved by its requests in flight (no whole request fits), other (budget and"
        " places free, nothing sent), and the drain (after the last request was sent)"
    )
    for r in results:
        cores = ", ".join(f"{k} {v / r.wall:.2f}" for k, v in r.cpu.items() if v)
        print(
            f"{r.phase}: CPU cores used on average: {cores}; the machine"
            f" {r.machine:.2f} of {os.cpu_count()}"
        )
        for note in r.notes:
            print(f"{r.phase}: {note}")
        if not r.verdict.ok:
            print("\n".join(r.verdict.lines()))
    for r in results:
        if r.phase != "kill":
            print_servers(r, args)


def print_servers(r: JobResult, args: argparse.Namespace) -> None:
    line = r.line
    speeds = rates(args, args.rate)
    tokens = [0] * len(speeds)
    path = Path(args.workdir).resolve() / r.phase
    for i in range(len(speeds)):
        log = path / f"s{i}-requests.jsonl"
        tokens[i] = sum(
            json.loads(x)["completion_tokens"] for x in log.read_text().splitlines() if x.strip()
        )
    total = sum(tokens)
    capacity = sum(speeds)
    rows = [
        [
            f"s{i}",
            f"{speeds[i]:g}",
            f"{speeds[i] / capacity:.1%}",
            f"{tokens[i] / total:.1%}",
            line.max_in_flight[i],
            f"{line.last_answer[i]:.1f} s",
            line.tail_answers[i],
            f"{line.tail_longest[i]:.1f} s",
        ]
        for i in range(len(speeds))
    ]
    print(f"\n{r.phase}: per server (the drain: after the last request was sent)")
    print(
        format_table(
            [
                "server",
                "tokens/s/request",
                "capacity share",
                "tokens share",
                "max in flight",
                "last answer before end",
                "answers in drain",
                "longest in drain",
            ],
            rows,
        )
    )


def print_cpu(results: list[CpuResult]) -> None:
    rows = []
    for r in results:
        others = ", ".join(
            f"{k} {1000 * v / max(1, r.completions):.2f}" for k, v in r.others.items()
        )
        rows.append(
            [
                r.name,
                f"{r.completions:,}",
                f"{r.completions / r.seconds:,.0f}/s",
                f"{r.cpu / r.seconds:.2f}",
                f"{r.per_1000:.2f} s",
                f"{1000 / r.per_1000:,.0f}/s",
                others,
            ]
        )
    print()
    print(
        format_table(
            [
                "client",
                "completions in window",
                "rate",
                "cores",
                "CPU per 1,000",
                "ceiling (one process)",
                "beside it, CPU s per 1,000",
            ],
            rows,
        )
    )

    def mean(prefix: str) -> float | None:
        found = [r.per_1000 for r in results if r.name.startswith(prefix)]
        return sum(found) / len(found) if found else None

    loops = [r.name for r in results if r.name.startswith("tokenbudget")]
    mine, httpx_loop = mean(loops[0]) if loops else None, mean("bare asyncio+httpx")
    aiohttp_loop = mean("bare asyncio+aiohttp")
    for other in dict.fromkeys(loops[1:]):
        if other != loops[0] and mine:
            print(f"{loops[0]} / {other}, CPU per completion: {mine / (mean(other) or 1):.2f}x")
    if mine and httpx_loop:
        print(f"dispatcher CPU per completion / the bare httpx loop's: {mine / httpx_loop:.2f}x")
    if mine and aiohttp_loop:
        print(
            f"dispatcher CPU per completion / the bare aiohttp loop's: {mine / aiohttp_loop:.2f}x"
        )
    if httpx_loop and aiohttp_loop:
        print(f"bare httpx loop / bare aiohttp loop: {httpx_loop / aiohttp_loop:.2f}x")


# ---- main -----------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smaller run: ~40 s jobs, 8 s windows"
    )
    parser.add_argument(
        "--phases", default=",".join(PHASES), help="comma-separated, of: " + ", ".join(PHASES)
    )
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=128, help="per server")
    parser.add_argument(
        "--rate", type=float, default=50.0, help="the slowest server's tokens/s per request"
    )
    parser.add_argument(
        "--spread", type=float, default=4.0, help="the fastest server's rate / the slowest's"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        help="the job's ideal length: budgets = capacity x this (default 90, --quick 40)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument(
        "--kill-at", type=float, default=0.4, help="share of the budgets kept at the kill"
    )
    parser.add_argument(
        "--cpu-offered",
        type=float,
        default=1200.0,
        help="completions/s the servers could take at 1,024 in flight (the target: 1,000)",
    )
    parser.add_argument("--cpu-max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--cpu-stream",
        action="store_true",
        help='the cpu phase\'s dispatcher streams its answers (reserve = "grow")',
    )
    parser.add_argument("--cpu-warmup", type=float, help="seconds (default 10, --quick 5)")
    parser.add_argument(
        "--cpu-seconds", type=float, help="the measured window (default 20, --quick 8)"
    )
    parser.add_argument(
        "--cpu-pairs", type=int, default=1, help="dispatchers and bare loops, alternating"
    )
    parser.add_argument(
        "--cpu-loops",
        default="uvloop",
        help="the cpu phase's dispatchers: their event loops (TOKENBUDGET_LOOP), comma-separated",
    )
    parser.add_argument(
        "--cpu-bare",
        default="httpx,aiohttp",
        help="the cpu phase's bare loops beside them: httpx, aiohttp, comma-separated ('' none)",
    )
    parser.add_argument(
        "--profile-dispatcher",
        metavar="PATH",
        help="run the cpu phase's dispatcher under cProfile, print its top costs",
    )
    parser.add_argument("--bootstrap", help="a broker to use (default: one of the bench's own)")
    parser.add_argument("--workdir", default="bench-out/fleet")
    args = parser.parse_args()
    for key, full, quick in (
        ("seconds", 90.0, 40.0),
        ("cpu_warmup", 10.0, 5.0),
        ("cpu_seconds", 20.0, 8.0),
    ):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    settings: BrokerSettings | None = None
    bootstrap = args.bootstrap
    if not bootstrap:
        defaults = BrokerSettings.from_env()
        port, controller_port = free_ports(2)
        settings = BrokerSettings(
            home=workdir / "broker",
            port=port,
            controller_port=controller_port,
            kafka_version=defaults.kafka_version,
            jars_root=defaults.jars_root,
        )
        bootstrap = broker.up(settings, [])
    speeds = rates(args, args.rate)
    capacity = sum(args.concurrency * r for r in speeds)
    budgeted = [s.name for s in SEED_SHAPE if s.share]
    unbudgeted = [s.name for s in SEED_SHAPE if not s.share]
    print(
        f"{args.servers} servers at {', '.join(f'{r:g}' for r in speeds)} tokens/s per request,"
        f" concurrency {args.concurrency} each ({args.servers * args.concurrency:,} in flight):"
        f" capacity {capacity:,.0f} tokens/s; budgets {capacity * args.seconds:,.0f} tokens"
        f" ({args.seconds:g} s at capacity) over {', '.join(budgeted)}, and"
        f" {', '.join(unbudgeted)} (no budget: it runs out of rows);"
        f" max_new_tokens {args.max_new_tokens}; broker {bootstrap}",
        flush=True,
    )
    try:
        results: list[JobResult] = []
        kinds: dict[str, Callable[[], JobResult]] = {
            "least_work": lambda: run_job("least_work", args, bootstrap, settings),
            "round_robin": lambda: run_job(
                "round_robin", args, bootstrap, settings, routing="round_robin"
            ),
            "kill": lambda: run_job("kill", args, bootstrap, settings, kill=args.servers - 1),
            "rows": lambda: run_job("rows", args, bootstrap, settings, budgets=False),
            "grow": lambda: run_job("grow", args, bootstrap, settings, reserve="grow"),
            "grow_any": lambda: run_job(
                "grow_any", args, bootstrap, settings, reserve="grow", cut="any"
            ),
        }
        for phase in phases:
            if phase in kinds:
                result = kinds[phase]()
                print(
                    f"{phase}: run {result.wall:.1f} s, span {result.line.span:.1f} s, ideal"
                    f" {result.line.ideal:.1f} s, ideal/actual {result.line.ratio:.3f},"
                    f" exact {result.verdict.ok}",
                    flush=True,
                )
                results.append(result)
        if results:
            print_jobs(results, args)
        if "cpu" in phases:
            print_cpu(cpu_phase(args, bootstrap))
    finally:
        if settings is not None:
            broker.down(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
