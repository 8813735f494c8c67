"""Every event that crosses a topic, as typed, frozen, versioned structs.

Wire format: JSON (msgspec) with a ``type`` tag and a schema version ``v``. A reader
accepts the versions in ``SUPPORTED_VERSIONS``; anything else is an
:class:`~tokenbudget.errors.EventDecodeError`, which workers turn into a dead-letter
event instead of crashing.

Keys: every keyed event is keyed by its dataset name (``event_key``), so all events
of one dataset land in one partition, in order, next to its ledger entry.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from tokenbudget.errors import EventDecodeError

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

FinishReason = Literal["stop", "length", "abort"]
BudgetUnit = Literal["completion_tokens", "total_tokens", "samples"]
CountSource = Literal["server", "tokenizer"]


def now() -> float:
    return time.time()


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = SCHEMA_VERSION


class PromptEvent(_Event, tag="prompt", frozen=True):
    """One prompt to generate from. ``prompt_id`` is stable across runs."""

    prompt_id: str
    dataset: str
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingParams = SamplingParams()
    source: str = ""  # "file:line", for error messages
    produced_at: float = 0.0
    input_ids: list[int] | None = None  # chat template applied locally: sent as ids


class CompletionEvent(_Event, tag="completion", frozen=True):
    """What the inference server produced for one prompt: the source of truth."""

    request_id: str
    prompt_id: str
    dataset: str
    prompt_tokens: int
    completion_tokens: int
    output_ids: list[int]
    finish_reason: FinishReason
    max_new_tokens: int
    text: str = ""
    count_source: CountSource = "server"
    attempts: int = 1
    lease_id: str = ""  # the reservation it was admitted under, if any
    cost: int = 0  # what it consumed of that lease, in the budget's unit
    dispatched_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float = 0.0


class BudgetSet(_Event, tag="budget_set", frozen=True):
    """A user (or ``run`` from its config) sets a dataset's budget."""

    dataset: str
    budget: int
    unit: BudgetUnit = "completion_tokens"
    set_at: float = 0.0
    set_by: str = ""


class BudgetExceeded(_Event, tag="budget_exceeded", frozen=True):
    """The ledger saw the dataset reach its budget: producers must stop it now."""

    dataset: str
    budget: int
    used: int
    unit: BudgetUnit = "completion_tokens"
    trigger_request_id: str = ""
    at: float = 0.0


class BudgetRaised(_Event, tag="budget_raised", frozen=True):
    """A halted dataset's budget was raised above what it used: it is open again."""

    dataset: str
    budget: int
    used: int
    unit: BudgetUnit = "completion_tokens"
    at: float = 0.0


class LeaseRequested(_Event, tag="lease_requested", frozen=True):
    """A dispatcher asks for budget it may spend locally (or more on its lease).

    ``want`` and ``min_grant`` are in the budget's unit. A grant smaller than
    ``min_grant`` is useless to the asker (the ``finish`` policy needs room for a
    whole answer), so the ledger denies instead.
    """

    dataset: str
    lease_id: str
    holder: str
    want: int
    min_grant: int = 1
    ttl_s: float = 30.0
    at: float = 0.0


class LeaseGranted(_Event, tag="lease_granted", frozen=True):
    dataset: str
    lease_id: str
    holder: str
    granted: int  # added to the lease by this grant
    expires_at: float
    at: float = 0.0


class LeaseDenied(_Event, tag="lease_denied", frozen=True):
    dataset: str
    lease_id: str
    holder: str
    remaining: int
    # True when even every reservation coming back could not fit the smallest
    # useful request: the dataset is done. False: budget is only tied up in other
    # holders' leases for now, so ask again later.
    full: bool = False
    at: float = 0.0


class LeaseRenewed(_Event, tag="lease_renewed", frozen=True):
    """The holder is alive and still spending: push the lease's expiry out."""

    dataset: str
    lease_id: str
    holder: str
    ttl_s: float = 30.0
    at: float = 0.0


class LeaseReleased(_Event, tag="lease_released", frozen=True):
    """The holder is done with a lease. ``spent`` is what it published under it,
    so the ledger keeps the part of it still in flight on the way reserved."""

    dataset: str
    lease_id: str
    holder: str
    spent: int
    at: float = 0.0


class LeaseExpired(_Event, tag="lease_expired", frozen=True):
    """The ledger's own clock says a lease's holder stopped renewing it."""

    dataset: str
    lease_id: str
    at: float = 0.0


class LeaseRevoked(_Event, tag="lease_revoked", frozen=True):
    """A budget was lowered below what is kept plus reserved (or the lease expired):
    the holder must admit nothing more on it, keep at most ``allowance`` more of
    what it has in flight (cutting the rest at the line), abort, and release."""

    dataset: str
    lease_id: str
    holder: str
    allowance: int = 0  # what the lease may still commit beyond what the ledger counted
    # The most the lease may commit in all (counted + allowance). The holder keeps
    # ceiling - what it already published, which also covers completions it sent
    # that the ledger had not counted yet.
    ceiling: int = 0
    kept: int = 0  # what the dataset had kept when the lease was revoked
    at: float = 0.0


DatasetStatus = Literal["open", "halted", "exhausted"]


class LedgerSnapshot(_Event, tag="ledger_snapshot", frozen=True):
    """The ledger's view of one dataset, published when it changes."""

    dataset: str
    budget: int | None
    unit: BudgetUnit
    completion_tokens: int
    prompt_tokens: int
    samples: int
    skipped: int
    failed: int
    produced: int | None
    halted: bool
    status: DatasetStatus
    outcome_events: int = 0
    reserved: int = 0
    at: float = 0.0


class PromptSkipped(_Event, tag="prompt_skipped", frozen=True):
    """A prompt not sent because its dataset was halted when its turn came."""

    prompt_id: str
    dataset: str
    reason: str
    at: float = 0.0


class PromptFailed(_Event, tag="prompt_failed", frozen=True):
    """A prompt given up after its retries; its details are in the dead-letter topic."""

    prompt_id: str
    dataset: str
    reason: str
    attempts: int
    at: float = 0.0


class ProducerDone(_Event, tag="producer_done", frozen=True):
    """The prompt producer will publish no more prompts of this dataset (this run)."""

    dataset: str
    produced: int
    reason: Literal["end_of_data", "halted", "limit"]
    at: float = 0.0


class DeadLetter(_Event, tag="dead_letter", frozen=True):
    """An event that could not be used, with why and where it came from."""

    reason: str
    source_topic: str
    partition: int = -1
    offset: int = -1
    key: str | None = None
    payload: str = ""  # the original bytes, decoded as UTF-8 with replacement
    at: float = 0.0


Event = (
    PromptEvent
    | CompletionEvent
    | BudgetSet
    | BudgetExceeded
    | BudgetRaised
    | LedgerSnapshot
    | PromptSkipped
    | PromptFailed
    | ProducerDone
    | DeadLetter
    | LeaseRequested
    | LeaseGranted
    | LeaseDenied
    | LeaseRenewed
    | LeaseReleased
    | LeaseExpired
    | LeaseRevoked
)

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)  # type: ignore[arg-type]


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


class _Header(msgspec.Struct):
    type: str = "?"
    v: int = SCHEMA_VERSION


_header_decoder = msgspec.json.Decoder(_Header)


def decode(data: bytes) -> Event:
    """Decode one event, or raise EventDecodeError saying what is wrong with it.

    The version is checked before the shape, so an event from a newer writer is
    reported as such rather than as a missing or unknown field.
    """
    try:
        header = _header_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not a tokenbudget event: {exc}") from exc
    if header.v not in SUPPORTED_VERSIONS:
        raise EventDecodeError(
            f"'{header.type}' event has schema version {header.v}; this build reads "
            f"versions {sorted(SUPPORTED_VERSIONS)}: upgrade tokenbudget"
        )
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not a tokenbudget event: {exc}") from exc


def event_key(event: Event) -> bytes | None:
    dataset = getattr(event, "dataset", None)
    return dataset.encode() if isinstance(dataset, str) else None


def dead_letter_for(reason: str, record: Any) -> DeadLetter:
    """The dead letter for a consumer record (kafka-python's or aiokafka's: both
    carry ``topic``, ``partition``, ``offset``, ``key`` and ``value``)."""
    return dead_letter(
        reason,
        source_topic=record.topic,
        payload=record.value,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
    )


def dead_letter(
    reason: str,
    *,
    source_topic: str,
    payload: bytes | None,
    partition: int = -1,
    offset: int = -1,
    key: bytes | None = None,
) -> DeadLetter:
    return DeadLetter(
        reason=reason,
        source_topic=source_topic,
        partition=partition,
        offset=offset,
        key=key.decode("utf-8", "replace") if key is not None else None,
        payload=(payload or b"").decode("utf-8", "replace"),
        at=now(),
    )
