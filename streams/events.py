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

import base64
import hashlib
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Any, Literal, overload

import msgspec
import numpy as np

from tokenbudget.core import sizes
from tokenbudget.core.config import Unit as BudgetUnit
from tokenbudget.core.errors import DatasetError, EventDecodeError
from tokenbudget.core.names import DATASET_NAME_PATTERN, MAX_DATASET_NAME
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

# Every value an event carries is checked at the door, by the decoder itself: these
# bounds are declared with the fields, so an event outside them is a bad event
# (EventDecodeError, a dead letter), never applied. Events come from anyone who can
# write a topic: a count, budget or epoch out of range would overflow a Parquet
# int64 or the ledger's msgpack, a negative one be added back to a balance.
MAX_TOKENS = sizes.MAX_TOKENS  # budgets and totals: what int64 (Parquet, msgpack) holds
MAX_COUNT = sizes.MAX_COUNT  # one request's counts and lengths, as wide as a token id
MAX_ID = 512  # characters of an id: prompt, request, lease, holder
MAX_TTL_S = 86_400.0
MAX_AT = 1e10  # seconds since 1970: the year 2286

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
Remaining = Annotated[int, msgspec.Meta(ge=-1, le=MAX_TOKENS)]  # -1: not known
Epoch = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
At = Annotated[float, msgspec.Meta(ge=0, le=MAX_AT)]
Ttl = Annotated[float, msgspec.Meta(gt=0, le=MAX_TTL_S)]
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID)]
DatasetName = Annotated[
    str, msgspec.Meta(pattern=DATASET_NAME_PATTERN, max_length=MAX_DATASET_NAME)
]
EnvName = Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z_][A-Za-z0-9_]{0,255})?$")]  # "": no key
Url = Annotated[str, msgspec.Meta(max_length=2048)]
Offset = Annotated[int, msgspec.Meta(ge=-1, le=MAX_TOKENS)]

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

    max_new_tokens: Count | None = None

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


class DatasetIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What one dataset of a job is: its rows (``content``, a hash of the file's
    bytes) and the settings its prompts and answers depend on, each one that is not
    at its default (see :mod:`tokenbudget.app.identity`)."""

    name: DatasetName
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
    first_at: At  # the namespace's first run
    recorded_at: At = 0.0
    recorded_by: str = ""
    config: str = ""  # the config file, absolute, when it was recorded ("": none known)


# What the fleet's changes and reports are keyed by on the budgets topic: one key, so
# they are read in the order they were made.
FLEET_KEY = b"@servers"

ServerState = Literal["up", "paused", "dropped", "draining", "drained"]


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


class ServerReport(msgspec.Struct, frozen=True, kw_only=True):
    """One server as one dispatcher sees it (its counts are that dispatcher's)."""

    url: Url
    state: ServerState
    in_flight: Tokens
    limit: Tokens  # its window now
    concurrency: Tokens  # its ceiling
    requests: Tokens  # sent so far
    tokens: Tokens  # generated so far
    errors: Tokens  # failed so far


class FleetReport(_Event, tag="fleet_report", frozen=True):
    """What one dispatcher (``holder``) sees of the fleet, published every few seconds
    while it runs, for ``tokenbudget status`` and ``servers list``."""

    holder: Id
    servers: tuple[ServerReport, ...]
    at: At = 0.0


DatasetStatus = Literal["open", "halted", "exhausted"]


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


# What travels on each topic (by its role, the last part of its name), and so who
# writes it: a reader refuses any other event there, so that one role's principal,
# which Kafka's ACLs let write only its own topics, cannot speak for another (an
# operator's command is believed from the control topic only, a halt or a grant from
# the ledger's budgets topic only). docs/kafka.md, Roles and ACLs.
ON_TOPIC: dict[str, tuple[type[_Event], ...]] = {
    "prompts": (PromptEvent,),
    "completions": (CompletionEvent, LeaseFenced),
    "control": (BudgetSet, ServerAdded, ServerDrained, JobIdentity),
    "budgets": (
        BudgetExceeded,
        BudgetRaised,
        LedgerSnapshot,
        LeaseGranted,
        LeaseDenied,
        LeaseRevoked,
    ),
    "outcomes": (PromptSkipped, PromptFailed, ProducerDone),
    "reservations": (LeaseRequested, LeaseRenewed, LeaseReleased, LeaseExpired, FleetReport),
    "deadletter": (DeadLetter,),
}


def topic_of(event_type: type[_Event]) -> str:
    """The role of the topic ``event_type`` travels on (a key of :data:`ON_TOPIC`)."""
    return next(role for role, kinds in ON_TOPIC.items() if event_type in kinds)


def decode(data: bytes, topic: str | None = None) -> Event:
    """Decode one event read from ``topic`` (its name; None: from anywhere, for
    tools and tests), or raise EventDecodeError saying what is wrong with it. Any
    failure is that error: a record nested past the parser's depth, a value out of
    its bounds, an event that does not travel on ``topic``.

    The version is checked before the shape, so an event from a newer writer is
    reported as such rather than as a missing or unknown field.
    """
    try:
        event = _decode(data)
    except EventDecodeError:
        raise
    except Exception as exc:  # RecursionError (nested ~1,000 deep), MemoryError, ...
        raise EventDecodeError(f"not a tokenbudget event: {type(exc).__name__}: {exc}") from exc
    if topic is not None:
        role = topic.rsplit(".", 1)[-1]
        if type(event) not in ON_TOPIC.get(role, ()):
            tag = type(event).__struct_config__.tag
            raise EventDecodeError(
                f"a {tag!r} event does not travel on {topic}: only on "
                f"{topic.rsplit('.', 1)[0]}.{topic_of(type(event))}"
            )
    return event


def _decode(data: bytes) -> Event:
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


EXCERPT_CHARS = 4096
PREFIX_BYTES = 64 * 1024
_KEY_BYTES = 1024
_REASON_CHARS = 4096


def dead_letter(
    reason: str,
    *,
    source_topic: str,
    payload: bytes | None,
    partition: int = -1,
    offset: int = -1,
    key: bytes | None = None,
) -> DeadLetter:
    """The letter for a record that could not be used: its reason (cut to a few KiB)
    and a bounded excerpt of it, its size and hash, so that a letter is never too big
    to send, whatever the record (a 1.5 MB binary payload makes a letter of ~90 KiB)."""
    data = payload or b""
    return DeadLetter(
        reason=reason[:_REASON_CHARS],
        source_topic=source_topic,
        partition=partition,
        offset=offset,
        key=key[:_KEY_BYTES].decode("utf-8", "replace") if key is not None else None,
        payload=data[: EXCERPT_CHARS * 4].decode("utf-8", "replace")[:EXCERPT_CHARS],
        at=now(),
        size=len(data),
        payload_base64=base64.b64encode(data[:PREFIX_BYTES]).decode(),
        sha256=hashlib.sha256(data).hexdigest(),
    )
