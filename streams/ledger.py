"""Budget ledger arithmetic: pure functions over immutable state, no I/O.

The Faust agent in :mod:`tokenbudget.streams.ledger_worker` is a thin loop around
these functions. Each
function takes the current state and one event and returns the new state plus the
events to publish, so every rule here is unit-tested without a broker.

Idempotency. Faust may hand the same event to the agent again after a restart, and
a dispatcher that crashed before committing may publish a second completion for a
prompt. The ledger therefore remembers each prompt's recorded outcome (the outcome
table, keyed by ``prompt_id``) and applies :func:`outcome_change`:

    none      -> any        count it
    skipped/failed -> completed   move the prompt from that count to completed
    completed -> any        ignore (the first completion is the one kept)
    skipped <-> failed      ignore (first wins)

Repeats of one event are recognised before these functions run: the agent keeps,
in each dataset's entry, the last offset applied per source topic-partition, and in
each outcome entry the offset that recorded it (:class:`OutcomeEntry`), so a
restart that re-delivers events applies none twice, whichever table write made it
out before the crash. ``DatasetLedger.last_event_id`` additionally makes a second
copy of the latest outcome event a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec

from tokenbudget.streams import budget
from tokenbudget.streams.events import (
    BudgetExceeded,
    BudgetRaised,
    BudgetSet,
    BudgetUnit,
    CompletionEvent,
    Event,
    LeaseDenied,
    LeaseExpired,
    LeaseFenced,
    LeaseGranted,
    LeaseReleased,
    LeaseRenewed,
    LeaseRequested,
    LeaseRevoked,
    LedgerSnapshot,
    ProducerDone,
    PromptFailed,
    PromptSkipped,
)
from tokenbudget.streams.fields import DatasetStatus

Outcome = Literal["completed", "skipped", "failed"]


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """Budget handed to one dispatcher to spend locally, in the budget's unit.

    While open, all of ``granted`` not yet ``committed`` is reserved (``committed``:
    the cost of its completions that arrived, counted or a later copy of a prompt
    already completed). Once the holder releases it, ``spent`` says how much it
    published under the lease, and only what of that has not arrived yet stays
    reserved: all of it, even above ``granted`` (a revoked lease's holder may have
    published more than its new ceiling before the revocation reached it), so that
    nothing granted afterwards overlaps completions still on their way.

    A lease the ledger can no longer hear from (expired) or whose completions are
    still on their way at release is *closing*: it stays reserved until the ledger
    reads back the :class:`~tokenbudget.streams.events.LeaseFenced` it wrote after it in the
    completions partition. Only then is everything the lease could have published
    counted, and its budget free.
    """

    holder: str
    granted: int
    committed: int = 0
    spent: int | None = None
    expires_at: float = 0.0
    closing: bool = False
    fenced_at: float = 0.0  # when its fence was last written (ledger clock)

    @property
    def outstanding(self) -> int:
        ceiling = self.granted if self.spent is None else self.spent
        return max(0, ceiling - self.committed)


class DatasetLedger(msgspec.Struct, frozen=True, kw_only=True):
    dataset: str
    budget: int | None = None
    unit: BudgetUnit = "completion_tokens"
    completion_tokens: int = 0
    prompt_tokens: int = 0
    samples: int = 0
    skipped: int = 0
    failed: int = 0
    # Completions counted that the budget's line cut (stop_reason "budget").
    cut: int = 0
    produced: int | None = None
    halted: bool = False
    last_event_id: str = ""
    # Every outcome event seen, repeats included: producers pace themselves by its
    # growth, which must not stall when a repeat changes no count.
    outcome_events: int = 0
    leases: dict[str, Lease] = {}
    # The smallest admission that is still useful (1 token to truncate at the line,
    # a whole answer for the ``finish`` policy): below it the dataset is full.
    admit_floor: int = 1
    # The last offset applied from each source "topic:partition": events Faust hands over again
    # after a restart are recognised by it.
    applied: dict[str, int] = {}
    # The epoch of the worker that wrote this state (tokenbudget.streams.events.ledger_epoch): at
    # recovery a state written by a worker that had lost the partition is not taken.
    epoch: int = 0


_ledger_encoder = msgspec.msgpack.Encoder()
_ledger_decoder = msgspec.msgpack.Decoder(DatasetLedger)


def dump_ledger(state: DatasetLedger) -> bytes:
    return _ledger_encoder.encode(state)


def load_ledger(data: bytes) -> DatasetLedger:
    return _ledger_decoder.decode(data)


def newer_owner(current: bytes, record: bytes) -> bool:
    """Recovery rule of the dataset table: a changelog record replaces the state
    unless an owner of a later epoch wrote the state it would replace."""
    return load_ledger(record).epoch >= load_ledger(current).epoch


class OutcomeEntry(msgspec.Struct, array_like=True, frozen=True):
    """A prompt's recorded outcome and the event that recorded it (and, for a
    completion, its request id: a repeat of that very request is no new copy)."""

    outcome: str
    prior: str | None
    topic: str
    offset: int
    request: str = ""


# Outcome-table keys beside prompt ids (32 hex digits): a fenced lease, and a later
# copy of a completed prompt whose cost was already taken off its lease.
FENCE_KEY = "fence:"
COPY_KEY = "copy:"


def is_prompt_key(key: str) -> bool:
    return not key.startswith((FENCE_KEY, COPY_KEY))


_outcome_encoder = msgspec.msgpack.Encoder()
_outcome_decoder = msgspec.msgpack.Decoder(OutcomeEntry)


def dump_outcome(entry: OutcomeEntry) -> bytes:
    return _outcome_encoder.encode(entry)


def not_a_lost_completion(current: bytes, record: bytes) -> bool:
    """Recovery rule of the outcome table: a prompt recorded as completed stays so
    (a later record saying otherwise can only come from a worker that had lost the
    partition: the ledger itself never moves a prompt away from completed)."""
    return (
        load_outcome(current).outcome != "completed" or load_outcome(record).outcome == "completed"
    )


def load_outcome(raw: bytes) -> OutcomeEntry:
    return _outcome_decoder.decode(raw)


def reserved(state: DatasetLedger) -> int:
    return sum(lease.outstanding for lease in state.leases.values())


def remaining(state: DatasetLedger) -> int | None:
    """Budget neither kept nor reserved: what the ledger can still grant."""
    if state.budget is None:
        return None
    return budget.unused(state.budget, budget.used(state) + reserved(state))


def outcomes_recorded(state: DatasetLedger) -> int:
    return state.samples + state.skipped + state.failed


def status(state: DatasetLedger) -> DatasetStatus:
    """``halted`` once the budget stopped it; ``exhausted`` once every produced
    prompt has an outcome and the producer has nothing more; else ``open``."""
    if state.halted:
        return "halted"
    if state.produced is not None and outcomes_recorded(state) >= state.produced:
        return "exhausted"
    return "open"


def snapshot(state: DatasetLedger, at: float) -> LedgerSnapshot:
    return LedgerSnapshot(
        dataset=state.dataset,
        budget=state.budget,
        unit=state.unit,
        completion_tokens=state.completion_tokens,
        prompt_tokens=state.prompt_tokens,
        samples=state.samples,
        skipped=state.skipped,
        failed=state.failed,
        cut=state.cut,
        produced=state.produced,
        halted=state.halted,
        status=status(state),
        outcome_events=state.outcome_events,
        reserved=reserved(state),
        at=at,
    )


@dataclass(frozen=True)
class Transition:
    state: DatasetLedger
    emit: list[Event] = field(default_factory=list)
    outcome: Outcome | None = None  # what to record for the prompt, if anything changed
    changed: bool = False


def event_id(event: CompletionEvent | PromptSkipped | PromptFailed) -> str:
    match event:
        case CompletionEvent():
            return f"completed:{event.request_id}"
        case PromptSkipped():
            return f"skipped:{event.prompt_id}"
        case PromptFailed():
            return f"failed:{event.prompt_id}"


def outcome_change(previous: Outcome | None, new: Outcome) -> bool:
    """Whether a prompt's recorded outcome moves from ``previous`` to ``new``: the
    first outcome wins, except that a completion replaces a skip or a failure.

    The one rule of which outcome a prompt keeps: the ledger counts by it, and the
    sink and the replay (:mod:`tokenbudget.sinks.rows`,
    :mod:`tokenbudget.sinks.audit`) keep rows and
    recount by it, so their totals agree with the ledger's."""
    if previous is None:
        return True
    return previous != "completed" and new == "completed"


def _check_budget(
    state: DatasetLedger, at: float, trigger_request_id: str = ""
) -> tuple[DatasetLedger, list[Event]]:
    """Halt when the budget is reached; reopen when it was raised above what is used."""
    if state.budget is None:
        return state, []
    spent = budget.used(state)
    full = budget.full(state.budget, spent, state.admit_floor)
    if not state.halted and full:
        event = BudgetExceeded(
            dataset=state.dataset,
            budget=state.budget,
            used=spent,
            unit=state.unit,
            trigger_request_id=trigger_request_id,
            at=at,
        )
        return msgspec.structs.replace(state, halted=True), [event]
    if state.halted and not full:
        raised = BudgetRaised(
            dataset=state.dataset, budget=state.budget, used=spent, unit=state.unit, at=at
        )
        return msgspec.structs.replace(state, halted=False), [raised]
    return state, []


def apply_outcome(
    state: DatasetLedger,
    event: CompletionEvent | PromptSkipped | PromptFailed,
    previous: Outcome | None,
    at: float,
    *,
    fenced: bool = False,
    new_copy: bool = False,
) -> Transition:
    """Count one prompt outcome, at most once per prompt (see the module docstring).

    ``fenced``: the completion's lease was fenced before it arrived; no one keeps it,
    and the prompt counts as skipped unless it has an outcome. ``new_copy``: a
    completion of a prompt already completed is another request's answer (not a
    repeat of the one counted): its cost comes off its lease's reservation.
    """
    # A rejected answer is not the one a later claim of the same request brings.
    eid = (
        f"fenced:{event.request_id}"
        if fenced and isinstance(event, CompletionEvent)
        else event_id(event)
    )
    new: Outcome
    match event:
        case CompletionEvent():
            new = "skipped" if fenced else "completed"
        case PromptSkipped():
            new = "skipped"
        case PromptFailed():
            new = "failed"
    seen = state.outcome_events + 1
    if state.last_event_id == eid:
        # Applied to the ledger before a crash; only the outcome record is missing.
        return Transition(state, outcome=new if previous != new else None)
    if not outcome_change(previous, new):
        leases = state.leases
        if isinstance(event, CompletionEvent) and not fenced and new_copy:
            leases = _commit_to_lease(state, event)
        updated = msgspec.structs.replace(state, outcome_events=seen, leases=leases)
        return Transition(updated, changed=True)

    counts = {
        "completion_tokens": state.completion_tokens,
        "prompt_tokens": state.prompt_tokens,
        "samples": state.samples,
        "skipped": state.skipped,
        "failed": state.failed,
        "cut": state.cut,
    }
    if previous == "skipped":
        counts["skipped"] -= 1
    elif previous == "failed":
        counts["failed"] -= 1
    trigger = ""
    leases = state.leases
    if isinstance(event, CompletionEvent) and fenced:
        counts["skipped"] += 1
    elif isinstance(event, CompletionEvent):
        counts["completion_tokens"] += event.completion_tokens
        counts["prompt_tokens"] += event.prompt_tokens
        counts["samples"] += 1
        if event.stop_reason == "budget":
            counts["cut"] += 1
        trigger = event.request_id
        leases = _commit_to_lease(state, event)
    elif isinstance(event, PromptSkipped):
        counts["skipped"] += 1
    else:
        counts["failed"] += 1
    updated = msgspec.structs.replace(
        state, last_event_id=eid, outcome_events=seen, leases=leases, **counts
    )
    updated, emit = _check_budget(updated, at, trigger)
    return Transition(updated, emit, outcome=new, changed=True)


def apply_budget_set(state: DatasetLedger, event: BudgetSet, at: float) -> Transition:
    if state.budget == event.budget and state.unit == event.unit:
        return Transition(state)
    updated = msgspec.structs.replace(state, budget=event.budget, unit=event.unit)
    updated, emit = _check_budget(updated, at)
    updated, revoked = revoke_overdrawn(updated, at)
    return Transition(updated, [*emit, *revoked], changed=True)


def apply_producer_done(state: DatasetLedger, event: ProducerDone) -> Transition:
    if state.produced == event.produced:
        return Transition(state)
    return Transition(msgspec.structs.replace(state, produced=event.produced), changed=True)


def _commit_to_lease(state: DatasetLedger, event: CompletionEvent) -> dict[str, Lease]:
    """Take an arrived completion's cost off its lease's reservation: to kept when
    it is counted, or just off when it is a later copy of a completed prompt (it
    will not arrive again). The outcome table makes either happen once per request.
    """
    lease = state.leases.get(event.lease_id) if event.lease_id else None
    if lease is None:
        return state.leases
    cost = budget.unit_cost(state.unit, event.prompt_tokens, event.completion_tokens)
    committed = lease.committed + cost
    leases = dict(state.leases)
    if lease.spent is not None and committed >= lease.spent:
        del leases[event.lease_id]
    else:
        leases[event.lease_id] = msgspec.structs.replace(lease, committed=committed)
    return leases


def apply_lease_request(
    state: DatasetLedger, event: LeaseRequested, at: float, *, fenced: bool = False
) -> Transition:
    """Grant ``min(want, remaining)`` on the asker's lease, or deny below ``min_grant``.

    This is the only place budget is handed out, and it runs in the single writer
    for the dataset, so grants never add up to more than the budget. ``fenced``: the
    lease was fenced (and forgotten) already; nothing published on it would be kept.
    """
    floor = max(1, event.min_grant)
    # The floor decides whether the dataset counts as full, so re-judge with it
    # before deciding: a smaller useful request may reopen it.
    state, judged = _check_budget(msgspec.structs.replace(state, admit_floor=floor), at)
    available = remaining(state)
    lease = state.leases.get(event.lease_id)
    closed = fenced or (
        lease is not None
        and (lease.spent is not None or lease.closing or lease.holder != event.holder)
    )
    if available is None or state.halted or available < floor or closed:
        denied = LeaseDenied(
            dataset=state.dataset,
            lease_id=event.lease_id,
            holder=event.holder,
            remaining=-1 if available is None else available,
            full=state.budget is not None and budget.full(state.budget, budget.used(state), floor),
            closed=closed,
            at=at,
        )
        return Transition(state, [denied, *judged], changed=True)
    grant = min(event.want, available)
    expires_at = at + event.ttl_s
    leases = dict(state.leases)
    if lease is None:
        leases[event.lease_id] = Lease(holder=event.holder, granted=grant, expires_at=expires_at)
    else:
        leases[event.lease_id] = msgspec.structs.replace(
            lease, granted=lease.granted + grant, expires_at=expires_at
        )
    granted = LeaseGranted(
        dataset=state.dataset,
        lease_id=event.lease_id,
        holder=event.holder,
        granted=grant,
        expires_at=expires_at,
        at=at,
        remaining=available - grant,
    )
    return Transition(
        msgspec.structs.replace(state, leases=leases), [granted, *judged], changed=True
    )


def apply_lease_renewed(state: DatasetLedger, event: LeaseRenewed, at: float) -> Transition:
    lease = state.leases.get(event.lease_id)
    if lease is None or lease.holder != event.holder or lease.closing:
        return Transition(state)
    leases = dict(state.leases)
    leases[event.lease_id] = msgspec.structs.replace(lease, expires_at=at + event.ttl_s)
    return Transition(msgspec.structs.replace(state, leases=leases), changed=True)


def apply_lease_released(state: DatasetLedger, event: LeaseReleased, at: float) -> Transition:
    """The holder is done: free the lease once what it spent has arrived. With
    completions still on their way (or lost), it closes through a fence instead:
    the holder published all of them before releasing, so each is before the fence."""
    lease = state.leases.get(event.lease_id)
    if lease is None or lease.holder != event.holder or lease.spent is not None:
        return Transition(state)
    leases = dict(state.leases)
    emit: list[Event] = []
    if lease.committed >= event.spent:
        del leases[event.lease_id]
    else:
        leases[event.lease_id] = msgspec.structs.replace(
            lease, spent=event.spent, closing=True, fenced_at=at
        )
        emit.append(LeaseFenced(dataset=state.dataset, lease_id=event.lease_id, at=at))
    updated, more = _check_budget(msgspec.structs.replace(state, leases=leases), at)
    return Transition(updated, [*emit, *more], changed=True)


# A closing lease whose fence has not come back after this long has its fence written
# again (the first may have been lost with a ledger that crashed before writing it).
FENCE_RESEND_S = 30.0


def expired_leases(state: DatasetLedger, now: float) -> list[str]:
    """Open leases past their expiry, and closing ones whose fence is overdue."""
    return [
        lease_id
        for lease_id, lease in state.leases.items()
        if (lease.fenced_at + FENCE_RESEND_S if lease.closing else lease.expires_at) <= now
    ]


def apply_lease_expired(state: DatasetLedger, event: LeaseExpired, at: float) -> Transition:
    """A lease whose holder stopped renewing it closes through a fence (see
    :class:`Lease`): its budget stays reserved until the fence is read back, so no
    completion it published before is left uncovered, and none after is kept.

    An open lease is also revoked, so a holder that is merely slow stops spending it
    and claims its answers anew. A closing lease whose fence is overdue gets another.
    """
    lease = state.leases.get(event.lease_id)
    if lease is None:
        return Transition(state)
    if lease.closing:
        if lease.fenced_at + FENCE_RESEND_S > at:
            return Transition(state)
        emit: list[Event] = []
    elif lease.expires_at > at:
        return Transition(state)
    else:
        emit = [
            LeaseRevoked(
                dataset=state.dataset,
                lease_id=event.lease_id,
                holder=lease.holder,
                expired=True,
                at=at,
            )
        ]
    leases = dict(state.leases)
    leases[event.lease_id] = msgspec.structs.replace(lease, closing=True, fenced_at=at)
    emit.append(LeaseFenced(dataset=state.dataset, lease_id=event.lease_id, at=at))
    return Transition(msgspec.structs.replace(state, leases=leases), emit, changed=True)


def apply_lease_fenced(state: DatasetLedger, event: LeaseFenced, at: float) -> Transition:
    """The ledger read a lease's fence back from the completions partition: every
    completion the lease published before it has been applied, and none after it
    will be kept, so whatever the lease still reserves is free."""
    if event.lease_id not in state.leases:
        return Transition(state)
    leases = dict(state.leases)
    del leases[event.lease_id]
    updated, emit = _check_budget(msgspec.structs.replace(state, leases=leases), at)
    return Transition(updated, emit, changed=True)


def revoke_overdrawn(state: DatasetLedger, at: float) -> tuple[DatasetLedger, list[Event]]:
    """After a budget was lowered below kept + reserved, revoke every open lease.

    What is still free under the new budget is split between the open leases in
    proportion to what each had outstanding: that is each holder's ``allowance``
    for what it has in flight. Its whole grant stays reserved until it releases
    (then what it published, until that arrives).
    """
    if state.budget is None or budget.used(state) + reserved(state) <= state.budget:
        return state, []
    open_leases = {
        i: lease for i, lease in state.leases.items() if lease.spent is None and not lease.closing
    }
    closing = sum(
        lease.outstanding
        for lease in state.leases.values()
        if lease.spent is not None or lease.closing
    )
    free = budget.unused(state.budget, budget.used(state) + closing)
    outstanding = sum(lease.outstanding for lease in open_leases.values())
    emit: list[Event] = []
    for lease_id, lease in open_leases.items():
        allowance = free * lease.outstanding // outstanding if outstanding else 0
        # The lease stays reserved at its grant: until the holder hears of this, it
        # may publish up to it, and a budget raised meanwhile must not hand that out.
        emit.append(
            LeaseRevoked(
                dataset=state.dataset,
                lease_id=lease_id,
                holder=lease.holder,
                allowance=allowance,
                ceiling=lease.committed + allowance,
                kept=budget.used(state),
                at=at,
            )
        )
    return state, emit
