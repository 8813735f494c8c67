"""The local broker's JVM as a process: which one runs on a home (its pid file, or
the orphan whose pid file was lost), its ports, stopping it, and waiting until it
answers a metadata request."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from tokenbudget.core.errors import BrokerError
from tokenbudget.core.files import write_atomic
from tokenbudget.core.kafka_admin import check_ready
from tokenbudget.core.retry import retry_until
from tokenbudget.localkafka.settings import (
    _MAIN_CLASS,
    _PID_FILE,
    _PROPS_FILE,
    _STATE_FILE,
    BrokerSettings,
)

log = logging.getLogger(__name__)


# Popen objects of brokers this process started, kept so they are reaped (no zombie,
# no "subprocess still running" warning) while this process lives.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return f"(no {path})"
    return "\n".join(data.splitlines()[-lines:])


def _reap(pid: int) -> None:
    child = _CHILDREN.get(pid)
    if child is not None:
        if child.poll() is not None:
            _CHILDREN.pop(pid, None)
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _alive(pid: int) -> bool:
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def _is_our_broker(pid: int, settings: BrokerSettings) -> bool:
    if not _alive(pid):
        return False
    cmd = _cmdline(pid)
    if cmd is None:
        return not Path("/proc").is_dir()  # cannot tell without /proc: trust the pid file
    props = str(settings.home.resolve() / _PROPS_FILE)
    return _MAIN_CLASS in cmd and props in cmd


def _find_orphan(settings: BrokerSettings) -> int | None:
    """A broker JVM running on this home whose pid file was lost."""
    props = str(settings.home.resolve() / _PROPS_FILE)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        cmd = _cmdline(int(entry))
        if cmd and _MAIN_CLASS in cmd and props in cmd and _alive(int(entry)):
            return int(entry)
    return None


def running_pid(settings: BrokerSettings) -> int | None:
    """The pid of the broker JVM running on ``settings.home``, if one runs."""
    return _running_pid(settings)


def _running_pid(settings: BrokerSettings) -> int | None:
    pid_file = settings.home / _PID_FILE
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        pid = None
    if pid is not None and _is_our_broker(pid, settings):
        return pid
    if not settings.home.is_dir():
        return None
    orphan = _find_orphan(settings)
    if orphan is not None:
        write_atomic(pid_file, f"{orphan}\n")
    return orphan


def _read_state(settings: BrokerSettings) -> dict[str, Any]:
    try:
        return dict(json.loads((settings.home / _STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _split_bootstrap(bootstrap: str) -> tuple[str, int]:
    first = bootstrap.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    return host or "127.0.0.1", int(port)


def _signal_and_wait(pid: int, timeout: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        log.warning("broker pid %d ignored SIGTERM for %.0fs; killing it", pid, timeout)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    _CHILDREN.pop(pid, None)


def wait_ready(
    bootstrap: str,
    timeout: float,
    *,
    pid: int | None = None,
    log_path: Path | None = None,
) -> None:
    """Block until Kafka at ``bootstrap`` is ready (:func:`check_ready`).

    With ``pid``, fail as soon as that process dies; ``log_path`` (the broker log) is
    quoted in the error.
    """
    host, port = _split_bootstrap(bootstrap)
    deadline = time.monotonic() + timeout

    def quoted_log() -> str:
        tail = _tail(log_path) if log_path else ""
        return f"; last lines of {log_path}:\n{tail}" if log_path else ""

    def attempt() -> None:
        # Only talk Kafka once something listens: keeps kafka-python's connection
        # errors out of the logs while the JVM boots.
        if not _port_open(host, port):
            raise ConnectionRefusedError(f"nothing listens on {host}:{port}")
        check_ready(bootstrap, min(max(0.0, deadline - time.monotonic()), 5.0))

    def exited(_: BaseException) -> None:
        if pid is not None and not _alive(pid):
            raise BrokerError(
                f"the Kafka broker (pid {pid}) exited before it was ready at {bootstrap}"
                + quoted_log()
            )

    def not_ready(last: BaseException) -> BrokerError:
        exited(last)
        return BrokerError(
            f"Kafka at {bootstrap} not ready after {timeout:.0f}s (last error: {last!r})"
            + quoted_log()
        )

    retry_until(attempt, timeout=timeout, on_retry=exited, give_up=not_ready)
