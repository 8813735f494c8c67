"""The HTTP client the inference backends speak through: one aiohttp session per server.

    client = HttpClient(concurrency=128, timeouts=Timeouts(connect=5, read=600))
    reply = await client.request("POST", url, {"text": "..."}, headers, tokens=N)  # -> Reply
    async with client.stream("POST", url, body, headers, tokens=N) as streamed:  # -> Streamed
        async for lines in streamed.lines(): ...                         # per read
    await client.aclose()

Why aiohttp and not httpx (which the one-off probes still use): a dispatcher carries
every completion of its fleet through this client, and per request httpx with httpcore
spent about four times aiohttp's CPU (``bench/fleet.py``'s cpu phase, bare loops on
the same servers), two thirds of a dispatcher's CPU per completion; httpcore's pool
also re-examines all its connections whenever a request starts or ends.

Contract:

* ``body`` is sent as JSON (``None``: no body); ``headers`` are added to the request.
* A reply of any status is returned: statuses are the caller's to judge.
* A connection that cannot be made, breaks, or stays silent past ``timeouts.read``
  (a stream's body: noticed within a quarter more, :class:`_Watch`) raises
  :class:`~tokenbudget.core.errors.InferenceTransportError` naming the method and the
  URL, the library's exception chained; no other aiohttp exception leaves here.
* A reply not read whole within :meth:`Timeouts.total` of ``tokens`` (the answer's
  ``max_new_tokens``; 0 for a request that asks for none) raises its subclass
  :class:`~tokenbudget.core.errors.InferenceTimeLimitError`: one timer per request,
  nothing per chunk.
* Sizes are bounded (:class:`~tokenbudget.core.errors.InferenceReplyTooLargeError`,
  the rest not read and the connection closed): a reply read whole and a streamed
  line to ``max_reply_bytes`` (a Content-Length over it is refused before reading);
  an error reply (status 400 and up) is read to :data:`ERROR_BODY_BYTES` only, the
  message its caller shows, and the rest is dropped unread.
* The session is made on first use, inside the running event loop, and holds up to
  ``2 * concurrency + 8`` connections: room for as many aborts beside the requests they
  stop (an abort must not queue behind them).
"""

from __future__ import annotations

import asyncio
import functools
import os
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import certifi
import msgspec

from tokenbudget.core import sizes
from tokenbudget.core.errors import (
    InferenceReplyTooLargeError,
    InferenceTimeLimitError,
    InferenceTransportError,
)

if TYPE_CHECKING:
    from tokenbudget.core.request_sections import InferenceConfig

_encode = msgspec.json.Encoder().encode
# What aiohttp raises for a connection that cannot be made, breaks or stays silent.
_FAILURES = (TimeoutError, aiohttp.ClientError)
#: what is read of an error reply: its message (callers show 200 characters of it)
ERROR_BODY_BYTES = 8192


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    read: float = 600.0  # the longest silence on a connection, not the whole answer's
    # The slowest answer waited for (0: no total limit): see total().
    min_tokens_per_s: float = 1.0

    @classmethod
    def of(cls, inference: InferenceConfig, read: float | None = None) -> Timeouts:
        """``[inference]``'s timeouts (``read``: another read timeout, a probe's)."""
        return cls(
            inference.connect_timeout_s,
            inference.read_timeout_s if read is None else read,
            inference.min_tokens_per_s,
        )

    def total(self, tokens: int) -> float | None:
        """The longest a request for ``tokens`` new tokens may take, until its reply is
        read whole (None: no limit): the connection, the read timeout (the server's own
        wait before it starts: a queue, the prefill) and the tokens at
        ``min_tokens_per_s``. A server answering slower than that, but never silent for
        the read timeout, would otherwise hold the request for ever."""
        if not self.min_tokens_per_s:
            return None
        return self.connect + self.read + tokens / self.min_tokens_per_s


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context of every HTTP client of the process, made once: each takes
    ~70 ms of CPU to make (loading the CA bundle), which a fleet of eight servers paid
    eight times at a dispatcher's start, and a server added at run time paid inside
    the dispatcher's event loop."""
    # As httpx made it before (the variables a private CA is given in), else certifi's.
    if os.environ.get("SSL_CERT_FILE"):
        return ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    if os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    return ssl.create_default_context(cafile=certifi.where())


def _proxied() -> bool:
    """A proxy is set in the environment (``HTTP_PROXY``, ``HTTPS_PROXY``, any case):
    then requests go through it, as httpx sent them, unless ``NO_PROXY`` names the
    server. Looked up per request only then: it costs CPU on every one."""
    return any(
        os.environ.get(name) for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
    )


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]  # case-insensitive names
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class Streamed:
    """A reply whose body is read as it comes: whole (:meth:`read`) or by lines, either
    to ``limit`` bytes (see the module's contract)."""

    def __init__(self, response: aiohttp.ClientResponse, where: str, limit: int) -> None:
        self._response = response
        self._where = where
        self._limit = limit
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers

    async def read(self) -> bytes:
        try:
            return await _read_whole(self._response, self._where, self._limit)
        except _FAILURES as exc:
            raise _transport_error(self._where, exc) from exc

    async def lines(self) -> AsyncIterator[list[bytes]]:
        """The lines each network read completes, together, as bytes (a read that completes
        none yields nothing): a streamed answer's chunks then cost its reader one step
        per read, not one per line of each of its layers."""
        chunks = self._response.content.iter_any()
        try:
            async for lines in lines_of(chunks, self._limit, self._where):
                yield lines
        except _FAILURES as exc:
            raise _transport_error(self._where, exc, "stream broke: ") from exc


async def lines_of(
    chunks: AsyncIterable[bytes], limit: int = sizes.REPLY_BYTES, where: str = "a stream"
) -> AsyncIterator[list[bytes]]:
    """The lines (``\n`` or ``\r\n`` ended, the last one maybe not) of a body that
    comes in ``chunks`` cut anywhere, of any length, as each chunk completes them, as
    bytes: a server that streams the whole answer so far in every event sends lines of
    megabytes, and each is decoded once, by its reader. A chunk is searched from its
    last newline back (``memrchr``, then ``memchr`` per line): ``bytes.split`` went
    through every byte of such lines and, with a decode to text, took a tenth of a
    dispatcher's CPU (``bench/fleet.py``'s cpu phase under ``py-spy``). A line over
    ``limit`` bytes, ended or not, raises
    :class:`~tokenbudget.core.errors.InferenceReplyTooLargeError` (``where``: the
    request) as soon as it is: what is held of a line never outgrows it by more than
    one chunk."""
    held: list[bytes] = []  # a line begun and not ended: joined once, when it ends
    held_bytes = 0
    async for chunk in chunks:
        end = chunk.rfind(b"\n")
        if end < 0:
            if chunk:
                held.append(chunk)
                held_bytes += len(chunk)
                if held_bytes > limit:
                    raise _too_large(where, "a streamed line", limit, held_bytes)
            continue
        if held:
            end += held_bytes
            held.append(chunk)
            chunk = b"".join(held)
            held = []
        held_bytes = len(chunk) - end - 1
        if held_bytes:
            held.append(chunk[end + 1 :])
            if held_bytes > limit:
                raise _too_large(where, "a streamed line", limit, held_bytes)
        yield _lines(chunk, end, limit, where)
    if held:
        last = b"".join(held)
        yield [last[:-1] if last.endswith(b"\r") else last]


def _lines(block: bytes, end: int, limit: int, where: str) -> list[bytes]:
    """The lines of ``block`` up to its newline at ``end``, without their ends."""
    lines = []
    start = 0
    while True:
        newline = block.find(b"\n", start, end + 1)
        if newline - start > limit:
            raise _too_large(where, "a streamed line", limit, newline - start, "in all")
        line = block[start:newline]
        lines.append(line[:-1] if line.endswith(b"\r") else line)
        if newline == end:
            return lines
        start = newline + 1


async def _read_whole(response: aiohttp.ClientResponse, where: str, limit: int) -> bytes:
    """The body of ``response``, read to its end within ``limit`` bytes; an error
    reply's only to :data:`ERROR_BODY_BYTES`, the rest dropped (the connection is
    closed, not kept with a body unread)."""
    if response.status >= 400:
        limit = min(limit, ERROR_BODY_BYTES)
    elif (response.content_length or 0) > limit:
        response.close()
        raise _too_large(
            where, "a reply", limit, response.content_length or 0, "by its Content-Length"
        )
    parts: list[bytes] = []
    size = 0
    while chunk := await response.content.readany():
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            response.close()
            if response.status >= 400:
                return b"".join(parts)[:limit]
            raise _too_large(where, "a reply", limit, size, "read")
    return b"".join(parts)


def _too_large(
    where: str, what: str, limit: int, size: int, seen: str = "held, no end of line yet"
) -> InferenceReplyTooLargeError:
    return InferenceReplyTooLargeError(
        f"{where}: {what} over [inference] max_reply_bytes = {limit:,} ({size:,} bytes "
        f"{seen}; the rest not read): raise the key if answers are that long"
    )


class _TimeLimit(aiohttp.ServerTimeoutError):
    """What :class:`_Watch` fails a stream with at its request's time limit."""


class _Watch:
    """Fails a streamed reply that receives nothing for ``seconds``, or is not over at
    ``deadline`` (the loop's time; None: never): its reader's next read raises
    :class:`aiohttp.ServerTimeoutError` (:class:`_TimeLimit` at the deadline). It
    looks at the bytes received four times a period instead of re-arming a timer on
    every network read as aiohttp's ``sock_read`` does, which was ~8% of a
    dispatcher's CPU samples with a thousand streams open (``py-spy`` on
    ``bench/fleet.py``'s cpu phase): one timer per stream, nothing per chunk. Silence
    is noticed between ``seconds`` and a quarter more, the deadline on time."""

    def __init__(
        self,
        content: aiohttp.StreamReader,
        seconds: float,
        deadline: float | None = None,
        why: str = "",
    ) -> None:
        self._content = content
        self._seconds = seconds
        self._deadline = deadline
        self._why = why  # what the deadline is, for its error
        self._loop = asyncio.get_running_loop()
        self._seen = content.total_bytes
        self._since = self._loop.time()
        self._handle = self._loop.call_at(self._next(self._since), self._look)

    def _next(self, now: float) -> float:
        wake = now + self._seconds / 4
        return wake if self._deadline is None else min(wake, self._deadline)

    def _look(self) -> None:
        now, seen = self._loop.time(), self._content.total_bytes
        if self._deadline is not None and now >= self._deadline:
            self._content.set_exception(_TimeLimit(self._why))
            return
        if seen != self._seen:
            self._seen, self._since = seen, now
        elif now - self._since >= self._seconds:
            self._content.set_exception(
                aiohttp.ServerTimeoutError(f"nothing received for {self._seconds:g} s")
            )
            return
        self._handle = self._loop.call_at(self._next(now), self._look)

    def cancel(self) -> None:
        self._handle.cancel()


def _time_limit(timeouts: Timeouts, tokens: int, total: float) -> str:
    return (
        f"not read whole within {total:g} s: {tokens} tokens at [inference] "
        f"min_tokens_per_s = {timeouts.min_tokens_per_s:g}, plus the connect and read "
        "timeouts (a server this slow can lower it, 0: no limit)"
    )


def _transport_error(where: str, exc: BaseException, what: str = "") -> InferenceTransportError:
    if isinstance(exc, _TimeLimit):
        return InferenceTimeLimitError(f"{where}: {exc}")
    if isinstance(exc, TimeoutError):
        return InferenceTransportError(f"{where}: timed out ({exc!r})")
    return InferenceTransportError(f"{where}: {what}{exc!r}")


class HttpClient:
    """Requests to one inference server (see the module's docstring)."""

    def __init__(
        self,
        concurrency: int = 64,
        timeouts: Timeouts | None = None,
        max_reply_bytes: int = sizes.REPLY_BYTES,
    ) -> None:
        self.limit = 2 * concurrency + 8
        self.timeouts = timeouts or Timeouts()
        self.max_reply_bytes = max_reply_bytes
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        connect, read = self.timeouts.connect, self.timeouts.read
        # A reply read whole: aiohttp times each silence. A stream: _Silence does, not a
        # timer re-armed per network read (see stream()).
        self._whole = aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=read)
        self._streamed = aiohttp.ClientTimeout(total=None, sock_connect=connect)

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise InferenceTransportError("the HTTP client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.limit, ssl=tls_context()),
                timeout=self._whole,
                # The servers' own words are what callers judge: no cookies kept (and
                # no redirects followed, in _send).
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=_proxied(),
            )
        return self._session

    def _send(
        self,
        method: str,
        url: str,
        body: Any,
        headers: Mapping[str, str] | None,
        *,
        stream: bool = False,
    ) -> Any:
        sent = dict(headers or {})
        data = None
        if body is not None:
            data = _encode(body)
            sent["Content-Type"] = "application/json"
        timeout = self._streamed if stream else self._whole
        return self._open().request(
            method, url, data=data, headers=sent, allow_redirects=False, timeout=timeout
        )

    async def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        *,
        tokens: int = 0,
    ) -> Reply:
        """The reply, read whole within its limits (see the module's contract):
        ``tokens`` is the answer's ``max_new_tokens``, for its time limit."""
        where = f"{method} {url}"
        total = self.timeouts.total(tokens)
        limit = asyncio.timeout(total)
        try:
            async with limit, self._send(method, url, body, headers) as response:
                content = await _read_whole(response, where, self.max_reply_bytes)
                return Reply(response.status, response.headers, content)
        except _FAILURES as exc:
            if limit.expired():
                assert total is not None
                why = _time_limit(self.timeouts, tokens, total)
                raise InferenceTimeLimitError(f"{where}: {why}") from exc
            raise _transport_error(where, exc) from exc

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        *,
        tokens: int = 0,
    ) -> AsyncIterator[Streamed]:
        """A streamed reply: the wait for its head is bounded by ``timeouts.read`` as a
        whole, the silences in its body and its whole time (``tokens``: the answer's
        ``max_new_tokens``) by :class:`_Watch`."""
        where = f"{method} {url}"
        read = self.timeouts.read
        total = self.timeouts.total(tokens)
        deadline = None if total is None else asyncio.get_running_loop().time() + total
        try:
            async with asyncio.timeout(read):
                response = await self._send(method, url, body, headers, stream=True).__aenter__()
        except _FAILURES as exc:
            raise _transport_error(where, exc) from exc
        why = "" if total is None else _time_limit(self.timeouts, tokens, total)
        watch = _Watch(response.content, read, deadline, why)
        try:
            yield Streamed(response, where, self.max_reply_bytes)
        finally:
            watch.cancel()
            if response.content.at_eof():
                response.release()  # read to its end: the connection serves the next
            else:
                # Cancelled, or the caller stopped early: the connection is closed,
                # which is how a server without an abort API hears that the answer is
                # no longer wanted.
                response.close()

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
