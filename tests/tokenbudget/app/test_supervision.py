"""run's children started again when they end, at every wait of the run."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading

import pytest

from tokenbudget.app.supervision import SinkThread, Supervised, supervise
from tokenbudget.core.errors import WorkerFailedError


def starter(*codes: int | None) -> tuple[list[subprocess.Popen[bytes]], object]:
    """Starts a process per call: one exiting with the next code, or (None) one that
    runs until stopped."""
    started: list[subprocess.Popen[bytes]] = []
    plan = list(codes)

    def start() -> subprocess.Popen[bytes]:
        code = plan.pop(0) if plan else None
        script = "import time; time.sleep(60)" if code is None else f"raise SystemExit({code})"
        started.append(subprocess.Popen([sys.executable, "-c", script]))
        return started[-1]

    return started, start


def wait_exited(process: subprocess.Popen[bytes]) -> None:
    process.wait(30)


def test_a_child_that_ends_is_started_again_and_one_that_keeps_ending_fails_the_run() -> None:
    started, start = starter(75, 3, None)
    child = Supervised("ledger worker", start, max_restarts=2, window_s=60)  # type: ignore[arg-type]
    try:
        wait_exited(started[0])
        first = child.check()
        assert first is not None and (first.name, first.pid, first.code) == (
            "ledger worker",
            started[0].pid,
            75,
        )
        wait_exited(started[1])
        assert child.check() is not None
        assert child.check() is None  # the third one runs
        assert len(started) == 3 and child.process is started[2]
        started[2].kill()
        wait_exited(started[2])
        with pytest.raises(WorkerFailedError, match="ledger worker exited 3 times"):
            child.check()
    finally:
        for process in started:
            process.kill()
            process.wait()


def test_a_child_that_dies_while_run_waits_on_it_is_started_again() -> None:
    """The wait (for the ledger to apply what the producer recorded, say) ends only
    once the child runs again: no supervision during it would wait for ever."""
    started, start = starter(1, None)

    async def main() -> None:
        child = Supervised("ledger worker", start)  # type: ignore[arg-type]
        wait_exited(started[0])

        async def needs_the_child() -> None:
            while len(started) < 2:
                await asyncio.sleep(0.05)

        waited = asyncio.create_task(needs_the_child())
        await asyncio.wait_for(supervise(waited, {}, [child]), 20)
        assert [r.code for r in child.restarts] == [1]

    try:
        asyncio.run(main())
    finally:
        for process in started:
            process.kill()
            process.wait()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_child_that_crashes_at_every_start_fails_the_run_however_slowly_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ledger whose metrics port another job took crashed a few seconds into every
    start: more than ``max_restarts`` exits ever fell within one window, so it was
    started again for ever."""
    clock = Clock()
    monkeypatch.setattr("tokenbudget.app.supervision.time.monotonic", clock)
    started, start = starter(1, 1, 1, 1)
    child = Supervised("ledger worker", start, max_restarts=3, window_s=60)  # type: ignore[arg-type]
    try:
        for _ in range(3):
            clock.now += 40  # each life shorter than the window, together far longer
            wait_exited(started[-1])
            assert child.check() is not None
        clock.now += 40
        wait_exited(started[-1])
        with pytest.raises(WorkerFailedError, match="exited 4 times in a row, each within 60 s"):
            child.check()
    finally:
        for process in started:
            process.kill()
            process.wait()


def test_a_child_that_lived_past_the_window_starts_the_count_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr("tokenbudget.app.supervision.time.monotonic", clock)
    started, start = starter(1, 1, 1, 1, 1)
    child = Supervised("ledger worker", start, max_restarts=2, window_s=60)  # type: ignore[arg-type]
    try:
        for lived in (5, 5, 600, 5, 5):  # killed after ten minutes of work: not a crash
            clock.now += lived
            wait_exited(started[-1])
            assert child.check() is not None
        assert child.short_lives == 2
    finally:
        for process in started:
            process.kill()
            process.wait()


class _Broken:
    """A sink that stops on its own, as a full disk stops the real one."""

    def run(self, stop: object) -> None:
        raise OSError(28, "No space left on device")

    def where(self) -> str:
        return "at ns.completions[2]@1041..1090"


def test_a_sink_that_stops_on_its_own_stops_the_run_naming_where_and_why() -> None:
    sink = SinkThread(_Broken())  # type: ignore[arg-type]
    sink.thread.join(10)
    message = (
        "the Parquet sink stopped at ns.completions[2]@1041..1090: "
        "OSError: [Errno 28] No space left on device"
    )
    with pytest.raises(WorkerFailedError, match=re.escape(message)):
        sink.check()
    with pytest.raises(WorkerFailedError, match=re.escape(message)):
        sink.finish()  # also when it is found at the end of the run


def test_a_sink_stopped_by_the_run_is_not_a_failure() -> None:
    class Finishing(_Broken):
        def run(self, stop: object) -> None:
            assert isinstance(stop, threading.Event)
            stop.wait(10)

    sink = SinkThread(Finishing())  # type: ignore[arg-type]
    sink.check()  # running
    sink.finish()
    sink.check()


def test_a_worker_that_fails_ends_the_run_naming_its_role() -> None:
    async def main() -> None:
        async def breaks() -> None:
            raise RuntimeError("a poison record")

        async def forever() -> None:
            await asyncio.sleep(60)

        drain = asyncio.create_task(forever())
        worker = asyncio.create_task(breaks())
        with pytest.raises(
            WorkerFailedError, match="the prompt producer stopped: RuntimeError: a poison record"
        ):
            await asyncio.wait_for(supervise(drain, {"prompt producer": worker}, []), 20)
        assert drain.cancelled()

    asyncio.run(main())
