"""Every event that crosses a topic, as typed, frozen, versioned structs.

Wire format: JSON (msgspec) with a ``type`` tag and a schema version ``v``. A reader
accepts the versions in ``SUPPORTED_VERSIONS`` (``COMPLETION_VERSIONS`` for
completions); anything else is an :class:`~tokenbudget.core.errors.EventDecodeError`,
which workers turn into a dead-letter event instead of crashing.

Completions are at version 6: ``output_ids`` (and ``prompt_ids``) are the
little-endian int32 bytes of the ids, which JSON carries as base64
(:class:`TokenIds`), and the event carries what a trainer needs beside the answer:
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

Keys: every keyed event is keyed by its dataset name (``event_key``), so all events
of one dataset land in one partition, in order, next to its ledger entry.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, overload

import msgspec
import numpy as np

from tokenbudget.core.config import Unit as BudgetUnit
from tokenbudget.core.errors import DatasetError, EventDecodeError
from tokenbudget.core.sampling import SAMPLING_KEYS, Sampling

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

FinishReason = Literal["stop", "length", "abort"]
# Why a kept answer ends: the server's finish reason, or "budget" when the budget's
# line ended it (cut to fit, or a max_new_tokens lowered below the dataset's own), so
# a trainer can tell an answer the model finished from one the job cut.
StopReason = Literal["stop", "length", "budget", "abort"]
# "server": counts and token ids from the server; "usage": the server's counts but no
# token ids (output_ids is None); "tokenizer": counted here, the server did not.
CountSource = Literal["server", "usage", "tokenizer"]


def now() -> float:
    return time.time()


class ToolCall(msgspec.Struct, frozen=True):
    """A function call as a chat model makes it (OpenAI's ``tool_calls[]``, flat):
    ``arguments`` is the JSON text the model wrote."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    """A chat turn. ``tool_calls`` (assistant), ``tool_call_id`` (a ``tool`` result)
    and ``name`` are set only on the turns that have them, and take no room else."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class SamplingParams(Sampling, frozen=True, omit_defaults=True, kw_only=True):
    """What the request asks of the sampler, as configured (``[inference]`` and
    ``[[datasets]]``, :class:`~tokenbudget.core.sampling.Sampling`) and the length the
    budget allows; unset ones are left to the server and take no room here."""

    max_new_tokens: int | None = None

    def request_fields(self) -> dict[str, Any]:
        """The settings a request carries beside max_new_tokens (the budget's)."""
        return {name: value for name in SAMPLING_KEYS if (value := getattr(self, name)) is not None}


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = SCHEMA_VERSION


class _LedgerEvent(_Event, frozen=True, kw_only=True):
    """What the ledger announces about a dataset. ``epoch`` says which ownership of
    the dataset's partition wrote it (:func:`ledger_epoch`): a reader that has seen a
    dataset's events at some epoch drops those of lower epochs, which can only come
    from a ledger worker that lost the partition and did not know yet."""

    epoch: int = 0


def ledger_epoch(recovered_to: int, assigned_at: float) -> int:
    """The epoch of a ledger worker's ownership of a partition: the end offset of the
    partition's table changelog when it took it (it only grows), then the time it did
    (for takeovers with no write in between), as one comparable integer."""
    return (recovered_to << 32) | (int(assigned_at) & 0xFFFFFFFF)


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
    row_id: str | None = None  # the dataset row's own "id"
    input_columns: dict[str, Any] | None = None  # the row's [[datasets]] keep_columns
    sample_index: int = 0  # which of the dataset's n samples of this prompt
    tools: list[dict[str, Any]] | None = None  # the row's tool definitions, sent as is
    # A turn of a conversation regenerated turn by turn (turns = "regenerate"): the
    # conversation's key (one server may keep its turns' prefix cached: a router can
    # send them all there), which of its ``turns`` this is (from 0), and the dataset's
    # conversation as recorded (``reference``), which the next turns are built from.
    conversation_id: str | None = None
    turn: int | None = None
    turns: int | None = None
    reference: tuple[ChatMessage, ...] | None = None

    def __post_init__(self) -> None:
        if self.v < PROMPT_VERSION and (self.tools is not None or self.conversation_id):
            msgspec.structs.force_setattr(self, "v", PROMPT_VERSION)


TOKEN_ID = np.dtype("<i4")  # the wire's byte order, whatever the host's
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class TokenIds(Sequence[int]):
    """A completion's token ids, held as their little-endian int32 bytes.

    Why bytes and not ``list[int]``: those bytes are both the wire form (base64 in
    the JSON, decoded by msgspec in C) and the values buffer of the Parquet
    ``list<int32>`` column, so neither the sink nor the ledger makes a Python int
    per token id (parsing JSON numbers cost as much as writing the Parquet).

    An immutable sequence of ``int``; equal to any sequence of the same ints, so
    ``event.output_ids == [1, 2]`` holds. Ids outside int32 are rejected.
    """

    __slots__ = ("_data",)
    _data: bytes

    def __init__(self, ids: Iterable[int] = ()) -> None:
        if isinstance(ids, TokenIds):
            self._data = ids._data
            return
        array = np.asarray(ids if isinstance(ids, Sequence | np.ndarray) else list(ids))
        if array.size == 0:
            self._data = b""
            return
        # bools, floats and ints past int64 (object arrays) are not token ids
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise ValueError("output_ids: token ids must be a flat sequence of integers")
        low, high = int(array.min()), int(array.max())
        if low < _INT32_MIN or high > _INT32_MAX:
            bad = low if low < _INT32_MIN else high
            raise ValueError(f"output_ids: token id {bad} does not fit in int32")
        self._data = array.astype(TOKEN_ID).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> TokenIds:
        """Ids from their little-endian int32 bytes (the wire form), not copied
        when ``data`` is already ``bytes``."""
        if len(data) % 4:
            raise ValueError(
                f"output_ids: {len(data)} bytes is not a whole number of int32 token ids"
            )
        ids = cls.__new__(cls)
        ids._data = bytes(data)
        return ids

    def tobytes(self) -> bytes:
        """The little-endian int32 bytes."""
        return self._data

    def to_numpy(self) -> np.ndarray:
        """A read-only int32 array over the bytes (no copy on little-endian hosts)."""
        return np.frombuffer(self._data, TOKEN_ID).astype(np.int32, copy=False)

    def tolist(self) -> list[int]:
        return self.to_numpy().tolist()  # type: ignore[no-any-return]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self.to_numpy()
        return array if dtype is None else array.astype(dtype)

    def __len__(self) -> int:
        return len(self._data) >> 2

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...
    def __getitem__(self, index: int | slice) -> int | TokenIds:
        if isinstance(index, slice):
            return TokenIds.from_bytes(self.to_numpy()[index].astype(TOKEN_ID).tobytes())
        return int(self.to_numpy()[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self._data == other._data
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._data)

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r})"


def _token_ids_from_wire(obj: Any) -> TokenIds:
    """``output_ids`` as decoded JSON: base64 of int32 bytes (v2) or numbers (v1)."""
    if isinstance(obj, str):
        try:
            data = msgspec.convert(obj, bytes)  # base64, in C
        except msgspec.ValidationError as exc:
            raise ValueError("output_ids: not base64-encoded int32 token ids") from exc
        return TokenIds.from_bytes(data)
    if isinstance(obj, list):
        try:
            ids = msgspec.convert(obj, list[int], strict=True)  # no bools, floats, strings
        except msgspec.ValidationError as exc:
            raise ValueError(f"output_ids: not a list of token ids: {exc}") from exc
        return TokenIds(ids)
    raise ValueError(
        f"output_ids: expected base64 int32 bytes or an array of ids, got {type(obj).__name__}"
    )


def count_problem(
    prompt_tokens: int,
    completion_tokens: int,
    ids: int | None,
    max_new_tokens: int,
    count_source: str = "server",
) -> str | None:
    """What makes a completion's counts impossible, or None. Every reader (ledger,
    sink, replay) rejects such a completion the same way, to the dead-letter topic:
    counting it could take a dataset past its budget. ``ids`` is the number of
    output_ids, None when the event has none (the server returned none)."""
    if prompt_tokens < 0 or completion_tokens < 0:
        return f"negative token count ({prompt_tokens} prompt, {completion_tokens} completion)"
    if ids is None and count_source == "server":
        return "output_ids is null, but count_source 'server' says the server returned them"
    if ids and ids != completion_tokens:
        return f"completion_tokens {completion_tokens} but {ids} output_ids"
    if max_new_tokens > 0 and completion_tokens > max_new_tokens:
        return f"completion_tokens {completion_tokens} above max_new_tokens {max_new_tokens}"
    return None


class CompletionEvent(_Event, tag="completion", frozen=True):
    """What the inference server produced for one prompt: the source of truth, and
    one training row (the Parquet sink's columns derive from these fields).

    ``output_ids`` may be given as any sequence of ints; it is held as
    :class:`TokenIds`, so an event always has (and encodes at) ``COMPLETION_VERSION``.
    It is None when the server returned no token ids (``count_source`` says how the
    answer was counted): no ids is better than a list that might be wrong.
    """

    request_id: str
    prompt_id: str
    dataset: str
    prompt_tokens: int
    completion_tokens: int
    output_ids: TokenIds | None
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
    # The request as sent: the prompt (text, or chat messages), its ids when known
    # (templated here, sent as ids, or returned by the server), the settings.
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_ids: TokenIds | None = None
    sampling: SamplingParams = SamplingParams()
    model: str = ""  # as the server reported it
    row_id: str | None = None
    input_columns: dict[str, Any] | None = None  # the row's keep_columns, as read
    sample_index: int = 0
    stop_reason: StopReason | None = None  # None: written before version 4
    # A thinking model's reasoning as the server split it off the answer (``text``
    # is then the answer alone); None when the server sent none (raw text and ids
    # hold the thinking inline).
    reasoning: str | None = None
    # Of completion_tokens, those the server says were thinking; None: not reported.
    reasoning_tokens: int | None = None
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
    turn: int | None = None
    turns: int | None = None
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

    dataset: str
    budget: int
    unit: BudgetUnit = "completion_tokens"
    set_at: float = 0.0
    set_by: str = ""
    config_budget: int | None = None


class BudgetExceeded(_LedgerEvent, tag="budget_exceeded", frozen=True):
    """The ledger saw the dataset reach its budget: producers must stop it now."""

    dataset: str
    budget: int
    used: int
    unit: BudgetUnit = "completion_tokens"
    trigger_request_id: str = ""
    at: float = 0.0


class BudgetRaised(_LedgerEvent, tag="budget_raised", frozen=True):
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


class LeaseGranted(_LedgerEvent, tag="lease_granted", frozen=True):
    dataset: str
    lease_id: str
    holder: str
    granted: int  # added to the lease by this grant
    expires_at: float
    at: float = 0.0
    # What the dataset's budget still had unleased after this grant (-1: unknown, a
    # ledger older than the field): growing reservations keep room for their answers
    # in flight before the ledger runs short.
    remaining: int = -1


class LeaseDenied(_LedgerEvent, tag="lease_denied", frozen=True):
    dataset: str
    lease_id: str
    holder: str
    remaining: int
    # True when even every reservation coming back could not fit the smallest
    # useful request: the dataset is done. False: budget is only tied up in other
    # holders' leases for now, so ask again later.
    full: bool = False
    # True when the lease itself takes nothing more (released, fenced, or another
    # holder's): its holder opens a fresh one instead of asking again on it.
    closed: bool = False
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


class LeaseFenced(_LedgerEvent, tag="lease_fenced", frozen=True):
    """Written by the ledger into the completions topic, in the partition of the
    lease's dataset, when it closes a lease it cannot hear from any more (expired, or
    released with answers still to arrive). Every reader of that partition sees the
    same order: the lease's completions before the fence are counted (so when the
    ledger reads it back, nothing of the lease is still on its way and its budget is
    freed), completions of it after the fence are kept by no one."""

    dataset: str
    lease_id: str
    at: float = 0.0


class LeaseRevoked(_LedgerEvent, tag="lease_revoked", frozen=True):
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
    # Revoked because the holder stopped renewing it: its budget is being freed, and
    # the holder claims answers still in flight on it anew (a fresh grant) or drops them.
    expired: bool = False
    at: float = 0.0


class DatasetIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What one dataset of a job is: its rows (``content``, a hash of the file's
    bytes) and the settings its prompts and answers depend on, each one that is not
    at its default (see :mod:`tokenbudget.app.identity`)."""

    name: str
    file: str  # where the content was read when recorded (for messages)
    content: str  # "<algorithm>:<hex digest>"
    settings: dict[str, Any] = {}


class JobIdentity(_Event, tag="job_identity", frozen=True):
    """What the job of a namespace is, recorded on its budgets topic by its first
    ``run`` or ``produce``, and again when a dataset is added or a rerun that differs
    is resumed anyway. The latest one is the job a rerun is compared with. It has no
    dataset (the ledger and the budget board pass it by)."""

    datasets: tuple[DatasetIdentity, ...]
    settings: dict[str, Any]  # the job's own: inference.api, inference.model, sink.path
    first_at: float  # the namespace's first run
    recorded_at: float = 0.0
    recorded_by: str = ""


# What the fleet's changes and reports are keyed by on the budgets topic: one key, so
# they are read in the order they were made.
FLEET_KEY = b"@servers"

ServerState = Literal["up", "paused", "dropped", "draining", "drained"]


class ServerAdded(_Event, tag="server_added", frozen=True):
    """``tokenbudget servers add``: every dispatcher of the namespace sends to this
    server from now on (with its own settings where given, else its config's
    ``[inference]``); one drained or dropped before comes back. No dataset: the
    ledger passes it by."""

    url: str
    concurrency: int | None = None
    weight: float | None = None
    api_key_env: str | None = None
    at: float = 0.0
    by: str = ""


class ServerDrained(_Event, tag="server_drained", frozen=True):
    """``tokenbudget servers drain``: the server gets no new prompts from any
    dispatcher of the namespace and finishes what it has."""

    url: str
    at: float = 0.0
    by: str = ""


class ServerReport(msgspec.Struct, frozen=True, kw_only=True):
    """One server as one dispatcher sees it (its counts are that dispatcher's)."""

    url: str
    state: ServerState
    in_flight: int
    limit: int  # its window now
    concurrency: int  # its ceiling
    requests: int  # sent so far
    tokens: int  # generated so far
    errors: int  # failed so far


class FleetReport(_Event, tag="fleet_report", frozen=True):
    """What one dispatcher (``holder``) sees of the fleet, published every few seconds
    while it runs, for ``tokenbudget status`` and ``servers list``."""

    holder: str
    servers: tuple[ServerReport, ...]
    at: float = 0.0


DatasetStatus = Literal["open", "halted", "exhausted"]


class LedgerSnapshot(_LedgerEvent, tag="ledger_snapshot", frozen=True):
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
    cut: int = 0  # completions counted that the budget's line cut (stop_reason "budget")


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
    """An event that could not be used, with why and where it came from; or a
    dataset row that never became one (:func:`bad_row_letter`: ``source_topic`` is
    empty, ``key`` is the dataset, ``source`` says where in its file)."""

    reason: str
    source_topic: str
    partition: int = -1
    offset: int = -1
    key: str | None = None
    payload: str = ""  # the original bytes, decoded as UTF-8 with replacement
    at: float = 0.0
    source: str = ""  # a bad row's "path:line"
    size: int = -1  # bytes of what the payload is an excerpt of, when it is cut


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


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, TokenIds):
        return obj.tobytes()  # msgspec writes bytes as base64
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is TokenIds:
        return _token_ids_from_wire(obj)  # its ValueError becomes a ValidationError
    raise NotImplementedError(f"cannot decode {kind.__name__}")


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(
    Event,  # type: ignore[arg-type]
    dec_hook=_dec_hook,
)


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


class _Header(msgspec.Struct):
    type: str = "?"
    v: int = SCHEMA_VERSION


_header_decoder = msgspec.json.Decoder(_Header)


def supported_versions(tag: str) -> frozenset[int]:
    """The schema versions this build reads for events of type ``tag``."""
    if tag == "completion":
        return COMPLETION_VERSIONS
    return PROMPT_VERSIONS if tag == "prompt" else SUPPORTED_VERSIONS


def decode(data: bytes) -> Event:
    """Decode one event, or raise EventDecodeError saying what is wrong with it.

    The version is checked before the shape, so an event from a newer writer is
    reported as such rather than as a missing or unknown field.
    """
    try:
        header = _header_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not a tokenbudget event: {exc}") from exc
    supported = supported_versions(header.type)
    if header.v not in supported:
        raise EventDecodeError(
            f"'{header.type}' event has schema version {header.v}; this build reads "
            f"versions {sorted(supported)}: upgrade tokenbudget"
        )
    try:
        event = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not a tokenbudget event: {exc}") from exc
    if isinstance(event, CompletionEvent):
        problem = count_problem(
            event.prompt_tokens,
            event.completion_tokens,
            None if event.output_ids is None else len(event.output_ids),
            event.max_new_tokens,
            event.count_source,
        )
        if problem is not None:
            raise EventDecodeError(f"impossible counts in completion {event.request_id}: {problem}")
    return event


def event_key(event: Event) -> bytes | None:
    dataset = getattr(event, "dataset", None)
    if isinstance(dataset, str):
        return dataset.encode()
    if isinstance(event, ServerAdded | ServerDrained | FleetReport):
        return FLEET_KEY
    return None


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


def bad_row_letter(dataset: str, row: DatasetError, fix: str) -> DeadLetter:
    """The dead letter of a dataset row that is not a prompt: where it is, why, and
    a bounded excerpt of it (never the megabytes of an oversized row)."""
    return DeadLetter(
        reason=f"bad row of dataset {dataset} at {row.where}: {row.message}; {fix}",
        source_topic="",
        key=dataset,
        payload=row.excerpt,
        at=now(),
        source=row.where,
        size=-1 if row.size is None else row.size,
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
