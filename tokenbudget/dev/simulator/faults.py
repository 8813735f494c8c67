"""The faults the simulator injects into generation requests (``_Faults``), an outage,
and the hostile answers some of them send (counts that lie, a body that never ends)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

import msgspec
from aiohttp import web

from tokenbudget.core.apis import API_TRAITS
from tokenbudget.dev.simulator.config import BAD_COUNTS, RequestRecord, SimulatorConfig
from tokenbudget.dev.simulator.log import _RequestLog
from tokenbudget.dev.simulator.request import _Parsed, _text_crc
from tokenbudget.dev.simulator.wire import _decode, _drop, _error, _json, _sse, _sse_response

# Longer than any client timeout: the client must give up, not the simulator.
_HANG_SECONDS = 3600.0


class _Faults:
    """Faults injected into generation requests: a share of them fails in each way
    (:class:`Faults`), drawn from one RNG per instance, once per request, so a fault
    schedule replays exactly for the same request order; and an outage
    (``POST /sim/outage``) during which every request, ``/health`` included, answers
    503. Each fault is recorded in the request log."""

    def __init__(self, config: SimulatorConfig, log: _RequestLog, stopping: asyncio.Event) -> None:
        self.config = config
        self.log = log
        self.stopping = stopping  # set at shutdown: a hanging request ends then
        self.fault_rng = random.Random(config.seed)
        self.outage_until = 0.0  # POST /sim/outage: every request answers 503 until then

    def out(self) -> bool:
        """Whether an outage is on now."""
        return time.time() < self.outage_until

    def draw(self, stream: bool) -> str | None:
        if self.out():
            return "outage"
        r = self.fault_rng.random()
        for kind, share in self.config.faults.shares().items():
            if r < share:
                # Only a stream can break off part way; a plain answer is reset whole.
                return "reset" if kind == "reset_mid_stream" and not stream else kind
            r -= share
        return None

    async def respond(
        self,
        kind: str,
        request: web.Request,
        api: str,
        parsed: _Parsed,
        received_at: float,
    ) -> web.StreamResponse:
        self.log.record(
            RequestRecord(
                rid=parsed.rid,
                api=api,
                received_at=received_at,
                finished_at=time.time(),
                prompt_tokens=parsed.prompt_tokens,
                max_new_tokens=parsed.max_new_tokens,
                completion_tokens=0,
                finish="fault",
                text_head=parsed.text[:80],
                text_crc=_text_crc(parsed),
                fault=kind,
                sampling=parsed.sampling,
                extra=parsed.extra,
                messages=parsed.messages,
                authorization_crc=parsed.authorization_crc,
            )
        )
        retry_after = {"Retry-After": f"{self.config.faults.retry_after_s:g}"}
        if kind == "busy":
            return _error(api, 429, "simulated: too many requests", headers=retry_after)
        if kind in ("unavailable", "outage"):
            return _error(api, 503, "simulated: service unavailable", headers=retry_after)
        if kind == "http_500":
            return _error(api, 500, "simulated internal server error")
        if kind == "timeout":
            # Waiting on the stop event (not a bare sleep) lets stop() end promptly.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), _HANG_SECONDS)
            _drop(request)
            return web.Response()
        if kind == "reset":
            _drop(request)
            # aiohttp swallows the ConnectionError from writing this to a dead transport.
            return web.Response()
        if kind == "bad_counts":
            count = self.fault_rng.choice(("prompt_tokens", "completion_tokens"))
            lie = {count: self.fault_rng.choice(BAD_COUNTS)}
            return await _lying(request, api, parsed, lie, self.config.model)
        if kind == "endless":
            return await _endless(request, parsed.stream)
        # malformed: a 200 whose body breaks off mid-JSON.
        if parsed.stream:
            resp = _sse_response()
            with contextlib.suppress(ConnectionError):
                await resp.prepare(request)
                await resp.write(b'data: {"text": " w1 w2", "meta_info": {"id": \n\n')
                await resp.write_eof()
            return resp
        return web.Response(
            body=b'{"text": " w1 w2 w3", "output_ids": [1, 2', content_type="application/json"
        )

    async def handle_outage(self, request: web.Request) -> web.Response:
        """``{"seconds": S}``: answer every request, /health included, with 503 for S
        seconds from now (0 ends an outage)."""
        try:
            seconds = float(_decode(await request.read() or b"{}").get("seconds", 0))
        except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
            return _error("sglang", 400, 'expected {"seconds": S}')
        self.outage_until = time.time() + max(0.0, seconds)
        return _json({"until": self.outage_until})


async def _lying(
    request: web.Request, api: str, parsed: _Parsed, lie: dict[str, Any], model: str
) -> web.StreamResponse:
    """An answer of one token, whole or streamed in the API's shape, whose counts are
    ``lie`` where it names them (else the true ones)."""
    counts = {"prompt_tokens": parsed.prompt_tokens, "completion_tokens": 1, **lie}
    if not API_TRAITS[api].openai_compatible:
        meta = {"id": parsed.rid, **counts, "finish_reason": {"type": "stop", "matched": None}}
        answer: dict[str, Any] = {"text": " w1", "output_ids": [1], "meta_info": meta}
        chunks = [answer]
    else:
        usage = {**counts, "total_tokens": 0}
        chat = API_TRAITS[api].chat
        whole = {"message": {"role": "assistant", "content": " w1"}} if chat else {"text": " w1"}
        part = {"delta": {"content": " w1"}} if chat else {"text": " w1"}
        ending = {"index": 0, "finish_reason": "stop", "token_ids": [1]}
        head = {"id": parsed.rid, "model": model}
        answer = {**head, "choices": [{**ending, **whole}], "usage": usage}
        chunks = [
            {**head, "choices": [{**ending, **part}]},
            {**head, "choices": [], "usage": usage},
        ]
    if not parsed.stream:
        return _json(answer)
    resp = _sse_response()
    with contextlib.suppress(ConnectionError):
        await resp.prepare(request)
        await resp.write(b"".join(map(_sse, chunks)) + b"data: [DONE]\n\n")
        await resp.write_eof()
    return resp


async def _endless(request: web.Request, stream: bool) -> web.StreamResponse:
    """A 200 whose body, or streamed first line, begins as an answer and never ends:
    written until the client hangs up (or the server stops)."""
    if stream:
        resp, head = _sse_response(), b'data: {"text": "'
    else:
        resp, head = web.StreamResponse(headers={"Content-Type": "application/json"}), b'{"text": "'
    filler = b" w1" * 21_845  # 64 KiB less a byte
    with contextlib.suppress(ConnectionError):
        await resp.prepare(request)
        await resp.write(head)
        while True:
            await resp.write(filler)
    return resp
