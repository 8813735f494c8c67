"""No process outlives its parent: a child started with spawn is in a session of its
own, knows its parent, and ends when that parent ends however it ends (SIGKILL
included), on SIGTERM, or within the grace period if it ignores SIGTERM; stop ends
a child with SIGTERM, then SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenbudget.core import lifetime


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_spawned_child_has_a_session_of_its_own_and_knows_its_parent() -> None:
    child = lifetime.spawn(
        python(f"import os; print(os.environ['{lifetime.PARENT_ENV}'], os.getsid(0))"),
        stdout=subprocess.PIPE,
    )
    out, _ = child.communicate(timeout=30)
    parent, session = out.decode().split()
    assert int(parent) == os.getpid()
    assert int(session) == child.pid  # Ctrl-C at a terminal reaches the parent only


def test_a_process_not_spawned_so_has_no_parent_to_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(lifetime.PARENT_ENV, raising=False)
    assert lifetime.watch_parent() is None
    monkeypatch.setenv(lifetime.PARENT_ENV, "not a pid")
    assert lifetime.watch_parent() is None
    assert lifetime.PARENT_ENV not in os.environ  # its own children watch it instead


@contextlib.contextmanager
def _family(tmp_path: Path, child_code: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A parent that spawns a child running ``child_code`` after watch_parent; the
    parent and the child's pid once the child watches. Neither outlives the test."""
    ready = tmp_path / "child.pid"
    child = textwrap.dedent(child_code).replace("READY", repr(str(ready)))
    parent = subprocess.Popen(
        python(
            f"""
            import sys, time
            from tokenbudget.core import lifetime
            lifetime.spawn([sys.executable, "-c", {child!r}])
            time.sleep(3600)
            """
        ),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    child_pid = None
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() or not ready.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        child_pid = int(ready.read_text())
        yield parent, child_pid
    finally:
        parent.kill()
        parent.wait()
        if child_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, signal.SIGKILL)


def test_a_child_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    code = """
        import os, pathlib, time
        from tokenbudget.core import lifetime
        lifetime.watch_parent()
        pathlib.Path(READY).write_text(str(os.getpid()))
        time.sleep(3600)
    """
    with _family(tmp_path, code) as (parent, child):
        parent.kill()
        parent.wait()
        assert gone(child, within=10)


def test_a_child_that_ignores_sigterm_ends_after_the_grace_period(tmp_path: Path) -> None:
    code = """
        import os, pathlib, signal, time
        from tokenbudget.core import lifetime
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        lifetime.watch_parent(grace_s=0.5)
        pathlib.Path(READY).write_text(str(os.getpid()))
        time.sleep(3600)
    """
    with _family(tmp_path, code) as (parent, child):
        parent.kill()
        parent.wait()
        assert gone(child, within=10)


def test_stop_terminates_then_kills() -> None:
    polite = subprocess.Popen(python("import time; time.sleep(3600)"))
    assert lifetime.stop(polite, timeout=10) == -signal.SIGTERM
    stubborn = subprocess.Popen(
        python(
            """
            import signal, sys, time
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("ready", flush=True)
            time.sleep(3600)
            """
        ),
        stdout=subprocess.PIPE,
    )
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    assert lifetime.stop(stubborn, timeout=0.5) == -signal.SIGKILL
    done = subprocess.Popen(python("raise SystemExit(4)"))
    done.wait()
    assert lifetime.stop(done) == 4  # already ended: its code, no signal
