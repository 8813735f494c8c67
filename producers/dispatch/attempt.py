"""One request of a prompt: generate, fit the answer to what it may keep, publish it.

:meth:`Attempt.submit` is the innermost step of a prompt's path (see
:mod:`tokenbudget.producers.dispatch.step`), called by
:class:`tokenbudget.producers.dispatch.tries.Tries` once the prompt is admitted, with the
ticket admission gave it:

    generate   the request goes to the server under a fresh rid, registered in
               :class:`~tokenbudget.producers.dispatch.caps.InFlight` while the server has it
               (abortable,
               counted by its lease's cap); its slot is handed over once the server
               has answered
    fit        the answer is cut to the request's limit (:func:`answers.within_request`),
               then to the budget: kept on its ticket, claimed anew when its lease
               may have expired meanwhile, or cut to a revoked lease's cap
    publish    the kept answer goes out as the prompt's completion, its ticket
               settled at the completion's cost before the send

Every ticket the attempt holds is settled exactly once, on every path (an error and
a cancellation included). An answer aborted in flight, or one nothing of which
fits, ends the attempt with a skip. What the server generated but is not kept is
counted as wasted, by reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import msgspec

from tokenbudget.core import metrics
from tokenbudget.producers.dispatch.admission import Admission
from tokenbudget.producers.dispatch.answers import (
    PROBLEMS,
    cut_answer,
    finish_label,
    kept_within,
    within_request,
)
from tokenbudget.producers.dispatch.caps import InFlight
from tokenbudget.producers.dispatch.leases import Ticket
from tokenbudget.producers.dispatch.outcomes import Publisher
from tokenbudget.producers.dispatch.slots import Slot
from tokenbudget.producers.dispatch.step import Dispatched, DispatchReport
from tokenbudget.producers.inference.generation import (
    GenerationRequest,
    GenerationResult,
    InferenceBackend,
)
from tokenbudget.producers.inference.reasoning import ReasoningRows
from tokenbudget.producers.prompts import conversations
from tokenbudget.streams import budget
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.fields import StopReason, TokenIds

log = logging.getLogger(__name__)


def wasted(dataset: str, reason: str, tokens: int) -> None:
    """Count ``tokens`` the server generated that are not kept."""
    if tokens > 0:
        metrics.WASTED_TOKENS.labels(dataset=dataset, reason=reason).inc(tokens)


@dataclass(frozen=True)
class _Generated:
    """The server's answer to one request, and when it was sent and finished."""

    answer: GenerationResult
    sent_at: float
    finished_at: float


@dataclass(frozen=True)
class _Fitted:
    """What of an answer is kept (``result``), on which ticket, and the answer as the
    request allowed it before the budget cut it (``answer``)."""

    ticket: Ticket | None
    result: GenerationResult
    answer: GenerationResult


class Tickets:
    """The tickets one attempt holds (its own, and one claimed for its answer if its
    lease expired): each is settled exactly once, at its cost when its completion is
    sent, and with nothing otherwise (:meth:`settle_rest`, on every path)."""

    def __init__(self, admission: Admission | None, admitted: Ticket | None) -> None:
        self.admitted = admitted
        self._admission = admission
        self._held: list[Ticket] = [admitted] if admitted is not None else []
        self._settled: list[Ticket] = []

    def hold(self, ticket: Ticket | None) -> None:
        """``ticket`` is this attempt's to settle too."""
        if ticket is not None and ticket not in self._held:
            self._held.append(ticket)

    def settle(self, ticket: Ticket, cost: int | None) -> None:
        """Settle ``ticket`` at ``cost`` (None: nothing published on it)."""
        assert self._admission is not None
        self._admission.settle(ticket, cost)
        self._settled.append(ticket)

    def sending(self, ticket: Ticket, completion: ev.CompletionEvent) -> None:
        """Its completion is about to be sent: spent at its cost from now on. An
        answer that ended on its own terms (not cut by the budget, not aborted) says
        how long the dataset's answers get."""
        assert self._admission is not None
        self._admission.sending(ticket)
        self.settle(ticket, completion.cost)
        if completion.stop_reason in ("stop", "length"):
            self._admission.answered(completion.dataset, completion.completion_tokens)

    def published(self, ticket: Ticket) -> None:
        """The completion announced by :meth:`sending` is on Kafka (or given up)."""
        assert self._admission is not None
        self._admission.published(ticket)

    def settle_rest(self) -> None:
        """Settle with nothing every ticket not settled yet."""
        for ticket in self._held:
            if ticket not in self._settled:
                self.settle(ticket, None)


class Attempt:
    """Sends one request of a prompt and publishes what of its answer is kept.

    ``admission`` is None when budgets are not reserved (then there is no ticket and
    the whole answer, within the request, is kept); ``board`` is read for lowerings
    of the budget before an answer is kept; ``unit`` is the budget's unit;
    ``keep_log`` keeps every request sent in ``report.sent``."""

    def __init__(
        self,
        publisher: Publisher,
        in_flight: InFlight,
        admission: Admission | None,
        board: BudgetBoard,
        reasoning: ReasoningRows,
        unit: ev.BudgetUnit,
        report: DispatchReport,
        *,
        keep_log: bool = False,
    ) -> None:
        self.publisher = publisher
        self.in_flight = in_flight
        self.admission = admission
        self.board = board
        self.reasoning = reasoning
        self.unit = unit
        self.report = report
        self.keep_log = keep_log
        self._reported_problems: set[str] = set()

    async def submit(
        self,
        backend: InferenceBackend,
        prompt: ev.PromptEvent,
        ticket: Ticket | None,
        max_new: int,
        attempts: int,
        slot: Slot | None,
    ) -> None:
        """One request of ``prompt`` to ``backend`` on ``ticket`` (None: budgets not
        reserved) for at most ``max_new`` tokens (the prompt's own limit; the ticket's
        may be lower), its ``attempts``-th: returns once its completion, or a skip
        (aborted in flight, or nothing of the answer fits), is on Kafka.

        Raises :class:`~tokenbudget.core.errors.InferenceError` when the request fails
        (whether to try again is the caller's), what :class:`Publisher` raises, and
        :class:`asyncio.CancelledError` when stopped. The ticket is settled on every
        path. Called by :class:`tokenbudget.producers.dispatch.tries.Tries`."""
        request = self._request(prompt, ticket, max_new)
        tickets = Tickets(self.admission, ticket)
        try:
            generated = await self._generate(backend, prompt, request, ticket, slot)
            if generated is None:
                reason = "aborted in flight: the budget (lowered, or at its end) had no room"
                await self.publisher.skip(prompt, reason)
                return
            fitted = await self._fit(backend, prompt, request, generated.answer, tickets, slot)
            if fitted is None:
                reason = "budget lowered or lease expired: answer not kept"
                await self.publisher.skip(prompt, reason)
                return
            await self._publish(prompt, request, generated, fitted, attempts, max_new, tickets)
        finally:
            tickets.settle_rest()

    def _request(
        self, prompt: ev.PromptEvent, ticket: Ticket | None, max_new: int
    ) -> GenerationRequest:
        """The prompt's request under a fresh rid, limited to what its ticket reserved."""
        return GenerationRequest(
            rid=uuid.uuid4().hex,
            on_progress=self.in_flight.on_progress,
            max_new_tokens=ticket.max_new_tokens if ticket else max_new,
            text=prompt.text,
            messages=prompt.messages,
            input_ids=tuple(prompt.input_ids) if prompt.input_ids is not None else None,
            sampling=prompt.sampling.request_fields(),
            tools=prompt.tools,
        )

    async def _generate(
        self,
        backend: InferenceBackend,
        prompt: ev.PromptEvent,
        request: GenerationRequest,
        ticket: Ticket | None,
        slot: Slot | None,
    ) -> _Generated | None:
        """The server's answer with when it was sent and finished; None when it was
        aborted by closing its stream, because its lease was revoked (a lowered
        budget) or its growing reservation could grow no more."""
        rid = request.rid
        sent_at = time.time()
        if self.keep_log:
            self.report.sent.append(Dispatched(prompt.dataset, rid, sent_at))
        metrics.IN_FLIGHT.inc()
        generation = asyncio.create_task(backend.generate(request))
        lease_id = ticket.lease_id if ticket else ""
        # In flight (abortable, counted by its lease's cap) until it is fitted.
        self.in_flight.add(rid, prompt.dataset, lease_id, generation, backend, ticket)
        try:
            try:
                result = await generation
            finally:
                metrics.IN_FLIGHT.dec()
            # Stamped before any cap is looked up: a budget lowered after this
            # moment is known (synced below) before the answer is kept.
            finished_at = time.time()
            if slot is not None:
                # The server may take the next request; handing back, this answer is
                # published, not dropped.
                await slot.hand_over()
            if ticket:
                # Every budget event published until now is applied, and a lower
                # budget on its way to the ledger has its answer (revocations come
                # before the snapshot that shows it): what fits is known.
                await self.board.sync()
                await self.board.decided(prompt.dataset)
            return _Generated(result, sent_at, finished_at)
        except asyncio.CancelledError:
            self.in_flight.forget(lease_id, rid)
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            # aborted in flight (see InFlight): what it streamed so far is lost
            wasted(prompt.dataset, "aborted", self.in_flight.streamed(rid))
            return None
        except BaseException:
            self.in_flight.forget(lease_id, rid)
            raise
        finally:
            self.in_flight.remove(rid)

    async def _fit(
        self,
        backend: InferenceBackend,
        prompt: ev.PromptEvent,
        request: GenerationRequest,
        answer: GenerationResult,
        tickets: Tickets,
        slot: Slot | None,
    ) -> _Fitted | None:
        """What of the answer is kept, and on which ticket: cut to the request's limit,
        then to the budget (:meth:`_kept`); None when nothing of it fits. What is cut
        or refused is counted as wasted."""
        generated_tokens = answer.completion_tokens
        answer = self._within_request(backend, answer, request.max_new_tokens)
        wasted(prompt.dataset, "over_request", generated_tokens - answer.completion_tokens)
        kept = await self._kept(prompt, tickets, request.rid, answer, slot)
        if kept is None:
            wasted(prompt.dataset, "refused", answer.completion_tokens)
            return None
        ticket, result = kept
        tickets.hold(ticket)
        wasted(prompt.dataset, "cut", answer.completion_tokens - result.completion_tokens)
        return _Fitted(ticket, result, answer)

    def _within_request(
        self, backend: InferenceBackend, result: GenerationResult, max_new_tokens: int
    ) -> GenerationResult:
        """The answer as the request allowed it: ids and count agreeing, at most
        ``max_new_tokens`` (a server that ignored the limit, or a recount that came out
        higher, is cut to it and reported once per server)."""
        checked, problem = within_request(result, max_new_tokens)
        if problem is not None:
            metrics.SERVER_COUNT_CORRECTIONS.labels(kind=problem).inc()
            if problem not in self._reported_problems:
                self._reported_problems.add(problem)
                log.error(
                    "the inference server %s returned %s (first seen: %d ids, %d counted, "
                    "max_new_tokens %d); such answers are cut to the request's limit",
                    backend.base_url,
                    PROBLEMS[problem],
                    len(result.output_ids or ()),
                    result.completion_tokens,
                    max_new_tokens,
                )
        return checked

    async def _kept(
        self,
        prompt: ev.PromptEvent,
        tickets: Tickets,
        rid: str,
        answer: GenerationResult,
        slot: Slot | None,
    ) -> tuple[Ticket | None, GenerationResult] | None:
        """What of the answer is kept, and on which ticket: its own; a fresh one when
        its lease may have expired meanwhile (the old one is settled); or, on a lease
        revoked by a lowered budget, what its allowance holds. None: nothing fits."""
        ticket = tickets.admitted
        if ticket is None or self.admission is None:
            return ticket, answer
        if self.admission.retire_if_expired(ticket):
            # Its budget may be someone else's now: claim the answer anew.
            tickets.settle(ticket, None)
            return await self._claim(prompt, answer, slot)
        if ticket.grows:
            grown = await self._grown(ticket, answer)
            if grown is None:
                return None
            answer = grown
        fitted = self.in_flight.fit(ticket.lease_id, prompt.dataset, rid, answer)
        return None if fitted is None else (ticket, fitted)

    async def _grown(self, ticket: Ticket, answer: GenerationResult) -> GenerationResult | None:
        """The answer on a growing ticket, its reservation grown to cover it
        (:meth:`~tokenbudget.producers.dispatch.growth.Growth.cover`): whole, cut at the
        line where it has outgrown what the budget had left, or None when it cannot
        be cut (no token ids)."""
        assert self.admission is not None
        cost = budget.unit_cost(self.unit, answer.prompt_tokens, answer.completion_tokens)
        held = await self.admission.growth.cover(ticket, cost)
        keep = budget.fit(cost, held, budget.cuttable(self.unit, bool(answer.output_ids)))
        return kept_within(answer, cost, keep)

    async def _claim(
        self, prompt: ev.PromptEvent, result: GenerationResult, slot: Slot | None
    ) -> tuple[Ticket, GenerationResult] | None:
        """A fresh ticket for an answer already generated, for what it actually costs
        (cut at the line when only part of it fits a completion-token budget), or None
        when the budget has no room left for it: GPU work done is kept when it can be."""
        assert self.admission is not None
        claimed = await self.admission.admit(
            prompt.dataset,
            result.completion_tokens,
            result.prompt_tokens,
            aside=slot.aside if slot is not None else None,
            exact=True,
        )
        metrics.CLAIMS.labels(result="kept" if claimed else "refused").inc()
        if claimed is None:
            return None
        if claimed.max_new_tokens >= result.completion_tokens:
            return claimed, result
        return claimed, cut_answer(result, claimed.max_new_tokens)

    async def _publish(
        self,
        prompt: ev.PromptEvent,
        request: GenerationRequest,
        generated: _Generated,
        fitted: _Fitted,
        attempts: int,
        max_new: int,
        tickets: Tickets,
    ) -> None:
        """Publish the kept answer as the prompt's completion, its ticket settled at
        the completion's cost before the send; count it."""
        ticket, result = fitted.ticket, fitted.result
        sent_at, finished_at = generated.sent_at, generated.finished_at
        metrics.REQUEST_LATENCY.labels(dataset=prompt.dataset).observe(finished_at - sent_at)
        if result.first_token_at is not None:
            metrics.TIME_TO_FIRST_TOKEN.observe(max(0.0, result.first_token_at - sent_at))
        stop_reason = finish_label(result, fitted.answer, request.max_new_tokens, max_new)
        unfinished = self.reasoning.unfinished(prompt.dataset, result, fitted.answer, stop_reason)
        completion = _completion(
            prompt, request, generated, fitted, attempts, stop_reason, unfinished, self.unit
        )
        if ticket is not None:
            # Spent from here on, before any await: a revocation arriving while
            # this is being sent must already see it.
            tickets.sending(ticket, completion)
        try:
            await self.publisher.completed(completion)
        finally:
            if ticket is not None:
                tickets.published(ticket)


def _completion(
    prompt: ev.PromptEvent,
    request: GenerationRequest,
    generated: _Generated,
    fitted: _Fitted,
    attempts: int,
    stop_reason: StopReason,
    unfinished: bool,
    unit: ev.BudgetUnit,
) -> ev.CompletionEvent:
    """The prompt's completion: the kept answer, what it cost, and its prompt and
    request as sent."""
    result, ticket = fitted.result, fitted.ticket
    return ev.CompletionEvent(
        request_id=request.rid,
        prompt_id=prompt.prompt_id,
        dataset=prompt.dataset,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        output_ids=None if result.output_ids is None else TokenIds(result.output_ids),
        finish_reason=result.finish_reason,
        max_new_tokens=request.max_new_tokens,
        text=result.text,
        attempts=attempts,
        lease_id=ticket.lease_id if ticket else "",
        cost=budget.unit_cost(unit, result.prompt_tokens, result.completion_tokens),
        dispatched_at=generated.sent_at,
        first_token_at=result.first_token_at,
        count_source=result.count_source,
        finished_at=generated.finished_at,
        prompt=prompt.text,
        messages=prompt.messages,
        # the ids sent (template applied here), else those the server returned
        prompt_ids=_sent_ids(prompt, result),
        sampling=msgspec.structs.replace(prompt.sampling, max_new_tokens=request.max_new_tokens),
        model=result.model,
        row_id=prompt.row_id,
        input_columns=prompt.input_columns,
        sample_index=prompt.sample_index,
        stop_reason=stop_reason,
        reasoning=result.reasoning,
        reasoning_tokens=result.reasoning_tokens,
        unfinished=unfinished,
        tool_calls=result.tool_calls,
        **conversations.completion_fields(prompt, result.tool_calls),
    )


def _sent_ids(prompt: ev.PromptEvent, result: GenerationResult) -> TokenIds | None:
    """The prompt's ids: those sent (the template applied here), else those the
    server returned, else unknown."""
    ids = prompt.input_ids if prompt.input_ids is not None else result.prompt_ids
    return None if ids is None else TokenIds(ids)
