"""How ``run`` stops when asked from outside: Ctrl-C (SIGINT), or SIGTERM (``kill``, a
batch scheduler at the end of a time limit).

Contract:

* The first signal is a request to stop in order, and ``run`` says so at once in one
  line on stderr. Whatever it was waiting for is cancelled (starting up, the job
  running); the stop itself is not: the producer stops reading, the dispatchers
  publish the answers they hold and hand back the requests still at the server (their
  prompts stay uncommitted on the prompts topic, for the rerun), the sink writes its
  files and commits, the ledger stops. ``run`` then ends with :class:`Interrupted`:
  exit code 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
* A second signal ends ``run`` at once (``os._exit``). Its children get SIGTERM from
  the kernel as it ends (:mod:`tokenbudget.core.lifetime`); what was not committed is taken
  over by the rerun, as after a SIGKILL.
* A signal ignored when ``run`` started stays ignored (``cmd &`` in a script: the
  shell asks that Ctrl-C in its terminal not reach it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """``run`` was stopped in order by a signal."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """SIGINT and SIGTERM, for the task that runs a job (see the module)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._task: asyncio.Task[object] | None = None
        self._stopping = False
        self._installed: list[int] = []

    def install(self) -> None:
        """Handle them in the running loop, for the current task."""
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_IGN:
                continue
            loop.add_signal_handler(signum, self._received, signum)
            self._installed.append(signum)

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in self._installed:
            loop.remove_signal_handler(signum)
        self._installed = []

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stopping(self) -> None:
        """The job is being stopped in order from here on: a signal no longer cancels
        what the task awaits (a second one still ends the process)."""
        self._stopping = True

    def _received(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            _say(f"{name} again: exiting now; rerun the same command to resume")
            os._exit(128 + signum)
        self.signum = signum
        _say(
            f"interrupted ({name}): stopping (in-flight requests handed back, output "
            f"flushed; {name} again exits at once); rerun the same command to resume"
        )
        if not self._stopping and self._task is not None:
            self._task.cancel()


def _say(line: str) -> None:
    print(f"tokenbudget: {line}", file=sys.stderr, flush=True)
