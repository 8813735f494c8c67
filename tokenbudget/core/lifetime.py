"""No process outlives its parent: children that end when the process that started
them ends, however it ends (SIGKILL and the OOM killer included).

Contract:

* :func:`spawn` starts a ``tokenbudget`` (or any) child in a session of its own, so
  a terminal's Ctrl-C or a signal to the parent's process group reaches the parent
  only, which then stops its children in order. It passes the parent's pid in
  ``TOKENBUDGET_PARENT_PID``.
* :func:`watch_parent`, called first thing by the child's CLI, makes the child end
  when that parent does: Linux's ``PR_SET_PDEATHSIG`` sends it SIGTERM at once, and a
  watcher thread (for other systems, and for a parent whose forking thread ended
  first, which also fires the death signal) sees the parent's pid change within half
  a second and sends the same SIGTERM. SIGTERM lets a worker hand back its leases and
  flush; a child still alive ``grace_s`` later is ended with ``os._exit``.

Why not ``preexec_fn``: it runs between fork and exec in a copy of a process that
has threads (Kafka clients, the sink), where taking any lock may deadlock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

log = logging.getLogger(__name__)

PARENT_ENV = "TOKENBUDGET_PARENT_PID"
_PR_SET_PDEATHSIG = 1
# Time a child has, after its parent is gone, to stop cleanly on SIGTERM.
GRACE_S = 30.0


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    cwd: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a child bound to this process's lifetime (see the module)."""
    child_env = dict(os.environ if env is None else env)
    child_env[PARENT_ENV] = str(os.getpid())
    return subprocess.Popen(
        list(argv),
        env=child_env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        cwd=cwd,
        start_new_session=True,
    )


def watch_parent(grace_s: float = GRACE_S) -> int | None:
    """If started by :func:`spawn`, end this process when its parent ends.

    Returns the parent's pid, or None when there is none to watch. The variable is
    removed from the environment, so this process's own children watch it instead.
    """
    raw = os.environ.pop(PARENT_ENV, None)
    if not raw:
        return None
    try:
        parent = int(raw)
    except ValueError:
        return None
    _set_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # gone before the death signal was armed
        _parent_gone(parent, grace_s)
        return parent
    thread = threading.Thread(
        target=_watch, args=(parent, grace_s), name="parent-watch", daemon=True
    )
    thread.start()
    return parent


def _set_death_signal(signum: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError) as exc:  # the watcher thread still covers it
        log.debug("PR_SET_PDEATHSIG unavailable: %s", exc)


def _watch(parent: int, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    _parent_gone(parent, grace_s)


def _parent_gone(parent: int, grace_s: float) -> None:
    log.warning("parent process %d is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)
    # Whatever SIGTERM's handler does, this process ends within the grace period.
    timer = threading.Timer(grace_s, os._exit, args=(70,))
    timer.daemon = True
    timer.start()


def stop(
    process: subprocess.Popen[bytes], timeout: float = 30, signum: int = signal.SIGTERM
) -> int | None:
    """``signum`` (SIGTERM), then SIGKILL after ``timeout``; the exit code."""
    if process.poll() is None:
        process.send_signal(signum)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
