"""A dispatcher's places: how many requests are at the server, answers being
published and prompts waiting aside for budget, each at most ``concurrency``.

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
from collections.abc import AsyncIterator


class Slot:
    """A request's place at the server, handed over to a place among the answers
    being published once the server has answered; lent to other prompts while its
    own waits for budget.

    Made holding ``server`` (acquired by whoever makes it); ``waiting`` None: the
    prompt never waits aside (it keeps its place while it waits)."""

    def __init__(
        self,
        server: asyncio.Semaphore,
        publishing: asyncio.Semaphore,
        waiting: asyncio.Semaphore | None = None,
    ) -> None:
        self._server: asyncio.Semaphore | None = server
        self._publishing = publishing
        self._waiting = waiting
        self._held: asyncio.Semaphore | None = None
        self.answered = False  # the server has answered this prompt

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
            await server.acquire()
            self._server = server

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


class Places:
    """The places of one dispatcher (of one server, when there are several): at
    the server, among the answers being published and among the prompts waiting
    aside, ``concurrency`` of each."""

    def __init__(self, concurrency: int) -> None:
        self._server = asyncio.Semaphore(concurrency)
        self._publishing = asyncio.Semaphore(concurrency)
        self._waiting = asyncio.Semaphore(concurrency)

    async def take(self, handing_back: asyncio.Event) -> Slot | None:
        """A slot holding a place at the server, once one is free; None (and no
        place) once ``handing_back`` is set, before or while it waits. Called by the
        dispatcher's consume loop before it starts a prompt."""
        if handing_back.is_set():
            return None
        if not self._server.locked():
            await self._server.acquire()
            return self._slot()
        place = asyncio.ensure_future(self._server.acquire())
        stopping = asyncio.ensure_future(handing_back.wait())
        await asyncio.wait({place, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not place.done():
            place.cancel()  # a waiter cancelled before it got the place takes nothing
            return None
        if handing_back.is_set():
            self._server.release()
            return None
        return self._slot()

    def _slot(self) -> Slot:
        return Slot(self._server, self._publishing, self._waiting)
