"""Growing reservations (``[budget] reserve = "grow"``) against the in-memory ledger
of ``test_admission``: a request reserves a typical answer, grows from the lease as its
answer comes, and what is kept never exceeds what the ledger granted."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import msgspec

from tests.producers.dispatch.test_admission import (
    DS,
    FakeLedger,
    balance,
    make,
    run,
    settle_and_complete,
)
from tokenbudget.producers.dispatch.admission import Admission
from tokenbudget.streams import events as ev
from tokenbudget.streams import ledger
from tokenbudget.streams.budget import used
from tokenbudget.streams.budget_board import BudgetBoard


def learned(admission: Admission, typical: int, answers: int = 10) -> None:
    for _ in range(answers):
        admission.answered(DS, typical)


def test_a_request_reserves_a_typical_answer_once_the_datasets_answers_are_known() -> None:
    async def main() -> None:
        admission, _, _ = make(100_000, lease_size=10_000, reserve="grow")
        first = await admission.admit(DS, 1000)
        assert first is not None
        assert (first.reserved, first.max_new_tokens, first.grows) == (1000, 1000, False)
        learned(admission, 200)
        ticket = await admission.admit(DS, 1000)
        assert ticket is not None
        assert (ticket.reserved, ticket.max_new_tokens, ticket.grows) == (200, 1000, True)
        # Not under the default: a request reserves its whole limit.
        whole, _, _ = make(100_000, lease_size=10_000)
        learned(whole, 200)
        plain = await whole.admit(DS, 1000)
        assert plain is not None and (plain.reserved, plain.grows) == (1000, False)

    run(main())


def test_a_request_waiting_since_before_the_answers_were_known_reserves_a_typical_one() -> None:
    """A prompt that came while the dataset's answers were unknown and waited for
    budget goes out growing once they are known: waiting for a whole max_new_tokens
    held a job's first prompts to budget / max_new_tokens in flight."""

    async def main() -> None:
        admission, fake, _ = make(2000, lease_size=2000, reserve="grow")
        early = [await admission.admit(DS, 1000) for _ in range(2)]
        assert all(t is not None and (t.reserved, t.grows) == (1000, False) for t in early)
        late = asyncio.ensure_future(admission.admit(DS, 1000))
        await asyncio.sleep(0.05)
        assert not late.done()  # the budget is all reserved: it waits
        learned(admission, 200)
        first = early[0]
        assert first is not None
        await settle_and_complete(admission, fake, first, 200)  # 800 back
        # As it came it would want 1,000 of the 800; as it goes, a typical 200.
        ticket = await asyncio.wait_for(late, 5)
        assert ticket is not None and (ticket.reserved, ticket.grows) == (200, True)

    run(main())


def test_a_growing_ticket_takes_from_the_lease_and_settles_what_it_held() -> None:
    async def main() -> None:
        admission, fake, _ = make(100_000, lease_size=10_000, reserve="grow")
        learned(admission, 200)
        ticket = await admission.admit(DS, 1000)
        assert ticket is not None and ticket.grows
        before = balance(admission)
        assert admission.growth.grow(ticket, 150) == 200  # still covered: nothing taken
        assert admission.growth.grow(ticket, 500) == 700  # the need and a reservation more
        assert balance(admission) == before - 500
        assert admission.growth.grow(ticket, 5000) == 1000  # never past its limit
        assert admission.growth.allowance(ticket) == 1000
        await settle_and_complete(admission, fake, ticket, 650)
        assert balance(admission) == before + 200 - 650
        assert used(fake.state()) == 650

    run(main())


def test_an_answer_that_outgrows_the_budget_is_covered_only_to_the_line() -> None:
    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=1000, reserve="grow")
        learned(admission, 200)
        tickets = [await admission.admit(DS, 1000) for _ in range(5)]
        assert [t.reserved for t in tickets if t] == [200] * 5
        assert balance(admission) == 0
        first, second = tickets[0], tickets[1]
        assert first is not None and second is not None
        assert admission.growth.can_grow(first)  # the ledger has not said no yet
        # The ledger has nothing more: the answer keeps what it reserved.
        assert await admission.growth.cover(first, 600) == 200
        assert not admission.growth.can_grow(first)
        # Another answer hands back what it did not use: the first grows into it.
        await settle_and_complete(admission, fake, second, 50)
        assert await admission.growth.cover(first, 600) == 350
        await settle_and_complete(admission, fake, first, 350)
        assert used(fake.state()) == 400

    run(main())


def test_cover_asks_the_ledger_when_the_lease_runs_dry() -> None:
    async def main() -> None:
        admission, fake, _ = make(10_000, lease_size=1000, reserve="grow")
        learned(admission, 500)
        a = await admission.admit(DS, 4000)
        b = await admission.admit(DS, 4000)
        assert a is not None and b is not None and balance(admission) == 0
        asked = len(fake.requests())
        assert await admission.growth.cover(a, 3000) == 3000
        assert len(fake.requests()) > asked
        await settle_and_complete(admission, fake, a, 3000)
        await settle_and_complete(admission, fake, b, 400)
        assert used(fake.state()) == 3400

    run(main())


def test_growing_answers_never_keep_more_than_the_budget_and_use_it_up() -> None:
    """Many answers of random lengths, growing as they come in random order, kept as
    far as what they hold allows: the ledger's count never passes the budget, and the
    budget is used to the token."""

    async def one(seed: int) -> None:
        rng = random.Random(seed)
        budget = 50_000
        admission, fake, _ = make(budget, lease_size=4000, reserve="grow")
        learned(admission, 800)
        kept: list[int] = []

        async def request() -> None:
            ticket = await admission.admit(DS, 4096)
            if ticket is None:
                return
            length = min(4096, int(rng.lognormvariate(6.5, 0.6)))
            for tokens in range(0, length, 256):
                await asyncio.sleep(rng.random() / 1000)
                admission.growth.grow(ticket, tokens + 256)
            held = await admission.growth.cover(ticket, length)
            keep = min(length, held)
            kept.append(keep)
            await settle_and_complete(admission, fake, ticket, keep)
            if keep == length:
                admission.answered(DS, keep)

        pending = [asyncio.ensure_future(request()) for _ in range(60)]
        while sum(kept) < budget and pending:
            await asyncio.sleep(0.005)
            pending = [p for p in pending if not p.done()]
            pending += [asyncio.ensure_future(request()) for _ in range(60 - len(pending))]
            assert used(fake.state()) <= budget
        await asyncio.gather(*pending)
        assert used(fake.state()) == sum(kept) == budget
        assert ledger.reserved(fake.state()) >= 0

    async def main() -> None:
        for seed in range(3):
            await one(seed)

    run(main(), timeout=120)


def test_a_growing_ticket_on_a_revoked_lease_grows_no_more() -> None:
    async def main() -> None:
        admission, _, board = make(100_000, lease_size=10_000, reserve="grow")
        learned(admission, 200)
        ticket = await admission.admit(DS, 1000)
        assert ticket is not None
        lease = admission._leases[DS]
        board.apply(ev.LeaseRevoked(dataset=DS, lease_id=lease.lease_id, holder="d1", ceiling=0))
        assert admission.growth.grow(ticket, 900) == 200
        assert not admission.growth.can_grow(ticket)

    run(main())


class SilentLedger(FakeLedger):
    """A ledger older than ``LeaseGranted.remaining``: its grants do not say what is
    left, so a dispatcher learns the end only when a grant falls short."""

    def _apply(self, transition: ledger.Transition) -> None:
        emit = [
            msgspec.structs.replace(e, remaining=-1) if isinstance(e, ev.LeaseGranted) else e
            for e in transition.emit
        ]
        super()._apply(dataclasses.replace(transition, emit=emit))


def test_at_the_budgets_end_leftovers_stay_for_the_answers_in_flight() -> None:
    """Once the ledger has said it has no more, what answers in flight hand back is
    kept for the others to grow into: a new request waits until what the lease holds
    covers a mean answer for it and each one in flight, with three standard
    deviations of their sum to spare, though every settle has waiting requests ask
    the ledger again."""

    async def main() -> None:
        board = BudgetBoard()
        fake = SilentLedger(board)
        fake.set_budget(1000)
        admission, _, _ = make(None, board=board, fake=fake, lease_size=1000, reserve="grow")
        for tokens in (100, 300) * 5:
            admission.answered(DS, tokens)  # a mean of 200, a deviation of 100
        tickets = [await admission.admit(DS, 1000) for _ in range(5)]
        assert all(t is not None and t.reserved == 200 for t in tickets)
        late = asyncio.ensure_future(admission.admit(DS, 1000))
        await asyncio.sleep(0.05)
        assert not late.done()  # the ledger has nothing more: it waits
        first = tickets[0]
        assert first is not None
        await settle_and_complete(admission, fake, first, None)  # 200 back
        await asyncio.sleep(0.05)
        assert balance(admission) == 200
        # Five answers of 200 +- 100 want 1,000 + 3 x sqrt(5) x 100 > the 1,000 held.
        assert not late.done()
        for ticket in tickets[1:4]:
            assert ticket is not None
            await settle_and_complete(admission, fake, ticket, None)
        # One in flight: two answers want 400 + 3 x sqrt(2) x 100 = 825 of 1,000.
        ticket = await asyncio.wait_for(late, 5)
        assert ticket is not None and (ticket.reserved, ticket.grows) == (200, True)

    run(main())


def test_a_grant_that_leaves_too_little_closes_the_gate_before_the_ledger_runs_short() -> None:
    """The ledger's grant says what the budget still has: once that, what the lease
    holds and what its tickets hold no longer cover one more typical answer and those
    in flight with room for their spread, a new request waits for their leftovers,
    though no grant has fallen short yet (the requests in flight would else outgrow
    the end together and be cut)."""

    async def main() -> None:
        admission, fake, _ = make(1000, lease_size=1000, reserve="grow")
        for tokens in (100, 300) * 5:
            admission.answered(DS, tokens)  # a mean of 200, a deviation of 100
        # Two answers want 400 + 3 x sqrt(2) x 100 = 825 of the 1,000 left.
        tickets = [await admission.admit(DS, 1000) for _ in range(2)]
        assert all(t is not None and (t.reserved, t.grows) == (200, True) for t in tickets)
        # A third would want 600 + 3 x sqrt(3) x 100 = 1,120: it waits.
        late = asyncio.ensure_future(admission.admit(DS, 1000))
        await asyncio.sleep(0.05)
        assert not late.done()
        assert len(fake.requests()) == 1  # the first grant said it all: nothing is asked
        first, second = tickets
        assert first is not None and second is not None
        await settle_and_complete(admission, fake, first, 200)
        await asyncio.sleep(0.05)
        assert not late.done()  # 800 left against 825 for two
        await settle_and_complete(admission, fake, second, 200)
        ticket = await asyncio.wait_for(late, 5)  # 600 left against 500 for one
        assert ticket is not None and (ticket.reserved, ticket.grows) == (200, True)

    run(main())


def test_a_grant_that_leaves_plenty_lets_requests_out_without_waiting() -> None:
    async def main() -> None:
        admission, fake, _ = make(100_000, lease_size=1000, reserve="grow")
        for tokens in (100, 300) * 5:
            admission.answered(DS, tokens)
        tickets = [await admission.admit(DS, 1000) for _ in range(20)]
        assert all(t is not None and t.grows for t in tickets)
        granted = [e for e in fake.replies if isinstance(e, ev.LeaseGranted)]
        assert [g.remaining for g in granted] == [
            100_000 - 1000 * (i + 1) for i in range(len(granted))
        ]

    run(main())
