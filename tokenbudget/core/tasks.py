"""Running a process's event loop (:func:`run`), and ending an asyncio task that runs
beside the work (a watcher, a prober, progress output): cancelled, and waited for, so
nothing of it runs on after its owner stops."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from tokenbudget.core.errors import TokenBudgetError

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Future[Any] | None, *, ignore_errors: bool = False) -> None:
    """Cancel ``task`` (None: nothing to end) and return once it has ended.

    Its cancellation ends here. An error it had ended with before (or raised while
    being cancelled) is raised, unless ``ignore_errors``: a ``finally`` block that
    cleans up after another error passes it, so that error is the one seen.

    Like the ``suppress(CancelledError)`` it replaces, a cancellation of the caller
    that arrives while it waits ends here too: owners call it while they stop."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:
        if not ignore_errors:
            raise


LOOPS = ("uvloop", "asyncio")


def run(main: Coroutine[Any, Any, T]) -> T:
    """:func:`asyncio.run` on uvloop's event loop where it is installed (and
    ``TOKENBUDGET_LOOP`` is not ``asyncio``): a dispatcher streaming answers wakes for
    every network read of every request in flight, and asyncio's own loop, written in
    Python, is a large share of what each wake-up costs (``bench/fleet.py --phases cpu
    --cpu-stream --cpu-loops uvloop,asyncio``)."""
    choice = os.environ.get("TOKENBUDGET_LOOP", "").strip().lower() or LOOPS[0]
    if choice not in LOOPS:
        raise TokenBudgetError(
            f"TOKENBUDGET_LOOP={choice!r} is not an event loop: use one of {', '.join(LOOPS)}"
        )
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError:  # not built for this platform: asyncio's loop does the same
            pass
        else:
            factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
