"""The simulator's wire helpers: JSON bodies, server-sent events, each API's error
shape, and dropping a connection."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from tokenbudget.core.apis import API_TRAITS

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def _drop(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        # abort(), not close(): no graceful flush, the client just sees the socket die.
        transport.abort()


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def _sse_response() -> web.StreamResponse:
    return web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
        },
    )


def _error(
    api: str, status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    if not API_TRAITS[api].openai_compatible:
        # SGLang's native endpoints answer errors as {"error": {"message": ...}}.
        response = _json({"error": {"message": message}}, status)
    else:
        kind = "BadRequestError" if status < 500 else "InternalServerError"
        body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
        response = _json(body, status)
    response.headers.update(headers or {})
    return response
