"""Every event that crosses a topic, as typed, frozen, versioned structs.

Wire format: JSON (msgspec) with a ``type`` tag and a schema version ``v``. A reader
accepts the versions in ``SUPPORTED_VERSIONS`` (``COMPLETION_VERSIONS`` for
completions); anything else is an :class:`~tokenbudget.core.errors.EventDecodeError`,
which workers turn into a dead-letter event instead of crashing.

Completions are at version 6: ``output_ids`` (and ``prompt_ids``) are the
little-endian int32 bytes of the ids, which JSON carries as base64
(``fields.TokenIds``), and the event carries what a trainer needs beside the answer:
the prompt as sent, the model, the sampling settings, the dataset row's id and kept
columns, why the kept answer ends (``stop_reason``), a thinking model's reasoning
(``reasoning``, ``reasoning_tokens``, ``unfinished``), and since version 6 the tools
offered, the tool calls the model answered with and, for a conversation regenerated
turn by turn, its id and the turn. Version 5 lacked the last group; version 4 the
reasoning; version 3 ``stop_reason``; version 2 the prompt and what follows it;
version 1 carried the ids as a JSON array of numbers. All are still read, to the
same event (the new fields empty), because the completions topic is the permanent
record.

Prompts are at version 2 when they carry tools or a conversation's turn (a build
that reads only version 1 would send the turn without its follow-up), else 1.

Keys: every keyed event is keyed by its dataset name (``codec.event_key``), so all
events of one dataset land in one partition, in order, next to its ledger entry.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec

from tokenbudget.core.sections import Unit as BudgetUnit
from tokenbudget.streams.fields import (
    MAX_COUNT,
    MAX_TOKENS,
    At,
    ChatMessage,
    Count,
    CountSource,
    DatasetIdentity,
    DatasetName,
    DatasetStatus,
    EnvName,
    Epoch,
    FinishReason,
    Id,
    Offset,
    Remaining,
    SamplingParams,
    ServerReport,
    StopReason,
    TokenIds,
    Tokens,
    ToolCall,
    Ttl,
    Url,
)

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})
# Completions only: v6 adds tools, tool calls and the conversation's turn; v5 the
# reasoning; v4 stop_reason; v3 the prompt and its settings; v2 carries output_ids
# as int32 bytes, v1 as JSON numbers.
COMPLETION_VERSION = 6
COMPLETION_VERSIONS = frozenset({1, 2, 3, 4, 5, 6})
# Prompts only: v2 carries tools or a conversation's turn (see the module docstring).
PROMPT_VERSION = 2
PROMPT_VERSIONS = frozenset({1, 2})


def now() -> float:
    return time.time()


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = SCHEMA_VERSION


class _LedgerEvent(_Event, frozen=True, kw_only=True):
    """What the ledger announces about a dataset. ``epoch`` says which ownership of
    the dataset's partition wrote it (:func:`ledger_epoch`): a reader that has seen a
    dataset's events at some epoch drops those of lower epochs, which can only come
    from a ledger worker that lost the partition and did not know yet."""

    epoch: Epoch = 0


def ledger_epoch(recovered_to: int, assigned_at: float) -> int:
    """The epoch of a ledger worker's ownership of a partition: the end offset of the
    partition's table changelog when it took it (it only grows), then the time it did
    (for takeovers with no write in between), as one comparable integer."""
    return (recovered_to << 32) | (int(assigned_at) & 0xFFFFFFFF)


class PromptEvent(_Event, tag="prompt", frozen=True):
    """One prompt to generate from. ``prompt_id`` is stable across runs."""

    prompt_id: Id
    dataset: DatasetName
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingParams = SamplingParams()
    source: str = ""  # "file:line", for error messages
    produced_at: At = 0.0
    input_ids: list[Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]] | None = (
        None  # chat template applied locally: sent as ids
    )
    row_id: str | None = None  # the dataset row's own "id"
    input_columns: dict[str, Any] | None = None  # the row's [[datasets]] keep_columns
    sample_index: Count = 0  # which of the dataset's n samples of this prompt
    tools: list[dict[str, Any]] | None = None  # the row's tool definitions, sent as is
    # A turn of a conversation regenerated turn by turn (turns = "regenerate"): the
    # conversation's key (one server may keep its turns' prefix cached: a router can
    # send them all there), which of its ``turns`` this is (from 0), and the dataset's
    # conversation as recorded (``reference``), which the next turns are built from.
    conversation_id: str | None = None
    turn: Count | None = None
    turns: Count | None = None
    reference: tuple[ChatMessage, ...] | None = None

    def __post_init__(self) -> None:
        if self.v < PROMPT_VERSION and (self.tools is not None or self.conversation_id):
            msgspec.structs.force_setattr(self, "v", PROMPT_VERSION)


class CompletionEvent(_Event, tag="completion", frozen=True):
    """What the inference server produced for one prompt: the source of truth, and
    one training row (the Parquet sink's columns derive from these fields).

    ``output_ids`` may be given as any sequence of ints; it is held as
    :class:`TokenIds`, so an event always has (and encodes at) ``COMPLETION_VERSION``.
    It is None when the server returned no token ids (``count_source`` says how the
    answer was counted): no ids is better than a list that might be wrong.
    """

    request_id: Id
    prompt_id: Id
    dataset: DatasetName
    prompt_tokens: Count
    completion_tokens: Count
    output_ids: TokenIds | None
    finish_reason: FinishReason
    max_new_tokens: Count
    text: str = ""
    count_source: CountSource = "server"
    attempts: Count = 1
    lease_id: Id = ""  # the reservation it was admitted under, if any
    cost: Tokens = 0  # what it consumed of that lease, in the budget's unit
    dispatched_at: At = 0.0
    first_token_at: At | None = None
    finished_at: At = 0.0
    # The request as sent: the prompt (text, or chat messages), its ids when known
    # (templated here, sent as ids, or returned by the server), the settings.
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_ids: TokenIds | None = None
    sampling: SamplingParams = SamplingParams()
    model: str = ""  # as the server reported it
    row_id: str | None = None
    input_columns: dict[str, Any] | None = None  # the row's keep_columns, as read
    sample_index: Count = 0
    stop_reason: StopReason | None = None  # None: written before version 4
    # A thinking model's reasoning as the server split it off the answer (``text``
    # is then the answer alone); None when the server sent none (raw text and ids
    # hold the thinking inline).
    reasoning: str | None = None
    # Of completion_tokens, those the server says were thinking; None: not reported.
    reasoning_tokens: Count | None = None
    # The answer was cut (length or budget) before it began: all thinking. Such rows
    # still count against the budget. None: written before version 5.
    unfinished: bool | None = None
    # The tools the request offered, and the calls the model answered with (None:
    # it called none; an answer cut at the budget's line keeps its ids, not a call).
    tools: list[dict[str, Any]] | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    # A conversation regenerated turn by turn (see PromptEvent); ``tool_mismatch``:
    # the model called other functions, or with other arguments, than the dataset
    # recorded for this turn, whose results therefore do not answer them.
    conversation_id: str | None = None
    turn: Count | None = None
    turns: Count | None = None
    tool_mismatch: bool | None = None

    def __post_init__(self) -> None:
        # Also runs after decoding: an older event becomes the current event it would have
        # been, so decode(v1 bytes) == decode(v6 bytes) and re-encoding writes v6.
        # (``v`` is set here rather than redeclared: a redeclared field would lose
        # _Event's kw_only and come before the required fields.)
        for name in ("output_ids", "prompt_ids"):
            ids = getattr(self, name)
            if ids is not None and not isinstance(ids, TokenIds):
                msgspec.structs.force_setattr(self, name, TokenIds(ids))
        if self.v != COMPLETION_VERSION:
            msgspec.structs.force_setattr(self, "v", COMPLETION_VERSION)


class BudgetSet(_Event, tag="budget_set", frozen=True):
    """A user (or ``run`` from its config) sets a dataset's budget. ``config_budget``:
    the config's own value for the dataset when it was set (its budget, from a config),
    which decides whether a value set by hand still holds at the next job
    (:mod:`tokenbudget.app.budgets`); None from older writers."""

    dataset: DatasetName
    budget: Tokens
    unit: BudgetUnit = "completion_tokens"
    set_at: At = 0.0
    set_by: str = ""
    config_budget: Tokens | None = None


class BudgetExceeded(_LedgerEvent, tag="budget_exceeded", frozen=True):
    """The ledger saw the dataset reach its budget: producers must stop it now."""

    dataset: DatasetName
    budget: Tokens
    used: Tokens
    unit: BudgetUnit = "completion_tokens"
    trigger_request_id: Id = ""
    at: At = 0.0


class BudgetRaised(_LedgerEvent, tag="budget_raised", frozen=True):
    """A halted dataset's budget was raised above what it used: it is open again."""

    dataset: DatasetName
    budget: Tokens
    used: Tokens
    unit: BudgetUnit = "completion_tokens"
    at: At = 0.0


class LeaseRequested(_Event, tag="lease_requested", frozen=True):
    """A dispatcher asks for budget it may spend locally (or more on its lease).

    ``want`` and ``min_grant`` are in the budget's unit. A grant smaller than
    ``min_grant`` is useless to the asker (the ``finish`` policy needs room for a
    whole answer), so the ledger denies instead.
    """

    dataset: DatasetName
    lease_id: Id
    holder: Id
    want: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    min_grant: Tokens = 1
    ttl_s: Ttl = 30.0
    at: At = 0.0


class LeaseGranted(_LedgerEvent, tag="lease_granted", frozen=True):
    dataset: DatasetName
    lease_id: Id
    holder: Id
    granted: Tokens  # added to the lease by this grant
    expires_at: At
    at: At = 0.0
    # What the dataset's budget still had unleased after this grant (-1: unknown, a
    # ledger older than the field): growing reservations keep room for their answers
    # in flight before the ledger runs short.
    remaining: Remaining = -1


class LeaseDenied(_LedgerEvent, tag="lease_denied", frozen=True):
    dataset: DatasetName
    lease_id: Id
    holder: Id
    remaining: Remaining
    # True when even every reservation coming back could not fit the smallest
    # useful request: the dataset is done. False: budget is only tied up in other
    # holders' leases for now, so ask again later.
    full: bool = False
    # True when the lease itself takes nothing more (released, fenced, or another
    # holder's): its holder opens a fresh one instead of asking again on it.
    closed: bool = False
    at: At = 0.0


class LeaseRenewed(_Event, tag="lease_renewed", frozen=True):
    """The holder is alive and still spending: push the lease's expiry out."""

    dataset: DatasetName
    lease_id: Id
    holder: Id
    ttl_s: Ttl = 30.0
    at: At = 0.0


class LeaseReleased(_Event, tag="lease_released", frozen=True):
    """The holder is done with a lease. ``spent`` is what it published under it,
    so the ledger keeps the part of it still in flight on the way reserved."""

    dataset: DatasetName
    lease_id: Id
    holder: Id
    spent: Tokens
    at: At = 0.0


class LeaseExpired(_Event, tag="lease_expired", frozen=True):
    """The ledger's own clock says a lease's holder stopped renewing it."""

    dataset: DatasetName
    lease_id: Id
    at: At = 0.0


class LeaseFenced(_LedgerEvent, tag="lease_fenced", frozen=True):
    """Written by the ledger into the completions topic, in the partition of the
    lease's dataset, when it closes a lease it cannot hear from any more (expired, or
    released with answers still to arrive). Every reader of that partition sees the
    same order: the lease's completions before the fence are counted (so when the
    ledger reads it back, nothing of the lease is still on its way and its budget is
    freed), completions of it after the fence are kept by no one."""

    dataset: DatasetName
    lease_id: Id
    at: At = 0.0


class LeaseRevoked(_LedgerEvent, tag="lease_revoked", frozen=True):
    """A budget was lowered below what is kept plus reserved (or the lease expired):
    the holder must admit nothing more on it, keep at most ``allowance`` more of
    what it has in flight (cutting the rest at the line), abort, and release."""

    dataset: DatasetName
    lease_id: Id
    holder: Id
    allowance: Tokens = 0  # what the lease may still commit beyond what the ledger counted
    # The most the lease may commit in all (counted + allowance). The holder keeps
    # ceiling - what it already published, which also covers completions it sent
    # that the ledger had not counted yet.
    ceiling: Tokens = 0
    kept: Tokens = 0  # what the dataset had kept when the lease was revoked
    # Revoked because the holder stopped renewing it: its budget is being freed, and
    # the holder claims answers still in flight on it anew (a fresh grant) or drops them.
    expired: bool = False
    at: At = 0.0


class JobIdentity(_Event, tag="job_identity", frozen=True):
    """What the job of a namespace is, recorded on its budgets topic by its first
    ``run`` or ``produce``, and again when a dataset is added or a rerun that differs
    is resumed anyway. The latest one is the job a rerun is compared with. It has no
    dataset (the ledger and the budget board pass it by)."""

    datasets: tuple[DatasetIdentity, ...]
    settings: dict[str, Any]  # the job's own: inference.api, inference.model, sink.path
    first_at: At  # the namespace's first run
    recorded_at: At = 0.0
    recorded_by: str = ""
    config: str = ""  # the config file, absolute, when it was recorded ("": none known)


# What the fleet's changes and reports are keyed by on the budgets topic: one key, so
# they are read in the order they were made.
FLEET_KEY = b"@servers"


class ServerAdded(_Event, tag="server_added", frozen=True):
    """``tokenbudget servers add``: every dispatcher of the namespace sends to this
    server from now on (with its own settings where given, else its config's
    ``[inference]``); one drained or dropped before comes back. No dataset: the
    ledger passes it by."""

    url: Url
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)] | None = None
    weight: Annotated[float, msgspec.Meta(gt=0, le=1e6)] | None = None
    api_key_env: EnvName | None = None
    at: At = 0.0
    by: str = ""


class ServerDrained(_Event, tag="server_drained", frozen=True):
    """``tokenbudget servers drain``: the server gets no new prompts from any
    dispatcher of the namespace and finishes what it has."""

    url: Url
    at: At = 0.0
    by: str = ""


class FleetReport(_Event, tag="fleet_report", frozen=True):
    """What one dispatcher (``holder``) sees of the fleet, published every few seconds
    while it runs, for ``tokenbudget status`` and ``servers list``."""

    holder: Id
    servers: tuple[ServerReport, ...]
    at: At = 0.0


class LedgerSnapshot(_LedgerEvent, tag="ledger_snapshot", frozen=True):
    """The ledger's view of one dataset, published when it changes."""

    dataset: DatasetName
    budget: Tokens | None
    unit: BudgetUnit
    completion_tokens: Tokens
    prompt_tokens: Tokens
    samples: Tokens
    skipped: Tokens
    failed: Tokens
    produced: Tokens | None
    halted: bool
    status: DatasetStatus
    outcome_events: Tokens = 0
    reserved: Tokens = 0
    at: At = 0.0
    cut: Tokens = 0  # completions counted that the budget's line cut (stop_reason "budget")


class PromptSkipped(_Event, tag="prompt_skipped", frozen=True):
    """A prompt not sent because its dataset was halted when its turn came."""

    prompt_id: Id
    dataset: DatasetName
    reason: str
    at: At = 0.0


class PromptFailed(_Event, tag="prompt_failed", frozen=True):
    """A prompt given up after its retries; its details are in the dead-letter topic."""

    prompt_id: Id
    dataset: DatasetName
    reason: str
    attempts: Count
    at: At = 0.0


class ProducerDone(_Event, tag="producer_done", frozen=True):
    """The prompt producer will publish no more prompts of this dataset (this run)."""

    dataset: DatasetName
    produced: Tokens
    reason: Literal["end_of_data", "halted", "limit"]
    at: At = 0.0


class SnapshotAsked(_Event, tag="snapshot_asked", frozen=True):
    """``run`` asks the owner of the dataset's ledger state for a snapshot now: its
    drain waits for one newer than the moment it saw the ledger caught up, which the
    ledger would otherwise send only with its round of every dataset, seconds later.
    The ledger changes nothing for it; it announces the dataset on its next tick."""

    dataset: DatasetName
    at: At = 0.0


class DeadLetter(_Event, tag="dead_letter", frozen=True):
    """An event that could not be used, with why and where it came from; or a
    dataset row that never became one (:func:`bad_row_letter`: ``source_topic`` is
    empty, ``key`` is the dataset, ``source`` says where in its file)."""

    reason: str
    source_topic: str
    partition: Offset = -1
    offset: Offset = -1
    key: str | None = None
    # The start of the original bytes as UTF-8 (invalid bytes replaced), for people:
    # at most EXCERPT_CHARS of it.
    payload: str = ""
    at: At = 0.0
    source: str = ""  # a bad row's "path:line"
    size: Offset = -1  # bytes of what the payload is an excerpt of (-1: not known)
    # The first PREFIX_BYTES of the original bytes exactly (base64), and the SHA-256
    # of all of them: enough to find the record again and tell two apart, and a
    # letter always fits in a message whatever the record's size.
    payload_base64: str = ""
    sha256: str = ""


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
    | SnapshotAsked
    | DeadLetter
    | LeaseRequested
    | LeaseGranted
    | LeaseDenied
    | LeaseRenewed
    | LeaseReleased
    | LeaseExpired
    | LeaseRevoked
    | LeaseFenced
    | JobIdentity
    | ServerAdded
    | ServerDrained
    | FleetReport
)

# What the ledger announces, each with its writer's epoch (see _LedgerEvent).
LedgerEvents = (
    BudgetExceeded,
    BudgetRaised,
    LeaseGranted,
    LeaseDenied,
    LeaseFenced,
    LeaseRevoked,
    LedgerSnapshot,
)
