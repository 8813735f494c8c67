"""A budget lowered while requests are in flight, at the dispatcher, without a broker.

The dispatcher runs against the in-memory ledger of ``test_admission`` (leases),
a recorder standing in for its Kafka producer and a scripted backend whose answers
and streamed progress the test releases step by step, so each interleaving of
"answer finished", "lower budget read" and "ledger's revocation read" is exact.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tests.producers.dispatch.test_admission import (
    DS,
    TOPICS,
    FakeLedger,
    open_snapshot,
    run,
    until,
)
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import InferenceTransportError
from tokenbudget.core.sections import ReserveMode
from tokenbudget.producers.dispatch.admission import Admission
from tokenbudget.producers.dispatch.dispatcher import Dispatcher
from tokenbudget.producers.dispatch.leases import AdmissionSettings
from tokenbudget.producers.dispatch.slots import Slot
from tokenbudget.producers.inference.fleet import Fleet
from tokenbudget.producers.inference.generation import (
    GenerationRequest,
    GenerationResult,
    InferenceBackend,
    RetryPolicy,
)
from tokenbudget.producers.inference.server_gate import GateSettings
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.fields import SamplingParams


class Recorder:
    """The dispatcher's producer: keeps what it publishes."""

    def __init__(self) -> None:
        self.sent: list[ev.Event] = []

    async def send_and_wait(self, topic: str, key: bytes, value: bytes) -> None:
        self.sent.append(codec.decode(value))

    def completions(self) -> list[ev.CompletionEvent]:
        return [e for e in self.sent if isinstance(e, ev.CompletionEvent)]

    def skipped(self) -> list[ev.PromptSkipped]:
        return [e for e in self.sent if isinstance(e, ev.PromptSkipped)]


@dataclass
class _Call:
    request: GenerationRequest
    answer: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class ScriptedBackend(InferenceBackend):
    """SGLang-like: answers when the test says how many tokens it generated."""

    api = "sglang"

    def __init__(self, base_url: str = "http://scripted") -> None:  # nothing on the wire
        self.base_url = base_url
        self.calls: dict[str, _Call] = {}
        self.aborted: list[str] = []
        self.abort_gate: dict[str, asyncio.Event] = {}  # rid -> released when set
        self.healthy = True

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        call = self.calls[request.rid] = _Call(request)
        tokens = await call.answer
        return GenerationResult(
            rid=request.rid,
            prompt_tokens=3,
            completion_tokens=tokens,
            output_ids=list(range(tokens)),
            text="t" * tokens,
            finish_reason="abort" if request.rid in self.aborted else "stop",
        )

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        gate = self.abort_gate.get(rid)
        if gate is not None:
            await gate.wait()

    async def health(self) -> None:
        if not self.healthy:
            raise InferenceTransportError("health: connection refused")

    def streamed(self, rid: str, tokens: int) -> None:
        request = self.calls[rid].request
        assert request.on_progress is not None
        request.on_progress(rid, tokens)

    def finish(self, rid: str, tokens: int) -> None:
        self.calls[rid].answer.set_result(tokens)

    def rid_of(self, index: int) -> str:
        return list(self.calls)[index]


def make_dispatcher(
    *,
    stream: bool,
    budget: int = 10_000,
    reserve: ReserveMode = "whole",
    unit: ev.BudgetUnit = "completion_tokens",
) -> tuple[Dispatcher, ScriptedBackend, FakeLedger, BudgetBoard, Recorder]:
    config = config_module.build(
        {
            "kafka": {"bootstrap": "127.0.0.1:1", "namespace": TOPICS.namespace},
            "inference": {"url": "http://sim", "stream": stream, "concurrency": 8},
            "budget": {"reserve": reserve, "unit": unit},
            # the job's one dataset: a dispatcher takes prompts of its job's datasets only
            "datasets": [{"name": DS, "path": "unread.jsonl", "budget": budget}],
        },
        environ={},
    )
    board = BudgetBoard()
    fake = FakeLedger(board)
    fake.set_budget(budget)
    board.apply(ev.BudgetSet(dataset=DS, budget=budget))
    dispatcher = Dispatcher(config, "127.0.0.1:1", board, holder="d1")
    recorder = Recorder()
    backend = ScriptedBackend()
    admission = Admission(
        fake,  # type: ignore[arg-type]
        TOPICS,
        "d1",
        board,
        AdmissionSettings(unit=unit, lease_size=1000, reserve=reserve),
    )
    dispatcher.compose(recorder, admission, Fleet.of(backend))  # type: ignore[arg-type]
    return dispatcher, backend, fake, board, recorder


# Servers of a test's fleet are held back after a failure for their Retry-After only.
NO_BACKOFF = RetryPolicy(backoff=0.0, backoff_max=0.0)


def serve(
    dispatcher: Dispatcher, *backends: InferenceBackend, gate: GateSettings | None = None
) -> Fleet:
    """From now on the dispatcher's fleet is ``backends`` (its steps composed anew,
    with the retry policy they had)."""
    fleet = Fleet.of(*backends, gate=gate or GateSettings(), backoff=NO_BACKOFF)
    retry = dispatcher.tries.retry
    dispatcher.compose(dispatcher.publisher.producer, dispatcher.admission, fleet)
    dispatcher.tries.retry = retry
    return fleet


async def dispatch(
    dispatcher: Dispatcher, backend: InferenceBackend, p: ev.PromptEvent, slot: Slot | None = None
) -> None:
    """``p`` dispatched to a fleet of ``backend`` alone."""
    if [s.backend for s in dispatcher.fleet.servers.values()] != [backend]:
        serve(dispatcher, backend)
    await dispatcher.tries.dispatch(p, slot)


def prompt(i: int, max_new_tokens: int = 500) -> ev.PromptEvent:
    return ev.PromptEvent(
        prompt_id=f"p{i}",
        dataset=DS,
        text=f"q{i}",
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
    )


def test_an_answer_finished_after_a_lowering_waits_for_the_ledger_and_is_cut() -> None:
    """The lowering is read when the finished answer syncs, the ledger's revocation
    only later: the answer must not be published whole meanwhile."""

    async def main() -> None:
        dispatcher, backend, fake, board, recorder = make_dispatcher(stream=False)
        lowered = 300
        syncs = 0

        async def syncer() -> None:
            nonlocal syncs
            syncs += 1
            if syncs == 1:  # published while the request was generating
                board.apply(ev.BudgetSet(dataset=DS, budget=lowered))

        board.syncer = syncer
        task = asyncio.create_task(dispatch(dispatcher, backend, prompt(0)))
        await until(lambda: len(backend.calls) == 1, "the request")
        backend.finish(backend.rid_of(0), 500)
        await until(lambda: syncs == 1, "the sync")
        await asyncio.sleep(0.05)
        assert recorder.sent == []  # held until the ledger's answer is known
        fake.set_budget(lowered)  # kept 0 + reserved 1000 > 300: the lease is revoked
        await until(lambda: dispatcher.admission.revocations != {}, "the revocation")  # type: ignore[union-attr]
        board.apply(open_snapshot(lowered))  # the ledger shows the new budget applied
        await asyncio.wait_for(task, 5)
        [completion] = recorder.completions()
        assert completion.completion_tokens == lowered
        assert completion.output_ids == list(range(lowered))
        assert completion.finish_reason == "length"

    run(main())


def test_an_answer_finished_before_the_lowering_was_published_is_kept_whole() -> None:
    async def main() -> None:
        dispatcher, backend, _, board, recorder = make_dispatcher(stream=False)
        task = asyncio.create_task(dispatch(dispatcher, backend, prompt(0)))
        await until(lambda: len(backend.calls) == 1, "the request")
        backend.finish(backend.rid_of(0), 500)
        await asyncio.wait_for(task, 5)
        [completion] = recorder.completions()
        assert completion.completion_tokens == 500
        assert not board.lowering(DS)

    run(main())


def test_streams_are_aborted_together_when_what_they_generated_reaches_the_cap() -> None:
    async def main() -> None:
        dispatcher, backend, fake, board, recorder = make_dispatcher(stream=True)
        tasks = [asyncio.create_task(dispatch(dispatcher, backend, prompt(i))) for i in range(2)]
        await until(lambda: len(backend.calls) == 2, "two requests")
        a, b = backend.rid_of(0), backend.rid_of(1)
        backend.streamed(a, 100)
        backend.streamed(b, 100)
        board.apply(ev.BudgetSet(dataset=DS, budget=300))
        fake.set_budget(300)  # allowance 300 for the two requests in flight
        board.apply(open_snapshot(300))
        await until(lambda: dispatcher.admission.revocations != {}, "the revocation")  # type: ignore[union-attr]
        await asyncio.sleep(0.01)
        backend.abort_gate[a] = asyncio.Event()  # a slow abort must not hold back the next
        backend.streamed(a, 150)
        assert backend.aborted == []  # 250 generated: both still fit
        backend.streamed(b, 160)  # 310: nothing more of either can be kept
        await until(lambda: sorted(backend.aborted) == sorted([a, b]), "both aborts")
        backend.finish(a, 150)
        backend.finish(b, 170)  # it ran on a little before the abort landed
        backend.abort_gate[a].set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        kept = sorted(c.completion_tokens for c in recorder.completions())
        assert kept == [150, 150]  # the allowance exactly: the second one cut at the line

    run(main())


def test_a_stream_already_past_its_cap_is_aborted_as_soon_as_the_cap_is_known() -> None:
    async def main() -> None:
        dispatcher, backend, fake, board, recorder = make_dispatcher(stream=True)
        task = asyncio.create_task(dispatch(dispatcher, backend, prompt(0)))
        await until(lambda: len(backend.calls) == 1, "the request")
        rid = backend.rid_of(0)
        backend.streamed(rid, 400)
        board.apply(ev.BudgetSet(dataset=DS, budget=100))
        fake.set_budget(100)
        board.apply(open_snapshot(100))
        await until(lambda: backend.aborted == [rid], "the abort")
        backend.finish(rid, 420)
        await asyncio.wait_for(task, 5)
        [completion] = recorder.completions()
        assert completion.completion_tokens == 100

    run(main())


def test_answers_the_model_ended_tell_admission_their_length_those_cut_do_not() -> None:
    async def main() -> None:
        dispatcher, backend, fake, board, recorder = make_dispatcher(stream=False)
        admission = dispatcher.admission
        assert admission is not None
        first = asyncio.create_task(dispatch(dispatcher, backend, prompt(0)))
        await until(lambda: len(backend.calls) == 1, "the first request")
        backend.finish(backend.rid_of(0), 400)
        await asyncio.wait_for(first, 5)

        # The second is cut at the line of a budget lowered while it runs.
        lowered = 500
        syncs = 0

        async def syncer() -> None:
            nonlocal syncs
            syncs += 1
            if syncs == 1:
                board.apply(ev.BudgetSet(dataset=DS, budget=lowered))

        board.syncer = syncer
        second = asyncio.create_task(dispatch(dispatcher, backend, prompt(1)))
        await until(lambda: len(backend.calls) == 2, "the second request")
        backend.finish(backend.rid_of(1), 500)
        await until(lambda: syncs == 1, "the sync")
        fake.set_budget(lowered)
        await until(lambda: admission.revocations != {}, "the revocation")
        board.apply(open_snapshot(lowered))
        await asyncio.wait_for(second, 5)
        kept = [(c.completion_tokens, c.stop_reason) for c in recorder.completions()]
        assert kept[0] == (400, "stop") and kept[1][1] == "budget"
        for _ in range(97):
            admission.answered(DS, 10)
        # 98 lengths, not 99: what was kept of the cut answer says nothing of its length.
        assert admission.long_answer(DS) is None
        admission.answered(DS, 10)
        assert admission.long_answer(DS) == 400

    run(main())
