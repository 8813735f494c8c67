"""Random interleavings of grants, releases, expiries, fences, lowered and raised
budgets and completions in transit: no state keeps more than the budget allows.

The completions partition is modelled as the ordered log it is (completions and the
ledger's fences in one order, read in that order); the reservations topic is read at
any time relative to it, and holders hear revocations late. The test counts what is
kept from the outcomes the ledger gives the completions it published, and bounds it
by the budget: after a budget is lowered below what is already kept plus reserved,
the bound is what was kept plus reserved then (answers already paid for are not
undone), and nothing more is ever granted above the new budget.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from tokenbudget.streams.budget import used
from tokenbudget.streams.events import (
    BudgetSet,
    CompletionEvent,
    LeaseExpired,
    LeaseFenced,
    LeaseGranted,
    LeaseReleased,
    LeaseRequested,
    LeaseRevoked,
)
from tokenbudget.streams.ledger import (
    FENCE_RESEND_S,
    DatasetLedger,
    Transition,
    apply_budget_set,
    apply_lease_expired,
    apply_lease_fenced,
    apply_lease_released,
    apply_lease_request,
    apply_outcome,
    reserved,
)

DS = "ds"
AT = 1000.0


@dataclass
class Holder:
    name: str
    serial: int = 0
    lease_id: str = ""
    balance: int = 0
    in_flight: list[int] = field(default_factory=list)
    spent: int = 0
    heard: LeaseRevoked | None = None  # the revocation it acts on
    pending: list[LeaseRevoked] = field(default_factory=list)  # not heard yet
    left: int | None = None  # what a lowered budget still lets it publish

    def open(self) -> None:
        self.serial += 1
        self.lease_id = f"{self.name}:{self.serial}"
        self.balance, self.spent, self.heard, self.left = 0, 0, None, None
        self.in_flight, self.pending = [], []


class Job:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.budget = self.rng.randint(200, 3000)
        self.state = apply_budget_set(
            DatasetLedger(dataset=DS), BudgetSet(dataset=DS, budget=self.budget), AT
        ).state
        self.bound = self.budget
        self.holders = [Holder(f"h{i}") for i in range(3)]
        for h in self.holders:
            h.open()
        self.partition: list[CompletionEvent | LeaseFenced] = []
        self.fences_read: set[str] = set()
        self.kept = 0  # summed from the outcomes of what the holders published
        self.published = 0
        self.lowered = 0

    # ---- the ledger --------------------------------------------------------------

    def take(self, t: Transition) -> None:
        self.state = t.state
        for event in t.emit:
            if isinstance(event, LeaseFenced):
                self.partition.append(event)
            elif isinstance(event, LeaseRevoked):
                for h in self.holders:
                    if h.lease_id == event.lease_id:
                        h.pending.append(event)

    def read_partition(self) -> None:
        item = self.partition.pop(0)
        if isinstance(item, LeaseFenced):
            self.fences_read.add(item.lease_id)
            self.take(apply_lease_fenced(self.state, item, AT))
            return
        fenced = item.lease_id in self.fences_read
        t = apply_outcome(self.state, item, None, AT, fenced=fenced)
        if t.outcome == "completed":
            self.kept += item.completion_tokens
        self.take(t)

    def expire(self) -> None:
        if not self.state.leases:
            return
        lease_id = self.rng.choice(sorted(self.state.leases))
        lease = self.state.leases[lease_id]
        at = lease.fenced_at + FENCE_RESEND_S if lease.closing else lease.expires_at
        self.take(apply_lease_expired(self.state, LeaseExpired(dataset=DS, lease_id=lease_id), at))

    def set_budget(self) -> None:
        budget = self.rng.randint(max(1, used(self.state) // 2), self.budget * 2)
        committed = used(self.state) + reserved(self.state)
        self.bound = budget if budget >= committed else max(committed, self.kept)
        self.lowered += budget < committed
        self.take(apply_budget_set(self.state, BudgetSet(dataset=DS, budget=budget), AT))

    # ---- a holder ----------------------------------------------------------------

    def ask(self, h: Holder) -> None:
        want = self.rng.randint(1, max(1, self.budget // 4))
        asked = LeaseRequested(
            dataset=DS, lease_id=h.lease_id, holder=h.name, want=want, min_grant=1, ttl_s=5
        )
        t = apply_lease_request(self.state, asked, AT, fenced=h.lease_id in self.fences_read)
        reply = t.emit[0]
        if isinstance(reply, LeaseGranted):
            assert used(t.state) + reserved(t.state) <= t.state.budget  # type: ignore[operator]
            h.balance += reply.granted
        self.take(t)

    def admit(self, h: Holder) -> None:
        if h.balance > 0 and h.heard is None:
            r = self.rng.randint(1, h.balance)
            h.balance -= r
            h.in_flight.append(r)

    def finish(self, h: Holder) -> None:
        if not h.in_flight:
            return
        r = h.in_flight.pop(self.rng.randrange(len(h.in_flight)))
        cost = self.rng.randint(0, r)
        if h.left is not None:  # revoked by a lowered budget: cut at the line
            cost = min(cost, h.left)
            h.left -= cost
        self.published += 1
        self.partition.append(
            CompletionEvent(
                request_id=f"r{self.published}",
                prompt_id=f"p{self.published}",
                dataset=DS,
                prompt_tokens=0,
                completion_tokens=cost,
                output_ids=[],
                finish_reason="length",
                max_new_tokens=r,
                lease_id=h.lease_id,
            )
        )
        h.spent += cost
        if h.heard is None:
            h.balance += r - cost

    def hear(self, h: Holder) -> None:
        if not h.pending:
            return
        revoked = h.pending.pop(0)
        h.heard, h.balance = revoked, 0
        if revoked.expired:
            h.in_flight = []  # dropped (a claim is a new grant: modelled by ask)
        else:
            h.left = max(0, revoked.ceiling - h.spent)

    def release(self, h: Holder) -> None:
        if h.in_flight:
            return
        done = LeaseReleased(dataset=DS, lease_id=h.lease_id, holder=h.name, spent=h.spent)
        self.take(apply_lease_released(self.state, done, AT))
        h.open()

    # ---- what must hold in every state -------------------------------------------

    def check(self) -> None:
        assert self.kept == self.state.completion_tokens
        assert self.kept <= self.bound
        assert used(self.state) + reserved(self.state) <= max(self.bound, self.kept)
        for h in self.holders:
            if h.lease_id in self.fences_read or h.pending:
                # Fenced: whatever it publishes now is kept by no one. A revocation
                # not heard yet: the ledger already counts it at its new ceiling
                # (and the bound above, at what it held before).
                continue
            may_publish = h.balance + sum(h.in_flight)
            if h.left is not None:
                may_publish = min(may_publish, h.left)
            on_wire = sum(
                e.completion_tokens
                for e in self.partition
                if isinstance(e, CompletionEvent) and e.lease_id == h.lease_id
            )
            lease = self.state.leases.get(h.lease_id)
            assert (lease.outstanding if lease else 0) >= may_publish + on_wire, h

    def step(self) -> None:
        h = self.rng.choice(self.holders)
        roll = self.rng.random()
        if roll < 0.15:
            self.ask(h)
        elif roll < 0.35:
            self.admit(h)
        elif roll < 0.55:
            self.finish(h)
        elif roll < 0.75:
            if self.partition:
                self.read_partition()
        elif roll < 0.83:
            self.hear(h)
        elif roll < 0.91:
            self.release(h)
        elif roll < 0.97:
            self.expire()
        else:
            self.set_budget()


@pytest.mark.parametrize("seed", range(40))
def test_no_interleaving_keeps_more_than_the_budget(seed: int) -> None:
    job = Job(seed)
    for _ in range(1500):
        job.step()
        job.check()
    # Drain: revocations heard, answers finished, leases released, everything read.
    for h in job.holders:
        while h.pending:
            job.hear(h)
        while h.in_flight:
            job.finish(h)
        job.release(h)
        job.check()
    while job.partition:
        job.read_partition()
        job.check()
    assert job.state.leases == {}
    assert reserved(job.state) == 0
    assert job.published > 40 and job.kept > 0


def test_the_interleavings_reach_every_path() -> None:
    """The random walk above does take every path it is meant to test."""
    fenced = rejected = lowered = 0
    for seed in range(40):
        job = Job(seed)
        for _ in range(1500):
            before = job.state.skipped
            job.step()
            rejected += job.state.skipped - before
        fenced += len(job.fences_read)
        lowered += job.lowered
    assert fenced > 40 and rejected > 0 and lowered > 0
