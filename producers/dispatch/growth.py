"""Growing reservations (``[budget] reserve = "grow"``): what a growing ticket holds,
taken from its lease as its answer comes (:class:`Growth`), part of one dispatcher's
:class:`~tokenbudget.producers.dispatch.admission.Admission`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from tokenbudget.producers.dispatch.leases import AdmissionSettings, Lease, Ticket
from tokenbudget.streams import budget
from tokenbudget.streams import events as ev

log = logging.getLogger(__name__)


class Growth:
    """Growing reservations (``[budget] reserve = "grow"``) of one dispatcher's
    tickets: what a growing ticket holds, taken from its lease as its answer comes.
    Part of :class:`~tokenbudget.producers.dispatch.admission.Admission`, whose leases
    (``lease_of``) and requests to the ledger (``ask``, ``spawn`` for one in the
    background) it is built with; reached as ``admission.growth`` by the register of
    requests in flight, as a streamed answer comes (:meth:`grow`, :meth:`can_grow`),
    and by the request attempt, once the answer is in (:meth:`cover`);
    ``Admission.settle`` gives back what a ticket held, grown or not."""

    def __init__(
        self,
        settings: AdmissionSettings,
        lease_of: Callable[[Ticket], Lease | None],
        ask: Callable[[Lease, int, int], Awaitable[ev.Event | None]],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self._settings = settings
        self._lease_of = lease_of
        self._ask = ask
        self._spawn = spawn

    def allowance(self, ticket: Ticket) -> int:
        """What the ticket holds now: what it reserved and what it grew by."""
        lease = self._lease_of(ticket)
        return ticket.reserved if lease is None else lease.holding(ticket)

    def grow(self, ticket: Ticket, need: int) -> int:
        """Grow a growing ticket's reservation from its lease towards ``need`` (what
        its answer costs so far, and some room to go on) and return what it holds
        (:meth:`allowance`). Takes only what the lease holds now; when that falls
        short, the ledger is asked for more in the background (:meth:`can_grow` tells
        whether more may still come). Called by the register of requests in flight
        as a streamed answer comes, and by :meth:`cover`; never raises."""
        lease = self._lease_of(ticket)
        if lease is None:
            return ticket.reserved
        held = lease.holding(ticket)
        if not ticket.grows:
            return held
        ceiling = budget.unit_cost(
            self._settings.unit, ticket.prompt_estimate, ticket.max_new_tokens
        )
        need = min(need, ceiling)
        if lease.revoked or need <= held:
            return held
        extra = budget.growth(held, need, ticket.reserved, ceiling, lease.balance)
        if extra:
            lease.balance -= extra
            lease.held += extra
            held += extra
            lease.grown[ticket.serial] = held - ticket.reserved
            lease.last_used = time.monotonic()
        if held < need and not lease.ledger_short and (lease.asked is None or lease.asked.done()):
            self._spawn(self._ask_more(lease, need - held))
        return held

    def can_grow(self, ticket: Ticket) -> bool:
        """Whether a growing ticket may still grow: its lease is in use, and holds
        more or may get more from the ledger (no denial since the last settle, or an
        answer on its way)."""
        lease = self._lease_of(ticket)
        if lease is None or lease.revoked or not ticket.grows:
            return False
        asking = lease.asked is not None and not lease.asked.done()
        return lease.balance > 0 or asking or not lease.ledger_short

    async def cover(self, ticket: Ticket, cost: int) -> int:
        """Grow a growing ticket to cover an answer that came in costing ``cost``,
        asking the ledger for more if the lease falls short, and return what it holds
        (:meth:`allowance`): the answer is cut to that when it falls short. Called by
        the request attempt before the answer is kept; raises what sending to Kafka
        raises, and a cancellation."""
        held = self.grow(ticket, cost)
        lease = self._lease_of(ticket)
        while held < cost and lease is not None and not lease.revoked and ticket.grows:
            granted = False
            if lease.balance == 0:
                if lease.ledger_short:
                    break
                reply = await self._ask(lease, self._more(cost - held), 1)
                granted = isinstance(reply, ev.LeaseGranted)
                if not granted:
                    lease.ledger_short = lease.dry = True  # denied, or no answer in time
            grown = self.grow(ticket, cost)
            if grown == held and not granted:
                break  # nothing more to take: the answer is cut to what it holds
            held = grown
        return held

    def _more(self, short: int) -> int:
        return max(self._settings.lease_size, short)

    async def _ask_more(self, lease: Lease, short: int) -> None:
        """Ask the ledger for more on the lease for growing answers (a background
        task of :meth:`grow`); a denial or no answer means they grow no more."""
        try:
            reply = await self._ask(lease, self._more(short), 1)
        except Exception as exc:  # a broker away: the answers are cut, never over
            log.warning("%s: asking the ledger for more failed: %r", lease.dataset, exc)
            reply = None
        if not isinstance(reply, ev.LeaseGranted):
            lease.ledger_short = lease.dry = True
