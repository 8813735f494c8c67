"""Ledger leases: budget handed out only by grants, never more than the budget."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from tokenbudget.streams import ledger
from tokenbudget.streams.budget import unit_cost, used
from tokenbudget.streams.events import (
    BudgetExceeded,
    BudgetRaised,
    BudgetSet,
    BudgetUnit,
    CompletionEvent,
    LeaseDenied,
    LeaseExpired,
    LeaseFenced,
    LeaseGranted,
    LeaseReleased,
    LeaseRenewed,
    LeaseRequested,
    LeaseRevoked,
)
from tokenbudget.streams.ledger import (
    DatasetLedger,
    Lease,
    Outcome,
    apply_budget_set,
    apply_lease_expired,
    apply_lease_fenced,
    apply_lease_released,
    apply_lease_renewed,
    apply_lease_request,
    apply_outcome,
    expired_leases,
    remaining,
    reserved,
)

DS = "ds"
AT = 1000.0


def fresh(budget: int | None = 1000, unit: BudgetUnit = "completion_tokens") -> DatasetLedger:
    state = DatasetLedger(dataset=DS)
    if budget is not None:
        state = apply_budget_set(state, BudgetSet(dataset=DS, budget=budget, unit=unit), AT).state
    return state


def request(
    lease_id: str = "L1",
    holder: str = "h1",
    want: int = 100,
    min_grant: int = 1,
    ttl_s: float = 30.0,
) -> LeaseRequested:
    return LeaseRequested(
        dataset=DS, lease_id=lease_id, holder=holder, want=want, min_grant=min_grant, ttl_s=ttl_s
    )


def release(lease_id: str = "L1", holder: str = "h1", spent: int = 0) -> LeaseReleased:
    return LeaseReleased(dataset=DS, lease_id=lease_id, holder=holder, spent=spent)


def completion(
    request_id: str,
    lease_id: str = "L1",
    *,
    completion_tokens: int = 10,
    prompt_tokens: int = 3,
    prompt_id: str | None = None,
) -> CompletionEvent:
    return CompletionEvent(
        request_id=request_id,
        prompt_id=prompt_id or f"p-{request_id}",
        dataset=DS,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        output_ids=[],
        finish_reason="stop",
        max_new_tokens=4096,
        lease_id=lease_id,
    )


def grant(state: DatasetLedger, at: float = AT, **kwargs: object) -> DatasetLedger:
    """Request a lease and assert it was granted."""
    t = apply_lease_request(state, request(**kwargs), at)  # type: ignore[arg-type]
    assert isinstance(t.emit[0], LeaseGranted), t.emit
    return t.state


def only(events: list, kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


# ---- grants ------------------------------------------------------------------------


def test_grant_is_want_when_enough_remains() -> None:
    t = apply_lease_request(fresh(1000), request(want=300, ttl_s=30), AT)
    assert t.changed
    [granted] = t.emit
    assert isinstance(granted, LeaseGranted)
    assert (granted.lease_id, granted.holder, granted.granted) == ("L1", "h1", 300)
    assert granted.expires_at == AT + 30
    assert t.state.leases["L1"] == Lease(holder="h1", granted=300, expires_at=AT + 30)
    assert reserved(t.state) == 300
    assert remaining(t.state) == 700
    assert granted.remaining == 700  # what the grant says is left


def test_grant_is_clamped_to_remaining() -> None:
    state = grant(fresh(1000), want=800)
    t = apply_lease_request(state, request("L2", "h2", want=500), AT)
    [granted] = t.emit
    assert isinstance(granted, LeaseGranted)
    assert granted.granted == 200
    assert remaining(t.state) == 0
    assert used(t.state) + reserved(t.state) == 1000


def test_remaining_counts_kept_and_every_open_lease() -> None:
    state = grant(fresh(1000), lease_id="A", holder="h1", want=300)
    state = grant(state, lease_id="B", holder="h2", want=200)
    state = apply_outcome(state, completion("r1", "A", completion_tokens=50), None, AT).state
    state = apply_outcome(state, completion("r2", "", completion_tokens=40), None, AT).state
    # kept: 90; reserved: A 250 + B 200
    assert used(state) == 90
    assert reserved(state) == 450
    assert remaining(state) == 1000 - 90 - 450
    t = apply_lease_request(state, request("C", "h3", want=10_000), AT)
    assert t.emit[0].granted == 460
    assert remaining(t.state) == 0


def test_remaining_is_none_without_a_budget_and_never_negative() -> None:
    assert remaining(fresh(None)) is None
    state = grant(fresh(100), want=100)
    state = apply_budget_set(state, BudgetSet(dataset=DS, budget=50), AT).state
    assert remaining(state) == 0


def test_second_request_on_same_lease_adds_to_granted_and_pushes_expiry() -> None:
    state = grant(fresh(1000), AT, want=100, ttl_s=30)
    t = apply_lease_request(state, request(want=150, ttl_s=30), AT + 10)
    [granted] = t.emit
    assert isinstance(granted, LeaseGranted)
    assert granted.granted == 150
    lease = t.state.leases["L1"]
    assert lease.granted == 250
    assert lease.expires_at == AT + 40
    assert reserved(t.state) == 250
    assert len(t.state.leases) == 1


def test_second_request_counts_what_was_committed() -> None:
    state = grant(fresh(300), want=200)
    state = apply_outcome(state, completion("r1", completion_tokens=150), None, AT).state
    # 150 kept, 50 still reserved on L1: 100 left to grant.
    t = apply_lease_request(state, request(want=500), AT)
    assert t.emit[0].granted == 100
    assert used(t.state) + reserved(t.state) == 300


# ---- denials -----------------------------------------------------------------------


def test_deny_when_remaining_below_min_grant() -> None:
    state = grant(fresh(5000), lease_id="A", holder="h1", want=2000)
    t = apply_lease_request(state, request("B", "h2", want=4096, min_grant=4096), AT)
    [denied] = only(t.emit, LeaseDenied)
    assert (denied.lease_id, denied.holder, denied.remaining) == ("B", "h2", 3000)
    assert "B" not in t.state.leases
    assert reserved(t.state) == 2000
    # Not halted: only 0 is used; the 3000 are free for a smaller ask.
    assert not t.state.halted
    assert only(t.emit, BudgetExceeded) == []
    t2 = apply_lease_request(t.state, request("B", "h2", want=3000, min_grant=3000), AT)
    assert t2.emit[0].granted == 3000


def test_exactly_min_grant_is_granted() -> None:
    t = apply_lease_request(fresh(4096), request(want=8192, min_grant=4096), AT)
    assert isinstance(t.emit[0], LeaseGranted)
    assert t.emit[0].granted == 4096


def test_deny_with_minus_one_when_no_budget_is_known() -> None:
    t = apply_lease_request(fresh(None), request(want=10), AT)
    [denied] = t.emit
    assert isinstance(denied, LeaseDenied)
    assert denied.remaining == -1
    assert t.state.leases == {}
    assert not t.state.halted


def test_deny_after_release() -> None:
    state = grant(fresh(1000), want=100)
    state = apply_outcome(state, completion("r1", completion_tokens=10), None, AT).state
    # Released with 20 spent: 10 still on the way, the lease stays but is closed.
    state = apply_lease_released(state, release(spent=20), AT).state
    assert state.leases["L1"].spent == 20
    t = apply_lease_request(state, request(want=100), AT)
    assert isinstance(t.emit[0], LeaseDenied)
    assert t.state.leases["L1"].granted == 100
    assert reserved(t.state) == 10


def test_deny_for_another_holders_lease_id() -> None:
    state = grant(fresh(1000), lease_id="L1", holder="h1", want=100)
    t = apply_lease_request(state, request("L1", "h2", want=100), AT)
    [denied] = only(t.emit, LeaseDenied)
    assert denied.holder == "h2"
    assert t.state.leases["L1"] == state.leases["L1"]


def test_deny_when_halted() -> None:
    state = apply_outcome(fresh(100), completion("r1", "", completion_tokens=100), None, AT).state
    assert state.halted
    t = apply_lease_request(state, request(want=1), AT)
    assert isinstance(t.emit[0], LeaseDenied)
    assert t.emit[0].remaining == 0


# ---- completions under a lease -----------------------------------------------------


def test_counted_completion_moves_cost_from_reserved_to_used() -> None:
    state = grant(fresh(1000), want=300)
    before = remaining(state)
    t = apply_outcome(state, completion("r1", completion_tokens=120), None, AT)
    assert t.outcome == "completed"
    assert used(t.state) == 120
    assert reserved(t.state) == 180
    assert t.state.leases["L1"].committed == 120
    assert remaining(t.state) == before == 700


def test_repeated_completion_does_not_touch_the_lease() -> None:
    state = grant(fresh(1000), want=300)
    first = apply_outcome(state, completion("r1", completion_tokens=120), None, AT).state
    # Same request again, after another event moved last_event_id on.
    other = apply_outcome(first, completion("r9", "", completion_tokens=1), None, AT).state
    again = apply_outcome(other, completion("r1", completion_tokens=120), "completed", AT)
    assert again.state.leases == other.leases
    assert used(again.state) == used(other)
    # Same prompt, new request id (a dispatcher crashed before committing).
    dup = completion("r2", completion_tokens=80, prompt_id="p-r1")
    again2 = apply_outcome(other, dup, "completed", AT)
    assert again2.state.leases == other.leases
    assert again2.state.leases["L1"].committed == 120
    assert used(again2.state) == used(other)
    # The torn-write guard (same event as last applied) does not commit twice either.
    torn = apply_outcome(first, completion("r1", completion_tokens=120), None, AT)
    assert torn.state.leases == first.leases


def test_completion_for_an_unknown_lease_is_just_counted() -> None:
    state = grant(fresh(1000), want=300)
    t = apply_outcome(state, completion("r1", "gone", completion_tokens=50), None, AT)
    assert used(t.state) == 50
    assert t.state.leases == state.leases


# ---- release -----------------------------------------------------------------------


def test_release_with_everything_committed_deletes_the_lease() -> None:
    state = grant(fresh(1000), want=300)
    state = apply_outcome(state, completion("r1", completion_tokens=100), None, AT).state
    t = apply_lease_released(state, release(spent=100), AT)
    assert t.changed
    assert t.state.leases == {}
    assert reserved(t.state) == 0
    assert remaining(t.state) == 900


def test_release_with_nothing_spent_frees_the_whole_grant() -> None:
    state = grant(fresh(1000), want=300)
    t = apply_lease_released(state, release(spent=0), AT)
    assert t.state.leases == {}
    assert remaining(t.state) == 1000


def test_release_keeps_in_flight_reserved_until_the_completions_arrive() -> None:
    state = grant(fresh(1000), want=300)
    state = apply_outcome(state, completion("r1", completion_tokens=100), None, AT).state
    state = apply_lease_released(state, release(spent=250), AT).state
    lease = state.leases["L1"]
    assert lease.spent == 250
    assert lease.outstanding == 150
    assert reserved(state) == 150  # the unspent 50 is free again
    assert remaining(state) == 1000 - 100 - 150
    state = apply_outcome(state, completion("r2", completion_tokens=60), None, AT).state
    assert reserved(state) == 90
    assert "L1" in state.leases
    state = apply_outcome(state, completion("r3", completion_tokens=90), None, AT).state
    assert state.leases == {}
    assert used(state) == 250
    assert remaining(state) == 750


def test_a_revoked_lease_released_above_its_ceiling_keeps_all_it_published_reserved() -> None:
    state = grant(fresh(1000), want=600)
    state = apply_outcome(state, completion("r1", completion_tokens=100), None, AT).state
    # Lowered to 300: the lease may keep 200 more (ceiling 300)...
    t = apply_budget_set(state, BudgetSet(dataset=DS, budget=300), AT)
    assert only(t.emit, LeaseRevoked)[0].ceiling == 300
    state = t.state
    # ...but its holder had published 450 before the revocation reached it.
    state = apply_lease_released(state, release(spent=450), AT).state
    assert reserved(state) == 350  # all of it is on its way to the ledger
    # Raised again before those completions arrive: only what they leave is granted.
    state = apply_budget_set(state, BudgetSet(dataset=DS, budget=800), AT).state
    t = apply_lease_request(state, request("L2", "h2", want=1000), AT)
    [granted] = only(t.emit, LeaseGranted)
    assert granted.granted == 800 - 450
    state = apply_outcome(t.state, completion("r2", completion_tokens=350), None, AT).state
    assert "L1" not in state.leases
    assert used(state) + granted.granted == 800


def test_a_budget_lowered_then_raised_before_the_holder_heard_grants_nothing_it_holds() -> None:
    """Lowering revokes the lease, but its holder may publish up to its whole grant
    before it hears: a raise meanwhile hands out only what that grant leaves."""
    state = grant(fresh(1000), want=600)
    state = apply_budget_set(state, BudgetSet(dataset=DS, budget=300), AT).state
    state = apply_budget_set(state, BudgetSet(dataset=DS, budget=1000), AT).state
    t = apply_lease_request(state, request("L2", "h2", want=1000), AT)
    [granted] = only(t.emit, LeaseGranted)
    assert granted.granted == 400
    state = apply_outcome(t.state, completion("r1", completion_tokens=600), None, AT).state
    assert used(state) + granted.granted == 1000


def test_a_fenced_and_forgotten_lease_is_granted_nothing_more() -> None:
    state = grant(fresh(1000), want=100, ttl_s=10)
    state = apply_lease_expired(state, LeaseExpired(dataset=DS, lease_id="L1"), AT + 10).state
    state = fenced(state)
    assert state.leases == {}
    t = apply_lease_request(state, request(want=100), AT + 11, fenced=True)
    assert isinstance(t.emit[0], LeaseDenied)
    assert reserved(t.state) == 0


def test_release_of_an_unknown_lease_is_a_no_op() -> None:
    state = fresh(1000)
    t = apply_lease_released(state, release("nope", spent=5), AT)
    assert not t.changed
    assert t.state == state


# ---- renewal and expiry --------------------------------------------------------------


def test_renewal_pushes_expiry_for_the_holder_only() -> None:
    state = grant(fresh(1000), AT, want=100, ttl_s=30)
    t = apply_lease_renewed(state, LeaseRenewed(dataset=DS, lease_id="L1", holder="h1"), AT + 20)
    assert t.changed
    assert t.state.leases["L1"].expires_at == AT + 50
    other = apply_lease_renewed(state, LeaseRenewed(dataset=DS, lease_id="L1", holder="h2"), AT)
    assert not other.changed
    missing = apply_lease_renewed(state, LeaseRenewed(dataset=DS, lease_id="X", holder="h1"), AT)
    assert not missing.changed


def test_expired_leases() -> None:
    state = grant(fresh(1000), AT, lease_id="A", holder="h1", want=100, ttl_s=10)
    state = grant(state, AT, lease_id="B", holder="h2", want=100, ttl_s=60)
    assert expired_leases(state, AT + 9) == []
    assert expired_leases(state, AT + 10) == ["A"]
    assert sorted(expired_leases(state, AT + 100)) == ["A", "B"]


def fenced(state: DatasetLedger, lease_id: str = "L1", at: float = AT) -> DatasetLedger:
    """The ledger reads a lease's fence back from the completions partition."""
    return apply_lease_fenced(state, LeaseFenced(dataset=DS, lease_id=lease_id), at).state


def test_expiry_of_an_open_lease_revokes_it_and_fences_it_before_freeing_its_budget() -> None:
    state = grant(fresh(1000), AT, want=400, ttl_s=10)
    t = apply_lease_expired(state, LeaseExpired(dataset=DS, lease_id="L1"), AT + 10)
    assert t.changed
    revoked, fence = t.emit
    assert isinstance(revoked, LeaseRevoked) and revoked.expired
    assert (revoked.lease_id, revoked.holder) == ("L1", "h1")
    assert isinstance(fence, LeaseFenced) and fence.lease_id == "L1"
    # Still reserved: what the holder published before the fence is on its way.
    assert reserved(t.state) == 400 and remaining(t.state) == 600
    assert t.state.leases["L1"].closing
    state = apply_outcome(t.state, completion("r1", completion_tokens=150), None, AT + 11).state
    assert (used(state), reserved(state)) == (150, 250)
    state = fenced(state)
    assert state.leases == {} and remaining(state) == 850


def test_a_closing_lease_takes_no_renewal_and_no_new_grant() -> None:
    state = grant(fresh(1000), AT, want=400, ttl_s=10)
    state = apply_lease_expired(state, LeaseExpired(dataset=DS, lease_id="L1"), AT + 10).state
    renewed = apply_lease_renewed(
        state, LeaseRenewed(dataset=DS, lease_id="L1", holder="h1"), AT + 11
    )
    assert not renewed.changed
    denied = apply_lease_request(state, request(want=100), AT + 11)
    assert isinstance(denied.emit[0], LeaseDenied)
    assert denied.state.leases["L1"].granted == 400


def test_released_with_answers_on_their_way_closes_through_a_fence() -> None:
    state = grant(fresh(1000), AT, want=400, ttl_s=10)
    t = apply_lease_released(state, release(spent=100), AT)
    [fence] = only(t.emit, LeaseFenced)
    assert fence.lease_id == "L1"
    assert reserved(t.state) == 100
    # Expiry does not free it either, nor revoke it: it waits for its fence.
    later = apply_lease_expired(t.state, LeaseExpired(dataset=DS, lease_id="L1"), AT + 11)
    assert not later.changed and reserved(later.state) == 100
    # A fence long overdue is written again.
    overdue = AT + ledger.FENCE_RESEND_S + 1
    again = apply_lease_expired(t.state, LeaseExpired(dataset=DS, lease_id="L1"), overdue)
    assert only(again.emit, LeaseRevoked) == [] and len(only(again.emit, LeaseFenced)) == 1
    assert reserved(again.state) == 100
    assert remaining(fenced(t.state)) == 1000


def test_budget_freed_by_expiry_is_not_granted_twice_when_reservations_run_ahead() -> None:
    """The interleaving from the issue: the reservations topic read well ahead of the
    completions topic. Budget 1000; lease A granted 1000; A released having published
    1000 (not counted yet); A expires; lease B asks for 1000; then both sets of
    completions arrive. Nothing may be kept beyond the budget."""
    state = grant(fresh(1000), AT, lease_id="A", want=1000, ttl_s=10)
    state = apply_lease_released(state, release("A", spent=1000), AT + 1).state
    state = apply_lease_expired(state, LeaseExpired(dataset=DS, lease_id="A"), AT + 20).state
    t = apply_lease_request(state, request("B", "h2", want=1000), AT + 21)
    assert isinstance(t.emit[0], LeaseDenied)  # A's answers still hold the budget
    state = t.state
    for i in range(10):
        answer = completion(f"a{i}", "A", completion_tokens=100)
        state = apply_outcome(state, answer, None, AT).state
    assert used(state) == 1000 and state.leases == {}
    t = apply_lease_request(state, request("B", "h2", want=1000), AT + 22)
    assert isinstance(t.emit[0], LeaseDenied) and t.emit[0].full
    assert used(t.state) <= 1000


def test_a_completion_after_its_lease_was_fenced_is_not_kept() -> None:
    state = grant(fresh(1000), AT, want=400, ttl_s=10)
    state = apply_lease_expired(state, LeaseExpired(dataset=DS, lease_id="L1"), AT + 10).state
    state = fenced(state)
    late = completion("r1", completion_tokens=300)
    t = apply_outcome(state, late, None, AT + 12, fenced=True)
    assert t.outcome == "skipped"
    assert (used(t.state), t.state.skipped, t.state.samples) == (0, 1, 0)
    # The holder claims it anew on a fresh lease: the same request is kept then.
    claimed = grant(t.state, AT + 13, lease_id="L2", want=300)
    again = apply_outcome(
        claimed,
        completion("r1", "L2", completion_tokens=300),
        "skipped",
        AT + 14,
    )
    assert again.outcome == "completed"
    assert (used(again.state), again.state.skipped, again.state.samples) == (300, 0, 1)
    assert again.state.leases["L2"].committed == 300


def test_a_later_copy_of_a_completed_prompt_takes_its_cost_off_its_lease() -> None:
    state = grant(fresh(1000), AT, lease_id="A", want=300)
    state = grant(state, AT, lease_id="B", holder="h2", want=300)
    first = apply_outcome(state, completion("r1", "A", completion_tokens=120), None, AT).state
    copy = completion("r2", "B", completion_tokens=80, prompt_id="p-r1")
    t = apply_outcome(first, copy, "completed", AT, new_copy=True)
    assert t.outcome is None
    assert used(t.state) == 120  # not counted
    assert t.state.leases["B"].committed == 80  # but no longer on its way
    assert reserved(t.state) == reserved(first) - 80


def test_expiry_ignored_when_renewed_meanwhile() -> None:
    state = grant(fresh(1000), AT, want=400, ttl_s=10)
    assert expired_leases(state, AT + 10) == ["L1"]
    renewed = apply_lease_renewed(
        state, LeaseRenewed(dataset=DS, lease_id="L1", holder="h1", ttl_s=10), AT + 9
    ).state
    t = apply_lease_expired(renewed, LeaseExpired(dataset=DS, lease_id="L1"), AT + 10)
    assert not t.changed
    assert t.emit == []
    assert t.state.leases == renewed.leases
    unknown = apply_lease_expired(renewed, LeaseExpired(dataset=DS, lease_id="zz"), AT + 100)
    assert not unknown.changed


def test_expiry_ignored_when_a_new_grant_pushed_it() -> None:
    state = grant(fresh(1000), AT, want=100, ttl_s=10)
    state = grant(state, AT + 8, want=100, ttl_s=10)
    t = apply_lease_expired(state, LeaseExpired(dataset=DS, lease_id="L1"), AT + 10)
    assert not t.changed
    assert "L1" in t.state.leases


# ---- budget changes ----------------------------------------------------------------


def test_lowering_budget_below_kept_plus_reserved_revokes_every_open_lease() -> None:
    state = grant(fresh(1000), lease_id="A", holder="h1", want=300)
    state = grant(state, lease_id="B", holder="h2", want=300)
    state = grant(state, lease_id="C", holder="h3", want=100)
    state = apply_lease_released(state, release("C", "h3", spent=50), AT).state  # closed
    state = apply_outcome(state, completion("r1", "A", completion_tokens=100), None, AT).state
    assert used(state) + reserved(state) == 100 + 200 + 300 + 50
    t = apply_budget_set(state, BudgetSet(dataset=DS, budget=500), AT)
    revoked = only(t.emit, LeaseRevoked)
    assert sorted((e.lease_id, e.holder) for e in revoked) == [("A", "h1"), ("B", "h2")]
    assert only(t.emit, BudgetExceeded) == []  # 400 left above the floor of 1
    assert not t.state.halted
    # Nothing more is granted until the holders release.
    assert remaining(t.state) == 0
    assert isinstance(apply_lease_request(t.state, request("D", "h4"), AT).emit[0], LeaseDenied)


def test_lowering_budget_with_room_left_revokes_nothing() -> None:
    state = grant(fresh(1000), want=300)
    t = apply_budget_set(state, BudgetSet(dataset=DS, budget=300), AT)
    assert t.changed
    assert t.emit == []


def test_lowering_budget_halts_below_admit_floor_then_raising_reopens() -> None:
    state = grant(fresh(10_000), want=4096, min_grant=4096)
    assert state.admit_floor == 4096
    state = apply_outcome(state, completion("r1", completion_tokens=3000), None, AT).state
    assert not state.halted
    t = apply_budget_set(state, BudgetSet(dataset=DS, budget=7000), AT)
    # 7000 - 3000 = 4000 < 4096: a whole answer no longer fits.
    [exceeded] = only(t.emit, BudgetExceeded)
    assert (exceeded.budget, exceeded.used) == (7000, 3000)
    assert t.state.halted
    # 3000 kept + 1096 reserved still fit in 7000: the lease is not revoked.
    assert only(t.emit, LeaseRevoked) == []
    raised = apply_budget_set(t.state, BudgetSet(dataset=DS, budget=20_000), AT)
    assert not raised.state.halted
    assert only(raised.emit, LeaseRevoked) == []
    [reopened] = only(raised.emit, BudgetRaised)
    assert (reopened.budget, reopened.used) == (20_000, 3000)


# ---- units -------------------------------------------------------------------------


def test_total_tokens_lease_commits_prompt_and_completion() -> None:
    state = grant(fresh(1000, "total_tokens"), want=500)
    t = apply_outcome(state, completion("r1", prompt_tokens=30, completion_tokens=70), None, AT)
    assert used(t.state) == 100
    assert t.state.leases["L1"].committed == 100
    assert reserved(t.state) == 400
    assert remaining(t.state) == 500
    released = apply_lease_released(t.state, release(spent=100), AT)
    assert released.state.leases == {}


def test_samples_lease_commits_one_per_completion() -> None:
    state = grant(fresh(3, "samples"), want=10)
    assert reserved(state) == 3
    state = apply_outcome(state, completion("r1", completion_tokens=500), None, AT).state
    assert used(state) == 1
    assert reserved(state) == 2
    assert state.leases["L1"].committed == 1
    state = apply_lease_released(state, release(spent=2), AT).state
    assert reserved(state) == 1
    state = apply_outcome(state, completion("r2", completion_tokens=700), None, AT).state
    assert state.leases == {}
    assert used(state) == 2
    assert not state.halted
    t = apply_lease_request(state, request("L2", want=5), AT)
    assert t.emit[0].granted == 1


# ---- halting uses admit_floor --------------------------------------------------------


def test_finish_policy_halts_once_a_whole_answer_no_longer_fits() -> None:
    state = grant(fresh(10_000), want=4096, min_grant=4096)
    state = apply_outcome(state, completion("r1", completion_tokens=4000), None, AT).state
    state = apply_lease_released(state, release(spent=4000), AT).state
    state = grant(state, lease_id="L2", want=4096, min_grant=4096)
    t = apply_outcome(state, completion("r2", "L2", completion_tokens=1904), None, AT)
    assert used(t.state) == 5904  # 4096 left: exactly a whole answer
    assert not t.state.halted
    assert t.emit == []
    t = apply_outcome(t.state, completion("r3", "L2", completion_tokens=1), None, AT)
    assert t.state.halted  # 4095 left < 4096
    [exceeded] = t.emit
    assert isinstance(exceeded, BudgetExceeded)
    assert exceeded.trigger_request_id == "r3"
    assert exceeded.used == 5905


def test_truncate_floor_would_not_halt_at_the_same_point() -> None:
    state = grant(fresh(10_000), want=4096, min_grant=1)
    state = apply_outcome(state, completion("r1", completion_tokens=4000), None, AT).state
    state = apply_outcome(state, completion("r2", "", completion_tokens=1905), None, AT).state
    assert state.admit_floor == 1
    assert not state.halted


def test_a_finish_request_that_cannot_fit_halts_the_dataset() -> None:
    state = apply_outcome(fresh(5000), completion("r1", "", completion_tokens=2000), None, AT).state
    t = apply_lease_request(state, request(want=4096, min_grant=4096), AT)
    assert isinstance(t.emit[0], LeaseDenied)
    assert t.emit[0].remaining == 3000
    assert t.state.admit_floor == 4096
    assert t.state.halted
    assert only(t.emit, BudgetExceeded)


def test_min_grant_below_one_is_treated_as_one() -> None:
    t = apply_lease_request(fresh(10), request(want=5, min_grant=0), AT)
    assert t.state.admit_floor == 1
    assert t.emit[0].granted == 5


# ---- persistence -------------------------------------------------------------------


def test_dump_load_round_trip_with_leases() -> None:
    state = grant(fresh(1000, "total_tokens"), lease_id="A", holder="h1", want=300, ttl_s=7)
    state = grant(state, lease_id="B", holder="h2", want=200, min_grant=50)
    state = apply_outcome(state, completion("r1", "B", completion_tokens=20), None, AT).state
    state = apply_lease_released(state, release("B", "h2", spent=100), AT).state
    assert state.leases["B"].spent == 100
    loaded = ledger.load_ledger(ledger.dump_ledger(state))
    assert loaded == state
    assert loaded.leases["A"] == Lease(holder="h1", granted=300, expires_at=AT + 7)
    assert loaded.admit_floor == 50
    assert reserved(loaded) == reserved(state)
    assert remaining(loaded) == remaining(state)


# ---- the invariant, under random traffic -------------------------------------------


@dataclass
class _Holder:
    name: str
    serial: int = 0
    lease_id: str = ""
    balance: int = 0
    in_flight: list[int] = field(default_factory=list)
    spent: int = 0


@dataclass
class _Wire:
    """A completion published but not yet read by the ledger."""

    event: CompletionEvent
    cost: int


def _split(unit: BudgetUnit, cost: int, rng: random.Random) -> tuple[int, int]:
    """Prompt and completion tokens whose unit_cost is ``cost``."""
    if unit == "completion_tokens":
        return rng.randint(0, 50), cost
    if unit == "total_tokens":
        prompt = rng.randint(0, cost)
        return prompt, cost - prompt
    return rng.randint(0, 50), rng.randint(0, 500)


@pytest.mark.parametrize("unit", ["completion_tokens", "total_tokens", "samples"])
@pytest.mark.parametrize("seed", range(8))
def test_grants_never_exceed_the_budget(unit: BudgetUnit, seed: int) -> None:
    rng = random.Random(seed)
    budget = rng.randint(50, 3000) if unit != "samples" else rng.randint(5, 60)
    state = fresh(budget, unit)
    holders = [_Holder(f"h{i}") for i in range(3)]
    wire: list[_Wire] = []
    delivered: list[_Wire] = []
    outcomes: dict[str, Outcome] = {}
    granted_total = 0
    requests = 0

    def open_lease(h: _Holder) -> None:
        h.serial += 1
        h.lease_id = f"{h.name}:{h.serial}"
        h.balance, h.spent = 0, 0

    for h in holders:
        open_lease(h)

    def deliver(item: _Wire, previous: Outcome | None) -> None:
        nonlocal state
        t = apply_outcome(state, item.event, previous, AT)
        state = t.state
        if t.outcome is not None:
            outcomes[item.event.prompt_id] = t.outcome

    def check() -> None:
        assert used(state) + reserved(state) <= budget
        # The ledger never reserves less than a holder may still cause to be kept.
        for h in holders:
            local = h.balance + sum(h.in_flight)
            local += sum(w.cost for w in wire if w.event.lease_id == h.lease_id)
            lease = state.leases.get(h.lease_id)
            assert (lease.outstanding if lease else 0) >= local
        for lease_id, lease in state.leases.items():
            on_wire = sum(w.cost for w in wire if w.event.lease_id == lease_id)
            if lease.spent is not None:
                assert lease.outstanding == on_wire

    for step in range(600):
        h = rng.choice(holders)
        action = rng.random()
        if action < 0.25:
            requests += 1
            want = rng.randint(1, max(1, budget // 3)) if unit != "samples" else rng.randint(1, 8)
            min_grant = rng.randint(1, max(1, want // 4))
            was_halted = state.halted
            t = apply_lease_request(state, request(h.lease_id, h.name, want, min_grant), AT)
            state = t.state
            reply = t.emit[0]
            if isinstance(reply, LeaseGranted):
                assert min_grant <= reply.granted <= want
                h.balance += reply.granted
                granted_total += reply.granted
            else:
                assert isinstance(reply, LeaseDenied)
                assert reply.remaining < min_grant or was_halted
        elif action < 0.5:
            if h.balance > 0:  # admit a request
                r = 1 if unit == "samples" else rng.randint(1, h.balance)
                h.balance -= r
                h.in_flight.append(r)
        elif action < 0.7:
            if h.in_flight:  # a request finishes and its completion is published
                r = h.in_flight.pop(rng.randrange(len(h.in_flight)))
                cost = 1 if unit == "samples" else rng.randint(0, r)
                prompt_tokens, completion_tokens = _split(unit, cost, rng)
                assert unit_cost(unit, prompt_tokens, completion_tokens) == cost
                rid = f"r{step}"
                event = completion(
                    rid,
                    h.lease_id,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                )
                wire.append(_Wire(event, cost))
                h.spent += cost
                h.balance += r - cost
        elif action < 0.9:
            if wire:  # the ledger reads a completion
                item = wire.pop(rng.randrange(len(wire)))
                deliver(item, None)
                delivered.append(item)
            elif delivered and rng.random() < 0.5:  # a repeat: changes nothing
                before = state.leases, used(state)
                deliver(rng.choice(delivered), "completed")
                assert (state.leases, used(state)) == before
        elif not h.in_flight:
            t = apply_lease_released(state, release(h.lease_id, h.name, h.spent), AT)
            state = t.state
            open_lease(h)
        check()

    # Drain: everything in flight finishes with its whole reservation, then release.
    for h in holders:
        while h.in_flight:
            r = h.in_flight.pop()
            cost = 1 if unit == "samples" else r
            p, c = _split(unit, cost, rng)
            rid = f"d{len(wire)}-{h.name}"
            event = completion(rid, h.lease_id, prompt_tokens=p, completion_tokens=c)
            wire.append(_Wire(event, cost))
            h.spent += cost
        state = apply_lease_released(state, release(h.lease_id, h.name, h.spent), AT).state
        open_lease(h)
        check()
    rng.shuffle(wire)
    while wire:
        deliver(wire.pop(), None)
        check()
    assert state.leases == {}
    assert reserved(state) == 0
    assert used(state) <= budget
    assert requests > 50
    assert granted_total > 0
