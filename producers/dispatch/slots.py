"""A dispatcher's places: how many prompts are at the fleet's servers, answers being
published and prompts waiting aside for budget, each at most what the fleet can
take at once (its servers' windows, which change: :class:`Capacity`).

:class:`Places` hands each prompt a :class:`Slot` (:meth:`Places.take`, called by the
dispatcher's consume loop before it starts a prompt); the slot goes down the
prompt's path with it:

* admission waits for budget inside :meth:`Slot.aside`, so a prompt waiting for
  budget does not keep prompts of other datasets from the server;
* the request attempt calls :meth:`Slot.hand_over` once the server has answered,
  which frees the server's place for the next request (and marks the prompt
  :attr:`Slot.answered`: handing back, its answer is published, not dropped);
* the dispatcher calls :meth:`Slot.release` when the prompt has its outcome.

Answers being published hold places of their own so that the server's places are
free again as soon as it answers, however slowly Kafka takes the answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Protocol


class Pool(Protocol):
    """What a slot takes places from: an :class:`asyncio.Semaphore` or a
    :class:`Capacity`."""

    async def acquire(self) -> object: ...

    def release(self) -> None: ...

    def locked(self) -> bool: ...


class Capacity:
    """A semaphore whose number of places can change while places are taken (the
    fleet's, as servers come and go and their windows move): a release or a larger
    size lets waiters in, first come first served; a smaller one lets none in until
    enough are released."""

    def __init__(self, places: int) -> None:
        self.places = places
        self.taken = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def locked(self) -> bool:
        return self.taken >= self.places or bool(self._waiters)

    async def acquire(self) -> bool:
        if not self.locked():
            self.taken += 1
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # let in, then cancelled before it went on
            raise
        return True

    def release(self) -> None:
        self.taken -= 1
        self._let_in()

    def resize(self, places: int) -> None:
        self.places = places
        self._let_in()

    def _let_in(self) -> None:
        while self._waiters and self.taken < self.places:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.taken += 1
                waiter.set_result(None)


async def _acquire_unless(pool: Pool, stop: asyncio.Event) -> bool:
    """A place from ``pool`` (True), or none (False) once ``stop`` is set while it
    waits; a place given just as ``stop`` is set is kept (True)."""
    if not pool.locked():
        await pool.acquire()
        return True
    place = asyncio.ensure_future(pool.acquire())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({place, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if place.done():
        return True
    place.cancel()  # a waiter cancelled before it got the place takes nothing
    return False


class Slot:
    """A request's place at the server, handed over to a place among the answers
    being published once the server has answered; lent to other prompts while its
    own waits for budget.

    Made holding ``server`` (acquired by whoever makes it); ``waiting`` None: the
    prompt never waits aside (it keeps its place while it waits)."""

    def __init__(
        self,
        server: Pool,
        publishing: Pool,
        waiting: Pool | None = None,
        stop: asyncio.Event | None = None,
    ) -> None:
        self._server: Pool | None = server
        self._publishing = publishing
        self._waiting = waiting
        self._stop = stop  # set: no place is waited for any more (see aside)
        self._held: Pool | None = None
        self.answered = False  # the server has answered this prompt
        # Told +1 when the prompt starts waiting for budget and -1 when it stops (a
        # :class:`Backlog`'s count for the partition the prompt came from).
        self.on_wait: Callable[[int], None] | None = None

    @contextlib.asynccontextmanager
    async def aside(self) -> AsyncIterator[None]:
        """Free the server place while the prompt waits for budget, so prompts of
        other datasets are not queued behind it, and take a place back (waiting
        like any new prompt) before it goes on. The prompt keeps a place among the
        waiting instead, so at most as many wait aside as the server has places;
        past that, it waits where it is.

        An answer waiting to be claimed anew (its lease expired) lends its place among
        the answers being published instead, always: the budget it waits for may be
        held by a request of the same lease that needs such a place to settle.

        Entered by admission around each of its waits (and by the retries around
        their backoff); a cancellation inside leaves the slot holding what it held
        before, to be released by :meth:`release`."""
        held = self._held
        if held is not None:
            held.release()
            self._held = None
            try:
                yield
            finally:
                await held.acquire()
                self._held = held
            return
        if self.on_wait is not None:
            self.on_wait(1)
        try:
            async with self._lent():
                yield
        finally:
            if self.on_wait is not None:
                self.on_wait(-1)

    @contextlib.asynccontextmanager
    async def _lent(self) -> AsyncIterator[None]:
        """The server place lent while the prompt waits, when there is room aside."""
        server, waiting = self._server, self._waiting
        if server is None or waiting is None or waiting.locked():
            yield
            return
        await waiting.acquire()  # not locked: returns at once
        server.release()
        self._server = None
        try:
            yield
        finally:
            waiting.release()
            await self._place_back(server)
            self._server = server

    async def _place_back(self, server: Pool) -> None:
        """A place at the server again, for a prompt back from aside; a cancellation
        instead once ``stop`` is set (the fleet is out: it may have no place to give
        ever again, and the dispatcher waits for its prompts to end), the prompt then
        holding none."""
        if self._stop is None:
            await server.acquire()
        elif not await _acquire_unless(server, self._stop):
            raise asyncio.CancelledError

    async def hand_over(self) -> None:
        """The server has answered: mark the prompt :attr:`answered`, and trade its
        place at the server for one among the answers being published (waiting for
        one). Called by the request attempt right after the answer came in."""
        self.answered = True
        if self._server is None:
            return
        await self._publishing.acquire()
        self._held = self._publishing
        self._server.release()
        self._server = None

    def release(self) -> None:
        """Give back whatever place the slot holds; never raises. Called once the
        prompt has its outcome (or is given up)."""
        if self._server is not None:
            self._server.release()
            self._server = None
        if self._held is not None:
            self._held.release()
            self._held = None


# Prompts waiting aside per place at the servers: room for a whole window of one
# dataset's prompts (the producer keeps each at most four times the places ahead, and
# near its budget's end only about twice what its rest buys; a partition with a window
# waiting is paused, :class:`Backlog`) before a waiting prompt keeps its server place.
ASIDE_PER_PLACE = 4


class Places:
    """The places of one dispatcher: at the fleet's servers and among the answers
    being published, ``concurrency`` of each to start with (the fleet's
    concurrency), and :data:`ASIDE_PER_PLACE` times that among the prompts waiting
    aside; then as :meth:`resize` says."""

    def __init__(self, concurrency: int) -> None:
        self._server = Capacity(concurrency)
        self._publishing = Capacity(concurrency)
        self._waiting = Capacity(ASIDE_PER_PLACE * concurrency)

    def resize(self, places: int) -> None:
        """The fleet can take ``places`` requests at once now. Called by the fleet
        (its ``on_capacity``); answers being published and prompts waiting aside
        keep the room they had, and grow with it."""
        self._server.resize(places)
        self._publishing.resize(max(self._publishing.places, places))
        self._waiting.resize(max(self._waiting.places, ASIDE_PER_PLACE * places))

    async def take(self, handing_back: asyncio.Event) -> Slot | None:
        """A slot holding a place at the server, once one is free; None (and no
        place) once ``handing_back`` is set, before or while it waits. Called by the
        dispatcher's consume loop before it starts a prompt."""
        if handing_back.is_set():
            return None
        if not await _acquire_unless(self._server, handing_back):
            return None
        if handing_back.is_set():
            self._server.release()
            return None
        return self._slot(handing_back)

    def _slot(self, handing_back: asyncio.Event) -> Slot:
        return Slot(self._server, self._publishing, self._waiting, stop=handing_back)


class Backlog:
    """Prompts waiting for budget, counted by where they were read from (a partition
    of the prompts topic), and the partitions paused because of them.

    Prompts are keyed by dataset, so a dataset at its budget's end has the rest of its
    prompts in its partition: read on, they would all wait (aside, then holding the
    fleet's places), and the prompts of other datasets read after them would find no
    place. In ``bench/fleet.py`` a dataset with a third of its budget left had ~5
    requests in flight out of 1,024 while three others waited at their budgets' ends.

    At ``pause_at`` prompts waiting from one partition, ``pause`` stops the reading
    from it, and at half that ``resume`` starts it again. A partition shared with
    another dataset pauses that one too while it lasts: the dispatcher pauses at
    ``[producer] max_queued_per_dataset`` (all that one dataset has queued), so such a
    dataset is held up only when several wait at once."""

    def __init__(
        self,
        pause_at: int,
        pause: Callable[[Hashable], None],
        resume: Callable[[Hashable], None],
    ) -> None:
        self.pause_at = max(1, pause_at)
        self._pause = pause
        self._resume = resume
        self.counts: dict[Hashable, int] = {}
        self.paused: set[Hashable] = set()

    def waiting(self, where: Hashable, change: int) -> None:
        """A prompt read from ``where`` starts (+1) or stops (-1) waiting for budget:
        a :attr:`Slot.on_wait`."""
        count = self.counts[where] = max(0, self.counts.get(where, 0) + change)
        if count >= self.pause_at and where not in self.paused:
            self.paused.add(where)
            self._pause(where)
        elif count <= self.pause_at // 2 and where in self.paused:
            self.paused.discard(where)
            self._resume(where)

    def forget(self, where: Hashable) -> None:
        """``where`` was taken away (a rebalance): its pause went with it."""
        self.paused.discard(where)
        self.counts.pop(where, None)
