"""Each role of a job wired from its config, in one place: the prompt producer, a
dispatcher and the Parquet sink, with the budget watcher whose board they read.
``run`` builds all three in one process (one board, each part logging in as its
role); ``tokenbudget produce``, ``dispatch`` and ``sink`` build one each (their
process plays the role, :func:`tokenbudget.core.roles.play`).

What differs between those callers is a parameter here: ``login``, the role a
part's clients log in as when its process plays several (``run``; None: the
process's own), and the standalone commands' signal handling (``interrupt``,
``signals``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenbudget.core import roles
from tokenbudget.core.config import Config
from tokenbudget.core.roles import Role
from tokenbudget.core.tasks import cancel_and_wait
from tokenbudget.producers.dispatch.dispatcher import Dispatcher
from tokenbudget.producers.dispatch.step import DispatchReport
from tokenbudget.producers.prompts.producer import ProduceReport, PromptProducer
from tokenbudget.sinks.parquet import ParquetSink, SinkSettings, stored_prompt_ids
from tokenbudget.sinks.reading import kept_completions
from tokenbudget.streams.budget_board import BudgetBoard, BudgetWatcher
from tokenbudget.streams.topics import Topics


@contextlib.contextmanager
def logged_in_as(login: Role | None) -> Iterator[None]:
    """Clients built inside (and in the tasks created inside) log in as ``login``;
    None: as the process plays. A task keeps the context it was created in, so a
    part's task is created inside; a thread does not, so it enters this itself."""
    if login is None:
        yield
        return
    with roles.acting_as(login):
        yield


@dataclass
class Watching:
    """The budget watcher feeding a board from the budgets and control topics, as a
    task until :meth:`stop`."""

    watcher: BudgetWatcher
    task: asyncio.Task[None]

    @property
    def board(self) -> BudgetBoard:
        return self.watcher.board

    async def stop(self) -> None:
        await cancel_and_wait(self.task, ignore_errors=True)
        await self.watcher.stop()


async def start_watcher(bootstrap: str, topics: Topics, *, fleet_reports: bool = False) -> Watching:
    """The job's budget watcher, started (``fleet_reports``: it also reads the
    dispatchers' reports of the fleet, which ``run``'s progress shows). Wait for its
    ``watcher.caught_up`` before the board is to be current."""
    watcher = BudgetWatcher(bootstrap, topics, fleet_reports=fleet_reports)
    await watcher.start()
    return Watching(watcher, asyncio.create_task(watcher.run()))


@dataclass
class Producing:
    """The prompt producer, running as a task until ``stop`` (or ``interrupt``) is set."""

    producer: PromptProducer
    task: asyncio.Task[dict[str, ProduceReport]]
    stop: asyncio.Event | None
    interrupt: asyncio.Event = field(default_factory=asyncio.Event)

    async def end(self) -> None:
        """If it still runs (the job is stopped early), stop it: what it sent is
        flushed, the rows it has not read are left for the rerun."""
        self.interrupt.set()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await self.task


def start_producer(
    config: Config,
    bootstrap: str,
    board: BudgetBoard,
    *,
    login: Role | None = None,
    hold_halted: bool = False,
    interrupt: asyncio.Event | None = None,
) -> Producing:
    """The prompt producer of ``config``'s job, reading budgets from ``board``, as a
    task: it skips the prompts already in the sink's files and resumes regenerated
    conversations from the completions kept. ``hold_halted``: a halted dataset waits
    for a raise until ``stop`` is set (``run``, which sets it once drained); else it
    ends there. ``interrupt`` ends it early (a standalone command's signals set it;
    by default :meth:`Producing.end` does)."""
    with logged_in_as(login):
        producer = PromptProducer(
            config,
            bootstrap,
            board,
            stored_prompt_ids=stored_prompt_ids(config),
            kept_completions=functools.partial(
                kept_completions, bootstrap, Topics(config.kafka.namespace)
            ),
        )
        stop = asyncio.Event() if hold_halted else None
        interrupt = asyncio.Event() if interrupt is None else interrupt
        task = asyncio.create_task(producer.run(stop, interrupt))
    return Producing(producer, task, stop, interrupt)


@dataclass
class Dispatching:
    """A dispatcher, running as a task until ``stop`` is set."""

    dispatcher: Dispatcher
    task: asyncio.Task[DispatchReport]
    stop: asyncio.Event

    def hand_back(self) -> None:
        """Stop it without waiting for the server: the answers it has are published,
        the requests still at the server handed back to the group."""
        self.dispatcher.hand_back()
        self.stop.set()

    async def finish(self, hand_back: bool = False) -> None:
        """Stop it (with ``hand_back``, as :meth:`hand_back`; else once the requests
        it started are answered) and wait for it; an error it ended with is the
        supervisor's to have reported."""
        if hand_back:
            self.hand_back()
        self.stop.set()
        with contextlib.suppress(Exception):
            await self.task


def start_dispatcher(
    config: Config,
    bootstrap: str,
    board: BudgetBoard,
    *,
    instance: str | None = None,
    keep_log: bool = False,
    login: Role | None = None,
    signals: bool = False,
) -> Dispatching:
    """A dispatcher of ``config``'s job, reading budgets from ``board``, as a task;
    ``instance``: its static group membership (None: a dynamic member); ``keep_log``
    keeps every request in its report. ``signals``: the standalone dispatcher's
    handlers, SIGTERM stops it once its requests are answered, SIGINT hands them
    back (``run`` stopped by Ctrl-C sends it that)."""
    with logged_in_as(login):
        dispatcher = Dispatcher(config, bootstrap, board, keep_log=keep_log, instance=instance)
        stop = asyncio.Event()
        dispatching = Dispatching(dispatcher, asyncio.create_task(dispatcher.run(stop)), stop)
    if signals:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, dispatching.hand_back)
    return dispatching


def build_sink(config: Config, bootstrap: str) -> ParquetSink:
    """The Parquet sink of ``config``'s job; it builds its clients when it runs, so
    whoever runs it gives it its login (``run``'s sink thread)."""
    return ParquetSink(bootstrap, Topics(config.kafka.namespace), SinkSettings.from_config(config))
