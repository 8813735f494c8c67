"""Clients for the inference server's wire formats, behind one small interface.

    InferenceBackend            generate / abort / health
    ├── SGLangBackend           POST /generate (text or input_ids), /abort_request
    ├── OpenAICompletionsBackend  POST /v1/completions
    └── OpenAIChatBackend       POST /v1/chat/completions

What an API can do beyond its wire format (abort by id, its health route, chat
or raw text, where its reasoning comes) is its row of
:data:`tokenbudget.core.apis.API_TRAITS`, which :data:`BACKENDS` covers.

Each backend speaks plain JSON or, with ``stream=True``, server-sent events:

* SGLang streams the whole answer so far in every chunk by default, or only the new
  part with ``--incremental-streaming-output``; which one is told apart from the
  chunk's ``output_ids`` against ``meta_info.completion_tokens``, so both work.
* OpenAI-compatible servers stream deltas; ``stream_options.include_usage`` makes
  them send the usage in a final chunk.

Tool use (chat only): the messages' ``tool_calls`` and ``tool_call_id`` and the
request's ``tools`` are sent as OpenAI's chat API takes them; an answer that calls
functions (``message.tool_calls``, streamed as indexed parts of ``delta.tool_calls``,
``finish_reason`` ``tool_calls``) is the model ending its turn: it finishes as
``stop`` with the calls in ``tool_calls``.

A thinking model's reasoning, when the server splits it off the answer (SGLang with
``--reasoning-parser``: ``message.reasoning_content``; vLLM: ``message.reasoning``,
older releases ``reasoning_content``; streamed in the same fields of ``delta``), is
kept beside the answer in ``reasoning``, and ``usage.completion_tokens_details.
reasoning_tokens`` in ``reasoning_tokens``. ``completion_tokens`` counts both.

Counts come from the server (``usage`` / ``meta_info``, else the token ids it returned:
vLLM's ``return_token_ids``). A server that returns neither is counted with the
model's tokenizer (``[inference] tokenizer``), and the result says so in
``count_source``. A count the server sends is a JSON integer within 0..:data:`MAX_COUNT`
(:func:`count_of`), or the answer is refused (never charged: a negative cost would
give budget back).

HTTP status codes and malformed bodies are translated here, and only here, into the
:class:`~tokenbudget.core.errors.InferenceError` tree (a failed connection already is,
by :mod:`tokenbudget.producers.inference.http`, the client every backend speaks through); callers
retry on ``error.retryable``.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import random
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import msgspec

from tokenbudget.core import sizes
from tokenbudget.core.apis import API_TRAITS
from tokenbudget.core.errors import (
    InferenceBadCountError,
    InferenceError,
    InferenceProtocolError,
    InferenceRequestError,
    InferenceServerError,
    InferenceTransportError,
    InferenceUnavailableError,
)
from tokenbudget.core.sampling import VERBATIM_KEY
from tokenbudget.producers.inference.http import HttpClient, Reply, Timeouts
from tokenbudget.producers.templates import config_tokenizer
from tokenbudget.streams.fields import ChatMessage, CountSource, FinishReason, ToolCall

if TYPE_CHECKING:
    from tokenbudget.core.config import Config, Server
    from tokenbudget.producers.templates import LocalTokenizer

# Statuses that say the server is busy or away, not that the request is wrong.
AWAY_STATUSES = frozenset({408, 429, 502, 503, 504})
# Of those, the server's own word that it takes no more now (not a proxy's).
BUSY_STATUSES = frozenset({429, 503})
# A Retry-After beyond this is taken as this: a job waits, it does not sleep for days.
RETRY_AFTER_MAX_S = 600.0


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from ``Retry-After`` (delay-seconds or an HTTP date), capped at
    :data:`RETRY_AFTER_MAX_S`; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return min(RETRY_AFTER_MAX_S, max(0.0, seconds))


# on_progress(rid, completion tokens so far): called after each network read that
# brought streamed chunks (one call for all a read brought).
ProgressCallback = Callable[[str, int], None]


class InferenceCountError(InferenceProtocolError):
    """The server returned neither usage nor token ids and no tokenizer is configured:
    asking again will not help."""

    retryable = False


class ServerUnreachableError(InferenceTransportError):
    """The pre-run check could not reach the server."""


class WrongModelError(InferenceRequestError):
    """The server serves another model than ``[inference] model``."""


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` more attempts after the first, exponential backoff with jitter."""

    retries: int = 3
    backoff: float = 0.5
    backoff_max: float = 10.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds before attempt ``attempt + 1``: exponential with jitter, and never
        less than the server's ``Retry-After``."""
        base = min(self.backoff_max, self.backoff * (2 ** (attempt - 1)))
        return max(base * (0.5 + random.random() / 2), retry_after or 0.0)


@dataclass(frozen=True)
class GenerationRequest:
    rid: str
    max_new_tokens: int
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    input_ids: tuple[int, ...] | None = None
    # Every sampling setting configured (tokenbudget.core.sampling), by its config name:
    # each backend maps them to its wire format.
    sampling: Mapping[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # chat: the function definitions offered
    # Streaming only: called with (rid, completion tokens so far) on every chunk.
    # Wins over the backend's own ``on_progress``.
    on_progress: ProgressCallback | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class GenerationResult:
    rid: str
    prompt_tokens: int
    completion_tokens: int
    output_ids: list[int] | None  # None: the server returned no ids (count_source says)
    text: str
    finish_reason: FinishReason
    first_token_at: float | None = None  # streaming: when the first content chunk came
    count_source: CountSource = "server"  # see tokenbudget.streams.fields.CountSource
    model: str = ""  # as the server reported it
    prompt_ids: list[int] | None = None  # as the server returned them
    # The thinking the server split off the answer (None: it sent none), and how many
    # of completion_tokens it says were thinking (None: not reported).
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    tool_calls: tuple[ToolCall, ...] | None = None  # chat: the functions the model called


def reasoning_of(message: Any, fields: tuple[str, ...]) -> str:
    """The reasoning a chat message or delta carries in one of ``fields`` (the API's
    ``reasoning_fields``), "" when none. A server that sends both names (vLLM while
    renaming) sends the same text in each."""
    if isinstance(message, dict):
        for name in fields:
            value = message.get(name)
            if isinstance(value, str) and value:
                return value
    return ""


#: the largest token count a server may report: the events' own bound
#: (:data:`tokenbudget.core.sizes.MAX_COUNT`), as wide as a token id
MAX_COUNT = sizes.MAX_COUNT


def count_of(value: Any, name: str, where: str) -> int:
    """``value`` as a token count: a JSON integer within 0..:data:`MAX_COUNT`. Anything
    else (negative, a float, a bool, a string, null, beyond any answer) raises
    :class:`~tokenbudget.core.errors.InferenceBadCountError` naming the field
    (``name``) and the server (``where``): the answer is refused, not charged."""
    if type(value) is int and 0 <= value <= MAX_COUNT:
        return value
    shown = repr(value)
    shown = shown if len(shown) <= 40 else f"{shown[:40]}..."
    raise InferenceBadCountError(
        f"{where}: {name} is {shown}, not a token count (an integer within "
        f"0..{MAX_COUNT}): the answer is refused, not charged"
    )


def token_ids_of(value: Any, name: str, where: str) -> list[int] | None:
    """``value`` as token ids (None: the server sent none): a list of integers within
    0..:data:`MAX_COUNT` (an integral float, as some servers write one, is taken as
    its integer). Anything else raises
    :class:`~tokenbudget.core.errors.InferenceProtocolError` naming the field and the
    server: an id past int32 would fail only when the completion is encoded, a bool or
    a fraction is no token."""
    if value is None:
        return None
    if isinstance(value, list):
        if all(type(i) is int for i in value):
            if not value or (min(value) >= 0 and max(value) <= MAX_COUNT):
                return value
        elif all(type(i) in (int, float) and i == int(i) for i in value):
            return token_ids_of([int(i) for i in value], name, where)
    shown = repr(value)
    shown = shown if len(shown) <= 60 else f"{shown[:60]}..."
    raise InferenceProtocolError(
        f"{where}: {name} is {shown}, not token ids (integers within 0..{MAX_COUNT}): "
        "the answer is refused, not charged"
    )


def reasoning_tokens_of(usage: Any, completion_tokens: int, where: str) -> int | None:
    """``usage.completion_tokens_details.reasoning_tokens`` (vLLM, newer SGLang), at
    most ``completion_tokens``, which counts thinking and answer; None when absent
    (or null). One that is not a count raises, as :func:`count_of` does."""
    details = usage.get("completion_tokens_details") if isinstance(usage, dict) else None
    value = details.get("reasoning_tokens") if isinstance(details, dict) else None
    if value is None:
        return None
    name = "usage.completion_tokens_details.reasoning_tokens"
    return min(count_of(value, name, where), completion_tokens)


# Chat answers that end by calling functions: the model ended its turn.
_CALLS_FINISH = frozenset({"tool_calls", "function_call"})


def _calls_end(finish: Any) -> Any:
    return "stop" if isinstance(finish, str) and finish in _CALLS_FINISH else finish


def _as_finish(value: Any) -> FinishReason:
    kind = value.get("type") if isinstance(value, dict) else value
    if kind in ("stop", "length", "abort"):
        return kind  # type: ignore[no-any-return]
    if kind is None:
        return "stop"
    raise InferenceProtocolError(f"unknown finish_reason {value!r}")


def _field(body: Any, *path: str | int) -> Any:
    node = body
    for part in path:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError) as exc:
            dotted = ".".join(str(p) for p in path)
            raise InferenceProtocolError(f"response lacks {dotted}: {str(body)[:200]}") from exc
    return node


def _int_list(value: Any) -> list[Any] | None:
    """A list the server sent as ids, as it is (checked once the answer is whole:
    :func:`token_ids_of`), or None."""
    return value if isinstance(value, list) else None


class InferenceBackend(ABC):
    api: str
    # Defaults as class attributes, so subclasses that skip __init__ (test doubles)
    # still have them.
    base_url: str = "http://server"
    model: str = ""
    stream: bool = False
    headers: dict[str, str] = {}  # noqa: RUF012 - replaced per instance, never mutated
    tokenizer: LocalTokenizer | None = None
    on_progress: ProgressCallback | None = None

    def __init__(
        self,
        client: HttpClient,
        base_url: str,
        model: str = "",
        *,
        stream: bool = False,
        api_key: str | None = None,
        tokenizer: LocalTokenizer | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.stream = stream
        # The key only ever lives in this header: never in a message or a log line.
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = tokenizer
        self.on_progress = on_progress

    @abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    async def abort(self, rid: str) -> None:  # noqa: B027 - optional capability
        """Ask the server to stop a request. Servers without an abort API close
        the connection instead, which is what cancelling the caller's task does."""

    async def health(self) -> None:
        await self._request("GET", API_TRAITS[self.api].health_route, None)

    # ---- plumbing ---------------------------------------------------------------------

    def _raise_for_status(self, method: str, url: str, reply: Reply) -> None:
        status = reply.status
        if status < 400:
            return
        message = f"{method} {url}: HTTP {status}: {reply.text[:200]}"
        if status in AWAY_STATUSES:
            retry_after = parse_retry_after(reply.headers.get("Retry-After"))
            raise InferenceUnavailableError(
                message, retry_after=retry_after, busy=status in BUSY_STATUSES
            )
        if status >= 500:
            raise InferenceServerError(message)
        raise InferenceRequestError(message)

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None, tokens: int = 0
    ) -> Any:
        """The JSON of the reply (``tokens``: the answer's ``max_new_tokens``, for its
        time limit)."""
        url = self.base_url + path
        reply = await self.client.request(method, url, body, self.headers, tokens=tokens)
        self._raise_for_status(method, url, reply)
        if not reply.content:
            return None
        try:
            return json.loads(reply.content)
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deep
            raise InferenceProtocolError(
                f"{method} {url}: body is not JSON: {reply.text[:120]!r}"
            ) from exc

    async def _events(
        self, path: str, body: dict[str, Any], tokens: int
    ) -> AsyncIterator[list[Any]]:
        """POST and yield the JSON of the server-sent events each network read
        completes, until ``data: [DONE]`` or the end of the body."""
        url = self.base_url + path
        async for batch in self._data(path, body, tokens):
            yield [_stream_event(url, data) for data in batch]

    async def _data(
        self, path: str, body: dict[str, Any], tokens: int
    ) -> AsyncIterator[list[bytes]]:
        """POST and yield the data of the server-sent events each network read
        completes, undecoded (none: nothing is yielded), until ``data: [DONE]`` or the
        end of the body; ``tokens``, the answer's ``max_new_tokens``, sets its time
        limit."""
        url = self.base_url + path
        streamed_reply = self.client.stream("POST", url, body, self.headers, tokens=tokens)
        async with streamed_reply as streamed:
            if streamed.status >= 400:
                refusal = Reply(streamed.status, streamed.headers, await streamed.read())
                self._raise_for_status("POST", url, refusal)
            async for lines in streamed.lines():
                batch: list[bytes] = []
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event:/id: fields
                    # One copy of a line that may be the whole answer so far: the
                    # space after the field's colon is dropped, the JSON decoders
                    # skip any other whitespace.
                    data = line[6:] if line[5:6] == b" " else line[5:]
                    if len(data) < 16 and data.strip() == b"[DONE]":
                        if batch:
                            yield batch
                        return
                    batch.append(data)
                if batch:
                    yield batch

    def _progress(self, request: GenerationRequest, tokens: int) -> None:
        callback = request.on_progress or self.on_progress
        if callback is not None:
            callback(request.rid, tokens)

    def _counts(
        self,
        request: GenerationRequest,
        *,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        prompt_ids: list[int] | None,
        output_ids: list[int] | None,
        text: str,
    ) -> tuple[int, int, CountSource]:
        """Counts from the server when it gave them (usage, else its token ids; the
        ids we sent are the prompt), else from the tokenizer."""
        source: CountSource = "server"
        if completion_tokens is None and output_ids is not None:
            completion_tokens = len(output_ids)
        if prompt_tokens is None:
            if prompt_ids is not None:
                prompt_tokens = len(prompt_ids)
            elif request.input_ids is not None:
                prompt_tokens = len(request.input_ids)
        if completion_tokens is None or prompt_tokens is None:
            if self.tokenizer is None:
                raise InferenceCountError(
                    f"{self.base_url}: the server returned neither usage nor token ids; "
                    "set [inference] tokenizer to count with the model's tokenizer"
                )
            source = "tokenizer"
            if completion_tokens is None:
                completion_tokens = self.tokenizer.count_completion(text)
            if prompt_tokens is None:
                prompt_tokens = self.tokenizer.count_prompt(*self._sent_prompt(request))
        return prompt_tokens, completion_tokens, source

    def _sent_prompt(
        self, request: GenerationRequest
    ) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
        """The prompt as this API sends it, for counting: text, or chat messages
        (which the server renders with the model's chat template)."""
        if request.text is None and request.messages:
            return "\n".join(m.content for m in request.messages), None
        return request.text, None


def _model(body: Any) -> str:
    """The model an OpenAI-compatible response names ("" when it names none)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else ""


def _stream_event(url: str, data: bytes) -> Any:
    """A server-sent event's data, decoded: data that is not JSON is a protocol error,
    an error the server sends in the stream is the server's."""
    try:
        event = _decode(data)
    except (msgspec.DecodeError, RecursionError):
        # What msgspec refuses and Python's decoder reads as before: invalid UTF-8
        # (replaced), NaN and Infinity; JSON nested too deep for either is not JSON.
        try:
            event = json.loads(data.decode("utf-8", "replace"))
        except (json.JSONDecodeError, RecursionError) as exc:
            raise _not_json(url, data) from exc
    if isinstance(event, dict) and ("error" in event or event.get("object") == "error"):
        raise _error_in_stream(url, data)
    return event


def _not_json(url: str, data: bytes) -> InferenceProtocolError:
    return InferenceProtocolError(
        f"POST {url}: stream chunk is not JSON: {data[:120].decode('utf-8', 'replace')!r}"
    )


def _error_in_stream(url: str, data: bytes) -> InferenceServerError:
    return InferenceServerError(
        f"POST {url}: error in stream: {data[:200].decode('utf-8', 'replace')}"
    )


class _ChunkHead(msgspec.Struct):
    """What progress needs of an SGLang stream chunk; its text and ids are skipped
    unread (in cumulative streams they repeat the whole answer every chunk)."""

    meta_info: dict[str, Any] | None = None
    error: Any = None
    object: Any = None


_read_head = msgspec.json.Decoder(_ChunkHead).decode
_decode = msgspec.json.Decoder().decode


def _head(data: bytes) -> _ChunkHead:
    """What progress needs of a cumulative chunk, read from its ``meta_info`` key on,
    which SGLang writes after the text and ids: they repeat the whole answer so far, and
    reading past them took a tenth of a dispatcher's CPU. The key is found from the
    end: an unescaped quote only ever delimits a string, and a string followed by a
    colon is a key. A chunk where that key is not the top level's (what follows it
    does not close the object) or is missing is read whole."""
    at = data.rfind(b'"meta_info":')
    if at > 0 and data[at - 1 : at] != b"\\":
        try:
            return _read_head(b"{" + data[at:])
        except (msgspec.DecodeError, RecursionError):
            pass
    return _read_head(data)


class _LastChunk(msgspec.Struct):
    """A cumulative stream's last chunk, the whole answer, read once: its ids typed by
    the decoder (converting them one by one took ~3% of a dispatcher's CPU samples)."""

    text: str = ""
    output_ids: list[int] | None = None
    token_ids: list[int] | None = None  # older servers' name
    meta_info: dict[str, Any] | None = None


_read_last = msgspec.json.Decoder(_LastChunk).decode


class _SGLangStream:
    """Accumulates SGLang chunks, cumulative or incremental, telling which from the
    ids against ``meta_info.completion_tokens`` (text-only streams: from the text)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text = ""
        self.incremental: bool | None = None
        self.meta: dict[str, Any] = {}
        self.has_ids = False

    def add(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise InferenceProtocolError(f"stream chunk is not an object: {str(chunk)[:200]}")
        meta = chunk.get("meta_info")
        if isinstance(meta, dict):
            self.meta = meta
        ids = _int_list(chunk.get("output_ids", chunk.get("token_ids")))
        text = chunk.get("text")
        text = text if isinstance(text, str) else ""
        total = self.meta.get("completion_tokens") if isinstance(meta, dict) else None
        if self.incremental is None:
            self.incremental = self._mode(ids, text, total)
        if ids is not None:
            self.has_ids = True
            self.ids = self.ids + ids if self.incremental else ids
        self.text = self.text + text if self.incremental else text

    def add_last(self, url: str, data: bytes) -> None:
        """The last chunk of a cumulative stream (the whole answer); one the typed
        read refuses is read as any other chunk."""
        try:
            last = _read_last(data)
        except (msgspec.DecodeError, RecursionError):
            self.add(_stream_event(url, data))
            return
        if last.meta_info is not None:
            self.meta = last.meta_info
        ids = last.output_ids if last.output_ids is not None else last.token_ids
        if ids is not None:
            self.has_ids = True
            self.ids = ids
        self.text = last.text

    def _mode(self, ids: list[int] | None, text: str, total: Any) -> bool | None:
        if ids is not None:
            if not self.ids:
                return None  # first chunk: both readings agree
            if isinstance(total, int):
                if len(self.ids) + len(ids) == total and len(ids) != total:
                    return True
                if len(ids) == total:
                    return False
            return ids[: len(self.ids)] != self.ids
        if not self.text:
            return None
        return not text.startswith(self.text)

    @property
    def tokens(self) -> int:
        total = self.meta.get("completion_tokens")
        return int(total) if isinstance(total, int) else len(self.ids)


# SGLang's sampling_params name for a setting where it differs from ours.
_SGLANG_NAMES = {"seed": "sampling_seed"}
# Settings that are not sampling_params on /generate: the template's are applied
# here (template = true), the extra body goes beside sampling_params.
_NOT_SAMPLING_PARAMS = frozenset({"chat_template_kwargs", VERBATIM_KEY})


class SGLangBackend(InferenceBackend):
    api = "sglang"
    _model_lookup: asyncio.Future[str] | None = None

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        sampling: dict[str, Any] = {"max_new_tokens": request.max_new_tokens}
        for key, value in request.sampling.items():
            if key not in _NOT_SAMPLING_PARAMS:
                sampling[_SGLANG_NAMES.get(key, key)] = value
        body: dict[str, Any] = {
            "rid": request.rid,
            "sampling_params": sampling,
            "stream": self.stream,
            **(request.sampling.get(VERBATIM_KEY) or {}),
        }
        if request.input_ids is not None:
            body["input_ids"] = list(request.input_ids)
        elif request.text is not None:
            body["text"] = request.text
        else:
            # /generate takes plain text; a chat prompt without a local template is
            # sent as the concatenated turns.
            body["text"] = "\n".join(m.content for m in request.messages or ())
        return body

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        body = self._body(request)
        first_token_at: float | None = None
        if not self.stream:
            data = await self._request("POST", "/generate", body, request.max_new_tokens)
            meta = _field(data, "meta_info")
            output_ids = data.get("output_ids") if isinstance(data, dict) else None
            if output_ids is None:
                output_ids = data.get("token_ids") if isinstance(data, dict) else None  # old
            text = str(data.get("text", ""))
        else:
            url = self.base_url + "/generate"
            acc = _SGLangStream()
            last = b""  # the latest cumulative chunk, decoded in full only at the end
            async for batch in self._data("/generate", body, request.max_new_tokens):
                for data in batch:
                    if acc.incremental is False:
                        # Cumulative: each chunk repeats the answer so far; reading only
                        # its counts keeps a long answer's stream linear, not quadratic.
                        try:
                            head = _head(data)
                        except (msgspec.DecodeError, RecursionError) as exc:
                            raise _not_json(url, data) from exc
                        if head.error is not None or head.object == "error":
                            raise _error_in_stream(url, data)
                        if isinstance(head.meta_info, dict):
                            acc.meta = head.meta_info
                        last = data
                    else:
                        acc.add(_stream_event(url, data))
                if first_token_at is None and (acc.tokens > 0 or acc.text or last):
                    first_token_at = time.time()
                self._progress(request, acc.tokens)
            if last:
                acc.add_last(url, last)
            meta = acc.meta
            if not meta or meta.get("finish_reason") is None:
                raise InferenceTransportError(
                    f"POST {self.base_url}/generate: the stream ended before the request finished"
                )
            output_ids = acc.ids if acc.has_ids else None
            text = acc.text
        where = self.base_url + "/generate"
        output_ids = token_ids_of(output_ids, "output_ids", where)
        if output_ids is None:
            raise InferenceProtocolError(
                "SGLang response has no output_ids: use a build that returns them"
            )
        return GenerationResult(
            rid=request.rid,
            prompt_tokens=count_of(_field(meta, "prompt_tokens"), "meta_info.prompt_tokens", where),
            completion_tokens=count_of(
                _field(meta, "completion_tokens"), "meta_info.completion_tokens", where
            ),
            output_ids=output_ids,
            text=text,
            finish_reason=_as_finish(meta.get("finish_reason")),
            first_token_at=first_token_at,
            model=await self._served_model(),
        )

    async def _served_model(self) -> str:
        """/generate names no model: ask /get_model_info once, shared by every
        request in flight meanwhile (the configured name if the server will not say)."""
        lookup = self._model_lookup
        if lookup is None:
            lookup = self._model_lookup = asyncio.ensure_future(self._model_info())
        if lookup.done():
            return lookup.result()  # every answer after the first: no shield to build
        return await asyncio.shield(lookup)

    async def _model_info(self) -> str:
        try:
            info = await self._request("GET", API_TRAITS[self.api].model_info_route, None)
        except InferenceError:
            return self.model  # an older server or a proxy without it: the name asked for
        path = info.get("model_path") if isinstance(info, dict) else None
        return path if isinstance(path, str) and path else self.model

    async def abort(self, rid: str) -> None:
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": False})


class _OpenAIBackend(InferenceBackend):
    path: str

    @abstractmethod
    def _body(self, request: GenerationRequest) -> dict[str, Any]: ...

    @abstractmethod
    def _text(self, choice: Any) -> str: ...

    @abstractmethod
    def _delta(self, choice: Any) -> str: ...

    def _reasoning(self, choice: Any) -> str:
        """The reasoning of a whole answer's choice ("" when none): chat only."""
        return ""

    def _delta_reasoning(self, choice: Any) -> str:
        """The reasoning of a streamed choice's delta ("" when none): chat only."""
        return ""

    def _calls(self, choice: Any) -> tuple[ToolCall, ...] | None:
        """The functions a whole answer's choice calls (None: none): chat only."""
        return None

    def _delta_calls(self, choice: Any) -> list[Any]:
        """The parts of calls a streamed choice's delta carries: chat only."""
        return []

    def _full_body(self, request: GenerationRequest) -> dict[str, Any]:
        body = self._body(request)
        body.update(model=self.model, stream=self.stream, return_token_ids=True)
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for key, value in request.sampling.items():
            if key == "chat_template_kwargs" and not API_TRAITS[self.api].chat:
                continue  # only a chat route applies a template
            if key != VERBATIM_KEY:
                body[key] = value
        body.update(request.sampling.get(VERBATIM_KEY) or {})
        return body

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        body = self._full_body(request)
        if self.stream:
            return await self._generate_streaming(request, body)
        data = await self._request("POST", self.path, body, request.max_new_tokens)
        choice = _field(data, "choices", 0)
        usage = data.get("usage")
        prompt_ids = _int_list(choice.get("prompt_token_ids", data.get("prompt_token_ids")))
        return self._result(
            request,
            usage=usage,
            output_ids=_int_list(choice.get("token_ids")),
            prompt_ids=prompt_ids,
            text=self._text(choice),
            finish=choice.get("finish_reason"),
            first_token_at=None,
            model=_model(data),
            reasoning=self._reasoning(choice),
            tool_calls=self._calls(choice),
        )

    async def _generate_streaming(
        self, request: GenerationRequest, body: dict[str, Any]
    ) -> GenerationResult:
        parts: list[str] = []
        thoughts: list[str] = []
        ids: list[int] = []
        has_ids = False
        prompt_ids: list[int] | None = None
        usage: Any = None
        model = ""
        finish: Any = None
        finished = False
        content_chunks = 0
        first_token_at: float | None = None
        calls = _StreamedCalls()
        async for events in self._events(self.path, body, request.max_new_tokens):
            for chunk in events:
                if not isinstance(chunk, dict):
                    raise InferenceProtocolError(
                        f"stream chunk is not an object: {str(chunk)[:200]}"
                    )
                if chunk.get("usage"):  # llama.cpp: in the chunk that has finish_reason
                    usage = chunk["usage"]
                model = model or _model(chunk)
                prompt_ids = _int_list(chunk.get("prompt_token_ids")) or prompt_ids
                for choice in chunk.get("choices") or ():
                    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                        continue
                    prompt_ids = _int_list(choice.get("prompt_token_ids")) or prompt_ids
                    delta = self._delta(choice)
                    thought = self._delta_reasoning(choice)
                    new_ids = _int_list(choice.get("token_ids"))
                    call_parts = self._delta_calls(choice)
                    calls.add(call_parts)
                    if new_ids is not None:
                        has_ids = True
                        ids.extend(new_ids)
                    if delta or thought or new_ids or call_parts:
                        content_chunks += 1
                        parts.append(delta)
                        thoughts.append(thought)
                        if first_token_at is None:
                            first_token_at = time.time()
                    if choice.get("finish_reason") is not None:
                        finish, finished = choice["finish_reason"], True
            if has_ids:
                tokens = len(ids)
            elif isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                tokens = usage["completion_tokens"]  # continuous_usage_stats
            else:
                tokens = content_chunks  # about one token per chunk
            self._progress(request, tokens)
        if not finished:
            raise InferenceTransportError(
                f"POST {self.base_url}{self.path}: the stream ended before the request finished"
            )
        return self._result(
            request,
            usage=usage,
            output_ids=ids if has_ids else None,
            prompt_ids=prompt_ids,
            text="".join(parts),
            finish=finish,
            first_token_at=first_token_at,
            model=model,
            reasoning="".join(thoughts),
            tool_calls=calls.calls(),
        )

    def _result(
        self,
        request: GenerationRequest,
        *,
        usage: Any,
        output_ids: list[int] | None,
        prompt_ids: list[int] | None,
        text: str,
        finish: Any,
        first_token_at: float | None,
        model: str,
        reasoning: str,
        tool_calls: tuple[ToolCall, ...] | None = None,
    ) -> GenerationResult:
        """The answer, counted. ``reasoning`` "" means the server sent none."""
        prompt_tokens = completion_tokens = None
        where = self.base_url + self.path
        output_ids = token_ids_of(output_ids, "token_ids", where)
        prompt_ids = token_ids_of(prompt_ids, "prompt_token_ids", where)
        if usage:  # present: it must be whole
            prompt_tokens = count_of(_field(usage, "prompt_tokens"), "usage.prompt_tokens", where)
            completion_tokens = count_of(
                _field(usage, "completion_tokens"), "usage.completion_tokens", where
            )
        prompt, completion, source = self._counts(
            request,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            text=text,
        )
        return GenerationResult(
            rid=request.rid,
            prompt_tokens=prompt,
            completion_tokens=completion,
            output_ids=output_ids,
            text=text,
            finish_reason=_as_finish(_calls_end(finish)),
            first_token_at=first_token_at,
            count_source="usage" if source == "server" and output_ids is None else source,
            model=model,
            prompt_ids=prompt_ids,
            reasoning=reasoning or None,
            reasoning_tokens=reasoning_tokens_of(usage, completion, where) if usage else None,
            tool_calls=tool_calls,
        )


class OpenAICompletionsBackend(_OpenAIBackend):
    api = "openai-completions"
    path = "/v1/completions"

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        prompt: Any = list(request.input_ids) if request.input_ids is not None else request.text
        if prompt is None:
            prompt = "\n".join(m.content for m in request.messages or ())
        return {"prompt": prompt, "max_tokens": request.max_new_tokens, "request_id": request.rid}

    def _text(self, choice: Any) -> str:
        return str(choice.get("text") or "")

    def _delta(self, choice: Any) -> str:
        return str(choice.get("text") or "")


class OpenAIChatBackend(_OpenAIBackend):
    api = "openai-chat"
    path = "/v1/chat/completions"

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        messages = request.messages or (ChatMessage(role="user", content=request.text or ""),)
        body: dict[str, Any] = {
            "messages": [chat_message(m) for m in messages],
            "max_tokens": request.max_new_tokens,
            "request_id": request.rid,
        }
        if request.tools is not None:
            body["tools"] = request.tools
        return body

    def _sent_prompt(
        self, request: GenerationRequest
    ) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
        return None, request.messages or (ChatMessage(role="user", content=request.text or ""),)

    def _text(self, choice: Any) -> str:
        message = choice.get("message") or {}
        return str(message.get("content") or "")

    def _delta(self, choice: Any) -> str:
        delta = choice.get("delta") or {}
        return str(delta.get("content") or "") if isinstance(delta, dict) else ""

    def _reasoning(self, choice: Any) -> str:
        return reasoning_of(choice.get("message"), API_TRAITS[self.api].reasoning_fields)

    def _delta_reasoning(self, choice: Any) -> str:
        return reasoning_of(choice.get("delta"), API_TRAITS[self.api].reasoning_fields)

    def _calls(self, choice: Any) -> tuple[ToolCall, ...] | None:
        message = choice.get("message")
        value = message.get("tool_calls") if isinstance(message, dict) else None
        if not value:
            return None
        calls = _StreamedCalls()
        calls.add([{"index": i, **call} for i, call in enumerate(value) if isinstance(call, dict)])
        return calls.calls()

    def _delta_calls(self, choice: Any) -> list[Any]:
        delta = choice.get("delta")
        value = delta.get("tool_calls") if isinstance(delta, dict) else None
        return value if isinstance(value, list) else []


def chat_message(message: ChatMessage) -> dict[str, Any]:
    """A chat turn as OpenAI's chat API takes it: a turn that only calls functions
    has null content, and tool fields appear only on the turns that have them."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
        out["content"] = message.content or None
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


class _StreamedCalls:
    """Function calls assembled from their parts: a streamed ``delta.tool_calls``
    entry names its call by ``index``; its id and name come once, its arguments in
    pieces to join (a whole answer's calls are one part each)."""

    def __init__(self) -> None:
        self._parts: dict[int, dict[str, str]] = {}

    def add(self, parts: list[Any]) -> None:
        for part in parts:
            if not isinstance(part, dict):
                raise InferenceProtocolError(f"a tool call is not an object: {str(part)[:200]}")
            index = part.get("index", len(self._parts))
            call = self._parts.setdefault(index, {"id": "", "name": "", "arguments": ""})
            function = part.get("function") or {}
            if isinstance(part.get("id"), str) and part["id"]:
                call["id"] = part["id"]
            if isinstance(function.get("name"), str) and function["name"]:
                call["name"] = function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call["arguments"] += arguments
            elif arguments is not None:  # some servers send the object itself
                call["arguments"] += json.dumps(arguments)

    def calls(self) -> tuple[ToolCall, ...] | None:
        if not self._parts:
            return None
        out = []
        for index in sorted(self._parts):
            part = self._parts[index]
            if not part["name"]:
                raise InferenceProtocolError(f"tool call {index} came without a function name")
            out.append(ToolCall(id=part["id"] or f"call_{index}", name=part["name"],
                                arguments=part["arguments"]))  # fmt: skip
        return tuple(out)


# The client of each API, by the name its class declares (the rows of
# tokenbudget.core.apis.API_TRAITS, which this covers).
BACKENDS: dict[str, type[InferenceBackend]] = {
    backend.api: backend for backend in (SGLangBackend, OpenAICompletionsBackend, OpenAIChatBackend)
}


def make_backend(
    api: str,
    client: HttpClient,
    url: str,
    model: str = "",
    **options: Any,
) -> InferenceBackend:
    """``options``: ``stream``, ``api_key``, ``tokenizer``, ``on_progress``."""
    return BACKENDS[api](client, url, model, **options)


def api_key_of(server: Server) -> str | None:
    """The API key of ``server``, from the environment variable it names."""
    name = server.api_key_env
    return os.environ.get(name) or None if name else None


def api_key_from_env(config: Config) -> str | None:
    """The API key of the config's first server."""
    return api_key_of(config.servers[0])


def backend_for_server(
    config: Config,
    client: HttpClient,
    server: Server,
    *,
    on_progress: ProgressCallback | None = None,
) -> InferenceBackend:
    """The backend of one server of the fleet: ``[inference]``'s api, model and
    stream, the server's URL and key, and the tokenizer for servers that return no
    counts."""
    inference = config.inference
    tokenizer = config_tokenizer(config)
    return make_backend(
        inference.api,
        client,
        server.url,
        inference.model,
        stream=inference.stream,
        api_key=api_key_of(server),
        tokenizer=tokenizer,
        on_progress=on_progress,
    )


def backend_for_config(
    config: Config, client: HttpClient, *, on_progress: ProgressCallback | None = None
) -> InferenceBackend:
    """The backend of the config's first server (the whole fleet of a one-server job)."""
    return backend_for_server(config, client, config.servers[0], on_progress=on_progress)


# ---- before a run: are the servers there, and do they serve the model we expect? -----


@dataclass(frozen=True)
class ServerCheck:
    """One server as probed before a run: up (with the models it named) or why not."""

    url: str
    up: bool
    models: tuple[str, ...] = ()
    problem: str = ""  # why it is not up


async def prepare(config: Config) -> list[ServerCheck]:
    """Before a run: load the tokenizer (off the event loop, once per process) and,
    unless ``[inference] check_server = false``, probe every server of the fleet
    (:func:`check_servers`); [] when they are not checked."""
    await asyncio.to_thread(config_tokenizer, config)
    if config.inference.check_server:
        return await check_servers(config)
    return []


def _same_model(configured: str, served: str) -> bool:
    if configured == served:
        return True
    # SGLang reports the model path it loaded; a config may name the hub id.
    return configured.rstrip("/").rsplit("/", 1)[-1] == served.rstrip("/").rsplit("/", 1)[-1]


async def check_servers(config: Config, *, timeout: float = 10.0) -> list[ServerCheck]:
    """Probe every server of the fleet at once (:func:`check_server`): those that do
    not answer are reported down. Raises :class:`ServerUnreachableError` when none is
    up (naming each and why), and what :func:`check_server` raises for a server that
    answers wrongly (another model, a key refused): a mistake to fix, not an outage."""

    async def probe(server: Server) -> ServerCheck:
        try:
            models = await check_server(config, server=server, timeout=timeout)
        except ServerUnreachableError as exc:
            return ServerCheck(server.url, False, problem=str(exc))
        return ServerCheck(server.url, True, tuple(models))

    checks = list(await asyncio.gather(*(probe(s) for s in config.servers)))
    if not any(check.up for check in checks):
        if len(checks) == 1:
            raise ServerUnreachableError(checks[0].problem)
        raise ServerUnreachableError(
            f"none of the {len(checks)} inference servers answers: "
            + "; ".join(check.problem for check in checks)
        )
    return checks


async def check_server(
    config: Config, *, server: Server | None = None, timeout: float = 10.0
) -> list[str]:
    """GET ``/health`` (SGLang) or ``/v1/models`` (OpenAI-compatible) of ``server``
    (default: the config's first) and, with ``[inference] model`` set, check the
    server serves it; a server without that route (404: a proxy, a router) is sent a
    one-token request instead. Returns the model names the server reported. Raises
    :class:`ServerUnreachableError` or :class:`WrongModelError` (both
    :class:`InferenceError`) with what to fix."""
    inference = config.inference
    server = server or config.servers[0]
    url = server.url
    key = api_key_of(server)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    client = HttpClient(2, Timeouts.of(inference, read=timeout), inference.max_reply_bytes)
    async with client:

        async def get(path: str) -> Reply:
            try:
                response = await client.request("GET", url + path, None, headers)
            except InferenceTransportError as exc:
                cause = exc.__cause__ or exc
                raise ServerUnreachableError(
                    f"cannot reach the inference server at {url} ({inference.api}): "
                    f"GET {path} failed ({type(cause).__name__}: {cause}). Is the server"
                    " running?"
                ) from exc
            if response.status in (401, 403):
                raise InferenceRequestError(
                    f"the inference server at {url} refused GET {path} with HTTP "
                    f"{response.status}: set the API key in ${server.api_key_env}"
                )
            return response

        served: list[str] = []
        traits = API_TRAITS[inference.api]
        health = await get(traits.health_route)
        if health.status == 404:
            await _one_token(config, client, url, key)
        elif health.status >= 400 and not traits.health_lists_models:
            raise ServerUnreachableError(
                f"the inference server at {url} is not healthy: GET {traits.health_route} "
                f"answered HTTP {health.status}: {health.text[:200]}"
            )
        elif health.status >= 400:
            raise ServerUnreachableError(
                f"the server at {url} does not answer GET {traits.health_route} (HTTP "
                f"{health.status}): is it an OpenAI-compatible server "
                f"(api = {inference.api!r})?"
            )
        elif traits.health_lists_models:
            served += _model_ids(health.content)
        if traits.model_info_route and inference.model:
            info = await get(traits.model_info_route)
            with_path = _json_or_none(info.content) if info.status < 400 else None
            if isinstance(with_path, dict) and isinstance(with_path.get("model_path"), str):
                served.append(with_path["model_path"])
            # --served-model-name shows only here; a failure here is not fatal
            models = await get("/v1/models")
            served += _model_ids(models.content) if models.status < 400 else []
        served = list(dict.fromkeys(served))
        if inference.model and served and not any(_same_model(inference.model, s) for s in served):
            raise WrongModelError(
                f"the inference server at {url} serves {', '.join(map(repr, served))}, "
                f"but [inference] model is {inference.model!r}"
            )
        return served


def _model_ids(content: bytes) -> list[str]:
    listing = _json_or_none(content)
    data = listing.get("data") if isinstance(listing, dict) else None
    return [m["id"] for m in data or () if isinstance(m, dict) and "id" in m]


async def _one_token(config: Config, client: HttpClient, url: str, key: str | None) -> None:
    """A server without a health route is asked for one token instead."""
    backend = make_backend(config.inference.api, client, url, config.inference.model, api_key=key)
    request = GenerationRequest(
        rid=f"tokenbudget-probe-{random.getrandbits(48):012x}",
        max_new_tokens=1,
        text="ping",
        messages=(ChatMessage(role="user", content="ping"),),
    )
    try:
        await backend.generate(request)
    except InferenceError as exc:
        raise ServerUnreachableError(
            f"the inference server at {url} has no health route and did not answer a "
            f"one-token request: {exc}"
        ) from exc


def _json_or_none(content: bytes) -> Any:
    try:
        return json.loads(content)
    except (ValueError, RecursionError):
        return None


# ---- a server nobody has configured yet (tokenbudget init) ----------------------------


@dataclass(frozen=True)
class ServerInfo:
    """What a server says of itself."""

    url: str
    # The API whose model-info route answered ("sglang": /get_model_info), else
    # "openai" (an OpenAI-compatible server: /v1/models only).
    kind: str
    model: str  # as the server names it ("" if it does not)
    tokenizer: str  # the tokenizer folder the server names ("" if none)


def probe_server(
    url: str, *, api_key: str | None = None, key_env: str = "", timeout: float = 10.0
) -> ServerInfo:
    """Which API ``url`` speaks, asked as a client would: SGLang answers
    ``GET /get_model_info`` (the model's and the tokenizer's paths), an
    OpenAI-compatible server (vLLM, llama.cpp, SGLang too) ``GET /v1/models`` (the
    model's id; vLLM's ``root`` is the folder it loaded). Raises
    :class:`ServerUnreachableError` when neither answers, and
    :class:`InferenceRequestError` when it wants a key (``key_env`` names its
    variable)."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout, headers=headers) as client:

        def get(path: str) -> httpx.Response:
            try:
                return client.get(url + path)
            except httpx.HTTPError as exc:
                raise ServerUnreachableError(
                    f"cannot reach the inference server at {url}: GET {path} failed"
                    f" ({type(exc).__name__}: {exc}). Is the server running?"
                ) from exc

        unanswered = []
        for api, traits in API_TRAITS.items():
            if not traits.model_info_route:
                continue
            info = get(traits.model_info_route)
            body = _json_or_none(info.content) if info.status_code < 400 else None
            if isinstance(body, dict) and isinstance(body.get("model_path"), str):
                tokenizer = body.get("tokenizer_path")
                return ServerInfo(
                    url, api, body["model_path"], tokenizer if isinstance(tokenizer, str) else ""
                )
            unanswered.append(f"GET {traits.model_info_route} ({api}: HTTP {info.status_code})")
        models = get("/v1/models")
        if models.status_code in (401, 403):
            raise InferenceRequestError(
                f"the inference server at {url} refused GET /v1/models with HTTP"
                f" {models.status_code}: set its API key in ${key_env}"
            )
        listing = _json_or_none(models.content) if models.status_code < 400 else None
        data = listing.get("data") if isinstance(listing, dict) else None
        if isinstance(data, list):
            first = next((m for m in data if isinstance(m, dict)), {})
            root = first.get("root")
            return ServerInfo(
                url, "openai", str(first.get("id") or ""), root if isinstance(root, str) else ""
            )
        raise ServerUnreachableError(
            f"the server at {url} answers neither {' nor '.join(unanswered)} nor GET"
            f" /v1/models (OpenAI-compatible: HTTP {models.status_code}); is it an"
            " inference server, and its URL the root?"
        )
