"""A prompt's slot (producers/dispatch/slots.py) on its own: waiting aside, cancelled aside,
and places taken while the dispatcher hands back. How a dispatcher lends a place to
prompts of other datasets is in ``test_dispatcher_slots``."""

from __future__ import annotations

import asyncio
import contextlib

from tests.producers.dispatch.test_admission import run
from tokenbudget.producers.dispatch.slots import Backlog, Capacity, Places, Slot


def test_with_as_many_prompts_aside_as_places_the_next_waits_in_place() -> None:
    async def main() -> None:
        server, publishing, waiting = (asyncio.Semaphore(1) for _ in range(3))
        await waiting.acquire()  # the one place among the waiting is taken
        await server.acquire()
        slot = Slot(server, publishing, waiting)
        async with slot.aside():
            assert server.locked()  # kept: nobody else gets it meanwhile
        slot.release()
        assert not server.locked()

    run(main())


def test_a_prompt_cancelled_while_aside_leaves_every_place_free() -> None:
    async def main() -> None:
        server, publishing, waiting = (asyncio.Semaphore(1) for _ in range(3))
        await server.acquire()
        slot = Slot(server, publishing, waiting)
        entered = asyncio.Event()

        async def wait_aside() -> None:
            try:
                async with slot.aside():
                    entered.set()
                    await asyncio.Event().wait()
            finally:
                slot.release()

        task = asyncio.create_task(wait_aside())
        await entered.wait()
        await server.acquire()  # someone else holds the place when it is cancelled
        task.cancel()
        await asyncio.sleep(0.01)
        server.release()
        await asyncio.sleep(0.01)
        assert task.done()
        assert not server.locked() and not waiting.locked()

    run(main())


def test_the_server_answering_marks_the_slot_and_frees_its_place() -> None:
    async def main() -> None:
        server, publishing = asyncio.Semaphore(1), asyncio.Semaphore(1)
        await server.acquire()
        slot = Slot(server, publishing)
        assert not slot.answered
        await slot.hand_over()
        assert slot.answered
        assert not server.locked() and publishing.locked()  # a place among the publishing
        slot.release()
        assert not publishing.locked()

    run(main())


def test_no_place_is_taken_once_handing_back() -> None:
    async def main() -> None:
        places = Places(1)
        handing_back = asyncio.Event()
        first = await places.take(handing_back)
        assert first is not None
        waiting = asyncio.create_task(places.take(handing_back))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # the one place is taken
        handing_back.set()
        assert await asyncio.wait_for(waiting, 1) is None
        first.release()
        assert await places.take(handing_back) is None
        assert await places.take(asyncio.Event()) is not None  # the place was given back

    run(main())


def test_places_grow_and_shrink_with_what_the_fleet_can_take() -> None:
    async def main() -> None:
        places = Places(2)
        never = asyncio.Event()
        first, second = await places.take(never), await places.take(never)
        assert first is not None and second is not None
        third = asyncio.create_task(places.take(never))
        await asyncio.sleep(0)
        assert not third.done()  # two places, both taken
        places.resize(3)  # a server joined
        assert await asyncio.wait_for(third, 1) is not None
        places.resize(1)  # two servers went away: those taken stay taken
        first.release()
        second.release()
        fourth = asyncio.create_task(places.take(never))
        await asyncio.sleep(0)
        assert not fourth.done()  # one place, still held by the third prompt
        (await asyncio.wait_for(third, 1)).release()  # type: ignore[union-attr]
        assert await asyncio.wait_for(fourth, 1) is not None

    run(main())


def test_a_wait_for_a_place_cancelled_as_it_is_let_in_takes_nothing() -> None:
    async def main() -> None:
        capacity = Capacity(1)
        await capacity.acquire()
        waiter = asyncio.create_task(capacity.acquire())
        await asyncio.sleep(0)
        capacity.release()  # lets the waiter in...
        waiter.cancel()  # ... which is cancelled before it runs
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        assert capacity.taken == 0 and not capacity.locked()

    run(main())


def test_back_from_aside_once_the_fleet_is_out_the_prompt_ends_instead_of_waiting() -> None:
    """Every server dropped: the fleet has no place to give, ever; a prompt coming back
    from aside ends (a cancellation, holding nothing) rather than keep the
    dispatcher's wind-down waiting for it."""

    async def main() -> None:
        server = Capacity(1)
        publishing, waiting = asyncio.Semaphore(1), asyncio.Semaphore(1)
        stop = asyncio.Event()
        await server.acquire()
        slot = Slot(server, publishing, waiting, stop=stop)

        async def aside_then_on() -> None:
            async with slot.aside():
                await server.acquire()  # another prompt took the freed place
                server.resize(0)  # and the fleet's last server was dropped

        task = asyncio.create_task(aside_then_on())
        await asyncio.sleep(0.05)
        assert not task.done()  # waiting for a place back
        stop.set()
        await asyncio.wait_for(asyncio.wait({task}), timeout=2.0)
        assert task.cancelled()
        slot.release()
        assert server.taken == 1 and not waiting.locked()  # only the other's place

    run(main())


def test_a_partition_pauses_past_its_prompts_waiting_and_resumes_at_half() -> None:
    calls: list[tuple[str, str]] = []
    backlog = Backlog(
        4, lambda tp: calls.append(("pause", str(tp))), lambda tp: calls.append(("resume", str(tp)))
    )
    for _ in range(3):
        backlog.waiting("p1", 1)
    backlog.waiting("p2", 1)
    assert calls == []
    backlog.waiting("p1", 1)  # the fourth waiting from p1
    assert calls == [("pause", "p1")]
    backlog.waiting("p1", 1)
    backlog.waiting("p1", -1)
    backlog.waiting("p1", -1)
    assert calls == [("pause", "p1")]  # 3 still waiting: above half
    backlog.waiting("p1", -1)
    assert calls == [("pause", "p1"), ("resume", "p1")]
    assert backlog.paused == set() and backlog.counts == {"p1": 2, "p2": 1}


def test_a_partition_taken_away_forgets_its_pause() -> None:
    calls: list[str] = []
    backlog = Backlog(
        2, lambda tp: calls.append(f"pause {tp}"), lambda tp: calls.append(f"resume {tp}")
    )
    backlog.waiting("p", 1)
    backlog.waiting("p", 1)
    backlog.forget("p")
    for _ in range(2):
        backlog.waiting("p", -1)  # prompts read before it was taken away end later
    assert calls == ["pause p"]  # not resumed: it is not ours any more
    backlog.waiting("p", 1)
    backlog.waiting("p", 1)
    assert calls == ["pause p", "pause p"]  # counted afresh once it is ours again


def test_a_slot_tells_when_its_prompt_waits_for_budget_aside_or_in_place() -> None:
    async def main() -> None:
        told: list[int] = []
        server, publishing, waiting = (asyncio.Semaphore(1) for _ in range(3))
        await server.acquire()
        slot = Slot(server, publishing, waiting)
        slot.on_wait = told.append
        async with slot.aside():  # lends its place
            assert told == [1] and not server.locked()
        assert told == [1, -1] and server.locked()
        await waiting.acquire()  # no room aside: it waits in place, and still counts
        async with slot.aside():
            assert told == [1, -1, 1] and server.locked()
        assert told == [1, -1, 1, -1]
        waiting.release()
        await slot.hand_over()
        async with slot.aside():  # an answer waiting to be claimed is not a prompt waiting
            pass
        assert told == [1, -1, 1, -1]
        slot.release()

    run(main())


def test_more_prompts_wait_aside_than_there_are_server_places() -> None:
    async def main() -> None:
        places = Places(1)
        never = asyncio.Event()
        inside: list[asyncio.Event] = []
        go_on = asyncio.Event()

        async def waits_for_budget() -> None:
            slot = await places.take(never)
            assert slot is not None
            entered = asyncio.Event()
            inside.append(entered)
            async with slot.aside():
                entered.set()
                await go_on.wait()
            slot.release()

        first = asyncio.create_task(waits_for_budget())
        second = asyncio.create_task(waits_for_budget())
        await asyncio.wait_for(asyncio.gather(*(until_set(e) for e in await _two(inside))), 1)
        # Both wait aside, the one server place free for a prompt of another dataset.
        third = await asyncio.wait_for(places.take(never), 1)
        assert third is not None
        third.release()
        go_on.set()
        await asyncio.wait_for(asyncio.gather(first, second), 1)

    async def _two(events: list[asyncio.Event]) -> list[asyncio.Event]:
        while len(events) < 2:
            await asyncio.sleep(0.01)
        return events

    async def until_set(event: asyncio.Event) -> None:
        await event.wait()

    run(main())
