"""An HTTP client that answers every request with one canned reply (or each with the
next: :class:`CannedTurns`), without a server: the backends' reading of malformed,
busy, hostile or streamed answers, byte for byte; :func:`answer_body` writes an answer
of each API with the counts a test chooses."""

from __future__ import annotations

import json as json_module
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from multidict import CIMultiDict

from tokenbudget.producers.inference.http import HttpClient, Reply, lines_of


class CannedStream:
    def __init__(self, reply: Reply, chunk: int) -> None:
        self.status = reply.status
        self.headers = reply.headers
        self._content = reply.content
        self._chunk = chunk

    async def read(self) -> bytes:
        return self._content

    async def _chunks(self) -> AsyncIterator[bytes]:
        for start in range(0, len(self._content), self._chunk):
            yield self._content[start : start + self._chunk]

    def lines(self) -> AsyncIterator[list[bytes]]:
        return lines_of(self._chunks())


class CannedClient(HttpClient):
    """Every request answered ``status`` with ``content`` (``json``: encoded) and
    ``headers``; a streamed body comes in chunks of ``chunk`` bytes, cut anywhere."""

    def __init__(
        self,
        status: int = 200,
        *,
        json: Any = None,
        content: bytes | str = b"",
        headers: Mapping[str, str] | None = None,
        chunk: int = 7,
    ) -> None:
        super().__init__()
        body = json_module.dumps(json).encode() if json is not None else content
        self.reply = Reply(
            status,
            CIMultiDict(headers or {}),
            body.encode() if isinstance(body, str) else body,
        )
        self.chunk = chunk
        self.sent: list[tuple[str, str, Any]] = []

    async def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        *,
        tokens: int = 0,
    ) -> Reply:
        self.sent.append((method, url, body))
        return self._reply(method)

    @asynccontextmanager
    async def stream(  # type: ignore[override]
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        *,
        tokens: int = 0,
    ) -> AsyncIterator[CannedStream]:
        self.sent.append((method, url, body))
        yield CannedStream(self._reply(method), self.chunk)

    def _reply(self, method: str) -> Reply:
        return self.reply


class CannedTurns(CannedClient):
    """Each POST answered 200 with the next of ``bodies`` (the last one for every POST
    after it), whole or streamed; any other request 404 (a server without
    /get_model_info)."""

    def __init__(self, bodies: list[bytes], chunk: int = 7) -> None:
        super().__init__(200, content=bodies[0], chunk=chunk)
        self.bodies = list(bodies)

    def _reply(self, method: str) -> Reply:
        if method != "POST":
            return Reply(404, CIMultiDict(), b"")
        body = self.bodies.pop(0) if len(self.bodies) > 1 else self.bodies[0]
        return Reply(200, CIMultiDict(), body)


# An answer of two tokens to a prompt of three, as answer_body writes it by default.
HONEST = {"prompt_tokens": 3, "completion_tokens": 2}


def answer_body(api: str, *, stream: bool, **counts: Any) -> bytes:
    """An answer of ``api`` (whole, or streamed as the server streams it: SGLang's
    chunks cumulative, OpenAI's deltas then a usage chunk) of the two tokens
    ``[7, 8]``, its counts :data:`HONEST` but for ``counts`` (``prompt_tokens``,
    ``completion_tokens``: in SGLang's ``meta_info``, OpenAI's ``usage``;
    ``reasoning_tokens``: in ``usage.completion_tokens_details``), as given (any JSON)."""
    thinking = counts.pop("reasoning_tokens", None)
    usage: dict[str, Any] = {**HONEST, **counts}
    if thinking is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": thinking}
    if api == "sglang":
        meta = {"id": "r", **usage, "finish_reason": {"type": "stop", "matched": None}}
        first = {"text": " a", "output_ids": [7], "meta_info": {**meta, "finish_reason": None}}
        last = {"text": " a b", "output_ids": [7, 8], "meta_info": meta}
        if not stream:
            return json_module.dumps(last).encode()
        return _events([first, last])
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "token_ids": [7, 8]}
    if api == "openai-chat":
        choice["message"] = {"role": "assistant", "content": " a b"}
    else:
        choice["text"] = " a b"
    if not stream:
        return json_module.dumps({"choices": [choice], "usage": usage}).encode()
    field = "delta" if api == "openai-chat" else "text"

    def part(text: str, ids: list[int], finish: str | None) -> dict[str, Any]:
        content: Any = {"content": text} if field == "delta" else text
        return {"index": 0, field: content, "token_ids": ids, "finish_reason": finish}

    return _events(
        [
            {"choices": [part(" a", [7], None)]},
            {"choices": [part(" b", [8], "stop")]},
            {"choices": [], "usage": usage},
        ]
    )


def _events(chunks: list[Any]) -> bytes:
    return (
        "".join(f"data: {json_module.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    ).encode()
