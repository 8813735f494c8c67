"""What events are built of, each value bounded where its type is declared: counts,
token totals, epochs, ids, timestamps, dataset names, URLs, offsets, the reasons an
answer ends and the states a server or dataset is in; a chat's messages and tool
calls, the sampling settings, a dataset's identity and a server's report; and
:class:`TokenIds`, a completion's token ids held as their int32 bytes (the wire's
form and the Parquet column's)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Any, Literal, overload

import msgspec
import numpy as np

from tokenbudget.core import sizes
from tokenbudget.core.names import DATASET_NAME_PATTERN, MAX_DATASET_NAME
from tokenbudget.core.sampling import SAMPLING_KEYS, Sampling

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


class DatasetIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What one dataset of a job is: its rows (``content``, a hash of the file's
    bytes) and the settings its prompts and answers depend on, each one that is not
    at its default (see :mod:`tokenbudget.app.identity`)."""

    name: DatasetName
    file: str  # where the content was read when recorded (for messages)
    content: str  # "<algorithm>:<hex digest>"
    settings: dict[str, Any] = {}


ServerState = Literal["up", "paused", "dropped", "draining", "drained"]


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


DatasetStatus = Literal["open", "halted", "exhausted"]
