"""What admission (:class:`~tokenbudget.producers.dispatch.admission.Admission`) holds and
hands out: its settings, a ticket per admitted request, and one dispatcher's lease of a
dataset (granted by the ledger, spent locally: its balance, what is in flight on it,
what its growing tickets grew by, and where its asks to the ledger stand); and the
waits admission makes on a lease's next change.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from tokenbudget.core.sections import BoundaryPolicy, CutPolicy, ReserveMode
from tokenbudget.streams import budget
from tokenbudget.streams import events as ev

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionSettings:
    unit: ev.BudgetUnit = "completion_tokens"
    policy: BoundaryPolicy = "truncate"
    cut: CutPolicy = "last"
    reserve: ReserveMode = "whole"
    min_new_tokens: int = 1
    lease_size: int = 65536  # in the budget's unit
    lease_ttl_s: float = 30.0
    idle_release_s: float = 5.0


@dataclass(frozen=True)
class Ticket:
    """One admitted request: what it reserved and the max_new_tokens to send.
    ``grows``: it reserved less than max_new_tokens, and its reservation grows as its
    answer comes (:meth:`Growth.allowance` is what it holds then); ``serial``
    tells its growth apart from other tickets' on the lease."""

    dataset: str
    lease_id: str
    reserved: int
    max_new_tokens: int
    prompt_estimate: int = 0
    grows: bool = False
    serial: int = 0


@dataclass
class Lease:
    dataset: str
    lease_id: str
    balance: int = 0
    in_flight: int = 0
    spent: int = 0
    revoked: bool = False
    # Revoked because it expired at the ledger: its budget may be someone else's now,
    # so answers in flight on it are claimed anew rather than kept on it.
    expired: bool = False
    ledger_short: bool = False  # the ledger granted less than asked, or denied
    # The same, kept across settles (which clear ledger_short under cut = "last" so that
    # waiting requests ask again) until a grant covers what was asked: growing requests
    # keep what is left for the answers in flight until then.
    dry: bool = False
    # What the ledger last said the budget still had beyond the leases (None: not said).
    more: int | None = None
    asked_want: int = 0
    asked: asyncio.Future[ev.Event] | None = None
    # What each request sent on it asked for, oldest first, until its answer comes
    # (late ones included): the ledger answers each request once, and a grant that
    # answers none, or gives more than its request asked, is not the ledger's.
    unanswered: collections.deque[int] = field(default_factory=lambda: collections.deque(maxlen=64))
    told: bool = False  # that a reply answered none
    last_used: float = field(default_factory=time.monotonic)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Until when (monotonic) the ledger cannot have expired it: the last request or
    # renewal Kafka took, plus the TTL, less a margin for publishing an answer.
    valid_until: float = float("inf")
    publishing: int = 0  # completions settled on it whose send Kafka has not acked
    published: asyncio.Event = field(default_factory=asyncio.Event)
    releasing: bool = False
    grown: dict[int, int] = field(default_factory=dict)  # ticket serial -> tokens added
    held: int = 0  # what its tickets in flight hold, grown or not

    def holding(self, ticket: Ticket) -> int:
        """What ``ticket`` of this lease holds: what it reserved and what it grew by."""
        return ticket.reserved + self.grown.get(ticket.serial, 0)

    def answered_by(self, reply: ev.LeaseGranted | ev.LeaseDenied) -> bool:
        """Whether ``reply`` answers a request sent on the lease (taking that request
        off the unanswered ones): the ledger answers each once, and grants no more
        than it asked. A reply to none, or a bigger grant, is not the ledger's."""
        if self.unanswered and (
            not isinstance(reply, ev.LeaseGranted) or reply.granted <= self.unanswered[0]
        ):
            self.unanswered.popleft()
            return True
        if not self.told:  # said once per lease
            self.told = True
            log.warning(
                "%s: ignoring a %s on lease %s that answers no request of it (asked: %s); "
                "the budgets topic may be written by others than the ledger: see "
                "docs/kafka.md, Roles and ACLs",
                reply.dataset,
                type(reply).__struct_config__.tag,
                reply.lease_id,
                list(self.unanswered) or "nothing",
            )
        return False


def next_change(lease: Lease) -> Awaitable[None]:
    """Until the lease changes from now on (a settle, a grant, a revocation), or a
    second passes: its state is then looked at again."""
    lease.changed.clear()
    return _at_most(lease.changed.wait(), 1.0)


async def _at_most(awaitable: Awaitable[Any], seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(awaitable, timeout=seconds)


class Waits:
    """One request's waits for budget, inside ``aside()`` (when given, see
    :meth:`Admission.admit`) from the first of them until it is about to reserve:
    between two waits the budget is looked at without the server place. Every answer
    of a dataset wakes each of its prompts waiting at its budget's end; taking a place
    back for each look kept the fleet's places taken by prompts that went straight
    back to waiting."""

    def __init__(self, aside: Callable[[], AbstractAsyncContextManager[Any]] | None) -> None:
        self._aside = aside
        self._inside: contextlib.AsyncExitStack | None = None
        self.waited = False  # it has waited at least once

    @property
    def away(self) -> bool:
        """Inside ``aside()``: its place has to be taken back before it reserves."""
        return self._inside is not None

    async def wait(self, awaitable: Awaitable[Any]) -> Any:
        """Await ``awaitable`` (aside), and return what it gives."""
        self.waited = True
        if self._aside is not None and self._inside is None:
            inside = contextlib.AsyncExitStack()
            await inside.enter_async_context(self._aside())
            self._inside = inside
        return await awaitable

    async def back(self) -> None:
        """Out of ``aside()`` (its place taken back), if inside."""
        inside, self._inside = self._inside, None
        if inside is not None:
            await inside.aclose()


def as_sent(
    whole: budget.Ask,
    settings: AdmissionSettings,
    lengths: budget.AnswerLengths | None,
    exact: bool,
) -> budget.Ask:
    """``whole`` as it goes out: under ``[budget] reserve = "grow"`` growing from the
    dataset's answers seen so far (:meth:`tokenbudget.streams.budget.Ask.growing`),
    unless ``exact`` (an answer generated already, all of which it must cover)."""
    if settings.reserve != "grow" or exact:
        return whole
    if lengths is None:
        return whole.growing(None, settings.cut)
    return whole.growing(lengths.typical(), settings.cut, lengths.spread())
