"""The interface every inference backend implements: a request (:class:`GenerationRequest`)
in, a result (:class:`GenerationResult`) out, through :class:`InferenceBackend`'s
``generate`` / ``abort`` / ``health``; the plumbing they share (a JSON reply or a
stream of server-sent events read through :mod:`tokenbudget.producers.inference.http`,
HTTP statuses turned into the :class:`~tokenbudget.core.errors.InferenceError` tree,
counts from the server or the tokenizer), and the retry policy callers apply on
``error.retryable``.
"""

from __future__ import annotations

import json
import random
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenbudget.core.apis import API_TRAITS
from tokenbudget.core.errors import (
    InferenceProtocolError,
    InferenceRequestError,
    InferenceServerError,
    InferenceTransportError,
    InferenceUnavailableError,
)
from tokenbudget.producers.inference.http import HttpClient, Reply
from tokenbudget.producers.inference.replies import (
    AWAY_STATUSES,
    BUSY_STATUSES,
    parse_retry_after,
    stream_event,
)
from tokenbudget.streams.fields import ChatMessage, CountSource, FinishReason, ToolCall

if TYPE_CHECKING:
    from tokenbudget.producers.templates import LocalTokenizer


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
            yield [stream_event(url, data) for data in batch]

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
