"""Requests in flight, and what those on a revoked lease may still keep.

A lowered budget revokes leases (:mod:`tokenbudget.producers.dispatch.admission`); the requests
already at
the server on such a lease keep, between them, only the lease's allowance (a
:class:`RevokedCap`). :class:`InFlight` is the dispatcher's register of its requests
at the server and enforces that:

* the request attempt registers each request while the server has it
  (:meth:`InFlight.add`, :meth:`InFlight.remove`) and passes
  :meth:`InFlight.on_progress` to the backend as the request's progress callback;
* :class:`~tokenbudget.producers.dispatch.admission.Admission` calls :meth:`InFlight.on_revoke` (its
  ``on_revoke``) when it reads a revocation of a lease in use: the one way admission
  reaches back, with a dataset's name and nothing else;
* an answer that comes back on a revoked lease is cut to what the cap still holds
  (:meth:`InFlight.fit`) before it is kept.

Streamed requests on a revoked lease run on while what they generated together fits
and are aborted together the moment it no longer does; without streaming they are
aborted at once. A streamed request on a growing ticket (``[budget] reserve =
"grow"``) grows its reservation as its tokens come, a little ahead of them
(:meth:`~tokenbudget.producers.dispatch.growth.Growth.grow`), and is aborted alone once it
has outgrown what it holds and can grow no more. SGLang is told by rid (a dropped
connection alone may not stop it decoding); on OpenAI-compatible servers closing the
stream is the only abort.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from tokenbudget.core.apis import API_TRAITS
from tokenbudget.producers.dispatch.admission import Admission
from tokenbudget.producers.dispatch.answers import kept_within
from tokenbudget.producers.dispatch.leases import Ticket
from tokenbudget.producers.inference.generation import GenerationResult, InferenceBackend
from tokenbudget.streams import budget
from tokenbudget.streams import events as ev

log = logging.getLogger(__name__)


@dataclass
class RevokedCap:
    """What the requests in flight on a revoked lease may still keep, between them.

    ``left`` starts as the lease's allowance (its ceiling less what the holder had
    already spent). Streamed requests report their tokens as they arrive
    (:meth:`progress`): the moment what they generated together reaches ``left``,
    nothing more any of them generates can be kept, so all of them are to be
    aborted at once. Answers are then kept in the order they come back, the one
    that crosses the line cut at it (:meth:`fit`).
    """

    left: int
    generated: dict[str, int] = field(default_factory=dict)  # rid -> tokens so far
    aborting: bool = False

    def progress(self, rid: str, tokens: int) -> bool:
        """Record a request's tokens so far; True once (the first time the
        requests' tokens reach what may be kept): abort them all now."""
        self.generated[rid] = tokens
        return self.check()

    def check(self) -> bool:
        if self.aborting or sum(self.generated.values()) < self.left:
            return False
        self.aborting = True
        return True

    def fit(self, rid: str, cost: int, cuttable: bool) -> int | None:
        """How much of an answer costing ``cost`` is kept (:func:`tokenbudget.streams.budget.fit`):
        all of it, what is left when it can be cut at a token, or None."""
        self.generated.pop(rid, None)
        keep = budget.fit(cost, self.left, cuttable)
        if keep is not None:
            self.left -= keep
        return keep

    def forget(self, rid: str) -> None:
        """A request that ended with nothing to keep."""
        self.generated.pop(rid, None)


class _Request(NamedTuple):
    dataset: str
    lease_id: str  # "" when budgets are not reserved
    generation: asyncio.Task[GenerationResult]
    backend: InferenceBackend  # the server that has it, to abort it there
    ticket: Ticket | None  # what it reserved, when budgets are reserved


class InFlight:
    """The dispatcher's requests at the server, and the caps of revoked leases.

    ``admission`` (None when budgets are not reserved: then nothing is ever revoked)
    is read for its revocations; ``unit`` is the budget's unit and ``stream`` whether
    requests stream (``[inference] stream``), which decides how a revocation aborts.
    """

    def __init__(self, admission: Admission | None, unit: ev.BudgetUnit, stream: bool) -> None:
        self._admission = admission
        self._unit = unit
        self._stream = stream
        self._requests: dict[str, _Request] = {}
        self._generated: dict[str, int] = {}  # rid -> tokens streamed so far
        self._caps: dict[str, RevokedCap] = {}  # revoked lease id -> what may still be kept
        self._outgrown: set[str] = set()  # rids aborted past what their growing ticket holds
        self._aborts: set[asyncio.Task[None]] = set()

    def add(
        self,
        rid: str,
        dataset: str,
        lease_id: str,
        generation: asyncio.Task[GenerationResult],
        backend: InferenceBackend,
        ticket: Ticket | None = None,
    ) -> None:
        """The request ``rid`` is at ``backend``, generating in ``generation`` on
        ``ticket``: from now on it may be aborted (the task cancelled, or the server
        told), it counts towards its lease's cap, and a growing ticket grows as it
        streams. Called by the request attempt as it sends it."""
        self._requests[rid] = _Request(dataset, lease_id, generation, backend, ticket)

    def remove(self, rid: str) -> None:
        """The request ``rid`` is no longer at the server (answered, failed or
        cancelled). Called by the request attempt on every path; never raises."""
        self._requests.pop(rid, None)
        self._generated.pop(rid, None)
        self._outgrown.discard(rid)

    def streamed(self, rid: str) -> int:
        """Tokens the request ``rid`` reported so far (0 without streaming)."""
        return self._generated.get(rid, 0)

    def on_progress(self, rid: str, tokens: int) -> None:
        """A streamed request's tokens so far (the backend's progress callback): past
        its lease's cap, every request on the lease is aborted at once."""
        self._generated[rid] = tokens
        request = self._requests.get(rid)
        if request is None:
            return
        cap = self._cap(request.lease_id, request.dataset)
        if cap is not None and cap.progress(rid, tokens):
            self._abort_lease(request.lease_id)
        elif request.ticket is not None and request.ticket.grows:
            self._grow(rid, request, request.ticket, tokens)

    def _grow(self, rid: str, request: _Request, ticket: Ticket, tokens: int) -> None:
        """Keep a growing ticket a little ahead of its answer's ``tokens``: a quarter
        of what it first reserved, so that the ledger is asked while the answer still
        fits. Past what it holds with no more to come, the request is aborted: what it
        generates from then on could not be kept."""
        assert self._admission is not None
        held = self._admission.growth.grow(ticket, tokens + max(64, ticket.reserved // 4))
        outgrown = tokens > held and not self._admission.growth.can_grow(ticket)
        if outgrown and rid not in self._outgrown:
            self._outgrown.add(rid)
            self._abort(rid, request)

    async def on_revoke(self, dataset: str) -> None:
        """A lease of the dataset was revoked (budget lowered, or lease expired):
        :class:`~tokenbudget.producers.dispatch.admission.Admission`'s ``on_revoke``, run as a task
        of its
        own. Its requests in flight may keep its allowance between them; streamed,
        they run on while what they generated fits (:meth:`on_progress`), else they
        are aborted now. Either way their answers are then cut to what fits
        (:meth:`fit`)."""
        if self._admission is None or dataset not in self._admission.revocations:
            return
        lease_id, _ = self._admission.revocations[dataset]
        cap = self._cap(lease_id, dataset)
        if cap is None:
            return
        if not self._stream:
            cap.aborting = True
            self._abort_lease(lease_id)
        elif cap.check():
            self._abort_lease(lease_id)

    def fit(
        self, lease_id: str, dataset: str, rid: str, result: GenerationResult
    ) -> GenerationResult | None:
        """The answer of ``rid`` as its lease allows it: whole when the lease is not
        revoked, else cut to what the revoked lease's allowance still holds (None:
        nothing fits). Only completion-token budgets can be cut mid-answer; in other
        units an answer is kept whole or not at all. Called by the request attempt
        once the answer is in."""
        cap = self._cap(lease_id, dataset)
        if cap is None:
            return result
        cost = budget.unit_cost(self._unit, result.prompt_tokens, result.completion_tokens)
        keep = cap.fit(rid, cost, budget.cuttable(self._unit, bool(result.output_ids)))
        return kept_within(result, cost, keep)

    def forget(self, lease_id: str, rid: str) -> None:
        """The request ``rid`` ended with nothing to keep: its lease's cap no longer
        waits for it."""
        cap = self._caps.get(lease_id)
        if cap is not None:
            cap.forget(rid)

    def _cap(self, lease_id: str, dataset: str) -> RevokedCap | None:
        """The cap of a revoked lease, made when its revocation is first needed
        (the revocation is applied to the admission as soon as it is read)."""
        cap = self._caps.get(lease_id)
        if cap is not None or self._admission is None or not lease_id:
            return cap
        revoked = self._admission.revocations.get(dataset)
        if revoked is None or revoked[0] != lease_id:
            return None
        cap = RevokedCap(left=revoked[1])
        for rid, request in self._requests.items():
            if request.lease_id == lease_id:
                cap.generated[rid] = self._generated.get(rid, 0)
        self._caps[lease_id] = cap
        return cap

    def _abort_lease(self, lease_id: str) -> None:
        """Stop every request in flight on the lease, all at once."""
        for rid, request in list(self._requests.items()):
            if request.lease_id == lease_id:
                self._abort(rid, request)

    def _abort(self, rid: str, request: _Request) -> None:
        """Stop one request at its server: by rid where the API aborts by id (SGLang:
        it answers with what was generated), elsewhere by closing the stream (what
        came is lost)."""
        if API_TRAITS[request.backend.api].abort_by_id:
            task = asyncio.get_running_loop().create_task(_abort_request(request.backend, rid))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
        else:
            request.generation.cancel()  # closing the stream is the only abort there


async def _abort_request(backend: InferenceBackend, rid: str) -> None:
    try:
        await backend.abort(rid)
    except Exception as exc:  # the request may have finished meanwhile
        log.debug("abort of %s failed: %s", rid, exc)
