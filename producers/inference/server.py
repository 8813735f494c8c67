"""One server of the fleet (:class:`~tokenbudget.producers.inference.fleet.Fleet`) and a
request's place at it.

    Server    one server: its backend (and HTTP client), its gate
              (producers/inference/server_gate.py), its window and pace
              (producers/inference/placement.py), its requests in flight and the
              tokens reserved for them, and its state (:data:`STATES`)
    Visit     one request's place at a server, and the backend the request attempt
              sends through: freed the moment the server answers
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from tokenbudget.core import metrics
from tokenbudget.core.config import Server as ServerSpec
from tokenbudget.core.errors import (
    InferenceError,
    InferenceTransportError,
)
from tokenbudget.producers.inference import placement
from tokenbudget.producers.inference.generation import (
    GenerationRequest,
    GenerationResult,
    InferenceBackend,
    RetryPolicy,
)
from tokenbudget.producers.inference.http import HttpClient
from tokenbudget.producers.inference.server_gate import GateSettings, ServerGate
from tokenbudget.streams.fields import ServerReport, ServerState

STATES: tuple[ServerState, ...] = ("up", "paused", "dropped", "draining", "drained")


DEFAULT_GATE = GateSettings()
DEFAULT_BACKOFF = RetryPolicy()


class Visit(InferenceBackend):
    """One request's place at a server, and the backend the request attempt sends it
    through: it frees the place as soon as the server answers, tells the server how
    the answer went, and turns its cancellation by a move into an away error."""

    def __init__(self, server: Server, tokens: int) -> None:
        # Not InferenceBackend.__init__: the server's own backend holds the client.
        backend = server.backend
        self.server = server
        self.url = server.url
        self.tokens = tokens
        self.api = backend.api
        self.base_url = backend.base_url
        self.model = backend.model
        self.stream = backend.stream
        self.tokenizer = backend.tokenizer
        self.moved = False
        self._task: asyncio.Task[object] | None = None
        self._left = False

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        server = self.server
        self._task = asyncio.current_task()
        sent, wall = time.monotonic(), time.time()
        try:
            result = await server.backend.generate(request)
        except asyncio.CancelledError:
            if not self.moved:
                raise
            raise InferenceTransportError(
                f"{server.url} went away with this request in flight: sent to another server"
            ) from None
        finally:
            self._task = None
            self.done()
        server.answered(result, time.monotonic() - sent, wall)
        return result

    async def abort(self, rid: str) -> None:
        await self.server.backend.abort(rid)

    async def health(self) -> None:
        await self.server.backend.health()

    def move(self) -> None:
        """Give the request up (its server is away): its attempt fails as away."""
        if self._task is not None:
            self.moved = True
            self._task.cancel()

    def done(self) -> None:
        """Free the place (once; every later call does nothing)."""
        if not self._left:
            self._left = True
            self.server.left(self)

    def failed(self, error: InferenceError) -> None:
        """The request failed with ``error``: the server hears it, unless the request
        was moved (the server is known to be away already)."""
        self.server.failed(error, moved=self.moved)

    def succeeded(self) -> None:
        self.server.succeeded()


class Server:
    """One server of the fleet (see the module's docstring). ``on_change`` hears every
    change routing depends on: its state, its window, its places."""

    def __init__(
        self,
        spec: ServerSpec,
        backend: InferenceBackend,
        gate: GateSettings,
        *,
        backoff: RetryPolicy = DEFAULT_BACKOFF,
        client: HttpClient | None = None,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.spec = spec
        self.url = spec.url
        self.backend = backend
        self.client = client
        self.window = placement.Window.full(spec.concurrency)
        self.pace = placement.Pace()
        self.in_flight = 0
        self.outstanding = 0  # tokens reserved for its requests in flight
        self.not_before = 0.0  # monotonic: held back till then (Retry-After, backoff)
        self.backoff = backoff
        self.away_in_row = 0  # away-failures since its last answer
        self.draining = False
        self.requests = self.tokens = self.errors = 0
        self.visits: set[Visit] = set()
        self._on_change = on_change
        self._moving = False  # its last away-failure was a connection's
        self._room: list[asyncio.Future[None]] = []  # round robin: waiting for its room
        self.gate = ServerGate(backend.health, gate, url=spec.url, on_change=self._gate_changed)
        self._shown: str | None = None
        self._metrics = (
            metrics.SERVER_REQUESTS.labels(server=self.url),
            metrics.SERVER_TOKENS.labels(server=self.url),
            metrics.SERVER_IN_FLIGHT.labels(server=self.url),
            metrics.SERVER_LIMIT.labels(server=self.url),
        )
        self._metrics[3].set(self.window.size)
        self._show()

    @property
    def state(self) -> ServerState:
        if self.gate.outage is not None:
            return "dropped"
        if not self.gate.is_open:
            return "paused"
        if self.draining:
            return "draining" if self.in_flight else "drained"
        return "up"

    def candidate(self, now: float) -> placement.Candidate:
        return placement.Candidate(
            url=self.url,
            weight=self.spec.weight,
            speed=self.pace.recent,
            in_flight=self.in_flight,
            limit=self.window.size,
            outstanding=self.outstanding,
            ready=self.state == "up" and now >= self.not_before,
        )

    def visit(self, tokens: int) -> Visit:
        """A place for a request reserving ``tokens``."""
        visit = Visit(self, tokens)
        self.visits.add(visit)
        self.in_flight += 1
        self.outstanding += tokens
        self.requests += 1
        self._metrics[0].inc()
        self._metrics[2].set(self.in_flight)
        return visit

    def left(self, visit: Visit) -> None:
        self.visits.discard(visit)
        self.in_flight -= 1
        self.outstanding -= visit.tokens
        self._metrics[2].set(self.in_flight)
        self._wake_room(everyone=False)
        self._on_change()

    async def room(self) -> None:
        """Until a request of this server ends (round robin waits here for its turn's
        server)."""
        waiter = asyncio.get_running_loop().create_future()
        self._room.append(waiter)
        await waiter

    def answered(self, result: GenerationResult, seconds: float, sent_at: float) -> None:
        """An answer came back after ``seconds`` (sent at ``sent_at``, wall clock)."""
        self.tokens += result.completion_tokens
        self._metrics[1].inc(result.completion_tokens)
        if result.first_token_at is not None:
            metrics.SERVER_TTFT.labels(server=self.url).observe(
                max(0.0, result.first_token_at - sent_at)
            )
        self.pace = self.pace.observed(result.completion_tokens, seconds)
        window = self.window.grown(self.in_flight + 1)
        if self.pace.slow:
            window = window.cut(time.monotonic())
        self._set_window(window)

    def failed(self, error: InferenceError, *, moved: bool = False) -> None:
        self.errors += 1
        kind = "moved" if moved else type(error).__name__
        metrics.SERVER_ERRORS.labels(server=self.url, kind=kind).inc()
        if moved:
            return
        now = time.monotonic()
        if error.busy:
            self._set_window(self.window.cut(now))
        if error.server_away:
            # Held back, not the prompt: it may go to another server at once.
            self.away_in_row += 1
            hold = self.backoff.delay(min(self.away_in_row, 8), error.retry_after)
            self.not_before = max(self.not_before, now + hold)
            self._moving = isinstance(error, InferenceTransportError)
        self.gate.failed(error)
        self._on_change()

    def succeeded(self) -> None:
        """A request was answered: its away-failures in a row start again."""
        self.away_in_row = 0
        self.gate.succeeded()

    def drain(self) -> None:
        self.draining = True
        self._wake_room(everyone=True)
        self._show()
        self._on_change()

    def restore(self, spec: ServerSpec) -> None:
        """Added again: back in the fleet, with ``spec``'s concurrency and weight."""
        self.spec = spec
        self.draining = False
        self._set_window(self.window.resized(spec.concurrency))
        self._show()
        self._on_change()

    def report(self) -> ServerReport:
        return ServerReport(
            url=self.url,
            state=self.state,
            in_flight=self.in_flight,
            limit=self.window.size,
            concurrency=self.spec.concurrency,
            requests=self.requests,
            tokens=self.tokens,
            errors=self.errors,
        )

    async def close(self) -> None:
        await self.gate.close()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.aclose()

    def _set_window(self, window: placement.Window) -> None:
        if window.size != self.window.size:
            self._metrics[3].set(window.size)
        self.window = window

    def _gate_changed(self) -> None:
        if not self.gate.is_open and self._moving:
            # It stopped taking connections: what it has in flight is as good as lost
            # (SIGKILL resets it at once, a frozen host holds it till read_timeout_s).
            for visit in list(self.visits):
                visit.move()
        self._wake_room(everyone=True)
        self._show()
        self._on_change()

    def _wake_room(self, *, everyone: bool) -> None:
        while self._room:
            waiter = self._room.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                if not everyone:
                    return

    def _show(self) -> None:
        state = self.state
        if state != self._shown:
            for name in STATES:
                metrics.SERVER_STATE.labels(server=self.url, state=name).set(name == state)
            self._shown = state
