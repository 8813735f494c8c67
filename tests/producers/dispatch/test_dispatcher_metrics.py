"""The dispatcher's signals, without a broker: completions by finish reason (how the
budget's cut is told from the model's own stop is in ``test_answers``), tokens
generated but not kept, retries, time spent waiting for budget, request latency per
dataset, and halt latency on the board."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from tests.producers.dispatch.test_admission import DS, run, until
from tests.producers.dispatch.test_dispatcher_caps import dispatch, make_dispatcher, prompt
from tests.producers.dispatch.test_dispatcher_faults import FailingBackend, outcomes, with_retry
from tokenbudget.core.errors import InferenceUnavailableError
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_retries_are_counted_per_dataset_and_reason() -> None:
    async def main() -> None:
        dispatcher, _, _, _, recorder = make_dispatcher(stream=False)
        with_retry(dispatcher, retries=1)
        labels = {"dataset": DS, "reason": "InferenceUnavailableError"}
        before = sample("tokenbudget_inference_retries_total", **labels)
        busy = [InferenceUnavailableError("HTTP 503") for _ in range(3)]
        await dispatch(dispatcher, FailingBackend(busy), prompt(0))
        assert isinstance(outcomes(recorder)[0], ev.CompletionEvent)
        assert sample("tokenbudget_inference_retries_total", **labels) == before + 3

    run(main())


def test_latency_budget_wait_and_finish_reason_are_observed_per_dataset() -> None:
    async def main() -> None:
        dispatcher, _, _, _, _ = make_dispatcher(stream=False)
        latency = sample("tokenbudget_request_latency_seconds_count", dataset=DS)
        waits = sample("tokenbudget_budget_wait_seconds_count", dataset=DS)
        stops = sample("tokenbudget_completions_total", dataset=DS, finish_reason="stop")
        await dispatch(dispatcher, FailingBackend([], tokens=40), prompt(0))
        assert sample("tokenbudget_request_latency_seconds_count", dataset=DS) == latency + 1
        assert sample("tokenbudget_budget_wait_seconds_count", dataset=DS) == waits + 1
        assert (
            sample("tokenbudget_completions_total", dataset=DS, finish_reason="stop") == stops + 1
        )

    run(main())


def test_tokens_beyond_the_request_are_waste() -> None:
    async def main() -> None:
        dispatcher, _, _, _, _ = make_dispatcher(stream=False)
        labels = {"dataset": DS, "reason": "over_request"}
        before = sample("tokenbudget_wasted_tokens_total", **labels)
        await dispatch(dispatcher, FailingBackend([], tokens=900), prompt(0, max_new_tokens=500))
        assert sample("tokenbudget_wasted_tokens_total", **labels) == before + 400

    run(main())


def test_an_answer_the_budget_has_no_room_for_is_waste() -> None:
    async def main() -> None:
        dispatcher, backend, fake, _, recorder = make_dispatcher(stream=False, budget=1000)
        labels = {"dataset": DS, "reason": "refused"}
        before = sample("tokenbudget_wasted_tokens_total", **labels)
        task = asyncio.create_task(dispatch(dispatcher, backend, prompt(0)))
        await until(lambda: len(backend.calls) == 1, "the request")
        dispatcher.admission._leases[DS].valid_until = 0.0  # type: ignore[union-attr]
        fake.states[DS] = fake.state().__class__(
            dataset=DS, budget=1000, completion_tokens=1000, samples=1
        )
        backend.finish(backend.rid_of(0), 300)
        await asyncio.wait_for(task, 5)
        assert recorder.completions() == []
        assert sample("tokenbudget_wasted_tokens_total", **labels) == before + 300

    run(main())


def test_halt_latency_is_observed_for_news_not_for_history() -> None:
    board = BudgetBoard()
    count = REGISTRY.get_sample_value("tokenbudget_halt_latency_seconds_count") or 0.0
    old = ev.BudgetExceeded(dataset="a", budget=10, used=10, at=time.time() - 3600)
    board.apply(old)  # read back from the topic's history: not a latency
    assert REGISTRY.get_sample_value("tokenbudget_halt_latency_seconds_count") == count
    board.live = True
    now = time.time()
    board.apply(ev.BudgetExceeded(dataset="b", budget=10, used=10, at=now - 0.2), seen_at=now)
    board.apply(ev.BudgetExceeded(dataset="b", budget=10, used=11, at=now), seen_at=now)  # again
    assert REGISTRY.get_sample_value("tokenbudget_halt_latency_seconds_count") == count + 1
