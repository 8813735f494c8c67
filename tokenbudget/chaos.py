"""Chaos: the multi-dataset scenario under kills, a broker restart and a faulty server.

The pipeline runs as separate processes (``ledger``, ``dispatch`` x N, ``sink``,
``produce``) on a broker of its own, against the simulator answering a share of
requests with 5xx, a hang (read timeout), a reset connection or a body cut off mid
JSON. At random moments one component is SIGKILLed and started again; once, the
broker itself is restarted. Then the run is let finish, stopped with SIGTERM, and
the books are checked against what went in:

* every valid dataset row has exactly one recorded outcome (completed, skipped,
  failed) in the ledger's outcome table: lost = 0;
* Parquet holds each ``request_id`` and each ``prompt_id`` once, exactly the
  prompts recorded as completed;
* per dataset, the ledger's kept tokens and samples equal Parquet's, and kept
  tokens never exceed the budget.

``bench/chaos.py`` runs the full version (20+ cycles) and prints the report; the
test suite runs a short one. Both call :func:`run_chaos`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from producers.datasets import read_prompts
from producers.resume import outcome_records
from sinks.replay import live_snapshots, read_to_end
from streams import events as ev
from streams.topics import Topics
from tokenbudget import broker
from tokenbudget.demo import (
    DEMO_DATASETS,
    DemoDataset,
    free_port,
    wait_for_simulator,
    write_datasets,
)
from tokenbudget.errors import DatasetError, TokenBudgetError
from tokenbudget.kafka import GroupLag
from tokenbudget.runner import cli_command, stop_process

log = logging.getLogger(__name__)

KINDS = ("ledger", "dispatch", "sink", "produce")

# Rows no reader may accept, one per way a row goes wrong; each must be reported
# with its file and line and skipped (``[producer] on_bad_row = "skip"``).
BAD_ROWS = (
    '{"prompt": "cut off',  # bad JSON
    '{"id": "no-prompt-field"}',  # missing field
    '{"prompt": ""}',  # empty prompt
    '{"prompt": 42}',  # wrong type
)


@dataclass(frozen=True)
class ChaosSettings:
    workdir: Path
    cycles: int = 20
    seed: int = 7
    budget: int = 300_000  # per dataset
    datasets: tuple[DemoDataset, ...] = DEMO_DATASETS
    dispatchers: int = 2
    concurrency: int = 32
    max_new_tokens: int = 8192
    tokens_per_second: float = 3000.0  # per request, in the simulator
    fault_share: float = 0.08  # of requests, split evenly over the four faults
    retries: int = 1  # a prompt fails (dead-lettered) after retries + 1 attempts
    kill_gap_s: tuple[float, float] = (1.0, 4.0)  # between kills
    restart_after_s: tuple[float, float] = (0.2, 2.0)  # a killed component is down this long
    broker_restart_cycle: int | None = None  # None: halfway through the cycles
    deadline_s: float = 900.0  # for the run to settle after the last cycle


@dataclass
class DatasetBooks:
    budget: int
    prompts_in: int = 0
    completed: int = 0
    skipped: int = 0
    failed: int = 0
    lost: int = 0
    ledger_tokens: int = 0
    ledger_samples: int = 0
    parquet_tokens: int = 0
    parquet_rows: int = 0

    @property
    def overshoot(self) -> int:
        return max(0, max(self.ledger_tokens, self.parquet_tokens) - self.budget)


@dataclass
class ChaosReport:
    datasets: dict[str, DatasetBooks] = field(default_factory=dict)
    kills: Counter[str] = field(default_factory=Counter)
    crashes: Counter[str] = field(default_factory=Counter)  # exited on their own
    broker_restarts: int = 0
    bad_rows: int = 0
    dead_letters: int = 0
    unknown_outcomes: int = 0  # outcomes for prompt ids no dataset holds
    duplicate_request_ids: int = 0
    duplicate_prompt_ids: int = 0
    completed_not_in_parquet: int = 0
    parquet_not_completed: int = 0
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    # share of the valid rows with an outcome when each kill landed
    progress_at_kills: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def lost(self) -> int:
        return sum(b.lost for b in self.datasets.values())

    @property
    def overshoot(self) -> int:
        return sum(b.overshoot for b in self.datasets.values())

    @property
    def ledger_matches_parquet(self) -> bool:
        return all(
            b.ledger_tokens == b.parquet_tokens and b.ledger_samples == b.parquet_rows
            for b in self.datasets.values()
        )

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.unknown_outcomes == 0
            and self.duplicate_request_ids == 0
            and self.duplicate_prompt_ids == 0
            and self.completed_not_in_parquet == 0
            and self.parquet_not_completed == 0
            and self.ledger_matches_parquet
            and self.overshoot == 0
            and all(code == 0 for code in self.exit_codes.values())
        )

    def lines(self) -> list[str]:
        out = [
            f"{'dataset':<22}{'budget':>10}{'in':>7}{'done':>7}{'skip':>7}{'fail':>6}"
            f"{'lost':>6}{'ledger_tok':>12}{'parquet_tok':>12}{'overshoot':>10}"
        ]
        for name, b in self.datasets.items():
            out.append(
                f"{name:<22}{b.budget:>10,}{b.prompts_in:>7}{b.completed:>7}{b.skipped:>7}"
                f"{b.failed:>6}{b.lost:>6}{b.ledger_tokens:>12,}{b.parquet_tokens:>12,}"
                f"{b.overshoot:>10,}"
            )
        total_in = sum(b.prompts_in for b in self.datasets.values())
        kinds = {
            k: sum(getattr(b, k) for b in self.datasets.values())
            for k in ("completed", "skipped", "failed")
        }
        kills = ", ".join(f"{k} {self.kills[k]}" for k in KINDS)
        mid_run = sum(1 for p in self.progress_at_kills if p < 1.0)
        spread = (
            f"{min(self.progress_at_kills):.0%}..{max(self.progress_at_kills):.0%}"
            if self.progress_at_kills
            else "-"
        )
        out += [
            f"kill/restart cycles: {sum(self.kills.values())} ({kills}); "
            f"broker restarts: {self.broker_restarts}; "
            f"exited on their own and restarted: {sum(self.crashes.values())}"
            + (f" ({dict(self.crashes)})" if self.crashes else ""),
            f"kills that landed before every prompt had its outcome: {mid_run} of "
            f"{len(self.progress_at_kills)} (progress at the kills: {spread})",
            f"prompts in: {total_in:,} (bad rows reported and skipped: {self.bad_rows}); "
            f"outcomes out: completed {kinds['completed']:,}, skipped {kinds['skipped']:,}, "
            f"failed {kinds['failed']:,} (dead letters: {self.dead_letters:,})",
            f"lost = {self.lost}, unknown outcomes = {self.unknown_outcomes}, "
            f"duplicated request_ids in Parquet = {self.duplicate_request_ids}, "
            f"duplicated prompt_ids = {self.duplicate_prompt_ids}, "
            f"completed but not in Parquet = {self.completed_not_in_parquet}, "
            f"in Parquet but not completed = {self.parquet_not_completed}",
            f"ledger totals = Parquet totals: {'yes' if self.ledger_matches_parquet else 'NO'}; "
            f"overshoot = {self.overshoot:,} tokens; "
            f"exit codes after SIGTERM: {self.exit_codes}",
            f"{self.seconds:.0f} s; {'OK' if self.ok else 'FAILED'}",
        ]
        return out


class Component:
    """One pipeline process, started again after it is killed."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def kind(self) -> str:
        return self.name.split("-")[0]

    def start(self) -> None:
        with self.log_path.open("ab") as out:
            out.write(f"\n==== start {time.strftime('%H:%M:%S')}\n".encode())
            out.flush()
            # Its own session: a SIGKILL to the group takes the whole process tree.
            self.process = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def terminate(self, timeout: float = 90) -> int | None:
        """SIGTERM, SIGKILL after ``timeout``; the exit code (negative if killed)."""
        if self.process is None:
            return None
        stop_process(self.process, timeout)
        return self.process.returncode


def plant_bad_rows(path: Path) -> int:
    """Insert the bad rows among the first lines of a dataset file."""
    lines = path.read_text().splitlines()
    for offset, row in enumerate(BAD_ROWS):
        lines.insert(2 + 3 * offset, row)
    path.write_text("\n".join(lines) + "\n")
    return len(BAD_ROWS)


def write_config(
    settings: ChaosSettings, bootstrap: str, namespace: str, url: str, paths: dict[str, Path]
) -> Path:
    lines = [
        "[kafka]",
        f'bootstrap = "{bootstrap}"',
        f'namespace = "{namespace}"',
        "[inference]",
        f'url = "{url}"',
        'api = "sglang"',
        f"concurrency = {settings.concurrency}",
        f"max_new_tokens = {settings.max_new_tokens}",
        f"retries = {settings.retries}",
        "backoff_s = 0.2",
        "backoff_max_s = 1.0",
        "connect_timeout_s = 2.0",
        # The hang fault never answers: a short read timeout turns it into a retry.
        "read_timeout_s = 8.0",
        "[budget]",
        # A killed dispatcher's lease comes back after this long.
        "lease_ttl_s = 4.0",
        "[producer]",
        'on_bad_row = "skip"',
        "[sink]",
        'path = "out"',
        "flush_interval_s = 1.0",
    ]
    for name, path in paths.items():
        lines += [
            "[[datasets]]",
            f'name = "{name}"',
            f'path = "{path}"',
            f"budget = {settings.budget}",
        ]
    config = settings.workdir / "tokenbudget.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def start_simulator(settings: ChaosSettings, port: int, log_path: Path) -> Component:
    share = settings.fault_share / 4
    argv = cli_command(
        "simulate",
        "--port", str(port),
        "--profile", "demo",
        "--tokens-per-second", str(settings.tokens_per_second),
        "--seed", str(settings.seed),
        "--fail-500", str(share),
        "--fail-timeout", str(share),
        "--fail-reset", str(share),
        "--fail-malformed", str(share),
    )  # fmt: skip
    sim = Component("simulator", argv, log_path)
    sim.start()
    assert sim.process is not None
    wait_for_simulator(sim.process, port, logs=f"; see {log_path}")
    return sim


def valid_rows(name: str, path: Path) -> tuple[set[str], int]:
    """The prompt ids a reader accepts from ``path``, and how many rows it rejects."""
    bad: list[DatasetError] = []
    ids = {row.prompt_id for row in read_prompts(name, path, on_bad_row=bad.append)}
    return ids, len(bad)


class Chaos:
    def __init__(self, settings: ChaosSettings) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.report = ChaosReport()
        workdir = settings.workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(exist_ok=True)
        defaults = broker.BrokerSettings.from_env()
        self.broker = broker.BrokerSettings(
            home=workdir / "broker",
            port=free_port(),
            controller_port=free_port(),
            kafka_version=defaults.kafka_version,
            jars_root=defaults.jars_root,
        )
        self.topics = Topics(f"chaos{settings.seed}x{int(time.time())}")
        self.components: list[Component] = []
        self.finished: set[str] = set()  # components that ended their work (exit 0)
        self.rows_in = 0

    # ---- the run -------------------------------------------------------------------

    def run(self) -> ChaosReport:
        started = time.monotonic()
        s = self.settings
        paths = write_datasets(self.workdir / "data", s.budget)
        paths = {d.name: paths[d.name] for d in s.datasets}
        plant_bad_rows(next(iter(paths.values())))
        self.rows_in = sum(len(valid_rows(name, path)[0]) for name, path in paths.items())
        bootstrap = broker.up(self.broker, self.topics.specs())
        port = free_port()
        sim = start_simulator(s, port, self.logs / "simulator.log")
        try:
            config = write_config(
                s, bootstrap, self.topics.namespace, f"http://127.0.0.1:{port}", paths
            )
            names = ["ledger", *(f"dispatch-{i}" for i in range(s.dispatchers)), "sink", "produce"]
            for name in names:
                kind = name.split("-")[0]
                component = Component(
                    name, cli_command(kind, "--config", str(config)), self.logs / f"{name}.log"
                )
                component.start()
                self.components.append(component)
            self._cycles()
            self._settle(bootstrap, paths)
            for component in self.components:
                self.report.exit_codes[component.name] = component.terminate()
        finally:
            for component in self.components:
                component.kill()
            sim.terminate(10)
        try:
            self._check(bootstrap, paths, self.workdir / "out")
        finally:
            broker.down(self.broker)
        self.report.seconds = time.monotonic() - started
        return self.report

    def _supervise(self) -> None:
        """Start again what exited on its own: a crash, unless it finished its work."""
        for component in self.components:
            code = component.exit_code()
            if code is None or component.name in self.finished:
                continue
            if code == 0 and component.kind == "produce":
                self.finished.add(component.name)  # every dataset read or halted
                continue
            self.report.crashes[component.name] += 1
            log.warning("%s exited with %s: starting it again", component.name, code)
            component.start()

    def _wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._supervise()
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))

    def _cycles(self) -> None:
        s = self.settings
        broker_cycle = s.cycles // 2 if s.broker_restart_cycle is None else s.broker_restart_cycle
        order: list[Component] = []
        for cycle in range(s.cycles):
            if not order:  # every component is hit once per round, in a random order
                order = list(self.components)
                self.rng.shuffle(order)
            victim = order.pop()
            self._wait(self.rng.uniform(*s.kill_gap_s))
            progress = self._progress()
            if progress is not None:
                self.report.progress_at_kills.append(progress)
            log.info("cycle %d: SIGKILL %s", cycle + 1, victim.name)
            victim.kill()
            self.finished.discard(victim.name)  # a finished producer is started again
            self.report.kills[victim.kind] += 1
            if cycle == broker_cycle:
                log.info("cycle %d: restarting the broker", cycle + 1)
                broker.down(self.broker)
                self.report.broker_restarts += 1
                broker.up(self.broker, self.topics.specs())
            time.sleep(self.rng.uniform(*s.restart_after_s))
            victim.start()

    def _progress(self) -> float | None:
        """Share of the valid rows that have an outcome, as the ledger last said."""
        try:
            snapshots = live_snapshots(self.broker.bootstrap, self.topics)
        except TokenBudgetError:
            return None
        done = sum(s.samples + s.skipped + s.failed for s in snapshots.values())
        return done / self.rows_in if self.rows_in else 1.0

    def _settle(self, bootstrap: str, paths: dict[str, Path]) -> None:
        """Wait until every valid row has an outcome in the ledger, the producer has
        finished and the sink has read every completion."""
        expected = {name: len(valid_rows(name, path)[0]) for name, path in paths.items()}
        deadline = time.monotonic() + self.settings.deadline_s
        lag = GroupLag(bootstrap)
        try:
            while time.monotonic() < deadline:
                self._wait(2.0)
                if "produce" not in self.finished:
                    continue
                snapshots = live_snapshots(bootstrap, self.topics)
                accounted = {
                    name: (s.samples + s.skipped + s.failed) if (s := snapshots.get(name)) else 0
                    for name in paths
                }
                if any(accounted[name] < expected[name] for name in paths):
                    continue
                group = f"{self.topics.namespace}-sink"
                if lag.lag(group, [self.topics.completions]) == 0:
                    return
            raise TokenBudgetError(
                f"the chaos run did not settle within {self.settings.deadline_s:.0f} s after its "
                f"last cycle; logs in {self.logs}"
            )
        finally:
            lag.close()

    # ---- the books -----------------------------------------------------------------

    def _check(self, bootstrap: str, paths: dict[str, Path], out: Path) -> None:
        report = self.report
        valid: dict[str, set[str]] = {}
        for name, path in paths.items():
            valid[name], bad = valid_rows(name, path)
            report.bad_rows += bad
        owner = {pid: name for name, ids in valid.items() for pid in ids}
        outcomes = outcome_records(bootstrap, self.topics)
        snapshots = live_snapshots(bootstrap, self.topics)

        rows = []
        for file in sorted(out.glob("dataset=*/*.parquet")):
            rows += pq.read_table(
                file, columns=["request_id", "prompt_id", "dataset", "completion_tokens"]
            ).to_pylist()
        request_ids = Counter(r["request_id"] for r in rows)
        prompt_ids = Counter(r["prompt_id"] for r in rows)
        report.duplicate_request_ids = sum(n - 1 for n in request_ids.values())
        report.duplicate_prompt_ids = sum(n - 1 for n in prompt_ids.values())
        completed = {pid for pid, outcome in outcomes.items() if outcome == "completed"}
        report.completed_not_in_parquet = len(completed - set(prompt_ids))
        report.parquet_not_completed = len(set(prompt_ids) - completed)
        report.unknown_outcomes = sum(1 for pid in outcomes if pid not in owner)

        letters = 0

        def count_letter(event: ev.Event) -> None:
            nonlocal letters
            letters += isinstance(event, ev.DeadLetter)

        read_to_end(bootstrap, self.topics.dead_letter, count_letter)
        report.dead_letters = letters

        for name in paths:
            books = DatasetBooks(budget=self.settings.budget, prompts_in=len(valid[name]))
            kinds = Counter(outcomes[pid] for pid in valid[name] if pid in outcomes)
            books.completed, books.skipped, books.failed = (
                kinds["completed"],
                kinds["skipped"],
                kinds["failed"],
            )
            books.lost = books.prompts_in - sum(kinds.values())
            snap = snapshots.get(name)
            if snap is not None:
                books.ledger_tokens, books.ledger_samples = snap.completion_tokens, snap.samples
            mine = [r for r in rows if r["dataset"] == name]
            books.parquet_rows = len(mine)
            books.parquet_tokens = sum(r["completion_tokens"] for r in mine)
            report.datasets[name] = books


def run_chaos(settings: ChaosSettings) -> ChaosReport:
    return Chaos(settings).run()


def report_json(report: ChaosReport) -> str:
    return json.dumps(
        {
            "ok": report.ok,
            "lost": report.lost,
            "duplicate_request_ids": report.duplicate_request_ids,
            "overshoot": report.overshoot,
            "kills": dict(report.kills),
            "broker_restarts": report.broker_restarts,
            "datasets": {name: vars(b) for name, b in report.datasets.items()},
        },
        indent=2,
    )
