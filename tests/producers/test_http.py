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

from tokenbudget.core.errors import InferenceTransportError
from tokenbudget.producers.http import HttpClient, Timeouts, lines_of, tls_context

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


async def _streamed_lines(url: str, timeouts: Timeouts) -> list[bytes]:
    got: list[bytes] = []
    async with HttpClient(2, timeouts) as client, client.stream("POST", url, {}) as streamed:
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
