"""Faults around a request, at the dispatcher, without a broker: a busy or absent
server, a send to Kafka that fails, an error outside the request, an answer longer
than it was allowed, an answer whose lease expired while it was generated."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from aiokafka.errors import KafkaConnectionError

from tests.producers.canned import CannedTurns, answer_body
from tests.producers.dispatch.test_admission import DS, run, until
from tests.producers.dispatch.test_dispatcher_caps import (
    Recorder,
    dispatch,
    make_dispatcher,
    prompt,
    serve,
)
from tokenbudget.core import metrics
from tokenbudget.core.errors import (
    InferenceRequestError,
    InferenceServerError,
    InferenceTransportError,
    InferenceUnavailableError,
    ServerOutageError,
)
from tokenbudget.producers.dispatch.leases import Ticket
from tokenbudget.producers.inference.backends import make_backend
from tokenbudget.producers.inference.generation import (
    GenerationRequest,
    GenerationResult,
    InferenceBackend,
    RetryPolicy,
)
from tokenbudget.producers.inference.server_gate import GateSettings
from tokenbudget.streams import codec, ledger
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget import used


class FailingBackend(InferenceBackend):
    """Fails with the given errors, in order, then answers ``tokens`` tokens."""

    api = "sglang"
    base_url = "http://sim"

    def __init__(self, errors: list[Exception], tokens: int = 50, ids: int | None = None) -> None:
        self.errors = list(errors)
        self.tokens = tokens
        self.ids = tokens if ids is None else ids
        self.requests: list[GenerationRequest] = []
        self.healthy = asyncio.Event()
        self.health_checks = 0
        self.before: Callable[[], object] = lambda: None  # called as each request comes

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.before()
        self.requests.append(request)
        if self.errors:
            raise self.errors.pop(0)
        return GenerationResult(
            rid=request.rid,
            prompt_tokens=3,
            completion_tokens=self.tokens,
            output_ids=list(range(self.ids)),
            text="t",
            finish_reason="stop",
        )

    async def health(self) -> None:
        self.health_checks += 1
        if not self.healthy.is_set():
            raise InferenceTransportError("health: connection refused")


class NoWaitRetry(RetryPolicy):
    """Records the delays asked for instead of sleeping them."""

    def __init__(self, retries: int) -> None:
        super().__init__(retries=retries, backoff=0.0, backoff_max=0.0)
        object.__setattr__(self, "asked", [])

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        self.asked.append(retry_after)  # type: ignore[attr-defined]
        return 0.0


def with_retry(dispatcher: Any, retries: int = 2) -> NoWaitRetry:
    policy = NoWaitRetry(retries)
    dispatcher.tries.retry = policy
    return policy


def outcomes(recorder: Recorder) -> list[ev.Event]:
    return [e for e in recorder.sent if not isinstance(e, ev.DeadLetter)]


def test_a_busy_server_is_held_back_by_its_retry_after_and_never_fails_a_prompt() -> None:
    async def main() -> None:
        dispatcher, _, fake, _, recorder = make_dispatcher(stream=False)
        with_retry(dispatcher, retries=1)
        busy = [InferenceUnavailableError("HTTP 429", retry_after=0.05, busy=True)] * 6
        backend = FailingBackend([*busy, InferenceTransportError("reset")])
        backend.healthy.set()  # up, only busy: a pause ends at its first health check
        gate = GateSettings(health_interval_s=0.01)
        (server,) = serve(dispatcher, backend, gate=gate).servers.values()
        holds: list[tuple[float, float]] = []  # (sent at, held till then by the last)
        backend.before = lambda: holds.append((time.monotonic(), server.not_before))
        await dispatcher.tries.dispatch(prompt(0))
        [completion] = outcomes(recorder)
        assert isinstance(completion, ev.CompletionEvent)
        assert completion.attempts == 8  # seven failures, more than `retries`, spared it
        # Each request after a busy answer waited out its Retry-After.
        assert all(sent >= held for sent, held in holds)
        assert all(b[1] >= a[0] + 0.05 for a, b in itertools.pairwise(holds[:7]))
        assert server.window.size < server.window.ceiling  # and it is sent fewer at once
        # Nothing stayed reserved for the failed attempts: the lease holds only what
        # the one published answer cost.
        lease = next(iter(fake.state().leases.values()))
        assert dispatcher.admission._leases[DS].balance == lease.granted - 50  # type: ignore[union-attr]

    run(main())


def test_a_wrong_request_fails_at_once_and_other_server_errors_after_the_retries() -> None:
    async def main() -> None:
        dispatcher, _, _, _, recorder = make_dispatcher(stream=False)
        with_retry(dispatcher, retries=2)
        wrong = FailingBackend([InferenceRequestError("HTTP 400: prompt too long")])
        await dispatch(dispatcher, wrong, prompt(0))
        broken = FailingBackend([InferenceServerError("HTTP 500")] * 5)
        await dispatch(dispatcher, broken, prompt(1))
        failed = [e for e in recorder.sent if isinstance(e, ev.PromptFailed)]
        assert [(f.prompt_id, f.attempts) for f in failed] == [("p0", 1), ("p1", 3)]
        assert len(wrong.requests) == 1 and len(broken.requests) == 3

    run(main())


def test_warnings_about_a_prompt_name_its_dataset_and_row(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        dispatcher, _, _, _, _ = make_dispatcher(stream=False)
        with_retry(dispatcher, retries=1)
        row = msgspec.structs.replace(prompt(0), source="data/a.jsonl:7")
        await dispatch(dispatcher, FailingBackend([InferenceServerError("HTTP 500")] * 2), row)

    # The dispatcher's steps log under their modules' names.
    steps = {
        "tokenbudget.producers.dispatch.dispatcher",
        "tokenbudget.producers.dispatch.tries",
        "tokenbudget.producers.dispatch.outcomes",
    }
    with caplog.at_level(logging.WARNING, logger="tokenbudget.producers"):
        run(main())
    about = f"{DS}, data/a.jsonl:7 (prompt p0)"
    assert [r.getMessage() for r in caplog.records if r.name in steps] == [
        f"{about}: attempt 1 failed: HTTP 500",
        f"{about}: attempt 2 failed: HTTP 500",
        f"{about}: failed for good (gave up after 2 attempt(s): HTTP 500); "
        "see the dead-letter topic",
    ]


def test_a_server_away_is_paused_its_idle_leases_go_back_and_it_resumes_on_health() -> None:
    async def main() -> None:
        dispatcher, _, fake, _, recorder = make_dispatcher(stream=False)
        with_retry(dispatcher, retries=0)
        backend = FailingBackend([InferenceTransportError("refused")] * 3)
        fleet = serve(dispatcher, backend, gate=GateSettings(pause_after=3, health_interval_s=0.01))
        (server,) = fleet.servers.values()
        task = asyncio.create_task(dispatcher.tries.dispatch(prompt(0)))
        await until(lambda: server.state == "paused", "the pause")
        await until(lambda: backend.health_checks >= 2, "health checks")
        # While the server is away nothing is sent and no budget is held.
        assert len(backend.requests) == 3
        await until(lambda: fake.of(ev.LeaseReleased) != [], "the lease handed back")
        assert not any(lease.spent is None for lease in fake.state().leases.values())
        backend.healthy.set()
        await asyncio.wait_for(task, 5)
        assert [type(e) for e in outcomes(recorder)] == [ev.CompletionEvent]
        assert server.state == "up"

    run(main())


def test_a_server_away_longer_than_the_outage_timeout_ends_dispatch_with_a_clear_error() -> None:
    async def main() -> None:
        dispatcher, _, _, _, recorder = make_dispatcher(stream=False)
        with_retry(dispatcher, retries=0)
        backend = FailingBackend([InferenceTransportError("refused")] * 100)
        gate = GateSettings(pause_after=1, health_interval_s=0.01, outage_timeout_s=0.05)
        fleet = serve(dispatcher, backend, gate=gate)
        try:
            await asyncio.wait_for(dispatcher.tries.dispatch(prompt(0)), 5)
        except ServerOutageError as exc:
            assert "http://sim" in str(exc) and "outage_timeout_s" in str(exc)
        else:
            raise AssertionError("expected ServerOutageError")
        assert outcomes(recorder) == []  # not failed: a rerun resumes it
        assert fleet.outage is not None

    run(main())


class FlakyProducer(Recorder):
    """Kafka refuses the first ``failures`` sends."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def send_and_wait(self, topic: str, key: bytes, value: bytes) -> None:
        if self.failures:
            self.failures -= 1
            raise KafkaConnectionError("broker away")
        await super().send_and_wait(topic, key, value)


def test_a_failed_send_is_retried_and_the_lease_is_handed_back_only_after_it() -> None:
    async def main() -> None:
        dispatcher, _, fake, _, _ = make_dispatcher(stream=False)
        flaky = FlakyProducer(failures=2)
        dispatcher.publisher.producer = flaky  # type: ignore[assignment]
        backend = FailingBackend([], tokens=40)
        task = asyncio.create_task(dispatch(dispatcher, backend, prompt(0)))
        await asyncio.wait_for(task, 10)
        [completion] = flaky.completions()
        admission = dispatcher.admission
        assert admission is not None
        lease = admission._leases[DS]
        assert lease.in_flight == 0 and lease.spent == 40 and lease.publishing == 0
        await admission.close()
        [released] = fake.of(ev.LeaseReleased)
        assert released.spent == 40 and completion.lease_id == released.lease_id

    run(main())


def test_an_error_outside_the_request_is_retried_and_the_offset_is_finished() -> None:
    async def main() -> None:
        dispatcher, _, _, board, recorder = make_dispatcher(stream=False)
        with_retry(dispatcher)
        syncs = 0

        async def syncer() -> None:
            nonlocal syncs
            syncs += 1
            if syncs == 1:
                raise RuntimeError("budgets not synced")

        board.syncer = syncer
        dispatcher.tries.retry = RetryPolicy(retries=1, backoff=0.0, backoff_max=0.0)
        record = _Record(codec.encode(prompt(0)))
        dispatcher.tracker.started(record.topic, record.partition, record.offset)
        slot = await dispatcher.places.take(asyncio.Event())
        assert slot is not None
        serve(dispatcher, FailingBackend([]))
        await dispatcher._handle(record, slot)
        assert [type(e) for e in outcomes(recorder)] == [ev.CompletionEvent]
        assert dispatcher.tracker.committable() == {(record.topic, record.partition): 1}
        lease = dispatcher.admission._leases[DS]  # type: ignore[union-attr]
        assert lease.in_flight == 0 and lease.spent == 50  # the failed try was settled

    run(main())


class _Record:
    topic = "t.prompts"
    partition = 0
    offset = 0
    key = DS.encode()

    def __init__(self, value: bytes) -> None:
        self.value = value


def test_an_answer_longer_than_asked_is_cut_to_the_request_and_counted() -> None:
    async def main() -> None:
        dispatcher, _, _, _, recorder = make_dispatcher(stream=False)
        before = metrics.SERVER_COUNT_CORRECTIONS.labels(kind="over_request")._value.get()
        await dispatch(dispatcher, FailingBackend([], tokens=900), prompt(0, max_new_tokens=500))
        [completion] = recorder.completions()
        assert completion.completion_tokens == 500 == len(completion.output_ids)
        assert completion.finish_reason == "length"
        after = metrics.SERVER_COUNT_CORRECTIONS.labels(kind="over_request")._value.get()
        assert after == before + 1

    run(main())


@pytest.mark.parametrize("value", [-1_000_000, 3.5, True, 2**63], ids=repr)
@pytest.mark.parametrize("count", ["prompt_tokens", "completion_tokens"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", ["sglang", "openai-completions", "openai-chat"])
def test_an_answer_whose_counts_are_not_counts_is_refused_and_never_charged(
    api: str, stream: bool, count: str, value: object
) -> None:
    """A server answering a count that is negative (-1,000,000 prompt tokens would give
    a million tokens back to the lease), not an integer or absurd: the answer is
    refused, counted as a failed attempt of its own kind, and asked again; only the
    honest answer that follows is published and charged (budgets in total_tokens,
    which charge the prompt too)."""

    async def main() -> None:
        dispatcher, _, fake, _, recorder = make_dispatcher(stream=stream, unit="total_tokens")
        with_retry(dispatcher, retries=1)
        hostile = answer_body(api, stream=stream, **{count: value})
        client = CannedTurns([hostile, answer_body(api, stream=stream)])
        backend = make_backend(api, client, "http://hostile", stream=stream)
        kind = metrics.INFERENCE_ERRORS.labels(kind="InferenceBadCountError")
        before = kind._value.get()
        await dispatch(dispatcher, backend, prompt(0))
        [completion] = recorder.completions()
        assert (completion.prompt_tokens, completion.completion_tokens) == (3, 2)
        assert completion.cost == 5 and completion.attempts == 2
        assert [method for method, _, _ in client.sent].count("POST") == 2
        assert kind._value.get() == before + 1
        # The lease gave up what the one answer cost, and took nothing back.
        [lease] = fake.state().leases.values()
        held = dispatcher.admission._leases[DS]  # type: ignore[union-attr]
        assert held.spent == 5 and held.in_flight == 0
        assert held.balance == lease.granted - 5

    run(main())


def test_an_answer_on_a_lease_expired_meanwhile_is_claimed_on_a_fresh_lease() -> None:
    async def main() -> None:
        dispatcher, backend, fake, board, recorder = make_dispatcher(stream=False)
        task = asyncio.create_task(dispatch(dispatcher, backend, prompt(0)))
        await until(lambda: len(backend.calls) == 1, "the request")
        first = dispatcher.admission._leases[DS]  # type: ignore[union-attr]
        # The ledger expired the lease (its holder looked dead): the budget it held
        # is free again, and the holder hears so.
        board.apply(ev.LeaseRevoked(dataset=DS, lease_id=first.lease_id, holder="d1", expired=True))
        backend.finish(backend.rid_of(0), 300)
        await asyncio.wait_for(task, 5)
        [completion] = recorder.completions()
        assert completion.lease_id != first.lease_id  # kept on a fresh grant
        assert completion.completion_tokens == 300
        asks = fake.requests()
        assert asks[-1].lease_id == completion.lease_id and asks[-1].want >= 300

    run(main())


def test_a_claim_the_budget_has_no_room_for_is_not_kept() -> None:
    async def main() -> None:
        dispatcher, backend, fake, _, recorder = make_dispatcher(stream=False, budget=1000)
        task = asyncio.create_task(dispatch(dispatcher, backend, prompt(0)))
        await until(lambda: len(backend.calls) == 1, "the request")
        first = dispatcher.admission._leases[DS]  # type: ignore[union-attr]
        first.valid_until = 0.0  # frozen past its TTL: no renewal reached the ledger
        # Meanwhile the ledger expired that lease and another holder spent the budget.
        fake.states[DS] = msgspec.structs.replace(fake.state(), leases={})
        other = ev.LeaseRequested(dataset=DS, lease_id="other:1", holder="other", want=1000)
        fake._apply(ledger.apply_lease_request(fake.state(), other, ev.now()))
        fake.complete(Ticket(DS, "other:1", 1000, 1000), 1000)
        backend.finish(backend.rid_of(0), 300)
        await asyncio.wait_for(task, 5)
        assert recorder.completions() == []
        [skipped] = recorder.skipped()
        assert "expired" in skipped.reason
        assert used(fake.state()) == 1000

    run(main())
