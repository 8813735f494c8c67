"""Free local ports for the processes the developer tools start (simulators, brokers,
cluster nodes)."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports. Each socket stays bound until all are chosen:
    bound and closed one at a time, the same port can come twice, and the process
    given it second cannot start (a CI run's cluster had two nodes on one port)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def free_port() -> int:
    """One free port (:func:`free_ports` when a process needs several)."""
    return free_ports(1)[0]
