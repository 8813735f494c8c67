"""Admission control: reserve budget before a request is sent, never after.

Each dispatcher holds at most one lease per dataset, granted by the ledger (the
single writer of budgets) and spent locally, so a request costs no round trip:

    admit(dataset)   take min(want, balance) from the lease; that amount is sent
                     as max_new_tokens, so the server cannot overshoot it
    settle(ticket)   give back what the answer did not use (or all of it when
                     nothing was published)

When the balance cannot cover the smallest useful request, the dispatcher asks the
ledger for more on the same lease. A denial with requests still in flight waits
for them to settle (their leftovers come back); a denial with nothing in flight
means the dataset is full for good, and the lease is released.

Once the ledger has no more to give, what the lease still holds is less than a
whole request; under ``[budget] cut = "last"`` a request waits for the leftovers
of those in flight rather than go out short, unless the balance likely covers an
answer of the dataset (:class:`tokenbudget.streams.budget.AnswerLengths`, fed by
:meth:`Admission.answered`) or nothing is in flight any more (the one answer cut at
the line). The ledger's word that it has no more is taken again after every
settle, so that one last request is sent only when the ledger still has nothing.

Under ``[budget] reserve = "grow"`` a request is sent with its max_new_tokens but
reserves less (:meth:`tokenbudget.streams.budget.Ask.growing`); its reservation then
grows from the lease as its answer comes
(:class:`~tokenbudget.producers.dispatch.growth.Growth`: ``grow`` as it streams,
``cover`` once it is in), asking the ledger for more on the way.
What an answer keeps never exceeds what its ticket holds, so nothing is kept beyond
the budget; an answer that outgrows what is left is cut at the line.

Leases are renewed while in use and released when idle, so a dispatcher that dies
holds budget only until its lease expires. A revoked lease (budget lowered, or
expired under a slow holder) stops all spending at once and aborts what is in
flight through ``on_revoke``; what those requests may still keep between them is a
:class:`tokenbudget.producers.dispatch.caps.RevokedCap`. From the moment a lower budget is
read on the budgets topic until the ledger has applied it, nothing is admitted on the dataset.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any

from aiokafka import AIOKafkaProducer

from tokenbudget.producers.dispatch.growth import Growth
from tokenbudget.producers.dispatch.leases import (
    AdmissionSettings,
    Lease,
    Ticket,
    Waits,
    as_sent,
    next_change,
)
from tokenbudget.streams import budget, codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)


class Admission:
    """One dispatcher's leases (``holder`` names it to the ledger), asked for and
    handed back with ``producer`` on the namespace's reservations topic; the ledger's
    answers come through ``board``.

    ``on_revoke``, if given, is called with a dataset's name, as a task of its own,
    when the ledger revokes a lease of it in use because its budget was lowered; what
    the lease's requests in flight may still keep is then in :attr:`revocations`.
    That is the one call admission makes back into the dispatcher
    (:meth:`tokenbudget.producers.dispatch.caps.InFlight.on_revoke`, wired by the dispatcher's
    ``compose``); every other call goes the other way."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        topics: Topics,
        holder: str,
        board: BudgetBoard,
        settings: AdmissionSettings,
        *,
        on_revoke: Callable[[str], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self.producer = producer
        self.topics = topics
        self.holder = holder
        self.board = board
        self.settings = settings
        self.on_revoke = on_revoke
        self._leases: dict[str, Lease] = {}  # the current lease of each dataset
        self._by_id: dict[str, Lease] = {}  # every lease not yet handed back
        self._tasks: set[asyncio.Task[None]] = set()
        self._counter = itertools.count(1)
        self._asks: dict[str, asyncio.Future[ev.Event]] = {}
        self.refused_at: dict[str, float] = {}  # when this dispatcher first refused
        self.revocations: dict[str, tuple[str, int]] = {}  # dataset -> (lease id, allowance)
        self._lengths: dict[str, budget.AnswerLengths] = {}
        board.lease_listeners[holder] = self._on_ledger_event
        self._maintenance: asyncio.Task[None] | None = None
        self.growth = Growth(settings, self._lease_of, self._ask, self._spawn)

    # -- the calls a dispatcher makes ------------------------------------------------

    async def admit(
        self,
        dataset: str,
        max_new_tokens: int,
        prompt_estimate: int = 0,
        *,
        aside: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
        exact: bool = False,
    ) -> Ticket | None:
        """Reserve for one request, or None when the dataset is full.

        ``aside``, if given, is entered at the first wait for budget (another holder's
        tokens, leftovers of requests in flight, a lowering on its way, the ledger's
        answer to a request for more) and left only once the budget is there for it,
        never around the reservation itself: the dispatcher lends its server place to
        prompts of other datasets meanwhile and has it back before anything is
        reserved, then looks at the budget again.
        ``exact``: ``max_new_tokens`` is the answer's own length (an answer generated
        already), not a limit, so only all of it covers it.

        Called by the dispatcher's tries for each prompt, and by its request attempt to
        claim an answer anew. Raises what sending to Kafka raises (a request for more
        budget) and a cancellation; a ticket is then not reserved.
        """
        waits = Waits(aside)
        settings = self.settings
        whole = budget.ask(
            settings.unit,
            settings.policy,
            max_new_tokens,
            prompt_estimate,
            settings.min_new_tokens,
        )
        try:
            while True:
                if waits.waited and self.board.is_halted(dataset):
                    # The ledger said the budget is reached while this one waited:
                    # looking on would ask it again, one round trip at a time for
                    # each prompt waiting, before the run can end.
                    await self._refuse(dataset)
                    return None
                if self.board.lowering(dataset):
                    # A lower budget is on its way to the ledger: admit nothing more
                    # under the old one until the ledger's answer (revocations, if
                    # any) is in.
                    await waits.wait(self.board.decided(dataset))
                    continue
                lease = self._lease(dataset)
                if lease.revoked:
                    # Revoked with requests still in flight: spend nothing more and do
                    # not ask on it (that would reopen an expired lease id at the
                    # ledger, or spin on denials); a fresh lease is opened once they
                    # have settled.
                    await waits.wait(next_change(lease))
                    continue
                # Anew each time: prompts that came before the dataset's answers were
                # known would wait for whole max_new_tokens, budget / that in flight.
                request = as_sent(whole, self.settings, self._lengths.get(dataset), exact)
                step = self._step(lease, request, exact)
                if step.action == "wait":
                    await waits.wait(next_change(lease))
                    continue
                if step.action == "reserve":
                    if waits.away:
                        # Its place first, then a fresh look: the budget may have
                        # gone to others while it waited for the place.
                        await waits.back()
                        continue
                    return self._reserve(lease, request, step, prompt_estimate)
                want = request.lease_request(settings.lease_size)
                # Aside too: nothing is reserved while the ledger answers (a round trip
                # through Kafka, up to _ask's timeout), and a prompt of a dataset at
                # its budget's end asks again after each of its answers, so holding
                # the place meanwhile kept other datasets' prompts from the fleet.
                reply = await waits.wait(self._ask(lease, want, request.floor))
                if not await self._after_asking(lease, reply, request.floor, waits.wait):
                    return None
        finally:
            await waits.back()

    def _step(self, lease: Lease, request: budget.Ask, exact: bool) -> budget.Step:
        """A whole request when the lease covers it; a clamped one only once the
        ledger has said it has no more to give (the budget's last tokens), and then
        as the cut policy says."""
        return request.step(
            lease.balance,
            ledger_short=lease.ledger_short or (request.grows and lease.dry),
            in_flight=lease.in_flight,
            long_answer=None if exact else self.long_answer(lease.dataset),
            cut=self.settings.cut,
            held=lease.held,
            more=lease.more,
        )

    def _reserve(
        self, lease: Lease, request: budget.Ask, step: budget.Step, estimate: int
    ) -> Ticket:
        lease.balance -= step.amount
        lease.held += step.amount
        lease.in_flight += 1
        lease.last_used = time.monotonic()
        send = request.max_new_tokens_for(step.amount, step.grows)
        serial = next(self._counter)
        return Ticket(
            lease.dataset, lease.lease_id, step.amount, send, estimate, step.grows, serial
        )

    async def _after_asking(
        self,
        lease: Lease,
        reply: ev.Event | None,
        floor: int,
        waiting: Callable[[Awaitable[Any]], Awaitable[None]],
    ) -> bool:
        """What the ledger's reply (None: no reply in time) to a request for more on
        ``lease`` means for :meth:`admit`: True to look at the budget again (after
        waiting, where the reply says to wait), False when the dataset is full for
        this holder (the refusal recorded, the lease released)."""
        dataset = lease.dataset
        if reply is None or isinstance(reply, ev.LeaseGranted):
            return True  # granted (see _on_ledger_event), or no answer yet: ask again
        lease.dry = True
        if lease.balance >= floor and self._leases.get(dataset) is lease:
            lease.ledger_short = True  # denied: spend what the lease still holds
            return True
        if lease.revoked or self._leases.get(dataset) is not lease:
            return True  # a fresh lease is opened on the next turn
        if isinstance(reply, ev.LeaseDenied) and reply.remaining < 0:
            # The ledger has not seen this dataset's budget yet: ask again.
            await waiting(asyncio.sleep(0.2))
            return True
        if lease.in_flight > 0:
            # Leftovers of requests in flight may still cover this one.
            await waiting(next_change(lease))
            return True
        if isinstance(reply, ev.LeaseDenied) and not reply.full:
            # The rest is reserved by other holders: it comes back when they
            # settle, go idle or expire.
            await waiting(asyncio.sleep(0.25))
            return True
        await self._refuse(dataset)
        return False

    async def _refuse(self, dataset: str) -> None:
        """The dataset is full for this holder: the refusal noted, and its lease
        released unless requests in flight still hold some of it."""
        self.refused_at.setdefault(dataset, time.time())
        lease = self._leases.get(dataset)
        if lease is not None and lease.in_flight == 0:
            await self._release(lease)

    def answered(self, dataset: str, completion_tokens: int) -> None:
        """An answer of the dataset the budget did not cut was this long: what the
        next ones likely need (:meth:`long_answer`). Called by the request attempt as
        such an answer's completion is sent."""
        lengths = self._lengths.get(dataset)
        if lengths is None:
            lengths = self._lengths[dataset] = budget.AnswerLengths()
        lengths.observe(completion_tokens)

    def long_answer(self, dataset: str) -> int | None:
        """Tokens a next answer of the dataset rarely exceeds, from the answers seen
        (:meth:`tokenbudget.streams.budget.AnswerLengths.high`); None until enough were."""
        lengths = self._lengths.get(dataset)
        return None if lengths is None else lengths.high()

    def retire_if_expired(self, ticket: Ticket) -> bool:
        """Whether the ticket's lease may have expired at the ledger (revoked as
        expired, or not renewed within its TTL, as after a freeze). If so the lease
        takes nothing more, and an answer on it is to be claimed anew (:meth:`admit`
        for its actual cost, after settling this ticket) before it is kept. Called by
        the request attempt once the answer is in."""
        lease = self._lease_of(ticket)
        if lease is None:
            return True
        if not (lease.expired or time.monotonic() >= lease.valid_until):
            return False
        lease.expired = lease.revoked = True
        lease.balance = 0
        lease.changed.set()
        return True

    def sending(self, ticket: Ticket) -> None:
        """A completion on ``ticket`` is about to be sent: its lease is not handed back
        before :meth:`published`, so every completion of a lease is on Kafka before its
        release, and the ledger never frees budget an answer on its way still needs.
        Called by the request attempt, before the send and before any await."""
        lease = self._lease_of(ticket)
        if lease is not None:
            lease.publishing += 1
            lease.published.clear()

    def published(self, ticket: Ticket) -> None:
        """The completion announced by :meth:`sending` is on Kafka (or given up).
        Called by the request attempt after the send, on every path."""
        lease = self._lease_of(ticket)
        if lease is None:
            return
        lease.publishing -= 1
        if lease.publishing <= 0:
            lease.published.set()

    def settle(self, ticket: Ticket, published_cost: int | None) -> None:
        """Give the ticket's lease back what its request did not use (all of it when
        nothing was published). ``published_cost``: what the published completion
        consumed, in the budget's unit, or None when nothing was published for this
        request. Called by the request attempt exactly once per ticket, on every
        path; never raises."""
        lease = self._lease_of(ticket)
        if lease is None:
            return  # its lease was released meanwhile
        cost = 0 if published_cost is None else published_cost
        held = ticket.reserved + lease.grown.pop(ticket.serial, 0)
        if cost > held:
            log.error(
                "%s: a completion cost %d but reserved %d: the server ignored max_new_tokens",
                ticket.dataset,
                cost,
                held,
            )
        lease.in_flight -= 1
        lease.held -= held
        lease.spent += cost
        if not lease.revoked:
            lease.balance += max(0, held - cost)
        if self.settings.cut == "last":
            # Waiting requests ask the ledger again before one of them goes out short:
            # what other holders handed back, or a raised budget, may cover it whole.
            lease.ledger_short = False
        lease.changed.set()
        if lease.revoked and lease.in_flight == 0:
            self._spawn(self._release(lease))

    # -- lease lifecycle --------------------------------------------------------------

    def _lease_of(self, ticket: Ticket) -> Lease | None:
        lease = self._by_id.get(ticket.lease_id)
        return lease if lease is not None and lease.dataset == ticket.dataset else None

    def _lease(self, dataset: str) -> Lease:
        lease = self._leases.get(dataset)
        if lease is None or (lease.revoked and lease.in_flight == 0):
            lease = Lease(dataset, f"{self.holder}:{dataset}:{next(self._counter)}")
            lease.published.set()
            self._leases[dataset] = lease
            self._by_id[lease.lease_id] = lease
        return lease

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ask(self, lease: Lease, want: int, min_grant: int) -> ev.Event | None:
        """One request to the ledger per lease at a time; every caller waits for
        its answer. None after a while without one (the ledger may be restarting)."""
        asked = lease.asked
        if asked is None or asked.done():
            # Held locally: another caller timing out while this one sends sets
            # lease.asked to None, and this caller still waits for its own answer.
            asked = lease.asked = asyncio.get_running_loop().create_future()
            lease.asked_want = want
            lease.unanswered.append(want)
            self._asks[lease.lease_id] = asked
            request = ev.LeaseRequested(
                dataset=lease.dataset,
                lease_id=lease.lease_id,
                holder=self.holder,
                want=want,
                min_grant=min_grant,
                ttl_s=self.settings.lease_ttl_s,
                at=time.time(),
            )
            await self._send_extending(lease, request)
        try:
            return await asyncio.wait_for(asyncio.shield(asked), timeout=10.0)
        except TimeoutError:
            if lease.asked is asked:
                lease.asked = None  # the next caller asks again; late answers still land
            return None

    def _on_ledger_event(self, event: ev.Event) -> None:
        match event:
            case ev.LeaseGranted() | ev.LeaseDenied():
                lease = self._leases.get(event.dataset)
                current = lease is not None and lease.lease_id == event.lease_id
                if current and not lease.answered_by(event):  # type: ignore[union-attr]
                    return  # not the ledger's
                # Answer whoever waits on this lease id, even if the lease was
                # released meanwhile (its waiters then move on to a fresh lease).
                asked = self._asks.pop(event.lease_id, None)
                if current and event.remaining >= 0:
                    assert lease is not None
                    lease.more = event.remaining
                if current and isinstance(event, ev.LeaseGranted):
                    assert lease is not None
                    lease.balance += event.granted
                    # Grants are min(asked, rest): less than asked means the end.
                    lease.ledger_short = lease.dry = event.granted < lease.asked_want
                if asked is not None and not asked.done():
                    asked.set_result(event)
                if current:
                    assert lease is not None
                    lease.changed.set()
                    if isinstance(event, ev.LeaseDenied) and event.closed:
                        # Fenced at the ledger (its revocation not heard, or lost):
                        # as good as expired.
                        self._revoke(lease, expired=True)
            case ev.LeaseRevoked():
                lease = self._leases.get(event.dataset)
                if lease is None or lease.lease_id != event.lease_id:
                    return
                if not self._revoke(lease, event.expired):
                    return
                asked = self._asks.pop(event.lease_id, None)
                if asked is not None and not asked.done():
                    asked.set_result(event)
                if not event.expired:
                    # What its requests in flight may still keep, read by on_revoke.
                    # (Answers on an expired lease are claimed anew instead.)
                    self.revocations[event.dataset] = (
                        event.lease_id,
                        max(0, event.ceiling - lease.spent),
                    )
                    if self.on_revoke is not None:
                        self._spawn(self.on_revoke(event.dataset))

    def _revoke(self, lease: Lease, expired: bool) -> bool:
        """Stop spending a lease (released once its requests in flight settle);
        False if it was revoked already."""
        if lease.revoked:
            return False
        lease.revoked = True
        lease.expired = expired
        lease.balance = 0
        lease.changed.set()
        if lease.in_flight == 0:
            self._spawn(self._release(lease))
        return True

    async def _release(self, lease: Lease) -> None:
        """Hand a lease back once Kafka has every completion published on it (see
        :meth:`published`); its ``spent`` tells the ledger what is still on its way."""
        if self._leases.get(lease.dataset) is lease:
            del self._leases[lease.dataset]
        if lease.releasing:
            return
        lease.releasing = True
        await lease.published.wait()
        self._by_id.pop(lease.lease_id, None)
        await self._send(
            ev.LeaseReleased(
                dataset=lease.dataset,
                lease_id=lease.lease_id,
                holder=self.holder,
                spent=lease.spent,
                at=time.time(),
            )
        )

    async def _send(self, event: ev.Event) -> None:
        await self.producer.send_and_wait(
            self.topics.reservations, key=codec.event_key(event), value=codec.encode(event)
        )

    async def _send_extending(self, lease: Lease, event: ev.Event) -> None:
        """Send a request or renewal; once Kafka has it, the ledger cannot expire the
        lease before the TTL has passed from the moment it was sent."""
        sent_at = time.monotonic()
        await self._send(event)
        margin = min(2.0, self.settings.lease_ttl_s / 4)
        until = sent_at + self.settings.lease_ttl_s - margin
        lease.valid_until = (
            until if lease.valid_until == float("inf") else max(lease.valid_until, until)
        )

    async def maintain(self) -> None:
        """Renew leases in use, release idle ones; run as a background task by the
        dispatcher while it runs. A failed send (a broker away) is tried again on the
        next round: this task never ends on its own, or every lease would expire
        under requests still using it."""
        interval = max(0.5, self.settings.lease_ttl_s / 3)
        while True:
            await asyncio.sleep(min(interval, self.settings.idle_release_s))
            try:
                await self._maintain_once()
            except Exception as exc:
                log.warning("lease renewal failed, trying again: %r", exc)

    async def _maintain_once(self) -> None:
        now = time.monotonic()
        for lease in list(self._leases.values()):
            if lease.revoked:
                continue
            idle = lease.in_flight == 0 and now - lease.last_used > self.settings.idle_release_s
            if idle:
                await self._release(lease)
            else:
                renewal = ev.LeaseRenewed(
                    dataset=lease.dataset,
                    lease_id=lease.lease_id,
                    holder=self.holder,
                    ttl_s=self.settings.lease_ttl_s,
                    at=time.time(),
                )
                await self._send_extending(lease, renewal)

    async def hand_back_idle(self) -> None:
        """Release every lease with no request in flight now: the server gate's
        ``on_pause`` (dispatch is pausing). Raises what sending to Kafka raises."""
        for lease in list(self._leases.values()):
            if lease.in_flight == 0 and not lease.revoked:
                await self._release(lease)

    async def close(self) -> None:
        """Hand every lease back (graceful stop: nothing is left in flight). Called by
        the dispatcher as it stops; raises what sending to Kafka raises."""
        for lease in list(self._by_id.values()):
            await self._release(lease)
        self.board.lease_listeners.pop(self.holder, None)
