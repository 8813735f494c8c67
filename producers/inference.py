"""Clients for the inference server's wire formats, behind one small interface.

    InferenceBackend            generate / abort / health
    ├── SGLangBackend           POST /generate (text or input_ids), /abort_request
    ├── OpenAICompletionsBackend  POST /v1/completions
    └── OpenAIChatBackend       POST /v1/chat/completions

httpx errors, HTTP status codes and malformed bodies are translated here, and only
here, into the :class:`~tokenbudget.errors.InferenceError` tree; callers retry on
``error.retryable``.
"""

from __future__ import annotations

import asyncio
import json
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import httpx

from streams.events import ChatMessage, FinishReason
from tokenbudget.errors import (
    InferenceError,
    InferenceProtocolError,
    InferenceRequestError,
    InferenceServerError,
    InferenceTransportError,
)


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    read: float = 600.0

    def to_httpx(self) -> httpx.Timeout:
        return httpx.Timeout(self.read, connect=self.connect, pool=None)


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` more attempts after the first, exponential backoff with jitter."""

    retries: int = 3
    backoff: float = 0.5
    backoff_max: float = 10.0

    def delay(self, attempt: int) -> float:
        base = min(self.backoff_max, self.backoff * (2 ** (attempt - 1)))
        return base * (0.5 + random.random() / 2)


@dataclass(frozen=True)
class GenerationRequest:
    rid: str
    max_new_tokens: int
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    input_ids: tuple[int, ...] | None = None
    temperature: float | None = None


@dataclass(frozen=True)
class GenerationResult:
    rid: str
    prompt_tokens: int
    completion_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    first_token_at: float | None = None


def _as_finish(value: Any) -> FinishReason:
    kind = value.get("type") if isinstance(value, dict) else value
    if kind in ("stop", "length", "abort"):
        return kind  # type: ignore[no-any-return]
    if kind is None:
        return "stop"
    raise InferenceProtocolError(f"unknown finish_reason {value!r}")


class InferenceBackend(ABC):
    api: str

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str = "") -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.model = model

    @abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    async def abort(self, rid: str) -> None:  # noqa: B027 - optional capability
        """Ask the server to stop a request. Servers without an abort API close
        the connection instead, which is what cancelling the caller's task does."""

    async def health(self) -> None:
        await self._request("GET", "/health", None)

    async def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        url = self.base_url + path
        try:
            response = await self.client.request(method, url, json=body)
        except httpx.TimeoutException as exc:
            raise InferenceTransportError(f"{method} {url}: timed out ({exc!r})") from exc
        except httpx.TransportError as exc:
            raise InferenceTransportError(f"{method} {url}: {exc!r}") from exc
        if response.status_code >= 500:
            raise InferenceServerError(
                f"{method} {url}: HTTP {response.status_code}: {response.text[:200]}"
            )
        if response.status_code >= 400:
            raise InferenceRequestError(
                f"{method} {url}: HTTP {response.status_code}: {response.text[:200]}"
            )
        if not response.content:
            return None
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InferenceProtocolError(
                f"{method} {url}: body is not JSON: {response.text[:120]!r}"
            ) from exc


def _field(body: Any, *path: str | int) -> Any:
    node = body
    for part in path:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError) as exc:
            dotted = ".".join(str(p) for p in path)
            raise InferenceProtocolError(f"response lacks {dotted}: {str(body)[:200]}") from exc
    return node


class SGLangBackend(InferenceBackend):
    api = "sglang"

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        sampling: dict[str, Any] = {"max_new_tokens": request.max_new_tokens}
        if request.temperature is not None:
            sampling["temperature"] = request.temperature
        body: dict[str, Any] = {"rid": request.rid, "sampling_params": sampling, "stream": False}
        if request.input_ids is not None:
            body["input_ids"] = list(request.input_ids)
        elif request.text is not None:
            body["text"] = request.text
        else:
            # /generate takes plain text; a chat prompt without a local template is
            # sent as the concatenated turns.
            body["text"] = "\n".join(m.content for m in request.messages or ())
        data = await self._request("POST", "/generate", body)
        meta = _field(data, "meta_info")
        output_ids = data.get("output_ids") if isinstance(data, dict) else None
        if output_ids is None:
            output_ids = data.get("token_ids") if isinstance(data, dict) else None  # old builds
        if not isinstance(output_ids, list):
            raise InferenceProtocolError(
                "SGLang response has no output_ids: use a build that returns them"
            )
        completion_tokens = int(_field(meta, "completion_tokens"))
        return GenerationResult(
            rid=request.rid,
            prompt_tokens=int(_field(meta, "prompt_tokens")),
            completion_tokens=completion_tokens,
            output_ids=output_ids,
            text=str(data.get("text", "")),
            finish_reason=_as_finish(meta.get("finish_reason")),
        )

    async def abort(self, rid: str) -> None:
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": False})


class _OpenAIBackend(InferenceBackend):
    path: str

    async def health(self) -> None:
        await self._request("GET", "/v1/models", None)

    @abstractmethod
    def _body(self, request: GenerationRequest) -> dict[str, Any]: ...

    @abstractmethod
    def _text(self, choice: Any) -> str: ...

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        body = self._body(request)
        body.update(model=self.model, stream=False, return_token_ids=True)
        if request.temperature is not None:
            body["temperature"] = request.temperature
        data = await self._request("POST", self.path, body)
        choice = _field(data, "choices", 0)
        usage = _field(data, "usage")
        ids = choice.get("token_ids")
        return GenerationResult(
            rid=request.rid,
            prompt_tokens=int(_field(usage, "prompt_tokens")),
            completion_tokens=int(_field(usage, "completion_tokens")),
            output_ids=list(ids) if isinstance(ids, list) else [],
            text=self._text(choice),
            finish_reason=_as_finish(choice.get("finish_reason")),
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
        return str(choice.get("text", ""))


class OpenAIChatBackend(_OpenAIBackend):
    api = "openai-chat"
    path = "/v1/chat/completions"

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        messages = request.messages or (ChatMessage(role="user", content=request.text or ""),)
        return {
            "messages": [{"role": m.role, "content": m.content} for m in messages],
            "max_tokens": request.max_new_tokens,
            "request_id": request.rid,
        }

    def _text(self, choice: Any) -> str:
        message = choice.get("message") or {}
        return str(message.get("content") or "")


BACKENDS: dict[str, type[InferenceBackend]] = {
    "sglang": SGLangBackend,
    "openai-completions": OpenAICompletionsBackend,
    "openai-chat": OpenAIChatBackend,
}


def make_backend(
    api: str, client: httpx.AsyncClient, url: str, model: str = ""
) -> InferenceBackend:
    return BACKENDS[api](client, url, model)


async def generate_with_retries(
    backend: InferenceBackend,
    request: GenerationRequest,
    policy: RetryPolicy,
    *,
    on_error: Any = None,
) -> tuple[GenerationResult, int]:
    """Returns the result and the number of attempts it took; raises the last
    error once retries are spent or at once for errors that are not retryable."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return await backend.generate(request), attempt
        except InferenceError as exc:
            if on_error is not None:
                on_error(exc)
            if not exc.retryable or attempt > policy.retries:
                raise
            await asyncio.sleep(policy.delay(attempt))
