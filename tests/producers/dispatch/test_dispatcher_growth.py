"""Growing reservations at the dispatcher (``[budget] reserve = "grow"``), without a
broker: the in-memory ledger of ``test_admission`` and the scripted backend of
``test_dispatcher_caps``, whose streamed progress the test releases step by step."""

from __future__ import annotations

import asyncio

from tests.producers.dispatch.test_admission import DS, balance, make, run, until
from tests.producers.dispatch.test_dispatcher_caps import (
    Recorder,
    ScriptedBackend,
    dispatch,
    make_dispatcher,
    prompt,
)
from tokenbudget.producers.dispatch.admission import Admission
from tokenbudget.producers.dispatch.caps import InFlight
from tokenbudget.producers.dispatch.dispatcher import Dispatcher


def growing_dispatcher(
    budget: int,
) -> tuple[Dispatcher, ScriptedBackend, Admission, Recorder]:
    """A dispatcher of growing reservations whose dataset's answers take 200 tokens."""
    dispatcher, backend, _, _, recorder = make_dispatcher(
        stream=True, budget=budget, reserve="grow"
    )
    admission = dispatcher.admission
    assert admission is not None
    for _ in range(10):
        admission.answered(DS, 200)
    return dispatcher, backend, admission, recorder


def test_a_streamed_answer_grows_ahead_of_its_tokens_and_is_kept_whole() -> None:
    async def main() -> None:
        dispatcher, backend, admission, recorder = growing_dispatcher(10_000)
        task = asyncio.create_task(dispatch(dispatcher, backend, prompt(0)))
        await until(lambda: len(backend.calls) == 1, "the request")
        rid = backend.rid_of(0)
        assert backend.calls[rid].request.max_new_tokens == 500  # its own limit
        for tokens in range(32, 481, 32):
            backend.streamed(rid, tokens)
        backend.finish(rid, 480)
        await asyncio.wait_for(task, 5)
        assert backend.aborted == []
        [completion] = recorder.completions()
        assert (completion.completion_tokens, completion.stop_reason) == (480, "stop")
        # Grown from the lease as it came, settled at its cost: the rest is back.
        assert balance(admission) == 1000 - 480

    run(main())


def test_an_answer_outgrowing_the_budgets_end_is_aborted_alone_and_cut_at_the_line() -> None:
    async def main() -> None:
        dispatcher, backend, _, recorder = growing_dispatcher(1000)
        tasks = [asyncio.create_task(dispatch(dispatcher, backend, prompt(i))) for i in range(5)]
        await until(lambda: len(backend.calls) == 5, "five requests of 200 each")
        long, short = backend.rid_of(0), backend.rid_of(1)
        backend.streamed(long, 150)  # near what it holds: the ledger is asked for more
        await asyncio.sleep(0.05)  # and has none (all 1,000 are reserved)
        backend.streamed(long, 230)
        await until(lambda: backend.aborted == [long], "the abort of the long answer")
        backend.finish(short, 60)
        await until(lambda: len(recorder.completions()) == 1, "the short answer")
        backend.finish(long, 400)  # what it generated until the abort landed
        await until(lambda: len(recorder.completions()) == 2, "the long answer")
        for i in range(2, 5):
            backend.finish(backend.rid_of(i), 100)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert backend.aborted == [long]  # the others were within what they held
        kept = {c.request_id: c for c in recorder.completions()}
        assert kept[short].completion_tokens == 60
        # Cut where the budget ended: what it reserved, and the short one's leftovers.
        assert kept[long].completion_tokens == 200 + 140
        assert kept[long].stop_reason == "budget"
        assert kept[long].output_ids == list(range(340))
        assert sum(c.completion_tokens for c in kept.values()) == 700 <= 1000

    run(main())


def test_a_streamed_answer_on_a_ticket_that_does_not_grow_is_never_aborted_for_it() -> None:
    """A samples budget reserves 1 per request and sends the request's own limit:
    its tickets do not grow, and a streamed answer past 1 token at the budget's end
    runs on to be kept whole."""

    async def main() -> None:
        admission, _, _ = make(1, unit="samples", lease_size=1)
        ticket = await admission.admit(DS, 500)
        assert ticket is not None and (ticket.reserved, ticket.max_new_tokens) == (1, 500)
        assert not ticket.grows
        admission._leases[DS].ledger_short = True  # the budget's end: nothing more
        in_flight = InFlight(admission, "samples", stream=True)
        backend = ScriptedBackend()
        generation = asyncio.get_running_loop().create_future()
        in_flight.add("r1", DS, ticket.lease_id, generation, backend, ticket)  # type: ignore[arg-type]
        in_flight.on_progress("r1", 300)
        await asyncio.sleep(0)
        assert backend.aborted == [] and not generation.cancelled()

    run(main())
