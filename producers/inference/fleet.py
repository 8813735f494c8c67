"""The inference servers one dispatcher drives (its fleet): where each request goes,
how many each server has at once, and each server's health.

    Fleet     the servers, by URL: a place at one of them per request, chosen by the
              policy of producers/inference/placement.py; the places they offer
              together; their changes at run time (``tokenbudget servers add|drain``); its outage
    Server    one server, and Visit, one request's place at it
              (producers/inference/server.py)

A server is ``up``; ``paused`` while it is away (its gate closed after
``[inference] pause_after_failures`` away-failures in a row: it is polled and comes
back by itself); ``dropped`` once away past ``outage_timeout_s`` (warned once, no
longer polled: the job goes on with the others); ``draining`` once drained (no new
requests, it finishes those it has) and then ``drained``. A server that stops
accepting connections while it had requests in flight has those moved: given up at
once and retried on another server (their tickets settled with nothing, so their
budget goes with them; the answer of a given-up request is never kept, so each
prompt keeps at most one). The fleet is out (:attr:`Fleet.outage`) once each of its
servers is dropped or drained and at least one is dropped: nothing will come back
by itself, and the dispatcher stops with one line saying so.

Contract, for the steps of a prompt's path:

* :meth:`Fleet.wait_ready` returns once some server can take a request (called by
  the tries before admission, so no budget is held while none can); it raises
  :class:`~tokenbudget.core.errors.ServerOutageError` once the fleet is out;
* :meth:`Fleet.visit` gives a place at the server the policy picks (a turn of a
  conversation goes back to the server that answered its previous turn), waiting
  while none has room; it raises as :meth:`Fleet.wait_ready` does. The route step
  reports how the request went (``Visit.failed``, ``Visit.succeeded``) and
  frees the place on every path (``Visit.done``, which the answer calls first);
* :meth:`Fleet.apply` takes a change read on the budgets topic (every dispatcher of
  the namespace reads the same changes, so they drive the same fleet); a server
  added that the config does not take is refused with one line, the fleet as it
  was, and an added server gets no key unless the change names one the config names;
* ``on_capacity`` hears how many requests the fleet can take at once whenever that
  changes (the dispatcher's places follow it), ``on_idle`` that no server is up any
  more (idle leases go back to the ledger), ``on_outage`` that the fleet is out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Protocol

from tokenbudget.core.config import Config, check_added_server
from tokenbudget.core.config import Server as ServerSpec
from tokenbudget.core.errors import (
    ConfigError,
    InferenceError,
    InferenceTransportError,
    ServerOutageError,
)
from tokenbudget.core.sections import RoutingPolicy
from tokenbudget.core.server_urls import in_clear
from tokenbudget.producers.inference import placement
from tokenbudget.producers.inference.backends import api_key_of, backend_for_server
from tokenbudget.producers.inference.generation import (
    InferenceBackend,
    RetryPolicy,
)
from tokenbudget.producers.inference.http import HttpClient, Timeouts
from tokenbudget.producers.inference.server import DEFAULT_BACKOFF, DEFAULT_GATE, Server, Visit
from tokenbudget.producers.inference.server_gate import GateSettings
from tokenbudget.streams import events as ev

log = logging.getLogger(__name__)


# Conversations whose last server is remembered, the oldest forgotten first.
AFFINITY_ENTRIES = 100_000


class Policy(Protocol):
    def __call__(
        self,
        candidates: list[placement.Candidate],
        tokens: int,
        rng: random.Random,
        *,
        prefer: str | None = None,
        avoid: Collection[str] = (),
    ) -> str | None: ...


def round_robin_policy() -> Policy:
    """The peers' way (``routing = "round_robin"``): each request to the next server
    in turn that is up, whether it has room or not (it then waits for it)."""
    turns = itertools.count()

    def policy(
        candidates: list[placement.Candidate],
        tokens: int,
        rng: random.Random,
        *,
        prefer: str | None = None,
        avoid: Collection[str] = (),
    ) -> str | None:
        up = [c for c in candidates if c.ready]
        return placement.round_robin(up, next(turns)) if up else None

    return policy


POLICIES: dict[RoutingPolicy, Callable[[], Policy]] = {
    "least_work": lambda: placement.pick,
    "round_robin": round_robin_policy,
}


def say_key_in_clear(spec: ServerSpec, warned: set[str]) -> None:
    """One line, once per server (``warned``: those told): its key would go over plain
    http to a host off this machine."""
    if spec.url in warned or not in_clear(spec.url) or api_key_of(spec) is None:
        return
    warned.add(spec.url)
    log.warning(
        "the inference server %s is sent its key ($%s) over plain http, readable on the "
        "way: use https://, or reach it through a loopback address (an SSH tunnel: ssh -L "
        "PORT:127.0.0.1:PORT HOST, then http://127.0.0.1:PORT)",
        spec.url,
        spec.api_key_env,
    )


class Fleet:
    """The servers one dispatcher drives (see the module's docstring). ``open_server``
    makes the server of a URL added at run time (None: none can be added);
    ``policy`` picks a server per request (:data:`POLICIES`)."""

    def __init__(
        self,
        servers: Iterable[Server] = (),
        *,
        open_server: Callable[[ServerSpec], Server] | None = None,
        policy: Policy = placement.pick,
        rng: random.Random | None = None,
    ) -> None:
        self.servers: dict[str, Server] = {}
        self._open_server = open_server
        self._policy = policy
        self._rng = rng or random.Random()
        self._ready = asyncio.Event()
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._timer: asyncio.TimerHandle | None = None
        self._capacity = -1
        self._was_up = True
        self._dropped: set[str] = set()
        self._closing: set[asyncio.Task[None]] = set()
        # The job's config: which servers added at run time it takes, and what they
        # take from it (None: any, at 64 requests in flight, without a key).
        self.config: Config | None = None
        self.warned: set[str] = set()  # servers told their key crosses in clear
        self.on_capacity: Callable[[int], None] | None = None
        self.on_idle: Callable[[], Awaitable[None]] | None = None
        self.on_outage: Callable[[], None] | None = None
        for server in servers:
            self._join(server)

    @classmethod
    def for_config(
        cls,
        config: Config,
        *,
        backend_factory: Callable[[HttpClient, ServerSpec], InferenceBackend] | None = None,
    ) -> Fleet:
        """The fleet ``config`` names, each server with an HTTP client of its own
        sized to its concurrency, gated by ``[inference]``'s pause and outage keys."""
        inference = config.inference
        timeouts = Timeouts.of(inference)
        settings = GateSettings(
            pause_after=inference.pause_after_failures,
            health_interval_s=inference.health_interval_s,
            outage_timeout_s=inference.outage_timeout_s,
        )
        backoff = RetryPolicy(inference.retries, inference.backoff_s, inference.backoff_max_s)

        def make(client: HttpClient, spec: ServerSpec) -> InferenceBackend:
            return backend_for_server(config, client, spec)

        factory = backend_factory or make
        fleet: Fleet

        def open_server(spec: ServerSpec) -> Server:
            say_key_in_clear(spec, fleet.warned)
            client = HttpClient(spec.concurrency, timeouts, inference.max_reply_bytes)
            backend = factory(client, spec)
            return Server(
                spec, backend, settings, backoff=backoff, client=client, on_change=fleet.changed
            )

        fleet = cls(open_server=open_server, policy=POLICIES[inference.routing]())
        fleet.config = config
        for spec in config.servers:
            fleet._join(open_server(spec))
        return fleet

    @classmethod
    def of(
        cls,
        *backends: InferenceBackend,
        gate: GateSettings = DEFAULT_GATE,
        backoff: RetryPolicy = DEFAULT_BACKOFF,
    ) -> Fleet:
        """A fleet of ``backends`` (their ``base_url`` tells them apart), each server
        without an HTTP client of its own: for stand-in backends."""
        fleet = cls()
        for backend in backends:
            spec = ServerSpec(url=backend.base_url, concurrency=1_000_000, api_key_env="")
            fleet._join(Server(spec, backend, gate, backoff=backoff, on_change=fleet.changed))
        return fleet

    # ---- the steps' side ------------------------------------------------------------

    @property
    def outage(self) -> ServerOutageError | None:
        """Set once every server is dropped or drained, one at least dropped."""
        if not self._dropped:
            return None  # the common case, asked several times per request: no states
        states = [server.state for server in self.servers.values()]
        if any(state not in ("dropped", "drained") for state in states):
            return None
        dropped = [s for s in self.servers.values() if s.state == "dropped"]
        if len(self.servers) == 1:
            return dropped[0].gate.outage
        timeout = dropped[0].gate.settings.outage_timeout_s
        return ServerOutageError(
            f"every inference server has been away for more than {timeout:g} s "
            f"([inference] outage_timeout_s): {', '.join(s.url for s in dropped)}; check "
            "them, then run the same command again to resume"
        )

    async def wait_ready(self) -> None:
        """Return once some server can take a request; raise the outage once out."""
        while True:
            outage = self.outage
            if outage is not None:
                raise outage
            if self._ready.is_set():
                return
            await self._ready.wait()

    async def visit(
        self, prompt: ev.PromptEvent, tokens: int, avoid: Collection[str] = ()
    ) -> Visit:
        """A place for ``prompt``'s request reserving ``tokens`` at the server the
        policy picks, avoiding those in ``avoid`` while another can take it."""
        conversation = prompt.conversation_id
        prefer = self._affinity.get(conversation) if conversation else None
        while True:
            await self.wait_ready()
            now = time.monotonic()
            candidates = [s.candidate(now) for s in self.servers.values()]
            url = self._policy(candidates, tokens, self._rng, prefer=prefer, avoid=avoid)
            if url is None:
                self._ready.clear()  # stale: looked at again on the next change
                continue
            server = self.servers[url]
            while server.state == "up" and server.in_flight >= server.window.size:
                await server.room()  # round robin: its turn's server, whatever its load
            if server.candidate(time.monotonic()).has_room:
                visit = server.visit(tokens)
                self.changed()
                return visit

    def answered_by(self, prompt: ev.PromptEvent, url: str) -> None:
        """``url`` answered ``prompt``: the next turn of its conversation goes there."""
        if prompt.conversation_id:
            self._affinity[prompt.conversation_id] = url
            self._affinity.move_to_end(prompt.conversation_id)
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)

    # ---- the fleet's changes ----------------------------------------------------------

    def apply(self, event: ev.ServerAdded | ev.ServerDrained) -> None:
        """A change read on the control topic (``tokenbudget servers add|drain``). An
        added server the config does not take (:func:`check_added_server`) is refused
        with one line, and the fleet stays as it was."""
        server = self.servers.get(event.url)
        if isinstance(event, ev.ServerDrained):
            if server is not None and not server.draining:
                log.warning(
                    "the inference server %s is drained: it finishes what it has", event.url
                )
                server.drain()
            return
        try:
            spec = self._added(event, server)
        except ConfigError as exc:
            log.warning("a server added at run time is refused (%s): %s", event.by or "?", exc)
            return
        if server is not None and server.state != "dropped":
            if server.draining:
                log.warning("the inference server %s is back in the fleet", event.url)
            server.restore(spec)
            return
        if self._open_server is None:
            return
        if server is not None:
            self._forget(server)
        log.warning("the inference server %s joins the fleet", event.url)
        joined = self._open_server(spec)
        self._join(joined)
        joined.gate.down(InferenceTransportError("added: not probed yet"))

    def _added(self, event: ev.ServerAdded, server: Server | None) -> ServerSpec:
        """The settings of a server added at run time: the event's, else those it had
        (else ``[inference]``'s concurrency). Its key is only the one the event names,
        or a configured server's own: never another server's because the event names
        none. Raises ConfigError when the config does not take it."""
        configured = None
        concurrency = 64
        if self.config is not None:
            check_added_server(self.config, event.url, event.api_key_env)
            configured = next((s for s in self.config.servers if s.url == event.url), None)
            concurrency = self.config.inference.concurrency
        before = server.spec if server is not None else configured
        key_env = configured.api_key_env if configured is not None else ""
        return ServerSpec(
            url=event.url,
            concurrency=event.concurrency or (before.concurrency if before else concurrency),
            api_key_env=key_env if event.api_key_env is None else event.api_key_env,
            weight=event.weight or (before.weight if before else 1.0),
        )

    async def start(self) -> None:
        """Probe every server once: those that do not answer start paused."""

        async def probe(server: Server) -> None:
            try:
                await server.backend.health()
            except InferenceError as exc:
                server.gate.down(exc)

        await asyncio.gather(*(probe(s) for s in list(self.servers.values())))
        self.changed()

    def changed(self) -> None:
        """Something routing depends on changed: wake those waiting, follow the
        capacity, and say when no server is up any more or the fleet is out."""
        now = time.monotonic()
        ready = False
        capacity = 0
        waiting_until: float | None = None
        for server in self.servers.values():
            state = server.state
            if state == "dropped" and server.url not in self._dropped:
                self._dropped.add(server.url)
                self._say_dropped(server)
            if state != "up":
                if state == "drained" and server.client is not None:
                    self._close(server)
                continue
            capacity += server.window.size
            if server.in_flight < server.window.size:
                if now >= server.not_before:
                    ready = True
                elif waiting_until is None or server.not_before < waiting_until:
                    waiting_until = server.not_before
        self._after(ready, capacity, waiting_until)

    def capacity(self) -> int:
        """Requests the fleet's servers that are up may have at once now."""
        return sum(s.window.size for s in self.servers.values() if s.state == "up")

    def report(self, holder: str) -> ev.FleetReport:
        return ev.FleetReport(
            holder=holder,
            servers=tuple(s.report() for s in self.servers.values()),
            at=time.time(),
        )

    async def report_every(
        self, publish: Callable[[ev.FleetReport], Awaitable[None]], holder: str, interval: float
    ) -> None:
        """Publish what this dispatcher sees of the fleet every ``interval`` seconds."""
        while True:
            with contextlib.suppress(Exception):  # a report is informative: the next one
                await publish(self.report(holder))
            await asyncio.sleep(interval)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for server in list(self.servers.values()):
            await server.close()
        for task in list(self._closing):
            with contextlib.suppress(Exception):
                await task

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- inside -----------------------------------------------------------------------

    def _join(self, server: Server) -> None:
        self.servers[server.url] = server
        server._on_change = self.changed
        self.changed()

    def _forget(self, server: Server) -> None:
        del self.servers[server.url]
        self._dropped.discard(server.url)
        task = asyncio.get_running_loop().create_task(server.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _close(self, server: Server) -> None:
        """A drained server's connections are closed (it stays listed, drained)."""
        client, server.client = server.client, None
        if client is not None:
            task = asyncio.get_running_loop().create_task(client.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _after(self, ready: bool, capacity: int, waiting_until: float | None) -> None:
        outage = self.outage
        if ready or outage is not None:
            self._ready.set()  # on an outage, the waiters wake to raise it
        else:
            self._ready.clear()
        if waiting_until is not None and not ready:
            self._wake_at(waiting_until)
        if capacity != self._capacity:
            self._capacity = capacity
            if self.on_capacity is not None:
                self.on_capacity(capacity)
        up = capacity > 0
        if self._was_up and not up and outage is None:
            self._say_idle()
        self._was_up = up
        if outage is not None and self.on_outage is not None:
            self.on_outage()

    def _wake_at(self, when: float) -> None:
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(loop.time() + max(0.0, when - time.monotonic()), self.changed)

    def _say_dropped(self, server: Server) -> None:
        others = [s for s in self.servers.values() if s.state not in ("dropped", "drained")]
        if not others:
            return  # the fleet is out: the dispatcher says so, once
        log.warning(
            "the inference server %s has been away for more than %g s ([inference] "
            "outage_timeout_s): dropped, the job goes on with the other %d (`tokenbudget "
            "servers add %s` brings it back)",
            server.url,
            server.gate.settings.outage_timeout_s,
            len(others),
            server.url,
        )

    def _say_idle(self) -> None:
        if any(s.state == "paused" for s in self.servers.values()):
            log.warning("no inference server is up: dispatch waits for one to answer")
        elif self.servers and all(s.draining for s in self.servers.values()):
            log.warning(
                "every inference server is drained: dispatch waits for `tokenbudget "
                "servers add URL`"
            )
        if self.on_idle is not None:
            task = asyncio.get_running_loop().create_task(self._idle())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _idle(self) -> None:
        assert self.on_idle is not None
        try:
            await self.on_idle()
        except Exception as exc:  # handing back leases is best effort
            log.warning("handing back idle leases: %r", exc)
