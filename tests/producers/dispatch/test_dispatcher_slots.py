"""A prompt waiting for budget lends its server place to prompts of other datasets,
and takes one back before it reserves anything (no broker: the harness of
``test_dispatcher_caps``)."""

from __future__ import annotations

import asyncio

from tests.producers.dispatch.test_admission import (
    DS,
    TOPICS,
    make,
    run,
    settle_and_complete,
    until,
)
from tests.producers.dispatch.test_dispatcher_caps import dispatch, make_dispatcher, prompt
from tokenbudget.producers.dispatch.admission import Admission
from tokenbudget.producers.dispatch.leases import AdmissionSettings
from tokenbudget.producers.dispatch.slots import Slot
from tokenbudget.streams import events as ev


def test_a_prompt_waiting_for_budget_frees_its_server_place_until_budget_comes() -> None:
    async def main() -> None:
        dispatcher, backend, fake, board, recorder = make_dispatcher(stream=False, budget=1000)
        server, publishing, waiting = (asyncio.Semaphore(1) for _ in range(3))
        other = Admission(
            fake,  # type: ignore[arg-type]
            TOPICS,
            "other",
            board,
            AdmissionSettings(lease_size=1000, policy="finish"),
        )
        taken = await other.admit(DS, 1000)  # another dispatcher holds the whole budget
        assert taken is not None

        await server.acquire()  # as the run loop does before it starts a prompt
        slot = Slot(server, publishing, waiting)
        task = asyncio.create_task(dispatch(dispatcher, backend, prompt(1), slot))
        await until(
            lambda: any(isinstance(e, ev.LeaseDenied) and e.holder == "d1" for e in fake.replies),
            "a denial for the waiting prompt",
        )
        # The place is free for the next prompt (of any dataset) while this one waits.
        await asyncio.wait_for(server.acquire(), timeout=2.0)

        await settle_and_complete(other, fake, taken, 100)
        await other.close()
        await asyncio.sleep(0.6)  # past the waiting prompt's next look at the budget
        assert backend.calls == {}  # budget is back, but it has no place yet
        # The ledger may have granted it a lease meanwhile (asked aside), but no request
        # reserves from it without a place.
        assert dispatcher.admission is not None
        assert all(lease.in_flight == 0 for lease in dispatcher.admission._leases.values())

        server.release()  # the other prompt is done with the place
        await until(lambda: len(backend.calls) == 1, "the request at the server")
        backend.finish(backend.rid_of(0), 400)
        await asyncio.wait_for(task, timeout=5.0)
        assert [c.completion_tokens for c in recorder.completions()] == [400]
        slot.release()
        assert not server.locked() and not waiting.locked() and not publishing.locked()

    run(main())


def test_a_prompt_asking_the_ledger_lends_its_server_place_until_the_answer() -> None:
    """The ledger's answer takes a round trip through Kafka; a dataset at its budget's
    end asks again after each of its answers. Meanwhile the asking prompt holds no
    server place, and it has one back before it reserves."""

    async def main() -> None:
        admission, fake, board = make(10_000, lease_size=500)
        answered = asyncio.Event()
        apply = board.apply

        def held_apply(event: ev.Event, seen_at: float | None = None) -> None:
            if isinstance(event, ev.LeaseGranted) and not answered.is_set():
                asyncio.get_running_loop().call_later(0.05, held_apply, event)
                return  # the ledger's answer is still on its way
            apply(event, seen_at)

        board.apply = held_apply  # type: ignore[method-assign]
        server, publishing, waiting = (asyncio.Semaphore(1) for _ in range(3))
        await server.acquire()  # as the run loop does before it starts a prompt
        slot = Slot(server, publishing, waiting)
        task = asyncio.create_task(admission.admit(DS, 100, aside=slot.aside))
        await until(lambda: any(isinstance(e, ev.LeaseRequested) for e in fake.sent), "the request")
        # Free for the next prompt (of any dataset) while the ledger answers.
        await asyncio.wait_for(server.acquire(), timeout=2.0)
        assert not task.done()
        answered.set()
        await asyncio.sleep(0.2)
        assert not task.done()  # granted, but it has no place yet: nothing reserved
        server.release()
        ticket = await asyncio.wait_for(task, timeout=5.0)
        assert ticket is not None and ticket.reserved == 100
        assert server.locked()  # its place again
        slot.release()

    run(main())


def test_an_answer_waiting_to_be_claimed_lends_its_place_among_those_being_published() -> None:
    """Two answers of one lease in flight when the ledger expires it (a frozen
    dispatcher, a broker away): the first to finish waits to claim budget anew until
    the lease's other request has settled, and that one needs a place among the
    answers being published to settle. The waiting claim lends its place meanwhile,
    or neither could ever go on."""

    async def main() -> None:
        dispatcher, backend, _, board, recorder = make_dispatcher(stream=False)
        server, publishing, waiting = asyncio.Semaphore(2), asyncio.Semaphore(1), None

        async def handle(i: int) -> None:  # as the run loop does
            await server.acquire()
            slot = Slot(server, publishing, waiting)
            try:
                await dispatch(dispatcher, backend, prompt(i), slot)
            finally:
                slot.release()

        tasks = [asyncio.create_task(handle(i)) for i in range(2)]
        await until(lambda: len(backend.calls) == 2, "both requests at the server")
        lease = dispatcher.admission._leases[DS]  # type: ignore[union-attr]
        board.apply(ev.LeaseRevoked(dataset=DS, lease_id=lease.lease_id, holder="d1", expired=True))
        backend.finish(backend.rid_of(0), 300)
        await asyncio.sleep(0.2)  # the first answer now waits for its claim
        backend.finish(backend.rid_of(1), 200)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=5.0)
        kept = sorted(c.completion_tokens for c in recorder.completions())
        assert kept == [200, 300]
        assert all(c.lease_id != lease.lease_id for c in recorder.completions())
        assert not server.locked() and not publishing.locked()

    run(main())
