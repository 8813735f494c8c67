"""The dispatcher: prompt events in, inference requests out, completions back.

Contract, per prompt read from the prompts topic:
  * undecodable           -> dead-letter topic
  * dataset halted        -> ``PromptSkipped`` (checked when its turn comes, right
                             before the request is sent, and before each retry)
  * generated             -> ``CompletionEvent`` with the server's own token counts
  * failed after retries  -> ``PromptFailed`` plus a dead-letter event with the reason
Its offset is committed only after that outcome is acknowledged by Kafka, so a
crash re-dispatches unfinished prompts and never loses one.

A prompt's path, in :meth:`Dispatcher._dispatch` and :meth:`Dispatcher._attempt`:
admit (a ticket on the budget) -> generate -> fit (what of the answer is kept) ->
publish, the ticket settled on every path; retried as the server's errors allow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import kafka.errors
import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from producers import conversations
from producers.admission import Admission, AdmissionSettings, Ticket
from producers.answers import PROBLEMS, cut_answer, finish_label, within_request
from producers.caps import InFlight
from producers.inference import (
    GenerationRequest,
    GenerationResult,
    InferenceBackend,
    RetryPolicy,
    Timeouts,
    backend_for_config,
    http_client,
)
from producers.offsets import OffsetTracker
from producers.publisher import Publisher
from producers.reasoning import ReasoningRows
from producers.resume import OutcomeView
from producers.server_gate import GateSettings, ServerGate
from producers.slots import Places, Slot
from producers.step import Dispatched, DispatchReport, about
from streams import budget
from streams import events as ev
from streams.halts import BudgetBoard
from streams.topics import Topics
from tokenbudget import metrics
from tokenbudget.config import Config
from tokenbudget.errors import (
    EventDecodeError,
    InferenceError,
    ServerOutageError,
)
from tokenbudget.kafka import aiokafka_producer_options, consumer_options

log = logging.getLogger(__name__)

PRODUCER_BATCH_BYTES = 512 * 1024
# Errors outside the inference request (not Kafka's: those are waited out) after which
# a prompt is recorded as failed rather than tried again.
UNEXPECTED_ERRORS = 5
# Handing back: how long answers already in get to be published before they too are
# given up (one waiting for budget on an expired lease could wait for long).
HAND_BACK_GRACE_S = 10.0


def wasted(dataset: str, reason: str, tokens: int) -> None:
    """Count ``tokens`` the server generated that are not kept."""
    if tokens > 0:
        metrics.WASTED_TOKENS.labels(dataset=dataset, reason=reason).inc(tokens)


@dataclass
class _Tries:
    """A prompt's attempts so far, and why the last one failed."""

    attempts: int = 0
    failures: int = 0  # failures that do not say the server is away
    last_error: InferenceError | None = None


@dataclass(frozen=True)
class _Admitted:
    """A prompt let through: on ``ticket`` when budgets are reserved, else None."""

    ticket: Ticket | None


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


class _Tickets:
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


class _CommitOnRevoke(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.dispatcher.commit()
        for tp in revoked:
            self.dispatcher.tracker.forget(tp.topic, tp.partition)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        # Prompts that come back (their dispatcher crashed between publishing and
        # committing) may be done by now: know which before dispatching them.
        with contextlib.suppress(Exception):  # then they are generated again, harmlessly
            await asyncio.to_thread(self.dispatcher.outcomes.refresh)


class Dispatcher:
    def __init__(
        self,
        config: Config,
        bootstrap: str,
        board: BudgetBoard,
        *,
        backend_factory: Callable[[httpx.AsyncClient], InferenceBackend] | None = None,
        keep_log: bool = False,
        holder: str | None = None,
        instance: str | None = None,
    ) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.board = board
        self.topics = Topics(config.kafka.namespace)
        self.tracker = OffsetTracker()
        self.report = DispatchReport()
        self.keep_log = keep_log
        self.reasoning = ReasoningRows.for_config(config)
        inference = config.inference
        self.retry = RetryPolicy(inference.retries, inference.backoff_s, inference.backoff_max_s)
        self.timeouts = Timeouts(inference.connect_timeout_s, inference.read_timeout_s)
        self._backend_factory = backend_factory or (
            lambda client: backend_for_config(config, client)
        )
        self._consumer: AIOKafkaConsumer | None = None
        self.places = Places(inference.concurrency)
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # Static group membership (Kafka's group.instance.id), when named.
        self.instance = instance
        self.admission: Admission | None = None
        self.in_flight = InFlight(None, config.budget.unit, inference.stream)
        self.gate: ServerGate | None = None
        self.outcomes = OutcomeView(bootstrap, self.topics)
        self._reported_problems: set[str] = set()
        self.refused_at: dict[str, float] = {}  # first refusal per dataset, this process
        self._handing_back = asyncio.Event()
        self._turns = conversations.Outcomes()  # what conversation turns led to

    @property
    def group_id(self) -> str:
        return f"{self.topics.namespace}-dispatch"

    async def commit(self) -> None:
        offsets = self.tracker.committable()
        if self._consumer is None or not offsets:
            return
        assigned = self._consumer.assignment()
        to_commit = {
            TopicPartition(topic, partition): offset
            for (topic, partition), offset in offsets.items()
            if TopicPartition(topic, partition) in assigned
        }
        if to_commit:
            with contextlib.suppress(Exception):  # retried on the next tick
                await self._consumer.commit(to_commit)

    def _clients(self) -> tuple[AIOKafkaConsumer, AIOKafkaProducer]:
        """The prompts consumer and the events producer, not started yet."""
        hold_ms = int(self.config.inference.prompt_hold_s * 1000)
        consumer = AIOKafkaConsumer(
            **consumer_options(self.bootstrap),
            group_id=self.group_id,
            # A restarted dispatcher of the same name takes its prompts straight back.
            group_instance_id=self.instance,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=self.config.inference.concurrency,
            fetch_max_wait_ms=100,
            # A dispatcher that stops heartbeating (frozen, cut off, killed) keeps its
            # prompts this long: back within it, it claims the answers it holds
            # instead of others generating them again.
            session_timeout_ms=hold_ms,
            heartbeat_interval_ms=min(3000, hold_ms // 3),
            # Waiting for a free place at the server is not a stuck consumer: only a
            # missing heartbeat (above) takes its prompts away.
            max_poll_interval_ms=24 * 3600 * 1000,
        )
        consumer.subscribe([self.topics.prompts], listener=_CommitOnRevoke(self))
        producer = AIOKafkaProducer(
            **aiokafka_producer_options(self.bootstrap, self.config.kafka.compression),
            linger_ms=2,
            # aiokafka sends one request per broker at a time, with at most one batch
            # per partition: with its default 16 KiB batches every completion (tens of
            # KiB) would be a request of its own, and under load completions queued
            # for seconds before reaching Kafka, holding their slots meanwhile.
            max_batch_size=PRODUCER_BATCH_BYTES,
        )
        return consumer, producer

    def _admission(self, producer: AIOKafkaProducer) -> Admission:
        settings, inference = self.config.budget, self.config.inference
        return Admission(
            producer,
            self.topics,
            self.holder,
            self.board,
            AdmissionSettings(
                unit=settings.unit,
                policy=settings.on_boundary,
                cut=settings.cut,
                min_new_tokens=settings.min_new_tokens,
                lease_size=budget.lease_size(
                    settings.unit,
                    settings.lease_tokens,
                    inference.concurrency,
                    inference.max_new_tokens,
                ),
                lease_ttl_s=settings.lease_ttl_s,
            ),
        )

    def compose(self, producer: AIOKafkaProducer, admission: Admission | None) -> None:
        """Wire the parts a prompt's path goes through: ``producer`` publishes the
        outcomes, ``admission`` (None when budgets are not reserved) admits, and the
        register of requests in flight hears its revocations. :meth:`run` calls it
        once its clients are up; a test calls it with stand-ins."""
        self.publisher = Publisher(producer, self.topics, self.report, seen=self._turns.saw)
        self.admission = admission
        self.in_flight = InFlight(admission, self.config.budget.unit, self.config.inference.stream)
        if admission is not None:
            admission.on_revoke = self.in_flight.on_revoke

    async def _started_clients(self) -> tuple[AIOKafkaConsumer, AIOKafkaProducer]:
        """The clients, started once Kafka answers (a broker restarting as the
        dispatcher starts is waited out, with fresh clients each time)."""
        delay = 0.5
        while True:
            consumer, producer = self._clients()
            try:
                await producer.start()
                await asyncio.to_thread(self.outcomes.refresh)
                await consumer.start()
                return consumer, producer
            except (KafkaError, kafka.errors.KafkaError, OSError) as exc:
                log.warning("dispatcher: Kafka does not answer (%r); trying again", exc)
                with contextlib.suppress(Exception):
                    await consumer.stop()
                with contextlib.suppress(Exception):
                    await producer.stop()
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)

    async def run(self, stop: asyncio.Event) -> DispatchReport:
        consumer, producer = await self._started_clients()
        self._consumer = consumer
        maintenance: asyncio.Task[None] | None = None
        admission = None
        if budget.reserves(self.config.budget.admission):
            admission = self._admission(producer)
            maintenance = asyncio.create_task(admission.maintain())
        self.compose(producer, admission)
        tasks: dict[asyncio.Task[None], Slot] = {}  # the prompts started, with their slots
        committer = asyncio.create_task(self._commit_every(0.5))
        try:
            async with http_client(self.config.inference.concurrency, self.timeouts) as client:
                backend = self._backend_factory(client)
                self.gate = self._gate(backend)
                while not self._stopping(stop):
                    batches = await consumer.getmany(
                        timeout_ms=200, max_records=self.config.inference.concurrency
                    )
                    for tp, records in batches.items():
                        metrics.consumed(tp.topic, "dispatcher", len(records))
                        for record in records:
                            # Started but not sent, a prompt handed back stays pending:
                            # the commit stops before it.
                            self.tracker.started(tp.topic, tp.partition, record.offset)
                            slot = await self.places.take(self._handing_back)
                            if slot is None:
                                break
                            task = asyncio.create_task(self._handle(backend, record, slot))
                            tasks[task] = slot
                            task.add_done_callback(lambda done: tasks.pop(done, None))
                # Graceful stop: finish what was started (handing back, only what the
                # server has answered), then commit it.
                if tasks:
                    await self._wind_down(tasks)
                if self.gate.outage is not None:
                    raise self.gate.outage
        finally:
            if self.gate is not None:
                await self.gate.close()
            committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await committer
            if maintenance is not None:
                maintenance.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await maintenance
            if self.admission is not None:
                with contextlib.suppress(Exception):
                    await self.admission.close()
                for dataset, at in self.admission.refused_at.items():
                    self.refused_at.setdefault(dataset, at)
            await self.commit()
            await consumer.stop()
            await producer.stop()
            await asyncio.to_thread(self.outcomes.close)
            self._consumer = None
        return self.report

    def hand_back(self) -> None:
        """Stop, handing back rather than finishing: no prompt is started any more,
        requests the server has not answered are given up (their prompts stay
        uncommitted, for the group's next dispatcher or a rerun), answers already in
        are published; then :meth:`run` commits and returns."""
        self._handing_back.set()

    def _stopping(self, stop: asyncio.Event) -> bool:
        return stop.is_set() or self._handing_back.is_set() or self._outage()

    def _outage(self) -> bool:
        return self.gate is not None and self.gate.outage is not None

    async def _wind_down(self, tasks: dict[asyncio.Task[None], Slot]) -> None:
        """Wait for the prompts started; once handing back, cancel those the server has
        not answered (their slots say) and give the others :data:`HAND_BACK_GRACE_S` to
        be published."""
        slots = dict(tasks)
        started = list(slots)
        finished = asyncio.gather(*started, return_exceptions=True)
        handing_back = asyncio.ensure_future(self._handing_back.wait())
        either: set[asyncio.Future[Any]] = {finished, handing_back}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        handing_back.cancel()
        if not finished.done():
            for task in started:
                if not slots[task].answered:
                    task.cancel()
            _, late = await asyncio.wait(started, timeout=HAND_BACK_GRACE_S)
            for task in late:
                task.cancel()
        await finished

    def _gate(self, backend: InferenceBackend) -> ServerGate:
        inference = self.config.inference

        async def hand_back() -> None:
            if self.admission is not None:
                await self.admission.hand_back_idle()

        return ServerGate(
            backend.health,
            GateSettings(
                pause_after=inference.pause_after_failures,
                health_interval_s=inference.health_interval_s,
                outage_timeout_s=inference.outage_timeout_s,
            ),
            url=inference.url,
            on_pause=hand_back,
        )

    def admission_refused(self, dataset: str) -> None:
        self.refused_at.setdefault(dataset, time.time())

    async def _commit_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.commit()

    async def _handle(self, backend: InferenceBackend, record: Any, slot: Slot) -> None:
        """Give the prompt at ``record`` its outcome, then let its offset be committed.

        Nothing but a stop (cancellation) leaves a prompt without an outcome: an error
        outside the inference request (a broker away, a bug) is retried with backoff,
        and a prompt it keeps failing is recorded as failed, so the partition's commit
        point never sticks behind it.
        """
        try:
            try:
                prompt = ev.decode(record.value)
                if not isinstance(prompt, ev.PromptEvent):
                    raise EventDecodeError(f"expected a prompt, got {type(prompt).__name__}")
            except EventDecodeError as exc:
                await self.publisher.dead_letter(str(exc), record)
            else:
                async with self._conversation_turn(prompt):
                    await self._settle_prompt(backend, prompt, slot)
        finally:
            slot.release()
        self.tracker.finished(record.topic, record.partition, record.offset)

    @contextlib.asynccontextmanager
    async def _conversation_turn(self, prompt: ev.PromptEvent) -> AsyncIterator[None]:
        """For a turn of a conversation regenerated turn by turn: once its outcome is
        published, publish what follows it (the next turn's prompt, or skips of the
        turns that will not be sent: :func:`conversations.follow_up`), before its
        offset may be committed. A stop before then leaves that to the prompt's
        redelivery, or to a rerun's producer (:func:`conversations.resume`)."""
        if not self._turns.expect(prompt):
            yield
            return
        try:
            yield
        except BaseException:
            self._turns.take(prompt.prompt_id)
            raise
        after = conversations.follow_up(
            prompt,
            self._turns.take(prompt.prompt_id),
            max_prompt_bytes=self.config.producer.max_prompt_bytes,
            at=time.time(),
        )
        if after.prompt is not None:
            await self.publisher.publish(self.topics.prompts, prompt.dataset, after.prompt)
            metrics.EVENTS_PRODUCED.labels(topic="prompts").inc()
        for skipped in after.skipped:
            await self.publisher.publish(self.topics.outcomes, prompt.dataset, skipped)
            metrics.SKIPPED_PROMPTS.labels(dataset=prompt.dataset).inc()
            metrics.EVENTS_PRODUCED.labels(topic="outcomes").inc()

    async def _settle_prompt(
        self, backend: InferenceBackend, prompt: ev.PromptEvent, slot: Slot
    ) -> None:
        errors = 0
        while True:
            try:
                await self._dispatch(backend, prompt, slot)
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
                async with slot.aside():
                    await asyncio.sleep(self.retry.delay(min(errors, 6)))

    async def _dispatch(
        self, backend: InferenceBackend, prompt: ev.PromptEvent, slot: Slot | None = None
    ) -> None:
        """Admit, then generate, fit and publish (:meth:`_attempt`); retry what the
        server's errors allow, and record the prompt as failed when they do not."""
        if prompt.prompt_id in self.outcomes.completed:
            self.report.already_completed += 1  # its outcome is recorded already
            return
        max_new = prompt.sampling.max_new_tokens or self.config.inference.max_new_tokens
        tries = _Tries()
        while True:
            admitted = await self._admit(prompt, max_new, slot)
            if admitted is None:
                return  # skipped: its dataset has no budget left for it
            tries.attempts += 1
            try:
                await self._attempt(backend, prompt, admitted.ticket, max_new, tries.attempts, slot)
            except InferenceError as exc:
                if await self._retry(prompt, exc, tries, slot):
                    continue
                break
            if self.gate is not None:
                self.gate.succeeded()
            return
        await self.publisher.fail(
            prompt,
            tries.attempts,
            f"gave up after {tries.attempts} attempt(s): {tries.last_error}",
        )

    async def _admit(
        self, prompt: ev.PromptEvent, max_new: int, slot: Slot | None
    ) -> _Admitted | None:
        """Wait until the server takes requests, then admit the prompt (with a ticket
        when budgets are reserved); None once it is skipped instead (dataset full)."""
        if self.gate is not None:
            await self.gate.wait_open()
        if self.board.is_halted(prompt.dataset):
            self.admission_refused(prompt.dataset)
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
        if self.gate is not None:
            self.gate.failed(exc)
        if not exc.retryable:
            return False
        if not exc.server_away:
            tries.failures += 1
            if tries.failures > self.retry.retries:
                return False
        reason = type(exc).__name__
        metrics.RETRIES.labels(dataset=prompt.dataset, reason=reason).inc()
        delay = self.retry.delay(min(tries.attempts, 8), exc.retry_after)
        if slot is not None:
            async with slot.aside():
                await asyncio.sleep(delay)
        else:
            await asyncio.sleep(delay)
        return True

    async def _attempt(
        self,
        backend: InferenceBackend,
        prompt: ev.PromptEvent,
        ticket: Ticket | None,
        max_new: int,
        attempts: int,
        slot: Slot | None,
    ) -> None:
        """One request: generate, fit the answer to what it may keep, publish it. The
        ticket is settled on every path (an error, a cancellation included)."""
        request = self._request(prompt, ticket, max_new)
        tickets = _Tickets(self.admission, ticket)
        try:
            generated = await self._generate(backend, prompt, request, ticket, slot)
            if generated is None:
                await self.publisher.skip(prompt, "budget lowered: aborted in flight")
                return
            fitted = await self._fit(backend, prompt, request, generated.answer, tickets, slot)
            if fitted is None:
                await self.publisher.skip(
                    prompt, "budget lowered or lease expired: answer not kept"
                )
                return
            await self._publish_completion(
                prompt, request, generated, fitted, attempts, max_new, tickets
            )
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
            temperature=prompt.sampling.temperature,
            sampling=prompt.sampling.request_fields(),
            tools=prompt.tools,
        )

    async def _fit(
        self,
        backend: InferenceBackend,
        prompt: ev.PromptEvent,
        request: GenerationRequest,
        answer: GenerationResult,
        tickets: _Tickets,
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

    async def _publish_completion(
        self,
        prompt: ev.PromptEvent,
        request: GenerationRequest,
        generated: _Generated,
        fitted: _Fitted,
        attempts: int,
        max_new: int,
        tickets: _Tickets,
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
        completion = self._completion(
            prompt, request, result, ticket, attempts, sent_at, finished_at, stop_reason, unfinished
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

    async def _generate(
        self,
        backend: InferenceBackend,
        prompt: ev.PromptEvent,
        request: GenerationRequest,
        ticket: Ticket | None,
        slot: Slot | None,
    ) -> _Generated | None:
        """The server's answer with when it was sent and finished; None when it was
        aborted because its lease was revoked (a lowered budget)."""
        rid = request.rid
        sent_at = time.time()
        if self.keep_log:
            self.report.sent.append(Dispatched(prompt.dataset, rid, sent_at))
        metrics.IN_FLIGHT.inc()
        generation = asyncio.create_task(backend.generate(request))
        lease_id = ticket.lease_id if ticket else ""
        # In flight (abortable, counted by its lease's cap) until it is fitted.
        self.in_flight.add(rid, prompt.dataset, lease_id, generation, backend)
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
            # aborted because its lease was revoked: what it streamed so far is lost
            wasted(prompt.dataset, "aborted", self.in_flight.streamed(rid))
            return None
        except BaseException:
            self.in_flight.forget(lease_id, rid)
            raise
        finally:
            self.in_flight.remove(rid)

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
        tickets: _Tickets,
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
        fitted = self.in_flight.fit(ticket.lease_id, prompt.dataset, rid, answer)
        return None if fitted is None else (ticket, fitted)

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

    def _completion(
        self,
        prompt: ev.PromptEvent,
        request: GenerationRequest,
        result: GenerationResult,
        ticket: Ticket | None,
        attempts: int,
        sent_at: float,
        finished_at: float,
        stop_reason: ev.StopReason,
        unfinished: bool,
    ) -> ev.CompletionEvent:
        return ev.CompletionEvent(
            request_id=request.rid,
            prompt_id=prompt.prompt_id,
            dataset=prompt.dataset,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            output_ids=None if result.output_ids is None else ev.TokenIds(result.output_ids),
            finish_reason=result.finish_reason,
            max_new_tokens=request.max_new_tokens,
            text=result.text,
            attempts=attempts,
            lease_id=ticket.lease_id if ticket else "",
            cost=budget.unit_cost(
                self.config.budget.unit, result.prompt_tokens, result.completion_tokens
            ),
            dispatched_at=sent_at,
            first_token_at=result.first_token_at,
            count_source=result.count_source,
            finished_at=finished_at,
            prompt=prompt.text,
            messages=prompt.messages,
            # the ids sent (template applied here), else those the server returned
            prompt_ids=_sent_ids(prompt, result),
            sampling=msgspec.structs.replace(
                prompt.sampling, max_new_tokens=request.max_new_tokens
            ),
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


def _sent_ids(prompt: ev.PromptEvent, result: GenerationResult) -> ev.TokenIds | None:
    """The prompt's ids: those sent (the template applied here), else those the
    server returned, else unknown."""
    ids = prompt.input_ids if prompt.input_ids is not None else result.prompt_ids
    return None if ids is None else ev.TokenIds(ids)


def prompt_token_estimate(prompt: ev.PromptEvent) -> int:
    """An upper bound on the prompt's tokens before the server counts them, for
    budgets in total_tokens: byte-level tokenizers never make more tokens than
    UTF-8 bytes; the margin covers special and template tokens."""
    text = prompt.text or "".join(m.content for m in prompt.messages or ())
    return len(text.encode()) + 16 * (1 + len(prompt.messages or ()))
