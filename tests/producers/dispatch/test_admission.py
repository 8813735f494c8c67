"""Admission against an in-memory ledger: leases spent locally, never beyond the budget.

The fake producer decodes what Admission publishes, applies it to a pure
:class:`tokenbudget.streams.ledger.DatasetLedger` and delivers the ledger's replies back through
a :class:`BudgetBoard` on a later loop turn, like the real round trip over Kafka.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import msgspec

from tokenbudget.producers.dispatch.admission import Admission
from tokenbudget.producers.dispatch.leases import AdmissionSettings, Ticket
from tokenbudget.streams import codec, ledger
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget import used
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.topics import Topics

DS = "ds"
TOPICS = Topics(namespace="t")
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


class FakeLedger:
    """A producer whose sends land in a pure ledger; replies come back via the board."""

    def __init__(self, board: BudgetBoard, unit: ev.BudgetUnit = "completion_tokens") -> None:
        self.board = board
        self.unit: ev.BudgetUnit = unit
        self.states: dict[str, ledger.DatasetLedger] = {}
        self.sent: list[ev.Event] = []
        self.replies: list[ev.Event] = []
        self.outcomes: dict[str, ledger.Outcome] = {}
        self.fenced: set[str] = set()
        self._rid = 0

    def state(self, dataset: str = DS) -> ledger.DatasetLedger:
        return self.states.setdefault(dataset, ledger.DatasetLedger(dataset=dataset))

    def _apply(self, transition: ledger.Transition) -> None:
        self.states[transition.state.dataset] = transition.state
        loop = asyncio.get_running_loop()
        for event in transition.emit:
            self.replies.append(event)
            if isinstance(event, ev.LeaseFenced):
                # Written into the completions partition and read back a moment later.
                loop.call_soon(self._read_fence, event)
            else:
                loop.call_soon(self.board.apply, event)

    def _read_fence(self, fence: ev.LeaseFenced) -> None:
        self.fenced.add(fence.lease_id)
        self._apply(ledger.apply_lease_fenced(self.state(fence.dataset), fence, ev.now()))

    def set_budget(self, budget: int, dataset: str = DS) -> None:
        event = ev.BudgetSet(dataset=dataset, budget=budget, unit=self.unit)
        self._apply(ledger.apply_budget_set(self.state(dataset), event, ev.now()))

    async def send_and_wait(
        self, topic: str, key: bytes | None = None, value: bytes | None = None
    ) -> None:
        assert topic == TOPICS.reservations
        assert value is not None
        event = codec.decode(value)
        assert key == codec.event_key(event)
        self.sent.append(event)
        await asyncio.sleep(0)
        at = ev.now()
        match event:
            case ev.LeaseRequested():
                fenced = event.lease_id in self.fenced
                t = ledger.apply_lease_request(self.state(event.dataset), event, at, fenced=fenced)
            case ev.LeaseRenewed():
                t = ledger.apply_lease_renewed(self.state(event.dataset), event, at)
            case ev.LeaseReleased():
                t = ledger.apply_lease_released(self.state(event.dataset), event, at)
            case _:
                raise AssertionError(f"unexpected event {event!r}")
        self._apply(t)

    def complete(self, ticket: Ticket, completion_tokens: int, prompt_tokens: int = 0) -> None:
        """The ledger reads the completion published for ``ticket``."""
        self._rid += 1
        event = ev.CompletionEvent(
            request_id=f"r{self._rid}",
            prompt_id=f"p{self._rid}",
            dataset=ticket.dataset,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            output_ids=[],
            finish_reason="stop",
            max_new_tokens=ticket.max_new_tokens,
            lease_id=ticket.lease_id,
        )
        fenced = ticket.lease_id in self.fenced  # published after its lease's fence
        state = self.state(ticket.dataset)
        self._apply(ledger.apply_outcome(state, event, None, ev.now(), fenced=fenced))

    def of(self, kind: type[T]) -> list[T]:
        return [e for e in self.sent if isinstance(e, kind)]

    def requests(self) -> list[ev.LeaseRequested]:
        return self.of(ev.LeaseRequested)

    def releases(self) -> list[ev.LeaseReleased]:
        return self.of(ev.LeaseReleased)


def make(
    budget: int | None = 1000,
    *,
    holder: str = "d1",
    board: BudgetBoard | None = None,
    fake: FakeLedger | None = None,
    on_revoke: Callable[[str], Coroutine[Any, Any, None]] | None = None,
    **settings: Any,
) -> tuple[Admission, FakeLedger, BudgetBoard]:
    board = board or BudgetBoard()
    if fake is None:
        fake = FakeLedger(board, settings.get("unit", "completion_tokens"))
        if budget is not None:
            fake.set_budget(budget)
    admission = Admission(
        fake,  # type: ignore[arg-type]
        TOPICS,
        holder,
        board,
        AdmissionSettings(**settings),
        on_revoke=on_revoke,
    )
    return admission, fake, board


async def until(predicate: Callable[[], bool], what: str = "condition") -> None:
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


async def settle_and_complete(
    admission: Admission, fake: FakeLedger, ticket: Ticket, cost: int | None
) -> None:
    """Publish a completion costing ``cost`` (None: nothing published) and settle."""
    if cost is not None:
        if admission.settings.unit == "total_tokens":
            fake.complete(ticket, cost - ticket.prompt_estimate, ticket.prompt_estimate)
        else:
            fake.complete(ticket, cost)
    admission.settle(ticket, cost)
    await asyncio.sleep(0)


def balance(admission: Admission, dataset: str = DS) -> int:
    lease = admission._leases.get(dataset)
    return 0 if lease is None else lease.balance


# ---- reserving ---------------------------------------------------------------------


def test_first_admit_requests_a_lease_and_reserves_the_request() -> None:
    async def main() -> None:
        admission, fake, board = make(10_000, lease_size=1000, lease_ttl_s=12.0)
        ticket = await admission.admit(DS, 256)
        assert ticket is not None
        assert (ticket.dataset, ticket.reserved, ticket.max_new_tokens) == (DS, 256, 256)
        [req] = fake.requests()
        assert (req.dataset, req.holder, req.want, req.min_grant) == (DS, "d1", 1000, 1)
        assert req.ttl_s == 12.0
        assert req.lease_id == ticket.lease_id
        assert board.lease_listeners["d1"] == admission._on_ledger_event
        assert balance(admission) == 1000 - 256
        assert ledger.reserved(fake.state()) == 1000

    run(main())


def test_truncate_clamps_max_new_tokens_at_the_end_of_the_budget() -> None:
    async def main() -> None:
        # cut = "any": what the lease holds goes out at once, requests in flight or not.
        admission, fake, _ = make(1000, lease_size=4096, cut="any")
        tickets = [await admission.admit(DS, 300) for _ in range(3)]
        assert [t.reserved for t in tickets if t] == [300, 300, 300]
        last = await admission.admit(DS, 300)
        assert last is not None
        assert (last.reserved, last.max_new_tokens) == (100, 100)
        assert len(fake.requests()) == 1
        assert sum(t.reserved for t in [*tickets, last] if t) == 1000

        # Nothing left: the next admit waits for in-flight leftovers...
        waiting = asyncio.create_task(admission.admit(DS, 300))
        await until(lambda: len(fake.of(ev.LeaseRequested)) >= 2, "a second lease request")
        assert not waiting.done()
        assert tickets[0] is not None
        await settle_and_complete(admission, fake, tickets[0], 120)
        resumed = await waiting
        assert resumed is not None
        # ...and is clamped to what came back.
        assert (resumed.reserved, resumed.max_new_tokens) == (180, 180)
        assert used(fake.state()) + ledger.reserved(fake.state()) <= 1000

    run(main())


def test_settle_returns_leftovers_so_the_next_admit_needs_no_request() -> None:
    async def main() -> None:
        admission, fake, _ = make(10_000, lease_size=1000)
        first = await admission.admit(DS, 500)
        assert first is not None
        assert balance(admission) == 500
        await settle_and_complete(admission, fake, first, 100)
        assert balance(admission) == 900
        second = await admission.admit(DS, 800)
        assert second is not None
        assert second.reserved == 800
        assert second.lease_id == first.lease_id
        assert len(fake.requests()) == 1
        # Nothing published: the whole reservation comes back.
        admission.settle(second, None)
        assert balance(admission) == 900
        lease = admission._leases[DS]
        assert (lease.in_flight, lease.spent) == (0, 100)

    run(main())


def test_settle_of_a_stale_ticket_is_ignored() -> None:
    async def main() -> None:
        admission, _, _ = make(10_000, lease_size=1000)
        ticket = await admission.admit(DS, 100)
        assert ticket is not None
        stale = Ticket(DS, "someone-else", 100, 100)
        admission.settle(stale, 50)
        assert admission._leases[DS].in_flight == 1
        assert balance(admission) == 900
        admission.settle(Ticket("other", ticket.lease_id, 100, 100), 50)
        assert admission._leases[DS].in_flight == 1

    run(main())


def test_bigger_ask_than_the_lease_size() -> None:
    async def main() -> None:
        admission, fake, _ = make(10_000, lease_size=100, policy="finish")
        ticket = await admission.admit(DS, 700)
        assert ticket is not None
        assert ticket.reserved == 700
        [req] = fake.requests()
        assert (req.want, req.min_grant) == (700, 700)

    run(main())


def test_sum_of_reservations_never_exceeds_the_budget() -> None:
    async def main() -> None:
        rng = random.Random(7)
        budget = 5000
        board = BudgetBoard()
        fake = FakeLedger(board)
        fake.set_budget(budget)
        admissions = [
            make(
                budget,
                holder=f"d{i}",
                board=board,
                fake=fake,
                lease_size=rng.choice([300, 700, 1500]),
                policy="truncate",
            )[0]
            for i in range(3)
        ]
        live: list[Ticket] = []
        kept = 0
        refused = 0

        def check() -> None:
            assert kept + sum(t.reserved for t in live) <= budget
            state = fake.state()
            assert used(state) + ledger.reserved(state) <= budget

        async def worker(admission: Admission, n: int) -> None:
            nonlocal kept, refused
            for _ in range(n):
                ticket = await admission.admit(DS, rng.randint(20, 400))
                if ticket is None:
                    refused += 1
                    continue
                assert 1 <= ticket.max_new_tokens == ticket.reserved
                live.append(ticket)
                check()
                for _ in range(rng.randint(0, 3)):
                    await asyncio.sleep(0)
                live.remove(ticket)
                if rng.random() < 0.1:
                    admission.settle(ticket, None)
                    continue
                cost = rng.randint(0, ticket.max_new_tokens)
                kept += cost
                fake.complete(ticket, cost)
                admission.settle(ticket, cost)
                check()

        await asyncio.gather(*(worker(a, 40) for a in admissions for _ in range(4)))
        check()
        for admission in admissions:
            await admission.close()
        await asyncio.sleep(0)
        state = fake.state()
        assert state.leases == {}
        assert used(state) == kept <= budget
        assert refused > 0  # the budget did run out
        assert kept > budget // 2

    run(main(), timeout=120)


# ---- cut = "last": only the answer at the line goes out short ---------------------------


def test_last_waits_for_leftovers_instead_of_sending_short_and_cuts_one_at_the_end() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=4096)
        t1, t2, t3 = [await admission.admit(DS, 300) for _ in range(3)]
        assert t1 is not None and t2 is not None and t3 is not None
        # 100 left and three requests in flight that will hand most of theirs back.
        fourth = asyncio.create_task(admission.admit(DS, 300))
        await asyncio.sleep(0.01)
        assert not fourth.done()
        await settle_and_complete(admission, fake, t1, 120)  # 280 held: not yet whole
        await asyncio.sleep(0.01)
        assert not fourth.done()
        await settle_and_complete(admission, fake, t2, 200)
        whole = await fourth
        assert whole is not None and (whole.reserved, whole.max_new_tokens) == (300, 300)

        # 80 left, two in flight: the fifth waits for both rather than go out short...
        fifth = asyncio.create_task(admission.admit(DS, 300))
        await settle_and_complete(admission, fake, t3, 250)
        await asyncio.sleep(0.01)
        assert not fifth.done()
        asks = len(fake.requests())
        await settle_and_complete(admission, fake, whole, 230)
        # ...then, the ledger asked again and still short, it is the one sent short.
        last = await fifth
        assert last is not None
        assert (last.reserved, last.max_new_tokens) == (200, 200)
        assert len(fake.requests()) == asks + 1
        state = fake.state()
        assert used(state) == 800 and used(state) + ledger.reserved(state) == 1000

    run(main())


def test_last_sends_at_once_what_likely_covers_an_answer_of_the_dataset() -> None:
    async def main() -> None:
        admission, _, _ = make(1000, lease_size=4096)
        for _ in range(98):
            admission.answered(DS, 100)
        assert admission.long_answer(DS) is None  # too few answers to judge a tail by
        admission.answered(DS, 90)
        assert admission.long_answer(DS) == 100
        tickets = [await admission.admit(DS, 300) for _ in range(3)]
        assert all(t is not None for t in tickets)
        # 100 left, in flight or not: as long as the longest of 99 answers.
        likely = await admission.admit(DS, 300)
        assert likely is not None and (likely.reserved, likely.max_new_tokens) == (100, 100)

    run(main())


def test_last_never_sends_a_generated_answer_short_by_the_lengths_of_others() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=4096)
        for _ in range(99):
            admission.answered(DS, 50)
        tickets = [await admission.admit(DS, 300) for _ in range(3)]
        assert tickets[0] is not None
        # An answer of 250 tokens claimed anew: its own length is what covers it.
        claim = asyncio.create_task(admission.admit(DS, 250, exact=True))
        await asyncio.sleep(0.01)
        assert not claim.done()
        await settle_and_complete(admission, fake, tickets[0], 100)
        claimed = await claim
        assert claimed is not None and claimed.max_new_tokens == 250

    run(main())


def test_last_asks_the_ledger_again_before_the_one_request_sent_short() -> None:
    async def main() -> None:
        board = BudgetBoard()
        fake = FakeLedger(board)
        fake.set_budget(1000)
        b, _, _ = make(board=board, fake=fake, holder="b", lease_size=400)
        a, _, _ = make(board=board, fake=fake, holder="a", lease_size=900)
        tb = await b.admit(DS, 300)
        ta = await a.admit(DS, 550)  # a lease of 600 where 900 was asked: the ledger ran dry
        assert tb is not None and ta is not None
        waiting = asyncio.create_task(a.admit(DS, 300))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # 50 held, 550 in flight
        # b is done: its 100 unspent go back to the ledger while a waits.
        await settle_and_complete(b, fake, tb, 300)
        await b.close()
        await until(lambda: ledger.remaining(fake.state()) == 100, "b's release")
        await settle_and_complete(a, fake, ta, 500)
        # a's 100 and b's 100 go out as one request: one answer cut, not two.
        ticket = await waiting
        assert ticket is not None and ticket.reserved == 200
        state = fake.state()
        assert used(state) == 800 and used(state) + ledger.reserved(state) == 1000

    run(main())


def test_finish_is_unchanged_by_the_cut_policy() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=4096, policy="finish")
        tickets = [await admission.admit(DS, 300) for _ in range(3)]
        assert all(t is not None for t in tickets)
        pending = asyncio.create_task(admission.admit(DS, 300))
        for ticket in tickets:
            assert ticket is not None
            await settle_and_complete(admission, fake, ticket, 290)
        # 130 left, never a whole answer: refused, nothing sent short.
        assert await pending is None

    run(main())


# ---- the finish policy ---------------------------------------------------------------


def test_finish_never_admits_less_than_a_whole_answer() -> None:
    async def main() -> None:
        admission, fake, board = make(1000, lease_size=4096, policy="finish")
        a = await admission.admit(DS, 400)
        b = await admission.admit(DS, 400)
        assert a is not None and b is not None
        assert (a.reserved, b.reserved) == (400, 400)
        assert (a.max_new_tokens, b.max_new_tokens) == (400, 400)
        [req] = fake.requests()
        assert req.min_grant == 400
        # 200 left: not enough for a whole answer. It waits for what is in flight...
        third = asyncio.create_task(admission.admit(DS, 400))
        await until(lambda: len(fake.requests()) >= 2, "a second request")
        assert fake.requests()[1].min_grant == 400
        await settle_and_complete(admission, fake, a, 400)
        await settle_and_complete(admission, fake, b, 400)
        # ...which used all of it, so the rest of the budget cannot fit one.
        assert await third is None
        assert DS in admission.refused_at
        assert fake.state().halted  # 1000 - 800 < 400
        assert board.is_halted(DS)
        [released] = fake.releases()
        assert (released.lease_id, released.spent) == (a.lease_id, 800)
        assert fake.state().leases == {}

    run(main())


def test_finish_returns_none_when_budget_left_is_below_an_answer() -> None:
    async def main() -> None:
        admission, fake, _ = make(300, lease_size=4096, policy="finish")
        assert await admission.admit(DS, 400) is None
        [req] = fake.requests()
        assert (req.want, req.min_grant) == (4096, 400)
        [denied] = [e for e in fake.replies if isinstance(e, ev.LeaseDenied)]
        assert denied.full
        assert fake.state().leases == {}
        assert fake.state().halted
        assert DS in admission.refused_at
        assert len(fake.releases()) == 1
        # A smaller whole answer still fits: another dispatcher gets it.
        admission2, _, _ = make(holder="d2", board=fake.board, fake=fake, policy="finish")
        small = await admission2.admit(DS, 250)
        assert small is not None
        assert small.reserved == 250
        assert used(fake.state()) + ledger.reserved(fake.state()) <= 300

    run(main())


def test_finish_with_total_tokens_needs_prompt_and_answer() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, unit="total_tokens", policy="finish", lease_size=4096)
        t = await admission.admit(DS, 300, prompt_estimate=200)
        assert t is not None
        assert (t.reserved, t.max_new_tokens) == (500, 300)
        u = await admission.admit(DS, 300, prompt_estimate=200)
        assert u is not None
        await settle_and_complete(admission, fake, t, 500)
        await settle_and_complete(admission, fake, u, 500)
        assert await admission.admit(DS, 1, prompt_estimate=200) is None

    run(main())


# ---- denials -------------------------------------------------------------------------


def test_denial_with_requests_in_flight_waits_and_admits_from_leftovers() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=1000, policy="finish")
        first = await admission.admit(DS, 600)
        assert first is not None
        second = asyncio.create_task(admission.admit(DS, 600))
        await until(lambda: any(isinstance(e, ev.LeaseDenied) for e in fake.replies), "a denial")
        await asyncio.sleep(0.01)
        assert not second.done()
        await settle_and_complete(admission, fake, first, 100)
        ticket = await second
        assert ticket is not None
        assert ticket.reserved == 600
        assert ticket.lease_id == first.lease_id
        assert admission.refused_at == {}
        assert fake.releases() == []
        state = fake.state()
        assert used(state) + ledger.reserved(state) <= 1000

    run(main())


def test_denial_with_nothing_in_flight_refuses_and_releases() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=300, policy="finish")
        t1 = await admission.admit(DS, 300)
        assert t1 is not None
        await settle_and_complete(admission, fake, t1, 250)
        t2 = await admission.admit(DS, 40)
        assert t2 is not None
        await settle_and_complete(admission, fake, t2, 30)
        t3 = await admission.admit(DS, 10)
        assert t3 is not None
        await settle_and_complete(admission, fake, t3, None)  # nothing published
        assert t1.lease_id == t2.lease_id == t3.lease_id
        assert fake.releases() == []

        # 720 left: a whole answer of 800 can never fit.
        assert await admission.admit(DS, 800) is None
        assert DS in admission.refused_at
        refused_at = admission.refused_at[DS]
        [released] = fake.releases()
        assert (released.lease_id, released.holder, released.spent) == (t1.lease_id, "d1", 280)
        assert fake.state().leases == {}
        assert DS not in admission._leases
        assert used(fake.state()) == 280
        # A second refusal keeps the first time, on a fresh lease.
        assert await admission.admit(DS, 800) is None
        assert admission.refused_at[DS] == refused_at
        assert fake.releases()[-1].lease_id != t1.lease_id

    run(main())


def test_full_denial_with_requests_in_flight_releases_only_once_they_settle() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=1000, policy="finish")
        t1 = await admission.admit(DS, 500)
        t2 = await admission.admit(DS, 400)
        assert t1 is not None and t2 is not None
        await settle_and_complete(admission, fake, t1, 500)
        pending = asyncio.create_task(admission.admit(DS, 600))
        await until(
            lambda: any(isinstance(e, ev.LeaseDenied) and e.full for e in fake.replies),
            "a full denial",
        )
        await asyncio.sleep(0.01)
        # Releasing now would hand back t2's reservation while it may still be spent.
        assert not pending.done()
        assert fake.releases() == []
        await settle_and_complete(admission, fake, t2, 400)
        assert await pending is None
        [released] = fake.releases()
        assert (released.lease_id, released.spent) == (t1.lease_id, 900)
        assert fake.state().leases == {}
        assert used(fake.state()) == 900

    run(main())


def test_denial_while_another_holder_reserves_the_rest_waits_for_it() -> None:
    async def main() -> None:
        board = BudgetBoard()
        fake = FakeLedger(board)
        fake.set_budget(1000)
        a, _, _ = make(board=board, fake=fake, holder="a", lease_size=300, policy="finish")
        b, _, _ = make(board=board, fake=fake, holder="b", lease_size=4096, policy="finish")
        t1 = await a.admit(DS, 300)
        assert t1 is not None
        await settle_and_complete(a, fake, t1, 250)
        # The other dispatcher takes everything else.
        tb = await b.admit(DS, 700)
        assert tb is not None and tb.reserved == 700
        assert ledger.remaining(fake.state()) == 0

        waiting = asyncio.create_task(a.admit(DS, 300))
        await until(
            lambda: any(
                isinstance(e, ev.LeaseDenied) and e.holder == "a" and not e.full
                for e in fake.replies
            ),
            "a denial while b holds the rest",
        )
        assert not waiting.done()
        await settle_and_complete(b, fake, tb, 100)
        await b.close()
        ticket = await waiting
        assert ticket is not None
        assert ticket.reserved == 300
        assert a.refused_at == {}
        assert b.refused_at == {}
        state = fake.state()
        assert used(state) + ledger.reserved(state) <= 1000

    run(main())


def test_no_budget_yet_keeps_asking_until_one_is_set() -> None:
    async def main() -> None:
        admission, fake, _ = make(None, lease_size=500)
        task = asyncio.create_task(admission.admit(DS, 100))
        await until(
            lambda: any(isinstance(e, ev.LeaseDenied) and e.remaining == -1 for e in fake.replies),
            "a denial without budget",
        )
        assert not task.done()
        fake.set_budget(1000)
        ticket = await task
        assert ticket is not None and ticket.reserved == 100
        assert admission.refused_at == {}
        assert len({r.lease_id for r in fake.requests()}) == 1

    run(main())


def test_an_ask_is_answered_though_an_older_wait_times_out_while_it_is_sent() -> None:
    """Callers waiting on an earlier request time out together (the ledger was
    restarting): one of them clears the lease's pending ask while a new caller is
    still sending its own; that caller waits for its own answer all the same."""

    async def main() -> None:
        admission, fake, _ = make(10_000, lease_size=500)
        sending, go = asyncio.Event(), asyncio.Event()
        send = fake.send_and_wait

        async def slow_send(
            topic: str, key: bytes | None = None, value: bytes | None = None
        ) -> None:
            sending.set()
            await go.wait()
            await send(topic, key, value)

        fake.send_and_wait = slow_send  # type: ignore[method-assign]
        lease = admission._lease(DS)
        ask = asyncio.create_task(admission._ask(lease, 100, 1))
        await sending.wait()
        lease.asked = None  # what an older waiter's timeout does
        go.set()
        assert isinstance(await ask, ev.LeaseGranted)

    run(main())


# ---- revocation ------------------------------------------------------------------------


def test_revoked_lease_aborts_zeroes_balance_and_a_new_lease_is_opened() -> None:
    async def main() -> None:
        revoked: list[str] = []

        async def on_revoke(dataset: str) -> None:
            revoked.append(dataset)

        admission, fake, _ = make(10_000, lease_size=1000, on_revoke=on_revoke)
        ticket = await admission.admit(DS, 100)
        assert ticket is not None
        assert balance(admission) == 900
        fake.set_budget(500)  # below kept + reserved: every open lease is revoked
        await until(lambda: revoked == [DS], "on_revoke")
        lease = admission._leases[DS]
        assert lease.revoked
        assert lease.balance == 0
        assert fake.releases() == []  # a request is still in flight
        # The request is aborted: nothing published; the lease is then released.
        admission.settle(ticket, None)
        assert balance(admission) == 0
        await until(lambda: len(fake.releases()) == 1, "the release")
        [released] = fake.releases()
        assert (released.lease_id, released.spent) == (ticket.lease_id, 0)
        assert fake.state().leases == {}

        fresh = await admission.admit(DS, 100)
        assert fresh is not None
        assert fresh.lease_id != ticket.lease_id
        assert fake.requests()[-1].lease_id == fresh.lease_id
        assert revoked == [DS]

    run(main())


def test_revoked_idle_lease_is_released_at_once() -> None:
    async def main() -> None:
        calls: list[str] = []

        async def on_revoke(dataset: str) -> None:
            calls.append(dataset)

        admission, fake, _ = make(10_000, lease_size=1000, on_revoke=on_revoke)
        ticket = await admission.admit(DS, 100)
        assert ticket is not None
        await settle_and_complete(admission, fake, ticket, 60)
        fake.set_budget(500)
        await until(lambda: len(fake.releases()) == 1, "the release")
        assert calls == [DS]
        [released] = fake.releases()
        assert (released.lease_id, released.spent) == (ticket.lease_id, 60)
        again = await admission.admit(DS, 100)
        assert again is not None
        assert again.lease_id != ticket.lease_id
        assert again.reserved == 100
        state = fake.state()
        assert used(state) + ledger.reserved(state) <= 500

    run(main())


def test_a_lease_fenced_without_word_reaching_its_holder_is_given_up_for_a_fresh_one() -> None:
    """The ledger expired and fenced the lease, and its revocation never arrived (a
    ledger that died before writing it): the next ask on it is denied as closed, and
    the holder moves to a fresh lease instead of asking on the dead one forever."""

    async def main() -> None:
        admission, fake, _ = make(10_000, lease_size=200)
        first = await admission.admit(DS, 100)
        assert first is not None
        await settle_and_complete(admission, fake, first, 100)
        lease = fake.state().leases[first.lease_id]
        expired = ev.LeaseExpired(dataset=DS, lease_id=first.lease_id)
        t = ledger.apply_lease_expired(fake.state(), expired, lease.expires_at)
        fake.states[DS] = t.state  # its LeaseRevoked is lost
        [fence] = [e for e in t.emit if isinstance(e, ev.LeaseFenced)]
        fake._read_fence(fence)
        second = await asyncio.wait_for(admission.admit(DS, 150), 10)
        assert second is not None
        assert second.lease_id != first.lease_id
        assert second.reserved == 150

    run(main())


def test_revocation_of_another_lease_or_holder_is_ignored() -> None:
    async def main() -> None:
        calls: list[str] = []

        async def on_revoke(dataset: str) -> None:
            calls.append(dataset)

        admission, _, board = make(10_000, lease_size=1000, on_revoke=on_revoke)
        ticket = await admission.admit(DS, 100)
        assert ticket is not None
        board.apply(ev.LeaseRevoked(dataset=DS, lease_id="old", holder="d1"))
        board.apply(ev.LeaseRevoked(dataset=DS, lease_id=ticket.lease_id, holder="d2"))
        stray = ev.LeaseGranted(dataset=DS, lease_id="old", holder="d1", granted=5, expires_at=0)
        board.apply(stray)
        await asyncio.sleep(0.01)
        assert calls == []
        assert not admission._leases[DS].revoked
        assert balance(admission) == 900

    run(main())


# ---- units -------------------------------------------------------------------------------


def test_samples_reserve_one_per_request_and_keep_max_new_tokens() -> None:
    async def main() -> None:
        admission, fake, _ = make(3, unit="samples", lease_size=10)
        tickets = [await admission.admit(DS, 512, prompt_estimate=99) for _ in range(3)]
        assert all(t is not None for t in tickets)
        assert [(t.reserved, t.max_new_tokens) for t in tickets if t] == [(1, 512)] * 3
        [req] = fake.requests()
        assert (req.want, req.min_grant) == (10, 1)
        assert ledger.reserved(fake.state()) == 3
        fourth = asyncio.create_task(admission.admit(DS, 512))
        await until(lambda: len(fake.requests()) >= 2, "a second request")
        for t in tickets:
            assert t is not None
            await settle_and_complete(admission, fake, t, 1)
        assert await fourth is None
        assert used(fake.state()) == 3
        assert fake.releases()[-1].spent == 3

    run(main())


def test_total_tokens_reserve_prompt_estimate_plus_max_new() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, unit="total_tokens", lease_size=4096, cut="any")
        a = await admission.admit(DS, 300, prompt_estimate=100)
        b = await admission.admit(DS, 300, prompt_estimate=100)
        assert a is not None and b is not None
        assert (a.reserved, a.max_new_tokens, a.prompt_estimate) == (400, 300, 100)
        [req] = fake.requests()
        assert (req.want, req.min_grant) == (4096, 101)
        c = await admission.admit(DS, 300, prompt_estimate=100)
        assert c is not None
        # 200 left: the prompt still needs its 100, so 100 new tokens.
        assert (c.reserved, c.max_new_tokens) == (200, 100)
        assert c.max_new_tokens == c.reserved - c.prompt_estimate
        await settle_and_complete(admission, fake, a, 350)
        assert balance(admission) == 50
        state = fake.state()
        assert used(state) == 350
        assert used(state) + ledger.reserved(state) <= 1000

    run(main())


def test_total_tokens_truncate_needs_room_for_the_prompt() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, unit="total_tokens", lease_size=4096, min_new_tokens=16)
        a = await admission.admit(DS, 880, prompt_estimate=100)
        assert a is not None and a.reserved == 980
        # 20 left < 100 prompt + 16 new tokens.
        pending = asyncio.create_task(admission.admit(DS, 300, prompt_estimate=100))
        await until(lambda: len(fake.requests()) >= 2, "a second request")
        assert fake.requests()[1].min_grant == 116
        await settle_and_complete(admission, fake, a, 980)
        assert await pending is None

    run(main())


# ---- lifecycle ---------------------------------------------------------------------------


def test_close_releases_every_lease() -> None:
    async def main() -> None:
        admission, fake, board = make(10_000, lease_size=1000)
        fake.set_budget(10_000, "other")
        a = await admission.admit(DS, 100)
        b = await admission.admit("other", 200)
        assert a is not None and b is not None
        await settle_and_complete(admission, fake, a, 40)
        await settle_and_complete(admission, fake, b, 150)
        await admission.close()
        released = {(r.dataset, r.lease_id, r.spent) for r in fake.releases()}
        assert released == {(DS, a.lease_id, 40), ("other", b.lease_id, 150)}
        assert fake.state(DS).leases == {}
        assert fake.state("other").leases == {}
        assert admission._leases == {}
        assert "d1" not in board.lease_listeners

    run(main())


def test_maintain_renews_leases_in_use_and_releases_idle_ones() -> None:
    async def main() -> None:
        admission, fake, _ = make(10_000, lease_size=1000, lease_ttl_s=1.5, idle_release_s=0.6)
        ticket = await admission.admit(DS, 100)
        assert ticket is not None
        task = asyncio.create_task(admission.maintain())
        try:
            await asyncio.wait_for(until_async(lambda: bool(fake.of(ev.LeaseRenewed))), timeout=20)
            renewed = fake.of(ev.LeaseRenewed)[0]
            assert (renewed.lease_id, renewed.ttl_s) == (ticket.lease_id, 1.5)
            assert fake.releases() == []  # in use: renewed, not released
            await settle_and_complete(admission, fake, ticket, 70)
            await asyncio.wait_for(until_async(lambda: bool(fake.releases())), timeout=20)
            [released] = fake.releases()
            assert (released.lease_id, released.spent) == (ticket.lease_id, 70)
            assert fake.state().leases == {}
            assert DS not in admission._leases
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    run(main())


async def until_async(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.02)


def _expire(fake: FakeLedger, lease_id: str, dataset: str = DS) -> None:
    """The ledger's clock says the lease's holder stopped renewing it."""
    event = ev.LeaseExpired(dataset=dataset, lease_id=lease_id)
    fake._apply(ledger.apply_lease_expired(fake.state(dataset), event, ev.now() + 3600))


def test_expired_lease_with_requests_in_flight_is_not_reopened() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=600)
        old = await admission.admit(DS, 500)
        assert old is not None
        _expire(fake, old.lease_id)
        await until(lambda: admission._leases[DS].revoked, "the revocation")
        # The ledger freed the lease once it read back the fence it wrote after it.
        await until(lambda: old.lease_id in fake.fenced, "the fence")
        assert ledger.reserved(fake.state()) == 0
        pending = asyncio.create_task(admission.admit(DS, 500))
        await asyncio.sleep(0.05)
        # No request may reopen the revoked lease id at the ledger: the old
        # request's completion would then be committed against the new grant.
        assert [r for r in fake.requests() if r.lease_id == old.lease_id][1:] == []
        await settle_and_complete(admission, fake, old, 500)
        new = await pending
        assert new is not None
        assert new.lease_id != old.lease_id
        state = fake.state()
        assert used(state) + ledger.reserved(state) <= 1000
        # What the ledger reserves covers what the holder may still spend.
        lease = state.leases[new.lease_id]
        assert lease.outstanding >= new.reserved + balance(admission)

    run(main())


def test_budget_revoked_lease_with_requests_in_flight_is_not_asked_again() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=600)
        old = await admission.admit(DS, 500)
        assert old is not None
        fake.set_budget(400)
        await until(lambda: admission._leases[DS].revoked, "the revocation")
        pending = asyncio.create_task(admission.admit(DS, 100))
        await asyncio.sleep(0.05)
        asked_on_old = [r for r in fake.requests() if r.lease_id == old.lease_id]
        assert len(asked_on_old) <= 2, f"{len(asked_on_old)} requests on a revoked lease"
        admission.settle(old, None)
        new = await pending
        assert new is not None
        assert new.lease_id != old.lease_id

    run(main())


# ---- a lowered budget: no admission under the old one, caps for what is in flight --------


def test_admit_waits_while_a_lower_budget_is_on_its_way_to_the_ledger() -> None:
    async def main() -> None:
        admission, fake, board = make(10_000, lease_size=1000)
        first = await admission.admit(DS, 100)
        assert first is not None
        board.apply(ev.BudgetSet(dataset=DS, budget=10_000))
        board.apply(ev.BudgetSet(dataset=DS, budget=600))  # read before the ledger's answer
        pending = asyncio.create_task(admission.admit(DS, 100))
        await asyncio.sleep(0.05)
        # The lease still holds 900, but that balance may be revoked any moment.
        assert not pending.done()
        fake.set_budget(600)  # the ledger revokes: kept 0 + reserved 1000 > 600
        await until(lambda: admission._leases[DS].revoked, "the revocation")
        board.apply(open_snapshot(600))
        await asyncio.sleep(0.05)
        assert not pending.done()  # the revoked lease's request is still in flight
        admission.settle(first, None)
        second = await pending
        assert second is not None
        assert second.lease_id != first.lease_id
        state = fake.state()
        assert used(state) + ledger.reserved(state) <= 600

    run(main())


def open_snapshot(budget: int, dataset: str = DS, at: float | None = None) -> ev.LedgerSnapshot:
    """The ledger's snapshot of an open dataset with nothing kept yet."""
    return ev.LedgerSnapshot(
        dataset=dataset,
        budget=budget,
        unit="completion_tokens",
        completion_tokens=0,
        prompt_tokens=0,
        samples=0,
        skipped=0,
        failed=0,
        produced=None,
        halted=False,
        status="open",
        at=ev.now() if at is None else at,
    )


def test_a_prompt_waiting_for_leftovers_stays_aside_until_the_budget_is_there() -> None:
    """Each answer of the dataset wakes its waiting prompts; one that is not yet covered
    goes on waiting without taking its server place back in between."""

    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=4096)
        tickets = [await admission.admit(DS, 300) for _ in range(3)]
        assert all(t is not None for t in tickets)
        moves: list[str] = []

        @contextlib.asynccontextmanager
        async def aside() -> AsyncIterator[None]:
            moves.append("aside")
            try:
                yield
            finally:
                moves.append("back")

        fourth = asyncio.create_task(admission.admit(DS, 300, aside=aside))
        await until(lambda: moves == ["aside"], "the prompt aside")
        for ticket, cost in zip(tickets[:2], (290, 295), strict=True):
            await settle_and_complete(admission, fake, ticket, cost)  # 15 back: not enough
            await asyncio.sleep(0.01)
            assert not fourth.done() and moves == ["aside"]
        await settle_and_complete(admission, fake, tickets[2], 10)  # 290 back: covered
        whole = await asyncio.wait_for(fourth, 5)
        assert whole is not None and whole.reserved == 300
        assert moves == ["aside", "back"]

    run(main())


def test_a_prompt_waiting_for_budget_gives_up_once_its_dataset_halts() -> None:
    async def main() -> None:
        admission, fake, board = make(1000, lease_size=4096)
        tickets = [await admission.admit(DS, 300) for _ in range(3)]
        assert all(t is not None for t in tickets)
        fourth = asyncio.create_task(admission.admit(DS, 300))  # waits for leftovers
        await asyncio.sleep(0.05)
        assert not fourth.done()
        asks = len(fake.requests())
        board.apply(ev.BudgetExceeded(dataset=DS, budget=1000, used=1000))
        assert await asyncio.wait_for(fourth, 3) is None
        assert DS in admission.refused_at
        assert len(fake.requests()) == asks  # not one more round trip to the ledger

    run(main())


# ---- replies that are not the ledger's ----------------------------------------------


def test_a_grant_that_answers_no_request_is_not_added_to_the_lease() -> None:
    """Copies of a real grant, or a grant bigger than the request, written on the
    budgets topic by anyone who can write it: none adds to the balance, so no more
    is admitted than the ledger granted."""

    async def main() -> None:
        admission, fake, board = make(1000, lease_size=400)
        ticket = await admission.admit(DS, 100)
        assert ticket is not None
        [granted] = [e for e in fake.replies if isinstance(e, ev.LeaseGranted)]
        assert balance(admission) == 300
        for forged in (
            granted,  # the real grant, again: its request is answered already
            msgspec.structs.replace(granted, granted=10**9),
        ):
            board.apply(forged)
        assert balance(admission) == 300
        # A request sent and not answered yet takes one reply, up to what it asked.
        lease = admission._leases[DS]
        lease.unanswered.append(50)
        board.apply(msgspec.structs.replace(granted, granted=51))
        assert balance(admission) == 300
        board.apply(msgspec.structs.replace(granted, granted=50))
        assert balance(admission) == 350 and not lease.unanswered
        # The ledger itself granted no more than the budget: the dataset takes what
        # it was granted and no more.
        tickets = [await admission.admit(DS, 100) for _ in range(3)]
        assert [t.reserved for t in tickets if t] == [100, 100, 100]

    run(main())
