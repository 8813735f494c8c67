"""``tokenbudget run``: producer, dispatchers, ledger and sink composed into one job.

The ledger runs as its own process (a Faust worker owns its event loop and signal
handlers); producer and dispatcher share one asyncio loop here and the sink runs in
a thread. The job ends when the pipeline is drained, judged from Kafka itself: the
producer is done, the dispatchers' group has committed the end of the prompts topic
(every prompt has an outcome), the ledger and the sink have read every completion,
and the ledger has published a snapshot of each dataset since.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec
from kafka.errors import KafkaError

from tokenbudget.app import identity, precedence, servers
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.interrupts import Interrupted, StopSignals
from tokenbudget.app.progress import Display, ProgressMode, choose_mode, display
from tokenbudget.core import lifetime, metrics, roles, sizes, tasks
from tokenbudget.core.config import ENV_PREFIX, Config, Unit, servers_environment
from tokenbudget.core.errors import ConfigError, TokenBudgetError, WorkerFailedError
from tokenbudget.core.kafka import GroupLag
from tokenbudget.core.retry import retry_until_async
from tokenbudget.core.security import subprocess_env
from tokenbudget.core.tasks import cancel_and_wait
from tokenbudget.producers.dispatch.dispatcher import Dispatcher
from tokenbudget.producers.dispatch.step import DispatchReport
from tokenbudget.producers.inference.backends import prepare
from tokenbudget.producers.prompts.datasets import check_datasets
from tokenbudget.producers.prompts.producer import ProduceReport, PromptProducer
from tokenbudget.sinks.parquet import ParquetSink, SinkSettings, stored_prompt_ids
from tokenbudget.sinks.reading import kept_completions
from tokenbudget.streams import budget
from tokenbudget.streams.budget_board import BudgetBoard, BudgetWatcher
from tokenbudget.streams.counts import DatasetCounts
from tokenbudget.streams.publisher import publish_events
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetResult(DatasetCounts):
    budget: int
    status: str  # "exhausted" | "halted"
    unit: Unit
    cut: int = 0  # answers kept that the budget's line cut (stop_reason "budget")

    @property
    def overshoot(self) -> int:
        return budget.overshoot(self.budget, budget.used(self))


@dataclass
class RunReport:
    datasets: dict[str, DatasetResult]
    produced: dict[str, ProduceReport] = field(default_factory=dict)
    dispatch: DispatchReport | None = None
    parquet_rows: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    halt_seen_at: dict[str, float | None] = field(default_factory=dict)
    # per dataset, when each dispatcher process first refused it (halt latency)
    refused_at: dict[str, list[float]] = field(default_factory=dict)
    restarts: list[Restart] = field(default_factory=list)  # children started again

    def already_done(self, dataset: str) -> int:
        """Prompts not produced because an earlier run of the namespace completed them."""
        report = self.produced.get(dataset)
        return report.already_done if report is not None else 0

    def bad_rows(self, dataset: str) -> int:
        """Rows of the dataset that are not prompts: dead-lettered and skipped."""
        report = self.produced.get(dataset)
        return report.bad_rows if report is not None else 0

    def to_json(self) -> dict[str, object]:
        return {
            "datasets": {
                name: {
                    "budget": r.budget,
                    "completion_tokens": r.completion_tokens,
                    "prompt_tokens": r.prompt_tokens,
                    "samples": r.samples,
                    "cut": r.cut,
                    "skipped": r.skipped,
                    "failed": r.failed,
                    "status": r.status,
                    "unit": r.unit,
                    "overshoot": r.overshoot,
                    "overshoot_percent": round(100.0 * r.overshoot / r.budget, 3)
                    if r.budget
                    else 0.0,
                    "already_done": self.already_done(name),
                    "bad_rows": self.bad_rows(name),
                }
                for name, r in self.datasets.items()
            },
            "failed": self.failed,
            "bad_rows": sum(self.bad_rows(name) for name in self.datasets),
            "already_done": sum(self.already_done(name) for name in self.datasets),
            "seconds": round(self.seconds, 3),
            "restarts": [vars(r) for r in self.restarts],
        }

    @property
    def failed(self) -> int:
        """Prompts that failed for good, over every dataset (``run`` then exits 3)."""
        return sum(r.failed for r in self.datasets.values())


def cli_command(*args: str) -> list[str]:
    """This tokenbudget, as a subprocess command line."""
    return [sys.executable, "-m", "tokenbudget", *args]


def start_ledger_process(
    bootstrap: str,
    namespace: str,
    snapshot_interval: float,
    metrics_port: int = 0,
    metrics_host: str = "127.0.0.1",
    compression: sizes.Compression = sizes.DEFAULT_COMPRESSION,
) -> subprocess.Popen[bytes]:
    command = cli_command(
        "ledger",
        "--bootstrap",
        bootstrap,
        "--namespace",
        namespace,
        "--snapshot-interval",
        str(snapshot_interval),
        "--metrics-host",
        metrics_host,
        "--metrics-port",
        str(metrics_port),
        "--compression",
        compression,
    )
    # Given only --bootstrap, the child learns the cluster's TLS/SASL from its env.
    return lifetime.spawn(command, env=subprocess_env(bootstrap))


def stop_process(process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    lifetime.stop(process, timeout)


@dataclass
class Restart:
    """A child of ``run`` that exited without being asked to, and was started again."""

    name: str
    pid: int
    code: int | None
    at: float


class Supervised:
    """A child process of ``run`` (the ledger, an extra dispatcher), started again
    whenever it exits without being asked to: killed from outside (the OOM killer, an
    operator), or ending itself to restart from what is durable (the ledger's 75). A
    child that keeps dying ends the run: ``max_restarts`` exits in a row, each within
    ``window_s`` of its start (a child that lived longer starts the count again). A
    child that crashes at start-up therefore ends the run however slowly it starts,
    while one killed now and then, after doing work, never does."""

    def __init__(
        self,
        name: str,
        start: Callable[[], subprocess.Popen[bytes]],
        *,
        max_restarts: int = 5,
        window_s: float = 60.0,
    ) -> None:
        self.name = name
        self._start = start
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.process = start()
        self.started_at = time.monotonic()
        self.short_lives = 0  # exits in a row within window_s of their start
        self.restarts: list[Restart] = []

    def check(self) -> Restart | None:
        code = self.process.poll()
        if code is None:
            return None
        lived = time.monotonic() - self.started_at
        self.short_lives = self.short_lives + 1 if lived < self.window_s else 0
        if self.short_lives > self.max_restarts:
            raise WorkerFailedError(
                f"the {self.name} exited {self.short_lives} times in a row, each within "
                f"{self.window_s:.0f} s of its start (last exit code {code}); see its "
                "messages above"
            )
        restart = Restart(self.name, self.process.pid, code, time.time())
        self.restarts.append(restart)
        log.warning(
            "the %s (pid %d) exited with code %s: starting it again",
            self.name,
            self.process.pid,
            code,
        )
        self.process = self._start()
        self.started_at = time.monotonic()
        return restart

    def stop(self, timeout: float = 30, signum: int = signal.SIGTERM) -> int | None:
        return lifetime.stop(self.process, timeout, signum)


class SupervisedGroup:
    """Several supervised children of one kind, checked and stopped together."""

    def __init__(self) -> None:
        self.children: list[Supervised] = []

    def check(self) -> list[Restart]:
        return [r for child in self.children if (r := child.check()) is not None]

    @property
    def restarts(self) -> list[Restart]:
        return [r for child in self.children for r in child.restarts]

    def stop(self, timeout: float = 30, signum: int = signal.SIGTERM) -> None:
        """``signum`` to all at once (they wind down side by side), then wait for each."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signum)
        for child in self.children:
            child.stop(timeout, signum)


class LedgerWorkers(SupervisedGroup):
    """``run --ledgers N``: N ``tokenbudget ledger`` processes in one Faust group,
    sharing the datasets by partition; a killed one's datasets move to the others
    (and back when it is started again).

    Metrics ports: ``run`` serves on P, the first ledger on P + 1 (it owns the budget
    gauges), extra dispatchers on P + 2 ... P + D, further ledgers after them."""

    def __init__(self, config: Config, bootstrap: str, count: int, dispatchers: int) -> None:
        super().__init__()
        if count < 1:
            raise ConfigError("--ledgers", f"must be >= 1, got {count}", source="command line")
        if count > config.kafka.partitions:
            log.warning(
                "%d ledger workers for %d partitions: %d of them will have nothing to do "
                "(raise [kafka] partitions for new topics)",
                count,
                config.kafka.partitions,
                count - config.kafka.partitions,
            )
        port = config.metrics.port
        for i in range(count):
            offset = ledger_port_offset(i, dispatchers)
            start = functools.partial(
                start_ledger_process,
                bootstrap,
                config.kafka.namespace,
                config.budget.snapshot_interval_s,
                port + offset if port else 0,
                config.metrics.host,
                config.kafka.compression,
            )
            self.children.append(
                Supervised("ledger worker" if count == 1 else f"ledger worker {i + 1}", start)
            )


class ExtraDispatchers(SupervisedGroup):
    """``run --dispatchers N``: N-1 ``tokenbudget dispatch`` processes beside the
    in-process one, all in the same consumer group, sharing budgets via leases."""

    def __init__(self, config: Config, count: int) -> None:
        super().__init__()
        self.config = config
        self.count = max(0, count)
        self.reports: list[Path] = []  # each child's, in the order of children
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        if self.count and not Path(config.source).is_file():
            raise ConfigError(
                "<file>",
                "--dispatchers > 1 needs a config loaded from a file",
                source=config.source,
            )

    def start(self) -> None:
        if not self.count:
            return
        self._folder = tempfile.TemporaryDirectory(prefix="tokenbudget-dispatch-")
        namespace = self.config.kafka.namespace
        for i in range(self.count):
            report = Path(self._folder.name) / f"dispatcher-{i}.json"
            command = cli_command(
                "dispatch",
                "--config",
                str(self.config.source),
                "--report",
                str(report),
                "--instance",
                Topics(namespace).dispatcher_instance(i + 1),
            )
            if self.config.metrics.port:
                port = self.config.metrics.port + dispatcher_port_offset(i)
                command += ["--metrics-port", str(port)]
            spawn = functools.partial(lifetime.spawn, command, env=self._environment())
            child = Supervised(f"dispatcher {i + 1}", spawn)
            self.children.append(child)
            self.reports.append(report)

    def _environment(self) -> dict[str, str]:
        """This process's environment, with its fleet (which ``--server`` or the
        environment may have changed from the file's)."""
        environment = {k: v for k, v in os.environ.items() if k != f"{ENV_PREFIX}INFERENCE__URL"}
        return {**environment, **servers_environment(self.config)}

    def finish(self, hand_back: bool = False) -> dict[str, list[float]]:
        """Stop them (with ``hand_back``, SIGINT: requests the server has not answered
        are handed back, not waited for), and say per dataset when each first refused
        it (their reports)."""
        self.stop(60, signal.SIGINT if hand_back else signal.SIGTERM)
        refused: dict[str, list[float]] = {}
        for report in self.reports:
            if report.exists():
                for dataset, at in json.loads(report.read_text())["refused_at"].items():
                    refused.setdefault(dataset, []).append(float(at))
        if self._folder is not None:
            self._folder.cleanup()
        return refused


async def publish_budgets(config: Config, bootstrap: str) -> list[precedence.BudgetChoice]:
    """Put each dataset's budget in force for a job: the config's, unless a value set
    with ``budget set`` holds (:mod:`tokenbudget.app.precedence`); say on stderr which
    one a dataset runs with, and why, when a set value was involved."""
    topics = Topics(config.kafka.namespace)
    latest = await asyncio.to_thread(precedence.latest_budget_sets, bootstrap, topics)
    chosen = precedence.choices(config, latest)
    events = [precedence.config_budget_set(config, c) for c in chosen if c.source == "config"]
    if events:
        await publish_events(bootstrap, topics.control, events, config.kafka.compression)
        metrics.EVENTS_PRODUCED.labels(topic="control").inc(len(events))
    for choice in chosen:
        if (line := choice.explain()) is not None:
            print(f"tokenbudget: {line}", file=sys.stderr)
    return chosen


async def _group_lag(bootstrap: str) -> GroupLag:
    """A lag reader, once Kafka answers (a broker restarting is waited out)."""
    return await retry_until_async(
        functools.partial(asyncio.to_thread, GroupLag, bootstrap),
        timeout=None,
        retry_on=KafkaError,
        interval=0.5,
        max_interval=5.0,
        on_retry=lambda exc: log.warning(
            "Kafka at %s does not answer (%r); trying again", bootstrap, exc
        ),
    )


async def _lag(lag: GroupLag, group: str, topics: list[str]) -> int | None:
    """The group's lag on ``topics``; None while Kafka does not answer."""
    try:
        return await asyncio.to_thread(lag.lag, group, topics)
    except KafkaError as exc:
        log.warning("reading the lag of %s failed (%r); trying again", group, exc)
        return None


async def _wait_drained(
    config: Config, bootstrap: str, producer: PromptProducer, watcher: BudgetWatcher
) -> float:
    topics = Topics(config.kafka.namespace)
    lag = await _group_lag(bootstrap)
    checks = [
        (topics.dispatch_group, [topics.prompts]),
        (topics.ledger_app_id, [topics.completions, topics.outcomes]),
    ]
    names = [d.name for d in config.datasets]
    try:
        while True:
            while not producer.settled():
                await asyncio.sleep(0.1)
            lags = [await _lag(lag, group, t) for group, t in checks]
            if any(n != 0 for n in lags):
                await asyncio.sleep(0.25)
                continue
            drained_at = time.time()
            await _snapshots_since(watcher, names, drained_at)
            # A budget raised meanwhile reopens its dataset: keep going.
            if producer.settled():
                return drained_at
    finally:
        lag.close()


async def _wait_ledger_applied(config: Config, bootstrap: str, watcher: BudgetWatcher) -> None:
    """Wait until the ledger has read every outcome published so far and has
    published a snapshot of each dataset since (the rows a stopped producer
    recorded as skipped belong in the report)."""
    topics = Topics(config.kafka.namespace)
    lag = await _group_lag(bootstrap)
    try:
        sources = [topics.completions, topics.outcomes]
        while await _lag(lag, topics.ledger_app_id, sources) != 0:
            await asyncio.sleep(0.25)
    finally:
        lag.close()
    await _snapshots_since(watcher, [d.name for d in config.datasets], time.time())


async def _snapshots_since(watcher: BudgetWatcher, names: list[str], since: float) -> None:
    """Wait until the ledger has published a snapshot of each dataset after ``since``."""
    while not all((s := watcher.board.snapshot(n)) is not None and s.at > since for n in names):
        await asyncio.sleep(0.1)


async def _wait_for_members(
    bootstrap: str, group: str, expected: int, timeout: float = 300
) -> None:
    """Wait for ``expected`` members in ``group`` (run under :func:`supervise`, so a
    dispatcher that ended meanwhile is started again)."""
    lag = await _group_lag(bootstrap)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if await asyncio.to_thread(lag.members, group) >= expected:
                    return
            except KafkaError as exc:
                log.warning("reading the members of %s failed (%r); trying again", group, exc)
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"only some of {expected} dispatchers joined {group}")
            await asyncio.sleep(0.25)
    finally:
        lag.close()


async def run_async(
    config: Config,
    *,
    bootstrap: str | None = None,
    ledger_process: bool = True,
    keep_dispatch_log: bool = False,
    progress: ProgressMode = "off",
    dispatchers: int = 1,
    ledgers: int = 1,
    resume_changed: bool = False,
    stop: StopSignals | None = None,
    on_start: Callable[[], object] | None = None,
) -> RunReport:
    """Run a job; ``stop``: the signals that stop it in order (see
    :mod:`tokenbudget.app.interrupts`), installed by the caller. ``on_start`` is
    called (in a thread) once the job can start, Kafka and the server having
    answered: ``run`` prints its plan."""
    started = time.monotonic()
    # What the config and the datasets' first rows can tell is told before anything
    # starts: no broker, no server touched for a job that cannot run.
    await asyncio.to_thread(check_datasets, config)
    # Tokenizer loaded; servers and model checked before anything runs (one up will do).
    checks = await prepare(config)
    if len(checks) > 1 or not all(check.up for check in checks):
        print(servers.start_table(checks), file=sys.stderr)
    if bootstrap is None:
        bootstrap = await asyncio.to_thread(resolve_bootstrap, config)
    # Is this the namespace's job? Settled before anything is published or started.
    await identity.settle(config, bootstrap, resume_changed=resume_changed, command="run")
    # Once Kafka answered: a job that cannot start says only why (one line).
    config = serve_metrics(config, dispatchers, ledgers if ledger_process else 0)
    if on_start is not None:
        await asyncio.to_thread(on_start)
    topics = Topics(config.kafka.namespace)
    for dataset in config.datasets:
        metrics.OVERSHOOT_ALLOWANCE.labels(dataset=dataset.name).set(
            budget.overshoot_allowance(
                config.budget.unit,
                config.budget.admission,
                config.concurrency,
                dataset.max_new_tokens,
                dispatchers,
            )
        )
    lag_sampler = metrics.LagSampler(
        bootstrap,
        {
            topics.dispatch_group: [topics.prompts],
            topics.ledger_app_id: [topics.completions, topics.outcomes],
            topics.sink_group: [topics.completions],
        },
    )
    if config.metrics.port:
        lag_sampler.start()
    await publish_budgets(config, bootstrap)
    ledger = LedgerWorkers(config, bootstrap, ledgers, dispatchers) if ledger_process else None
    try:
        return await _run_components(
            config,
            bootstrap,
            topics,
            ledger,
            started,
            keep_dispatch_log,
            progress,
            dispatchers,
            stop,
        )
    finally:
        if stop is not None:
            stop.stopping()
        await asyncio.to_thread(lag_sampler.stop)
        if ledger is not None:
            await asyncio.to_thread(ledger.stop)


def _ports_free(host: str, ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                return False
    return True


def ledger_port_offset(index: int, dispatchers: int) -> int:
    """Metrics port of ``run``'s ledger worker ``index``, from ``run``'s own: the
    first on + 1 (it owns the budget gauges), the others after the extra dispatchers
    (which take + 2 to + dispatchers)."""
    return 1 if index == 0 else max(1, dispatchers) + index


def dispatcher_port_offset(index: int) -> int:
    """Metrics port of ``run``'s extra dispatcher ``index`` (0-based), from its own."""
    return 2 + index


def _metrics_offsets(dispatchers: int, ledgers: int) -> list[int]:
    extra = [dispatcher_port_offset(i) for i in range(max(0, dispatchers - 1))]
    return [0, *(ledger_port_offset(i, dispatchers) for i in range(ledgers)), *extra]


def serve_metrics(config: Config, dispatchers: int, ledgers: int) -> Config:
    """Serve ``run``'s /metrics on ``[metrics] port``, or on the next block of free
    ports when another job holds it (its ledgers and extra dispatchers take the ports
    after it); say where on stderr. Returns the config with the port taken."""
    wanted = config.metrics.port
    if not wanted:
        return config
    offsets = _metrics_offsets(dispatchers, ledgers)
    span = max(offsets) + 1
    host = config.metrics.host
    for base in range(wanted, wanted + 16 * span, span):
        ours = metrics.serving(host, base)  # a run before this one in this process
        wanted_free = [base + o for o in offsets if o or not ours]
        if base + span <= 65536 and _ports_free(host, wanted_free):
            break
    else:
        raise ConfigError(
            "metrics.port",
            f"no {span} free ports from {wanted} on {host}; set another port, or 0 for none",
            source=config.source,
        )
    metrics.serve(host, base, config.kafka.namespace, "run")
    moved = "" if base == wanted else f" ({wanted} is taken)"
    others = (
        f", its ledger on {base + 1}"
        if span == 2
        else f", its workers on {base + 1} to {base + span - 1}"
        if span > 2
        else ""
    )
    print(f"tokenbudget: metrics on http://{host}:{base}/metrics{moved}{others}", file=sys.stderr)
    return msgspec.structs.replace(
        config, metrics=msgspec.structs.replace(config.metrics, port=base)
    )


class _Child(Protocol):
    def check(self) -> object: ...


async def supervise(
    drain: asyncio.Task[Any], workers: dict[str, asyncio.Task[Any]], children: list[_Child]
) -> None:
    """Wait for ``drain``, failing as soon as an in-process worker (by its role's
    name) fails, and starting again a child process that ended (cancelling ``drain``
    if it fails). A worker's error of ours is raised as it is (its line says what to
    fix); any other is raised as the role that stopped and why."""
    names = {task: name for name, task in workers.items()}
    pending: set[asyncio.Task[Any]] = {drain, *workers.values()}
    try:
        while not drain.done():
            done, pending = await asyncio.wait(
                pending, timeout=1.0, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                if task is drain or (exc := task.exception()) is None:
                    continue
                if isinstance(exc, TokenBudgetError):
                    raise exc
                raise WorkerFailedError(
                    f"the {names[task]} stopped: {type(exc).__name__}: {exc}"
                ) from exc
            for child in children:
                child.check()
    finally:
        drain.cancel()
    drain.result()


def _results(config: Config, board: BudgetBoard) -> dict[str, DatasetResult]:
    results = {}
    for dataset in config.datasets:
        snap = board.snapshot(dataset.name)
        assert snap is not None
        results[dataset.name] = DatasetResult.of(
            snap,
            budget=snap.budget or dataset.budget,
            status="halted" if snap.halted else "exhausted",
            unit=snap.unit,
            cut=snap.cut,
        )
    return results


@dataclass
class _InProcess:
    """What ``run`` runs in this process beside the producer: the budget watcher
    (with the progress bars), the sink's thread and the first dispatcher. Started by
    :func:`_start_in_process`, stopped by :func:`_stop_in_process`."""

    watcher: BudgetWatcher
    watch_task: asyncio.Task[None]
    bars: Display | None
    sink: SinkThread
    dispatcher: Dispatcher
    dispatch_stop: asyncio.Event
    dispatch_task: asyncio.Task[DispatchReport]


async def _start_in_process(
    config: Config,
    bootstrap: str,
    topics: Topics,
    keep_dispatch_log: bool,
    progress: ProgressMode,
) -> _InProcess:
    """Start the watcher and wait until it has read the budgets and control topics
    (so the board is current before anything is admitted), then the bars, the sink
    and the dispatcher."""
    # The bars show the fleet as its dispatchers report it.
    watcher = BudgetWatcher(bootstrap, topics, fleet_reports=progress != "off")
    await watcher.start()
    watch_task = asyncio.create_task(watcher.run())
    await watcher.caught_up.wait()
    bars = display(progress, config, watcher.board)
    if bars is not None:
        bars.start()

    # Each part logs in to Kafka as its role's principal ([[kafka.roles]]): a task
    # keeps the context it was created in, a thread is given its role inside.
    sink = SinkThread(ParquetSink(bootstrap, topics, SinkSettings.from_config(config)))

    with roles.acting_as("dispatcher"):
        dispatcher = Dispatcher(
            config,
            bootstrap,
            watcher.board,
            keep_log=keep_dispatch_log,
            instance=topics.dispatcher_instance(0),
        )
        dispatch_stop = asyncio.Event()
        dispatch_task = asyncio.create_task(dispatcher.run(dispatch_stop))
    return _InProcess(
        watcher,
        watch_task,
        bars,
        sink,
        dispatcher,
        dispatch_stop,
        dispatch_task,
    )


class SinkThread:
    """``run``'s Parquet sink, in a thread of its own (it logs in as the sink's
    role). :meth:`check`, called with the children's, ends the run with one line
    naming where it was and why when the sink stopped on its own: its files and
    offsets stop there, so the run must not go on as if it were keeping answers."""

    def __init__(self, sink: ParquetSink) -> None:
        self.sink = sink
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="sink", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with roles.acting_as("sink"):
            try:
                self.sink.run(self.stop)
            except BaseException as exc:
                log.debug("the sink stopped", exc_info=True)
                self.error = exc

    def check(self) -> None:
        if self.thread.is_alive() or (self.stop.is_set() and self.error is None):
            return
        reason = f"{type(self.error).__name__}: {self.error}" if self.error else "it returned"
        raise WorkerFailedError(f"the Parquet sink stopped {self.sink.where()}: {reason}")

    def finish(self, timeout: float = 120) -> None:
        """Stop it once it has read to the end of the completions topic (see
        :meth:`ParquetSink.run`), and raise as :meth:`check` if it failed."""
        self.stop.set()
        self.thread.join(timeout)
        self.check()


@dataclass
class _Producing:
    """The prompt producer, running as a task until ``stop`` (or ``interrupt``) is set."""

    producer: PromptProducer
    stop: asyncio.Event
    task: asyncio.Task[dict[str, ProduceReport]]
    interrupt: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def start(cls, config: Config, bootstrap: str, board: BudgetBoard) -> _Producing:
        with roles.acting_as("producer"):
            producer = PromptProducer(
                config,
                bootstrap,
                board,
                stored_prompt_ids=stored_prompt_ids(config),
                kept_completions=functools.partial(
                    kept_completions, bootstrap, Topics(config.kafka.namespace)
                ),
            )
            stop, interrupt = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(producer.run(stop, interrupt))
        return cls(producer, stop, task, interrupt)

    async def end(self) -> None:
        """If it still runs (the job is stopped early), stop it: what it sent is
        flushed, the rows it has not read are left for the rerun."""
        self.interrupt.set()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await self.task


async def _produce_until_drained(
    config: Config,
    bootstrap: str,
    producing: _Producing,
    running: _InProcess,
    children: list[_Child],
) -> dict[str, ProduceReport]:
    """Wait (under :func:`supervise`) until the pipeline is drained, stop the
    producer and return its reports; if it left rows unsent, wait until the ledger
    has applied their outcomes too."""
    watcher = running.watcher
    drain = asyncio.create_task(_wait_drained(config, bootstrap, producing.producer, watcher))
    workers = {"prompt producer": producing.task, "dispatcher": running.dispatch_task}
    await supervise(drain, workers, children)
    producing.stop.set()
    produced = await producing.task
    if any(report.not_sent for report in produced.values()):
        # The ledger may die here too: it is started again while we wait for it.
        applied = asyncio.create_task(_wait_ledger_applied(config, bootstrap, watcher))
        await supervise(applied, {"dispatcher": running.dispatch_task}, children)
    return produced


def _refusals(
    extra_refused: dict[str, list[float]],
    refused_here: dict[str, float],
    board: BudgetBoard,
) -> dict[str, list[float]]:
    """When each dispatcher first refused each dataset: the extra dispatchers'
    times (``extra_refused``, extended in place), this process's dispatcher's, and
    for a dataset it never refused but saw halted, the time the halt was seen."""
    refused = extra_refused
    for refused_name, at in refused_here.items():
        refused.setdefault(refused_name, []).append(at)
    for name, view in board.views.items():
        if view.halted_at is not None and name not in refused_here:
            refused.setdefault(name, []).append(view.halted_at)
    return refused


async def _stop_in_process(
    running: _InProcess, extra: ExtraDispatchers, hand_back: bool = False
) -> dict[str, list[float]]:
    """Stop the dispatchers (this one, then the extra processes; with ``hand_back``,
    giving up the requests the server has not answered), the sink (it reads to the
    end of the completions topic first), the bars and the watcher, in that order;
    return when they refused each dataset (:func:`_refusals`)."""
    if hand_back:
        running.dispatcher.hand_back()
    running.dispatch_stop.set()
    with contextlib.suppress(Exception):
        await running.dispatch_task
    extra_refused = await asyncio.to_thread(extra.finish, hand_back)
    refused = _refusals(extra_refused, running.dispatcher.refused_at, running.watcher.board)
    await asyncio.to_thread(running.sink.finish)
    if running.bars is not None:
        await running.bars.stop()
    await cancel_and_wait(running.watch_task, ignore_errors=True)
    await running.watcher.stop()
    return refused


async def _run_components(
    config: Config,
    bootstrap: str,
    topics: Topics,
    ledger: LedgerWorkers | None,
    started: float,
    keep_dispatch_log: bool = False,
    progress: ProgressMode = "off",
    dispatchers: int = 1,
    stop: StopSignals | None = None,
) -> RunReport:
    extra = ExtraDispatchers(config, dispatchers - 1)
    running = await _start_in_process(config, bootstrap, topics, keep_dispatch_log, progress)
    children: list[_Child] = (
        [extra, running.sink] if ledger is None else [ledger, extra, running.sink]
    )
    producing: _Producing | None = None
    try:
        extra.start()
        if extra.count:
            # Prompts handed out before every dispatcher joined would move at the
            # rebalance and be generated twice: wait for the group to settle first.
            group = running.dispatcher.group_id
            joined = _wait_for_members(bootstrap, group, extra.count + 1)
            await supervise(
                asyncio.create_task(joined), {"dispatcher": running.dispatch_task}, children
            )
        producing = _Producing.start(config, bootstrap, running.watcher.board)
        produced = await _produce_until_drained(config, bootstrap, producing, running, children)
    finally:
        interrupted = stop is not None and stop.requested
        if stop is not None:
            stop.stopping()
        if producing is not None:
            await producing.end()
        refused = await _stop_in_process(running, extra, hand_back=interrupted)

    board = running.watcher.board
    return RunReport(
        datasets=_results(config, board),
        produced=produced,
        dispatch=running.dispatcher.report,
        parquet_rows=dict(running.sink.sink.rows_written),
        seconds=time.monotonic() - started,
        halt_seen_at={d.name: board.view(d.name).halted_at for d in config.datasets},
        refused_at=refused,
        restarts=[*(ledger.restarts if ledger is not None else []), *extra.restarts],
    )


def run(
    config: Config,
    *,
    progress: ProgressMode | bool | None = None,
    dispatchers: int = 1,
    ledgers: int = 1,
    resume_changed: bool = False,
    on_start: Callable[[], object] | None = None,
) -> RunReport:
    """Run ``config``, showing its progress (:mod:`tokenbudget.app.progress`): by
    default bars on a terminal and lines otherwise; True: bars, False: nothing.
    ``resume_changed`` resumes its namespace even when the job differs from the one
    recorded there (:mod:`.identity`); ``on_start``: see :func:`run_async`."""
    logging.basicConfig(level=logging.WARNING)  # no-op once the CLI configured logging
    mode: ProgressMode
    if progress is None:
        mode = choose_mode()
    elif isinstance(progress, bool):
        mode = "live" if progress else "off"
    else:
        mode = progress
    return tasks.run(
        _run_until_stopped(
            config,
            progress=mode,
            dispatchers=dispatchers,
            ledgers=ledgers,
            resume_changed=resume_changed,
            on_start=on_start,
        )
    )


async def _run_until_stopped(config: Config, **options: Any) -> RunReport:
    """:func:`run_async`, stopped in order by SIGINT or SIGTERM: then it raises
    :class:`~tokenbudget.app.interrupts.Interrupted`."""
    stop = StopSignals()
    stop.install()
    try:
        return await run_async(config, stop=stop, **options)
    except asyncio.CancelledError:
        if stop.signum is None:
            raise
        raise Interrupted(stop.signum) from None
    finally:
        stop.uninstall()
