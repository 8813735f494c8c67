"""The server gate: a server of the fleet gets no requests while it is away.

One gate per server (:class:`tokenbudget.producers.inference.server.Server`), shared by all its
requests.
Contract:

* :attr:`ServerGate.is_open` while the server answers; while it is away the fleet
  sends it nothing and a single prober polls its health (:meth:`ServerGate.wait_open`
  returns once it is open again);
* :meth:`ServerGate.failed` with a "server away" error (connection refused, reset or
  timed out; HTTP 429/408/502/503/504) counts towards ``pause_after`` such errors in
  a row, which close the gate; :meth:`ServerGate.succeeded` resets the count;
* a closed gate stays closed for at least the server's ``Retry-After`` and then until
  its health check passes; each pause that ends in new failures doubles the next
  wait (up to :data:`MAX_PAUSE_S`), so a server that says "healthy" but cannot take
  the load is not flooded again at once;
* :meth:`ServerGate.down` closes it at once (the server did not answer its probe
  when the dispatcher started);
* ``on_change`` runs whenever the gate closes, opens or gives up, and a server away
  for longer than ``outage_timeout_s`` (0: for ever) is given up: :attr:`outage` is
  set, probing stops, and every waiter raises
  :class:`~tokenbudget.core.errors.ServerOutageError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tokenbudget.core import metrics
from tokenbudget.core.errors import InferenceError, ServerOutageError
from tokenbudget.core.tasks import cancel_and_wait

log = logging.getLogger(__name__)

MAX_PAUSE_S = 60.0


@dataclass(frozen=True)
class GateSettings:
    pause_after: int = 5
    health_interval_s: float = 2.0
    outage_timeout_s: float = 3600.0  # 0: wait for ever


class ServerGate:
    def __init__(
        self,
        health: Callable[[], Awaitable[None]],
        settings: GateSettings,
        *,
        url: str = "",
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._health = health
        self.settings = settings
        self.url = url
        self._on_change = on_change
        self._open = asyncio.Event()
        self._open.set()
        self._failures = 0
        self._pauses = 0  # pauses since the last success, for the growing wait
        self._retry_after = 0.0
        self._away_since: float | None = None
        self._prober: asyncio.Task[None] | None = None
        self._outage: ServerOutageError | None = None
        self.paused_total = 0

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def outage(self) -> ServerOutageError | None:
        """Set once the server has been away longer than allowed."""
        return self._outage

    async def wait_open(self) -> None:
        """Return once the gate is open (at once while the server answers). Raises
        :class:`~tokenbudget.core.errors.ServerOutageError` once the server has been away
        too long. Called by the dispatcher's tries before each admission."""
        while not self._open.is_set():
            if self._outage is not None:
                raise self._outage
            await self._open.wait()
        if self._outage is not None:
            raise self._outage

    def succeeded(self) -> None:
        """A request was answered: the count of failures in a row starts again.
        Called by the dispatcher's tries."""
        self._failures = 0
        self._pauses = 0
        self._away_since = None

    def failed(self, error: InferenceError) -> None:
        """A request failed with ``error``; a "server away" error counts towards the
        pause (see the module's contract). Called by the dispatcher's tries."""
        if not error.server_away:
            return
        if error.retry_after:
            self._retry_after = max(self._retry_after, error.retry_after)
        if self._away_since is None:
            self._away_since = time.monotonic()
        self._failures += 1
        if self._failures >= self.settings.pause_after and self._open.is_set():
            self._pause(error)

    def down(self, error: InferenceError) -> None:
        """The server is away already (it did not answer when probed): close the gate
        now, and poll it like any server away. Called by the fleet as it starts."""
        if self._away_since is None:
            self._away_since = time.monotonic()
        self._failures = max(self._failures, self.settings.pause_after)
        if self._open.is_set() and self._outage is None:
            self._pause(error)

    def _pause(self, error: InferenceError) -> None:
        self._open.clear()
        self._pauses += 1
        self.paused_total += 1
        metrics.SERVER_PAUSES.inc()
        log.warning(
            "the inference server %s is away (%d failures in a row, last: %s): it gets no "
            "requests until it answers its health check",
            self.url,
            self._failures,
            error,
        )
        self._prober = asyncio.get_running_loop().create_task(self._probe())
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    async def _probe(self) -> None:
        wait = min(MAX_PAUSE_S, self.settings.health_interval_s * 2 ** (self._pauses - 1))
        await asyncio.sleep(max(wait, self._retry_after))
        self._retry_after = 0.0
        while True:
            try:
                await self._health()
                break
            except InferenceError as exc:
                log.debug("health check of %s failed: %s", self.url, exc)
            if self._outage_exceeded():
                self._outage = ServerOutageError(
                    f"the inference server {self.url} has been away for more than "
                    f"{self.settings.outage_timeout_s:g} s ([inference] outage_timeout_s); "
                    "check it, then run the same command again to resume"
                )
                self._open.set()  # the waiters raise it
                self._changed()
                return
            await asyncio.sleep(self.settings.health_interval_s)
        self._failures = 0
        away = time.monotonic() - self._away_since if self._away_since is not None else 0.0
        log.warning(
            "the inference server %s answers again after %.0f s away: it gets requests again",
            self.url,
            away,
        )
        self._open.set()
        self._changed()

    def _outage_exceeded(self) -> bool:
        limit = self.settings.outage_timeout_s
        since = self._away_since
        return bool(limit) and since is not None and time.monotonic() - since > limit

    async def close(self) -> None:
        await cancel_and_wait(self._prober, ignore_errors=True)
