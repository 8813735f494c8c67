"""The backends' HTTP client against a real aiohttp server on a local port: bodies,
statuses, headers and streamed lines as sent, connections kept, failures translated."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tokenbudget.core.errors import (
    InferenceError,
    InferenceReplyTooLargeError,
    InferenceTimeLimitError,
    InferenceTransportError,
)
from tokenbudget.producers.inference.http import (
    ERROR_BODY_BYTES,
    HttpClient,
    Timeouts,
    lines_of,
    tls_context,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serving(handler: Handler, body: Callable[[str], Awaitable[Any]]) -> Any:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        return await body(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def serve(handler: Handler, body: Callable[[str], Awaitable[Any]]) -> Any:
    return asyncio.run(_serving(handler, body))


def test_a_json_body_goes_out_and_any_status_comes_back() -> None:
    seen: list[tuple[str, str, Any, str | None]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(
            (request.method, request.path, await request.json(), request.headers.get("X-Key"))
        )
        return web.json_response({"busy": True}, status=429, headers={"Retry-After": "7"})

    async def body(url: str) -> Any:
        async with HttpClient(2) as client:
            return await client.request("POST", url + "/generate", {"text": "é"}, {"X-Key": "k"})

    reply = serve(handler, body)
    assert seen == [("POST", "/generate", {"text": "é"}, "k")]
    assert reply.status == 429
    assert reply.headers["retry-after"] == "7"  # names are case-insensitive
    assert json.loads(reply.content) == {"busy": True}


def test_connections_are_kept_between_requests() -> None:
    peers: set[Any] = set()

    async def handler(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        return web.json_response({})

    async def body(url: str) -> None:
        async with HttpClient(2) as client:
            for _ in range(20):
                await client.request("GET", url + "/health")
            # a stream read to its end hands its connection back too
            for _ in range(5):
                async with client.stream("POST", url + "/s", {}) as streamed:
                    [line async for lines in streamed.lines() for line in lines]

    serve(handler, body)
    assert len(peers) == 1


def test_streamed_lines_of_megabytes_arrive_whole() -> None:
    long = "x" * 3_000_000
    events = [f"data: {long}", "", "data: [DONE]", ""]

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        payload = "\r\n".join(events).encode()
        for start in range(0, len(payload), 65_521):
            await response.write(payload[start : start + 65_521])
        await response.write_eof()
        return response

    async def body(url: str) -> list[bytes]:
        async with HttpClient(2) as client, client.stream("POST", url, {}) as streamed:
            assert streamed.status == 200
            return [line async for lines in streamed.lines() for line in lines]

    assert serve(handler, body) == [event.encode() for event in events[:-1]]


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 64])
def test_lines_of_a_body_cut_anywhere(cut: int) -> None:
    payload = b"data: a\r\n\r\ndata: \xc3\xa9\n\ndata: last"
    parts = [payload[i : i + cut] for i in range(0, len(payload), cut)]

    async def read() -> list[bytes]:
        return [line async for lines in lines_of(_chunks(parts)) for line in lines]

    assert asyncio.run(read()) == [b"data: a", b"", "data: é".encode(), b"", b"data: last"]


def test_lines_of_come_together_as_each_chunk_completes_them() -> None:
    parts = [b"data: a\n\ndata: b\n\nda", b"ta: c", b"\n\n", b"data: d"]

    async def read() -> list[list[bytes]]:
        return [lines async for lines in lines_of(_chunks(parts))]

    assert asyncio.run(read()) == [
        [b"data: a", b"", b"data: b", b""],
        [b"data: c", b""],
        [b"data: d"],
    ]


# --- replies a server may not send: too large, too slow -------------------------------

MB = 1_000_000
LIMIT = 1024 * 1024  # the client's max_reply_bytes in these tests


class Hostile:
    """A server that writes ``size`` bytes (``head`` first, then filler; None: for
    ever) after ``status`` and ``headers``, ``gap`` seconds between writes of ``piece``
    bytes, and keeps what happened: the bytes it wrote, and whether the client hung up
    before it was done (``cut``)."""

    def __init__(
        self,
        size: int | None,
        *,
        status: int = 200,
        head: bytes = b"",
        headers: dict[str, str] | None = None,
        piece: int = 65_536,
        gap: float = 0.0,
    ) -> None:
        self.size, self.status, self.head, self.headers = size, status, head, headers or {}
        self.piece, self.gap = piece, gap
        self.written = 0
        self.cut = False
        self.done = asyncio.Event()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=self.status, headers=self.headers)
        try:
            await response.prepare(request)
            pending = self.head
            while self.size is None or self.written < self.size:
                room = (
                    self.piece if self.size is None else min(self.piece, self.size - self.written)
                )
                chunk = pending[:room] or b"x" * room
                pending = pending[len(chunk) :]
                await response.write(chunk)
                self.written += len(chunk)
                if self.gap:
                    await asyncio.sleep(self.gap)
            await response.write_eof()
        except ConnectionError:
            self.cut = True
        finally:
            self.done.set()
        return response

    async def finished(self) -> None:
        await asyncio.wait_for(self.done.wait(), 10)


def _hostile(server: Hostile, read: Callable[[HttpClient, str], Awaitable[Any]]) -> Any:
    """What ``read`` gets from ``server`` with a client of :data:`LIMIT` bytes, once the
    server is done (cut or not): the reply, or the error raised."""

    async def body(url: str) -> Any:
        async with HttpClient(2, Timeouts(connect=1.0, read=5.0), LIMIT) as client:
            try:
                return await read(client, url)
            except InferenceError as exc:
                return exc
            finally:
                await server.finished()

    return serve(server, body)


async def _whole(client: HttpClient, url: str) -> Any:
    return await client.request("POST", url + "/generate", {})


async def _lines(client: HttpClient, url: str) -> Any:
    async with client.stream("POST", url + "/generate", {}, tokens=100) as streamed:
        return [line async for lines in streamed.lines() for line in lines]


@pytest.mark.parametrize(
    "headers", [{}, {"Content-Length": str(50 * MB)}], ids=["chunked", "content-length"]
)
def test_a_body_over_the_limit_is_refused_at_the_limit_and_not_read_further(
    headers: dict[str, str],
) -> None:
    """A 50 MB answer, sent with its length or without: refused naming the key and the
    size seen, and the server hears the client hang up long before it is through."""
    server = Hostile(50 * MB, headers=headers)
    error = _hostile(server, _whole)
    assert isinstance(error, InferenceReplyTooLargeError), error
    assert "max_reply_bytes = 1,048,576" in str(error) and "bytes" in str(error)
    assert server.cut and server.written < 50 * MB


def test_a_streamed_line_over_the_limit_is_refused_at_the_limit_and_not_read_further() -> None:
    """50 MB of one server-sent event that never ends its line."""
    server = Hostile(
        50 * MB, head=b'data: {"text": "', headers={"Content-Type": "text/event-stream"}
    )
    error = _hostile(server, _lines)
    assert isinstance(error, InferenceReplyTooLargeError), error
    assert "a streamed line over [inference] max_reply_bytes = 1,048,576" in str(error)
    assert server.cut and server.written < 50 * MB


def test_lines_of_refuses_a_line_over_the_limit_ended_or_not() -> None:
    async def read(parts: list[bytes]) -> list[bytes]:
        return [line async for lines in lines_of(_chunks(parts), 10) for line in lines]

    assert asyncio.run(read([b"0123456789\n", b"01234", b"5678\r\n", b"0123456789"])) == [
        b"0123456789", b"012345678", b"0123456789"
    ]  # fmt: skip
    for parts in ([b"012345", b"67890"], [b"01234567890\n"], [b"0\n01234567890"],
                  [b"01234", b"567890\n"]):  # fmt: skip
        with pytest.raises(InferenceReplyTooLargeError, match="a stream: a streamed line over"):
            asyncio.run(read(parts))


def test_the_default_limit_holds_a_350000_token_answer_as_sglang_streams_it() -> None:
    """The last cumulative chunk of an answer as long as a completion event holds (its
    whole text and ids): ids of six digits, and two CJK characters a token escaped as
    Python's json escapes them (12 bytes a token), well within the default."""
    tokens = 350_000
    chunk = {"text": "中文" * tokens, "output_ids": [151_935] * tokens,
             "meta_info": {"prompt_tokens": 100_000, "completion_tokens": tokens}}  # fmt: skip
    line = b"data: " + json.dumps(chunk).encode()
    parts = [line[i : i + 65_536] for i in range(0, len(line), 65_536)] + [b"\n\n"]

    async def read() -> list[bytes]:
        return [line async for lines in lines_of(_chunks(parts)) for line in lines]

    assert asyncio.run(read()) == [line, b""]
    assert len(line) > 6 * MB  # as long as it says


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_error_body_of_megabytes_is_read_only_for_its_message(stream: bool) -> None:
    """A 500 with 50 MB of body (a proxy's page, a dump): its first bytes are the
    reply, the rest is never read."""
    server = Hostile(50 * MB, status=500, head=b"oops: " + b"e" * 100_000)

    async def read(client: HttpClient, url: str) -> Any:
        if not stream:
            return await client.request("POST", url + "/generate", {})
        async with client.stream("POST", url + "/generate", {}) as streamed:
            return await streamed.read()

    reply = _hostile(server, read)
    content = reply if stream else reply.content
    assert content.startswith(b"oops: eee") and len(content) <= ERROR_BODY_BYTES
    assert server.cut and server.written < 50 * MB


TRICKLE = Timeouts(connect=0.5, read=1.0, min_tokens_per_s=10.0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_reply_that_trickles_for_ever_ends_at_its_time_limit(stream: bool) -> None:
    """A byte every 0.2 s, never silent for the read timeout: the request for 5 tokens
    at 10 tokens/s ends within its 2 s (0.5 + 1 + 5 / 10) as a timed-out attempt,
    retried like any timeout, naming the key."""
    server = Hostile(None, piece=1, gap=0.2, headers={"Content-Type": "text/event-stream"})

    async def read(client: HttpClient, url: str) -> Any:
        if not stream:
            return await client.request("POST", url + "/generate", {}, tokens=5)
        async with client.stream("POST", url + "/generate", {}, tokens=5) as streamed:
            return [line async for lines in streamed.lines() for line in lines]

    async def body(url: str) -> Any:
        async with HttpClient(2, TRICKLE) as client:
            try:
                return await read(client, url)
            except InferenceTransportError as exc:
                return exc
            finally:
                await server.finished()

    error = serve(server, body)
    assert isinstance(error, InferenceTimeLimitError), error
    assert "within 2 s: 5 tokens at [inference] min_tokens_per_s = 10" in str(error)
    assert error.retryable and error.server_away  # as any timeout
    assert server.cut  # the client hung up: the server was still trickling


def test_a_slow_steady_stream_within_its_time_limit_is_read_whole() -> None:
    """Slower in all than the connect and read timeouts together, but within its 20
    tokens at 10 tokens/s: an honest slow server is waited for."""

    def body(url: str) -> Awaitable[list[bytes]]:
        return _streamed_lines(url, TRICKLE, tokens=20)

    assert serve(_slow_stream([0.1] * 20), body) == [f"data: {n}".encode() for n in range(20)]


def test_a_time_limit_of_zero_tokens_per_second_is_none() -> None:
    assert Timeouts(connect=1.0, read=2.0, min_tokens_per_s=0.0).total(10**6) is None
    assert Timeouts(connect=1.0, read=2.0, min_tokens_per_s=4.0).total(10) == 5.5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_connection_is_a_transport_error_naming_the_request() -> None:
    url = f"http://127.0.0.1:{_closed_port()}/generate"

    async def go() -> None:
        async with HttpClient(2) as client:
            await client.request("POST", url, {})

    with pytest.raises(InferenceTransportError) as raised:
        asyncio.run(go())
    assert f"POST {url}" in str(raised.value)
    assert isinstance(raised.value.__cause__, aiohttp.ClientError)


def test_a_server_silent_past_the_read_timeout_is_a_transport_error() -> None:
    async def handler(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    async def body(url: str) -> None:
        async with HttpClient(2, Timeouts(connect=1.0, read=0.2)) as client:
            await client.request("GET", url + "/slow")

    with pytest.raises(InferenceTransportError, match="timed out"):
        serve(handler, body)


def _slow_stream(gaps: list[float]) -> Handler:
    """A stream that sends a line after each of ``gaps`` seconds, then ends."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            await response.write(f"data: {n}\n\n".encode())
        await response.write_eof()
        return response

    return handler


async def _streamed_lines(url: str, timeouts: Timeouts, tokens: int = 1000) -> list[bytes]:
    """The lines of a stream asked for ``tokens`` (by default its time limit is far off)."""
    got: list[bytes] = []
    async with (
        HttpClient(2, timeouts) as client,
        client.stream("POST", url, {}, tokens=tokens) as streamed,
    ):
        async for lines in streamed.lines():
            got.extend(line for line in lines if line)
    return got


def test_a_stream_silent_past_the_read_timeout_midway_is_a_transport_error() -> None:
    def body(url: str) -> Awaitable[list[bytes]]:
        return _streamed_lines(url, Timeouts(connect=1.0, read=0.3))

    with pytest.raises(InferenceTransportError, match="timed out"):
        serve(_slow_stream([0.0, 0.0, 5.0]), body)


def test_a_stream_whose_head_never_comes_is_a_transport_error() -> None:
    async def handler(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response()

    def body(url: str) -> Awaitable[list[bytes]]:
        return _streamed_lines(url, Timeouts(connect=1.0, read=0.3))

    with pytest.raises(InferenceTransportError, match="timed out"):
        serve(handler, body)


def test_a_stream_longer_than_the_read_timeout_is_read_whole_if_it_never_pauses_that_long() -> None:
    def body(url: str) -> Awaitable[list[bytes]]:
        return _streamed_lines(url, Timeouts(connect=1.0, read=0.5))

    assert serve(_slow_stream([0.1] * 15), body) == [f"data: {n}".encode() for n in range(15)]


def test_a_stream_broken_midway_is_a_transport_error() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": "1000"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        request.transport.close()  # type: ignore[union-attr]
        return response

    async def body(url: str) -> list[bytes]:
        got: list[bytes] = []
        async with HttpClient(2) as client, client.stream("POST", url, {}) as streamed:
            async for lines in streamed.lines():
                got.extend(lines)
        return got

    with pytest.raises(InferenceTransportError, match="stream broke"):
        serve(handler, body)


def test_a_closed_client_refuses_requests() -> None:
    async def go() -> None:
        client = HttpClient(2)
        await client.aclose()
        await client.request("GET", "http://127.0.0.1:1/")

    with pytest.raises(InferenceTransportError, match="closed"):
        asyncio.run(go())


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate for 127.0.0.1 it signed (openssl, where there is one)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found")
    ca_key, ca, key, csr, cert = (
        folder / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem")
    )
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for args in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "2", "-subj", "/CN=tokenbudget test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", ext],
    ):  # fmt: skip
        subprocess.run([openssl, *map(str, args)], check=True, capture_output=True)
    return ca, cert, key


def test_a_server_signed_by_a_private_ca_is_trusted_through_ssl_cert_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca, cert, key = _certificates(tmp_path)
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(cert, key)

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def get(site_ssl: ssl.SSLContext) -> Any:
        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=site_ssl)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with HttpClient(2) as client:
                return await client.request("GET", f"https://127.0.0.1:{port}/")
        finally:
            await runner.cleanup()

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    tls_context.cache_clear()
    with pytest.raises(InferenceTransportError, match="certificate"):
        asyncio.run(get(serving))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    tls_context.cache_clear()
    try:
        reply = asyncio.run(get(serving))
    finally:
        tls_context.cache_clear()
    assert reply.status == 200 and json.loads(reply.content) == {"ok": True}
