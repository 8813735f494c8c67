"""How ``run`` takes SIGINT and SIGTERM: the first asks for a stop in order (one line,
what it awaits cancelled unless it is stopping already), a second exits at once, and
a signal ignored at start stays ignored."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tokenbudget.app.interrupts import Interrupted, StopSignals


async def signalled(stop: StopSignals, signum: int, *, stopping: bool = False) -> bool:
    """Whether the task that installed ``stop`` was cancelled by ``signum``."""

    async def job() -> None:
        stop.install()
        if stopping:
            stop.stopping()
        try:
            os.kill(os.getpid(), signum)
            await asyncio.sleep(0.5)
        finally:
            stop.uninstall()

    try:
        await asyncio.create_task(job())
    except asyncio.CancelledError:
        return True
    return False


def test_the_first_signal_cancels_what_the_job_awaits_and_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    stop = StopSignals()
    assert asyncio.run(signalled(stop, signal.SIGTERM))
    assert stop.requested and stop.signum == signal.SIGTERM
    assert Interrupted(signal.SIGTERM).exit_code == 143
    assert Interrupted(signal.SIGINT).exit_code == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("tokenbudget: interrupted (SIGTERM): stopping (in-flight requests")
    assert err.endswith("rerun the same command to resume\n")


def test_a_signal_while_stopping_does_not_cut_the_stop_short() -> None:
    stop = StopSignals()
    assert not asyncio.run(signalled(stop, signal.SIGTERM, stopping=True))
    assert stop.requested


def test_a_signal_ignored_at_start_stays_ignored() -> None:
    stop = StopSignals()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:

        async def installed() -> list[int]:
            stop.install()
            try:
                return list(stop._installed)
            finally:
                stop.uninstall()

        assert asyncio.run(installed()) == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_second_signal_exits_at_once() -> None:
    script = textwrap.dedent(
        """
        import asyncio, os, signal
        from tokenbudget.app.interrupts import StopSignals

        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if run with `&`

        async def main():
            stop = StopSignals()
            stop.install()
            stop.stopping()  # an orderly stop that hangs
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0.1)
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 130, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("tokenbudget: interrupted (SIGINT)")
    assert lines[1] == "tokenbudget: SIGINT again: exiting now; rerun the same command to resume"
