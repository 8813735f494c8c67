"""The route step: each attempt of a prompt goes to a server of the fleet.

A step of the prompt's path (see :mod:`tokenbudget.producers.dispatch.step`), between the tries and
the
request attempt: for every attempt the tries make, it takes a place at the server
the fleet's policy picks (:meth:`tokenbudget.producers.inference.fleet.Fleet.visit`: the least
outstanding work for its speed, a conversation's turn back to the server of its
previous turn, a server that failed this prompt only when no other can take it),
sends the attempt through it, and tells the server how it went: an answer, or the
error (which may pause the server, cut its window or hold it till its
``Retry-After``). The place is freed on every path, at the latest here.
"""

from __future__ import annotations

from tokenbudget.core.errors import InferenceError
from tokenbudget.producers.dispatch.attempt import Attempt
from tokenbudget.producers.dispatch.leases import Ticket
from tokenbudget.producers.dispatch.slots import Slot
from tokenbudget.producers.inference.fleet import Fleet
from tokenbudget.streams import events as ev


class Route:
    """Sends each attempt through ``attempt`` to a server of ``fleet``."""

    def __init__(self, attempt: Attempt, fleet: Fleet) -> None:
        self.attempt = attempt
        self.fleet = fleet

    async def submit(
        self,
        prompt: ev.PromptEvent,
        ticket: Ticket | None,
        max_new: int,
        attempts: int,
        slot: Slot | None,
        failed_at: set[str],
    ) -> None:
        """:meth:`tokenbudget.producers.dispatch.attempt.Attempt.submit` at a server of the fleet,
        avoiding
        those in ``failed_at`` (the servers that failed this prompt: one more is added
        when this attempt fails). Raises what the attempt raises, and
        :class:`~tokenbudget.core.errors.ServerOutageError` once every server is gone.
        Called by :class:`tokenbudget.producers.dispatch.tries.Tries`."""
        tokens = ticket.max_new_tokens if ticket is not None else max_new
        visit = await self.fleet.visit(prompt, tokens, failed_at)
        try:
            await self.attempt.submit(visit, prompt, ticket, max_new, attempts, slot)
        except InferenceError as exc:
            visit.failed(exc)
            failed_at.add(visit.url)
            raise
        finally:
            visit.done()
        visit.succeeded()
        self.fleet.answered_by(prompt, visit.url)
