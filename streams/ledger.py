"""Budget ledger arithmetic: pure functions over immutable state, no I/O.

The Faust agent in :mod:`streams.app` is a thin loop around these functions. Each
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

The two tables are written one after the other, so a crash in between could leave
the dataset entry updated and the outcome entry not. ``DatasetLedger.last_event_id``
closes that gap: events of one dataset are processed in order, so only the latest
one can be half-applied, and it is recognised by its id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec

from streams.events import (
    BudgetExceeded,
    BudgetRaised,
    BudgetSet,
    BudgetUnit,
    CompletionEvent,
    DatasetStatus,
    Event,
    LedgerSnapshot,
    ProducerDone,
    PromptFailed,
    PromptSkipped,
)

Outcome = Literal["completed", "skipped", "failed"]


class DatasetLedger(msgspec.Struct, frozen=True, kw_only=True):
    dataset: str
    budget: int | None = None
    unit: BudgetUnit = "completion_tokens"
    completion_tokens: int = 0
    prompt_tokens: int = 0
    samples: int = 0
    skipped: int = 0
    failed: int = 0
    produced: int | None = None
    halted: bool = False
    last_event_id: str = ""
    # Every outcome event seen, repeats included: producers pace themselves by its
    # growth, which must not stall when a repeat changes no count.
    outcome_events: int = 0


_ledger_encoder = msgspec.msgpack.Encoder()
_ledger_decoder = msgspec.msgpack.Decoder(DatasetLedger)


def dump_ledger(state: DatasetLedger) -> bytes:
    return _ledger_encoder.encode(state)


def load_ledger(data: bytes) -> DatasetLedger:
    return _ledger_decoder.decode(data)


def used(state: DatasetLedger, unit: BudgetUnit | None = None) -> int:
    """How much of the budget the dataset has used, in the budget's unit."""
    match unit or state.unit:
        case "completion_tokens":
            return state.completion_tokens
        case "total_tokens":
            return state.completion_tokens + state.prompt_tokens
        case "samples":
            return state.samples
    raise ValueError(f"unknown budget unit {unit!r}")


def remaining(state: DatasetLedger) -> int | None:
    return None if state.budget is None else max(0, state.budget - used(state))


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


def is_settled(state: DatasetLedger) -> bool:
    """Nothing more will change: the producer is done and every prompt it published
    has an outcome. A halted dataset is settled only once its queued prompts are
    skipped and its in-flight requests completed."""
    return state.produced is not None and outcomes_recorded(state) >= state.produced


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
        produced=state.produced,
        halted=state.halted,
        status=status(state),
        outcome_events=state.outcome_events,
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
    """Whether a prompt's recorded outcome moves from ``previous`` to ``new``."""
    if previous is None:
        return True
    return previous != "completed" and new == "completed"


def _check_budget(
    state: DatasetLedger, at: float, trigger_request_id: str = ""
) -> tuple[DatasetLedger, list[Event]]:
    """Halt when the budget is reached; reopen when it was raised above what is used."""
    if state.budget is None:
        return state, []
    spent = used(state)
    if not state.halted and spent >= state.budget:
        event = BudgetExceeded(
            dataset=state.dataset,
            budget=state.budget,
            used=spent,
            unit=state.unit,
            trigger_request_id=trigger_request_id,
            at=at,
        )
        return msgspec.structs.replace(state, halted=True), [event]
    if state.halted and spent < state.budget:
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
) -> Transition:
    """Count one prompt outcome, at most once per prompt (see the module docstring)."""
    eid = event_id(event)
    new: Outcome
    match event:
        case CompletionEvent():
            new = "completed"
        case PromptSkipped():
            new = "skipped"
        case PromptFailed():
            new = "failed"
    seen = state.outcome_events + 1
    if state.last_event_id == eid:
        # Applied to the ledger before a crash; only the outcome record is missing.
        return Transition(state, outcome=new if previous != new else None)
    if not outcome_change(previous, new):
        return Transition(msgspec.structs.replace(state, outcome_events=seen), changed=True)

    counts = {
        "completion_tokens": state.completion_tokens,
        "prompt_tokens": state.prompt_tokens,
        "samples": state.samples,
        "skipped": state.skipped,
        "failed": state.failed,
    }
    if previous == "skipped":
        counts["skipped"] -= 1
    elif previous == "failed":
        counts["failed"] -= 1
    trigger = ""
    if isinstance(event, CompletionEvent):
        counts["completion_tokens"] += event.completion_tokens
        counts["prompt_tokens"] += event.prompt_tokens
        counts["samples"] += 1
        trigger = event.request_id
    elif isinstance(event, PromptSkipped):
        counts["skipped"] += 1
    else:
        counts["failed"] += 1
    updated = msgspec.structs.replace(state, last_event_id=eid, outcome_events=seen, **counts)
    updated, emit = _check_budget(updated, at, trigger)
    return Transition(updated, emit, outcome=new, changed=True)


def apply_budget_set(state: DatasetLedger, event: BudgetSet, at: float) -> Transition:
    if state.budget == event.budget and state.unit == event.unit:
        return Transition(state)
    updated = msgspec.structs.replace(state, budget=event.budget, unit=event.unit)
    updated, emit = _check_budget(updated, at)
    return Transition(updated, emit, changed=True)


def apply_producer_done(state: DatasetLedger, event: ProducerDone) -> Transition:
    if state.produced == event.produced:
        return Transition(state)
    return Transition(msgspec.structs.replace(state, produced=event.produced), changed=True)
