"""An HTTP client that answers every request with one canned reply, without a server:
the backends' reading of malformed, busy or streamed answers, byte for byte."""

from __future__ import annotations

import json as json_module
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from multidict import CIMultiDict

from tokenbudget.producers.http import HttpClient, Reply, lines_of


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
        self, method: str, url: str, body: Any = None, headers: Mapping[str, str] | None = None
    ) -> Reply:
        self.sent.append((method, url, body))
        return self.reply

    @asynccontextmanager
    async def stream(  # type: ignore[override]
        self, method: str, url: str, body: Any = None, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[CannedStream]:
        self.sent.append((method, url, body))
        yield CannedStream(self.reply, self.chunk)
