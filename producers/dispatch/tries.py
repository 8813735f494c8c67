"""A prompt's tries: admit it, attempt its request, retry as errors allow, or record
it failed.

Two loops, one inside the other (a step of the prompt's path, see
:mod:`tokenbudget.producers.dispatch.step`):

* :meth:`Tries.dispatch`: wait until a server of the fleet can take a request
  (:meth:`tokenbudget.producers.inference.fleet.Fleet.wait_ready`), skip the prompt if its dataset
  is
  halted or admission has no budget left for it, else send it to a server
  (:class:`tokenbudget.producers.dispatch.route.Route`, then
  :class:`tokenbudget.producers.dispatch.attempt.Attempt`). A
  failed request is retried as its error allows: "server away" errors (connection
  refused or reset, timeouts, 429/408/502/503/504) without limit and without a
  backoff of its own (the fleet holds a server away, or one that sent
  ``Retry-After``, out of routing meanwhile, and the retry goes to another server
  when one can take it); other retryable ones up to ``[inference] retries`` times,
  after a backoff; others not at all. Then the prompt is recorded as failed, with
  a dead letter.
* :meth:`Tries.submit`: around it, an error outside the inference request (a broker
  away, a bug) is retried with backoff, and a prompt it keeps failing
  (:data:`UNEXPECTED_ERRORS` in a row, Kafka's errors apart: those are waited out)
  is recorded as failed, so the partition's commit point never sticks behind it.

Every wait here for budget or a backoff lends the prompt's place to others
(:meth:`tokenbudget.producers.dispatch.slots.Slot.aside`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaError

from tokenbudget.core import metrics
from tokenbudget.core.errors import InferenceError, ServerOutageError
from tokenbudget.producers.dispatch.admission import Admission
from tokenbudget.producers.dispatch.leases import Ticket
from tokenbudget.producers.dispatch.outcomes import Publisher
from tokenbudget.producers.dispatch.route import Route
from tokenbudget.producers.dispatch.slots import Slot
from tokenbudget.producers.dispatch.step import DispatchReport, about
from tokenbudget.producers.inference.fleet import Fleet
from tokenbudget.producers.inference.generation import RetryPolicy
from tokenbudget.producers.prompts.resume import OutcomeView
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard

log = logging.getLogger(__name__)

# Errors outside the inference request (not Kafka's: those are waited out) after which
# a prompt is recorded as failed rather than tried again.
UNEXPECTED_ERRORS = 5


@dataclass
class _Tries:
    """A prompt's attempts so far, and why the last one failed."""

    attempts: int = 0
    failures: int = 0  # failures that do not say the server is away
    last_error: InferenceError | None = None
    failed_at: set[str] = field(default_factory=set)  # the servers that failed it


@dataclass(frozen=True)
class _Admitted:
    """A prompt let through: on ``ticket`` when budgets are reserved, else None."""

    ticket: Ticket | None


def prompt_token_estimate(prompt: ev.PromptEvent) -> int:
    """An upper bound on the prompt's tokens before the server counts them, for
    budgets in total_tokens: byte-level tokenizers never make more tokens than
    UTF-8 bytes; the margin covers special and template tokens."""
    text = prompt.text or "".join(m.content for m in prompt.messages or ())
    return len(text.encode()) + 16 * (1 + len(prompt.messages or ()))


def _aside(slot: Slot | None) -> AbstractAsyncContextManager[Any]:
    return slot.aside() if slot is not None else contextlib.nullcontext()


class Tries:
    """Takes a prompt through admission and its attempts to an outcome.

    ``route`` sends each attempt to a server of ``fleet``; ``admission`` is None when
    budgets are not reserved (every prompt of a dataset not halted is let through).
    ``outcomes`` says which prompts are done already (handed over again after a
    crash); ``max_new_tokens`` is the limit of a prompt that sets none; refusals
    (a prompt skipped because its dataset is halted) are noted in ``refused_at``,
    per dataset, the first time."""

    def __init__(
        self,
        route: Route,
        publisher: Publisher,
        board: BudgetBoard,
        admission: Admission | None,
        outcomes: OutcomeView,
        retry: RetryPolicy,
        *,
        max_new_tokens: int,
        report: DispatchReport,
        refused_at: dict[str, float],
    ) -> None:
        self.route = route
        self.fleet: Fleet = route.fleet
        self.publisher = publisher
        self.board = board
        self.admission = admission
        self.outcomes = outcomes
        self.retry = retry
        self.max_new_tokens = max_new_tokens
        self.report = report
        self.refused_at = refused_at

    async def submit(self, prompt: ev.PromptEvent, slot: Slot | None = None) -> None:
        """:meth:`dispatch`, tried again after any error but a stop and the server's
        outage, and recorded as failed after :data:`UNEXPECTED_ERRORS` of them.
        Raises :class:`asyncio.CancelledError` and
        :class:`~tokenbudget.core.errors.ServerOutageError` only (the :class:`Step`
        contract). Called by the conversation turn step."""
        errors = 0
        while True:
            try:
                await self.dispatch(prompt, slot)
                return
            except (asyncio.CancelledError, ServerOutageError):
                raise
            except Exception as exc:
                errors += 1
                log.warning(
                    "%s: %r (attempt %d); trying again",
                    about(prompt),
                    exc,
                    errors,
                    exc_info=errors == 1,
                )
                if errors >= UNEXPECTED_ERRORS and not isinstance(exc, KafkaError):
                    await self.publisher.fail(prompt, errors, f"dispatch failed: {exc!r}")
                    return
                async with _aside(slot):
                    await asyncio.sleep(self.retry.delay(min(errors, 6)))

    async def dispatch(self, prompt: ev.PromptEvent, slot: Slot | None = None) -> None:
        """Admit, then generate, fit and publish (:meth:`Attempt.submit`); retry what
        the server's errors allow, and record the prompt as failed when they do not.
        A prompt done already is left alone (counted as ``already_completed``).

        Raises what happens outside the inference request (a Kafka error, a bug), a
        cancellation and :class:`~tokenbudget.core.errors.ServerOutageError`; an
        :class:`~tokenbudget.core.errors.InferenceError` never gets out."""
        if prompt.prompt_id in self.outcomes.completed:
            self.report.already_completed += 1  # its outcome is recorded already
            return
        max_new = prompt.sampling.max_new_tokens or self.max_new_tokens
        tries = _Tries()
        while True:
            admitted = await self._admit(prompt, max_new, slot)
            if admitted is None:
                return  # skipped: its dataset has no budget left for it
            tries.attempts += 1
            try:
                await self.route.submit(
                    prompt, admitted.ticket, max_new, tries.attempts, slot, tries.failed_at
                )
            except InferenceError as exc:
                if await self._retry(prompt, exc, tries, slot):
                    continue
                break
            return
        await self.publisher.fail(
            prompt,
            tries.attempts,
            f"gave up after {tries.attempts} attempt(s): {tries.last_error}",
        )

    async def _admit(
        self, prompt: ev.PromptEvent, max_new: int, slot: Slot | None
    ) -> _Admitted | None:
        """Wait until a server can take a request, then admit the prompt (with a ticket
        when budgets are reserved); None once it is skipped instead (dataset full)."""
        await self.fleet.wait_ready()
        if self.board.is_halted(prompt.dataset):
            self.refused_at.setdefault(prompt.dataset, time.time())
            await self.publisher.skip(prompt, "budget reached")
            return None
        if self.admission is None:
            return _Admitted(None)
        asked_at = time.monotonic()
        ticket = await self.admission.admit(
            prompt.dataset,
            max_new,
            prompt_token_estimate(prompt),
            aside=slot.aside if slot is not None else None,
        )
        if ticket is None:
            await self.publisher.skip(prompt, "budget fully used or reserved")
            return None
        waited = time.monotonic() - asked_at
        metrics.BUDGET_WAIT.labels(dataset=prompt.dataset).observe(waited)
        return _Admitted(ticket)

    async def _retry(
        self, prompt: ev.PromptEvent, exc: InferenceError, tries: _Tries, slot: Slot | None
    ) -> bool:
        """Count a failed attempt; True once its backoff has passed if the prompt may be
        tried again, False when it is to be given up."""
        tries.last_error = exc
        metrics.INFERENCE_ERRORS.labels(kind=type(exc).__name__).inc()
        log.warning("%s: attempt %d failed: %s", about(prompt), tries.attempts, exc)
        if not exc.retryable:
            return False
        reason = type(exc).__name__
        if exc.server_away:
            # The fleet paces a server away (paused, held till its Retry-After): the
            # retry waits in it for a server that can take it, here not at all.
            metrics.RETRIES.labels(dataset=prompt.dataset, reason=reason).inc()
            return True
        tries.failures += 1
        if tries.failures > self.retry.retries:
            return False
        metrics.RETRIES.labels(dataset=prompt.dataset, reason=reason).inc()
        async with _aside(slot):
            await asyncio.sleep(self.retry.delay(min(tries.attempts, 8)))
        return True
