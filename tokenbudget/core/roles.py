"""The roles a process, or a part of ``run``, plays on Kafka.

Each role may log in as a principal of its own (``[[kafka.roles]]``), and Kafka's
ACLs keep each principal to the topics its role writes (docs/kafka.md, Roles and
ACLs): an operator's commands, the ledger's announcements, a dispatcher's answers
and leases, the producer's prompts, the sink's dead letters. A client logs in as the
role the code building it plays (:func:`current_role`): set for a whole process by
:func:`play` (the command's role: ``tokenbudget dispatch`` plays the dispatcher), or
for a task or thread by :func:`acting_as` (``run`` plays every role but the ledger's).
This module imports nothing heavy: the command line sets the role before it imports
the command.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal

Role = Literal["operator", "producer", "dispatcher", "ledger", "sink"]
ROLES: tuple[Role, ...] = ("operator", "producer", "dispatcher", "ledger", "sink")


# The role the code building a client plays: set per task or thread by acting_as,
# for the whole process by play (threads do not inherit a context variable).
_ACTING: contextvars.ContextVar[Role | None] = contextvars.ContextVar("role", default=None)
_PLAYED: list[Role | None] = [None]


def play(role: Role | None) -> Role | None:
    """Every client this process builds, in any thread, logs in as ``role`` unless
    :func:`acting_as` says otherwise (a process that plays one role: ``dispatch``,
    ``ledger``, ``sink``, ``produce``, the operators' commands; None: ``[kafka]``'s
    own login). Returns the role played before."""
    before, _PLAYED[0] = _PLAYED[0], role
    return before


@contextlib.contextmanager
def acting_as(role: Role) -> Iterator[None]:
    """Clients built inside (in this task or thread, and in tasks it creates) log in
    as ``role``: how ``run`` gives its producer, dispatcher and sink their own."""
    token = _ACTING.set(role)
    try:
        yield
    finally:
        _ACTING.reset(token)


def current_role() -> Role | None:
    acting = _ACTING.get()
    return acting if acting is not None else _PLAYED[0]
