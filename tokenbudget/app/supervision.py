"""How ``run`` watches what it started, and ends with one line when a part stops:
a child process (the ledger workers, the extra dispatchers) is started again when it
exits unasked, until it keeps dying (:class:`Supervised`); an in-process task that
fails ends the run naming its role (:func:`supervise`); the sink's thread that stops
on its own ends it naming where it was (:class:`SinkThread`)."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenbudget.app.assembly import logged_in_as
from tokenbudget.core import lifetime
from tokenbudget.core.errors import TokenBudgetError, WorkerFailedError
from tokenbudget.core.roles import Role
from tokenbudget.sinks.parquet import ParquetSink

log = logging.getLogger(__name__)


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


class Child(Protocol):
    def check(self) -> object: ...


async def supervise(
    drain: asyncio.Task[Any], workers: dict[str, asyncio.Task[Any]], children: list[Child]
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


class SinkThread:
    """``run``'s Parquet sink, in a thread of its own, its clients logged in as
    ``login`` (see :func:`~tokenbudget.app.assembly.logged_in_as`: a thread does not
    inherit the role its creator acts as). :meth:`check`, called with the children's,
    ends the run with one line naming where it was and why when the sink stopped on
    its own: its files and offsets stop there, so the run must not go on as if it
    were keeping answers."""

    def __init__(self, sink: ParquetSink, *, login: Role | None = None) -> None:
        self.sink = sink
        self.login = login
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="sink", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with logged_in_as(self.login):
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
