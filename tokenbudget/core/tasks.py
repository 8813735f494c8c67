"""Ending an asyncio task that runs beside the work (a watcher, a prober, progress
output): cancelled, and waited for, so nothing of it runs on after its owner stops."""

from __future__ import annotations

import asyncio
from typing import Any


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
