"""``tokenbudget run``: producer, dispatchers, ledger and sink composed into one job.

The ledger runs as its own process (a Faust worker owns its event loop and signal
handlers); producer and dispatcher share one asyncio loop here and the sink runs in
a thread, each built by :mod:`tokenbudget.app.assembly` and logging in as its role.
The job ends when the pipeline is drained, judged from Kafka itself
(:mod:`tokenbudget.app.drain`); its children are supervised
(:mod:`tokenbudget.app.supervision`, :mod:`tokenbudget.app.children`) and what it
did is told in a :class:`~tokenbudget.app.run_report.RunReport`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenbudget.app import identity, servers
from tokenbudget.app.assembly import (
    Dispatching,
    Producing,
    Watching,
    build_sink,
    start_dispatcher,
    start_producer,
    start_watcher,
)
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.children import ExtraDispatchers, LedgerWorkers
from tokenbudget.app.control import publish_budgets
from tokenbudget.app.drain import wait_drained, wait_for_members, wait_ledger_applied
from tokenbudget.app.interrupts import Interrupted, StopSignals
from tokenbudget.app.progress import Display, ProgressMode, choose_mode, display
from tokenbudget.app.run_metrics import serve_metrics, set_overshoot_allowances, start_lag_sampler
from tokenbudget.app.run_report import RunReport, dataset_results, refusals
from tokenbudget.app.supervision import Child, SinkThread, supervise
from tokenbudget.core import tasks
from tokenbudget.core.config import Config
from tokenbudget.producers.inference.backends import prepare
from tokenbudget.producers.prompts.dataset_checks import check_datasets
from tokenbudget.producers.prompts.producer import ProduceReport
from tokenbudget.streams.topics import Topics


@dataclass
class _InProcess:
    """What ``run`` runs in this process beside the producer: the budget watcher
    (with the progress bars), the sink's thread and the first dispatcher. Started by
    :func:`_start_in_process`, stopped by :func:`_stop_in_process`."""

    watching: Watching
    bars: Display | None
    sink: SinkThread
    dispatching: Dispatching


async def _start_in_process(
    config: Config,
    bootstrap: str,
    topics: Topics,
    keep_dispatch_log: bool,
    progress: ProgressMode,
) -> _InProcess:
    """Start the watcher and wait until it has read the budgets and control topics
    (so the board is current before anything is admitted), then the bars, the sink
    and the dispatcher, each logging in as its role's principal ([[kafka.roles]])."""
    # The bars show the fleet as its dispatchers report it.
    watching = await start_watcher(bootstrap, topics, fleet_reports=progress != "off")
    await watching.watcher.caught_up.wait()
    bars = display(progress, config, watching.board)
    if bars is not None:
        bars.start()
    sink = SinkThread(build_sink(config, bootstrap), login="sink")
    dispatching = start_dispatcher(
        config,
        bootstrap,
        watching.board,
        instance=topics.dispatcher_instance(0),
        keep_log=keep_dispatch_log,
        login="dispatcher",
    )
    return _InProcess(watching, bars, sink, dispatching)


async def _produce_until_drained(
    config: Config,
    bootstrap: str,
    producing: Producing,
    running: _InProcess,
    children: list[Child],
) -> dict[str, ProduceReport]:
    """Wait (under :func:`supervise`) until the pipeline is drained, stop the
    producer and return its reports; if it left rows unsent, wait until the ledger
    has applied their outcomes too."""
    watcher = running.watching.watcher
    dispatch_task = running.dispatching.task
    drain = asyncio.create_task(wait_drained(config, bootstrap, producing.producer, watcher))
    workers = {"prompt producer": producing.task, "dispatcher": dispatch_task}
    await supervise(drain, workers, children)
    assert producing.stop is not None  # held halted datasets until now
    producing.stop.set()
    produced = await producing.task
    if any(report.not_sent for report in produced.values()):
        # The ledger may die here too: it is started again while we wait for it.
        applied = asyncio.create_task(wait_ledger_applied(config, bootstrap, watcher))
        await supervise(applied, {"dispatcher": dispatch_task}, children)
    return produced


async def _stop_in_process(
    running: _InProcess, extra: ExtraDispatchers, hand_back: bool = False
) -> dict[str, list[float]]:
    """Stop the dispatchers (this one, then the extra processes; with ``hand_back``,
    giving up the requests the server has not answered), the sink (it reads to the
    end of the completions topic first), the bars and the watcher, in that order;
    return when they refused each dataset (:func:`.run_report.refusals`)."""
    await running.dispatching.finish(hand_back)
    extra_refused = await asyncio.to_thread(extra.finish, hand_back)
    dispatcher = running.dispatching.dispatcher
    refused = refusals(extra_refused, dispatcher.refused_at, running.watching.board)
    await asyncio.to_thread(running.sink.finish)
    if running.bars is not None:
        await running.bars.stop()
    await running.watching.stop()
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
    children: list[Child] = (
        [extra, running.sink] if ledger is None else [ledger, extra, running.sink]
    )
    producing: Producing | None = None
    try:
        extra.start()
        if extra.count:
            # Prompts handed out before every dispatcher joined would move at the
            # rebalance and be generated twice: wait for the group to settle first.
            group = running.dispatching.dispatcher.group_id
            joined = wait_for_members(bootstrap, group, extra.count + 1)
            await supervise(
                asyncio.create_task(joined), {"dispatcher": running.dispatching.task}, children
            )
        producing = start_producer(
            config, bootstrap, running.watching.board, login="producer", hold_halted=True
        )
        produced = await _produce_until_drained(config, bootstrap, producing, running, children)
    finally:
        interrupted = stop is not None and stop.requested
        if stop is not None:
            stop.stopping()
        if producing is not None:
            await producing.end()
        refused = await _stop_in_process(running, extra, hand_back=interrupted)

    board = running.watching.board
    return RunReport(
        datasets=dataset_results(config, board),
        produced=produced,
        dispatch=running.dispatching.dispatcher.report,
        parquet_rows=dict(running.sink.sink.rows_written),
        seconds=time.monotonic() - started,
        halt_seen_at={d.name: board.view(d.name).halted_at for d in config.datasets},
        refused_at=refused,
        restarts=[*(ledger.restarts if ledger is not None else []), *extra.restarts],
    )


async def _checked_start(config: Config, bootstrap: str | None, resume_changed: bool) -> str:
    """What the config and the datasets' first rows can tell is told before anything
    starts (no broker, no server touched for a job that cannot run); then the
    tokenizer, the servers and the model (one up will do), the broker, and whether
    this is the namespace's job. Returns the broker's address."""
    await asyncio.to_thread(check_datasets, config)
    checks = await prepare(config)
    if len(checks) > 1 or not all(check.up for check in checks):
        print(servers.start_table(checks), file=sys.stderr)
    if bootstrap is None:
        bootstrap = await asyncio.to_thread(resolve_bootstrap, config)
    # Settled before anything is published or started.
    await identity.settle(config, bootstrap, resume_changed=resume_changed, command="run")
    return bootstrap


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
    bootstrap = await _checked_start(config, bootstrap, resume_changed)
    # Once Kafka answered: a job that cannot start says only why (one line).
    config = serve_metrics(config, dispatchers, ledgers if ledger_process else 0)
    if on_start is not None:
        await asyncio.to_thread(on_start)
    set_overshoot_allowances(config, dispatchers)
    lag_sampler = start_lag_sampler(config, bootstrap)
    await publish_budgets(config, bootstrap)
    ledger = LedgerWorkers(config, bootstrap, ledgers, dispatchers) if ledger_process else None
    try:
        return await _run_components(
            config,
            bootstrap,
            Topics(config.kafka.namespace),
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
