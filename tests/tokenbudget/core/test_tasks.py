"""run: a process's event loop is uvloop's unless ``TOKENBUDGET_LOOP`` says asyncio,
and a value it does not know is refused naming it. cancel_and_wait: a task beside the
work is cancelled and has ended when it returns; what the task raised is raised,
unless the caller is cleaning up."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from tokenbudget.core import tasks
from tokenbudget.core.errors import TokenBudgetError
from tokenbudget.core.tasks import cancel_and_wait


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_run_is_on_uvloop_unless_told_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENBUDGET_LOOP", raising=False)
    assert tasks.run(_loop_type()) is uvloop.Loop
    monkeypatch.setenv("TOKENBUDGET_LOOP", " AsyncIO ")
    chosen = tasks.run(_loop_type())
    assert chosen is not uvloop.Loop and issubclass(chosen, asyncio.BaseEventLoop)


def test_run_refuses_an_event_loop_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENBUDGET_LOOP", "trio")
    main = _loop_type()
    with pytest.raises(TokenBudgetError, match=r"TOKENBUDGET_LOOP='trio'.*uvloop, asyncio"):
        tasks.run(main)
    main.close()  # never started


def test_the_task_has_ended_and_ran_its_cleanup_when_it_returns() -> None:
    cleaned = []

    async def loop() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0)  # cleanup that itself waits
            cleaned.append(True)

    async def main() -> asyncio.Task[None]:
        task = asyncio.create_task(loop())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        return task

    task = asyncio.run(main())
    assert task.cancelled() and cleaned == [True]


def test_none_and_a_finished_task_are_nothing_to_end() -> None:
    async def main() -> None:
        await cancel_and_wait(None)
        done = asyncio.create_task(asyncio.sleep(0))
        await done
        await cancel_and_wait(done)

    asyncio.run(main())


def test_an_error_the_task_ended_with_is_raised() -> None:
    async def fails() -> None:
        raise ValueError("the loop broke")

    async def main() -> None:
        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        await cancel_and_wait(task)

    with pytest.raises(ValueError, match="the loop broke"):
        asyncio.run(main())


def test_ignore_errors_leaves_the_callers_error_the_one_seen() -> None:
    async def fails_when_cancelled() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    async def main() -> None:
        task = asyncio.create_task(fails_when_cancelled())
        await asyncio.sleep(0)
        try:
            raise KeyError("the work failed")
        finally:
            await cancel_and_wait(task, ignore_errors=True)

    with pytest.raises(KeyError, match="the work failed"):
        asyncio.run(main())
