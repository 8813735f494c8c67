"""A dispatcher asked to hand back (``run`` stopped by Ctrl-C or SIGTERM): answers
already in are published, requests still at the server are given up without an
outcome and their offsets stay uncommitted (no broker: the harness of
``test_dispatcher_caps``)."""

from __future__ import annotations

import asyncio

from tests.producers.dispatch.test_admission import DS, run, until
from tests.producers.dispatch.test_dispatcher_caps import Recorder, make_dispatcher, prompt
from tokenbudget.producers.dispatch.dispatcher import Dispatcher
from tokenbudget.producers.dispatch.slots import Slot
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev


class HeldRecorder(Recorder):
    """Holds completions until ``release`` is set, as a slow broker would."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def send_and_wait(self, topic: str, key: bytes, value: bytes) -> None:
        if isinstance(codec.decode(value), ev.CompletionEvent):
            await self.release.wait()
        await super().send_and_wait(topic, key, value)


async def taken(dispatcher: Dispatcher) -> Slot:
    """A place at the server, as the run loop takes one before it starts a prompt."""
    slot = await dispatcher.places.take(asyncio.Event())
    assert slot is not None
    return slot


class Record:
    topic = "t.prompts"
    partition = 0
    key = DS.encode()

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.value = codec.encode(prompt(offset))


def test_handing_back_publishes_the_answers_in_and_gives_up_the_requests_at_the_server() -> None:
    async def main() -> None:
        dispatcher, backend, _, _, _ = make_dispatcher(stream=False)
        recorder = HeldRecorder()
        dispatcher.publisher.producer = recorder  # type: ignore[assignment]
        records = [Record(0), Record(1)]
        tasks = {}
        for record in records:
            dispatcher.tracker.started(record.topic, record.partition, record.offset)
            slot = await taken(dispatcher)
            tasks[asyncio.create_task(dispatcher._handle(record, slot))] = slot
        await until(lambda: len(backend.calls) == 2, "both requests at the server")
        calls = {call.request.text: call for call in backend.calls.values()}
        p0, p1 = calls["q0"], calls["q1"]
        p0.answer.set_result(40)  # p0's answer is in, its completion not sent yet
        await until(lambda: [s.answered for s in tasks.values()] == [True, False], "p0's answer")

        dispatcher.hand_back()
        winding_down = asyncio.create_task(dispatcher._wind_down(tasks))
        await until(lambda: p1.answer.cancelled(), "p1's request given up")
        recorder.release.set()
        await asyncio.wait_for(winding_down, 5)

        assert [c.prompt_id for c in recorder.completions()] == ["p0"]
        assert recorder.skipped() == []  # p1 has no outcome: the rerun sends it
        assert not any(isinstance(e, ev.PromptFailed) for e in recorder.sent)
        assert dispatcher.tracker.committable() == {("t.prompts", 0): 1}
        lease = dispatcher.admission._leases[DS]  # type: ignore[union-attr]
        assert lease.in_flight == 0 and lease.spent == 40  # p1's reservation is back

    run(main())


def test_without_hand_back_a_stop_waits_for_every_request() -> None:
    async def main() -> None:
        dispatcher, backend, _, _, recorder = make_dispatcher(stream=False)
        record = Record(0)
        dispatcher.tracker.started(record.topic, record.partition, record.offset)
        slot = await taken(dispatcher)
        tasks = {asyncio.create_task(dispatcher._handle(record, slot)): slot}
        await until(lambda: len(backend.calls) == 1, "the request at the server")
        winding_down = asyncio.create_task(dispatcher._wind_down(tasks))
        await asyncio.sleep(0.05)
        assert not winding_down.done()
        backend.finish(backend.rid_of(0), 30)
        await asyncio.wait_for(winding_down, 5)
        assert [c.completion_tokens for c in recorder.completions()] == [30]
        assert dispatcher.tracker.committable() == {("t.prompts", 0): 1}

    run(main())
