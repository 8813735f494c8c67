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
from typing import Literal

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
