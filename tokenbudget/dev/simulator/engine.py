"""The generation engine every API of the simulator shares (``_Engine``): a parsed
request becomes a job decoding in a task of its own, rendered as it is sent and
recorded when it ends; and ``keyed``, a route behind the API key."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from tokenbudget.core.apis import API_TRAITS
from tokenbudget.dev.simulator.config import PROFILES, THINK_END, RequestRecord, SimulatorConfig
from tokenbudget.dev.simulator.faults import _Faults
from tokenbudget.dev.simulator.generation import _crc, _generate, _Output, ids_crc
from tokenbudget.dev.simulator.log import _RequestLog
from tokenbudget.dev.simulator.request import (
    _Answer,
    _BadRequest,
    _Counters,
    _is_int,
    _Job,
    _Parsed,
    _text_crc,
    first_tool,
    requested_settings,
    returned_prompt_ids,
    thinking_turned_off,
)
from tokenbudget.dev.simulator.wire import _decode, _drop, _encode, _error, _sse_response
from tokenbudget.producers.templates import load_tokenizer

if TYPE_CHECKING:
    from tokenbudget.producers.templates import LocalTokenizer


# A streamed chunk every ~32 tokens is what real servers look like on the wire; one chunk
# per token would make Python the bottleneck of the demo.
_CHUNK_TOKENS = 32
# Below ~1 ms asyncio timer overhead dominates, so faster decoding just gets bigger chunks.
_MIN_STREAM_SLICE = 0.001


class _Engine:
    """The generation core shared by every API: a parsed request becomes a job that
    decodes in a task of its own at ``tokens_per_second`` (outliving a client that
    hangs up, as SGLang's requests do), is rendered as it is sent, streamed or
    answered whole, and recorded in the request log when it ends; faults are drawn
    before a request is admitted."""

    def __init__(
        self,
        config: SimulatorConfig,
        log: _RequestLog,
        faults: _Faults,
        stopping: asyncio.Event,
    ) -> None:
        self.config = config
        self.rules = PROFILES[config.profile]
        self.tokenizer = _load_tokenizer(config.tokenizer) if config.tokenizer else None
        self.think_end = _think_end_id(config, self.tokenizer)
        self.log = log
        self.faults = faults
        self.stopping = stopping
        self.counters = _Counters()
        self.jobs: dict[str, _Job] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def admit(self, api: str, parsed: _Parsed, received_at: float) -> _Job:
        if parsed.rid in self.jobs:
            raise _BadRequest(f"Duplicate request ID: {parsed.rid}")
        thinks = self.think_end is not None and not thinking_turned_off(
            parsed.sampling, parsed.text
        )
        ids, natural_finish, think, natural = _generate(
            self.rules,
            self.config.seed,
            parsed.text,
            parsed.max_new_tokens,
            self.config.vocab_size,
            self.think_end if thinks else None,
        )
        job = _Job(
            rid=parsed.rid,
            api=api,
            received_at=received_at,
            prompt_tokens=parsed.prompt_tokens,
            max_new_tokens=parsed.max_new_tokens,
            output=_Output(ids, think),
            natural_finish=natural_finish,
            natural_tokens=natural,
            text_head=parsed.text[:80],
            prompt_crc=ids_crc(parsed.prompt_ids) if parsed.prompt_ids is not None else 0,
            returned_prompt_crc=(
                ids_crc(returned_prompt_ids(parsed, self.config.vocab_size))
                if parsed.return_token_ids
                else 0
            ),
            text_crc=_text_crc(parsed),
            sampling=parsed.sampling,
            extra=parsed.extra,
            tool=first_tool(parsed.extra) if self._calls_tool(api, parsed) else None,
            query=parsed.query or "",
            messages=parsed.messages,
            authorization_crc=parsed.authorization_crc,
        )
        self.jobs[job.rid] = job
        # A task of its own, not the handler's coroutine: decoding must outlive a client
        # that hangs up (SGLang semantics).
        task = asyncio.create_task(self._decode(job, parsed.stream), name=f"sim-{job.rid}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return job

    def _calls_tool(self, api: str, parsed: _Parsed) -> bool:
        return API_TRAITS[api].chat and self.config.tool_calls and parsed.query is not None

    async def _decode(self, job: _Job, stream: bool) -> None:
        loop = asyncio.get_running_loop()
        tps = self.config.tokens_per_second
        n = len(job.output.ids)
        start = loop.time()
        end = start + n / tps
        # Non-streaming requests sleep straight to the end: an abort wakes them early.
        slice_s = max(_CHUNK_TOKENS / tps, _MIN_STREAM_SLICE) if stream else math.inf
        try:
            while job.produced < n and not job.abort_requested:
                delay = min(end - loop.time(), slice_s)
                if delay > 0:
                    await self._sleep(job, delay)
                now = loop.time()
                # Float rounding may leave int(...) one short at the deadline.
                job.produced = n if now >= end else min(n, int((now - start) * tps))
                job.notify()
            aborted_early = job.abort_requested and job.produced < n
            job.finish = "abort" if aborted_early else job.natural_finish
        finally:
            if job.finish is None:
                job.finish = "abort"
            self._finish(job)

    async def _sleep(self, job: _Job, delay: float) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        job.wake = fut
        handle = loop.call_later(delay, _resolve, fut)
        try:
            await fut
        finally:
            handle.cancel()
            job.wake = None

    def _finish(self, job: _Job) -> None:
        self.jobs.pop(job.rid, None)
        c = self.counters
        c.requests += 1
        c.prompt_tokens += job.prompt_tokens
        c.generation_tokens += job.produced
        if job.finish == "abort":
            c.aborted += 1
        sent = self.sent(job)
        self.log.record(
            RequestRecord(
                rid=job.rid,
                api=job.api,
                received_at=job.received_at,
                finished_at=time.time(),
                prompt_tokens=job.prompt_tokens,
                max_new_tokens=job.max_new_tokens,
                completion_tokens=job.produced,
                finish=job.finish or "abort",
                text_head=job.text_head,
                output_crc=ids_crc(job.output.ids[: job.produced]),
                prompt_crc=job.prompt_crc,
                returned_prompt_crc=job.returned_prompt_crc,
                text_crc=job.text_crc,
                fault=job.fault,
                natural_tokens=job.natural_tokens,
                sampling=job.sampling,
                extra=job.extra,
                reasoning_tokens=sent.reasoning_tokens,
                reasoning_crc=_crc(sent.reasoning),
                content_crc=_crc(sent.content),
                tool_calls=len(sent.tool_calls),
                messages=job.messages,
                call_ids=[call["id"] for call in sent.tool_calls],
                authorization_crc=job.authorization_crc,
            )
        )
        job.done.set()
        job.notify()

    def sent(
        self, job: _Job, start: int = 0, end: int | None = None, *, final: bool = True
    ) -> _Answer:
        """What the answer holds of tokens ``start:end`` (all produced by default) as
        this server sends it: the one rendering both the responses and the log use.
        ``final``: the part that ends the answer (a tool call is sent there)."""
        end = job.produced if end is None else end
        output = job.output
        thinking = output.thinking_tokens(end) if self.think_end is not None else None
        reasoning: str | None = None
        content = output.text(start, end)
        if API_TRAITS[job.api].reasoning_fields and self.config.reasoning_style != "none":
            reasoning = output.reasoning(start, end) or None
            content = output.answer(start, end)
        if job.tool is None:
            return _Answer(reasoning, content, thinking, ())
        if final:
            call = {
                "id": f"call_{job.rid[:16]}",
                "type": "function",
                "function": {
                    "name": job.tool,
                    "arguments": _encode({"query": job.query}).decode(),
                },
            }
            return _Answer(reasoning, None, thinking, (call,))
        return _Answer(reasoning, "", thinking, ())  # the call comes at the end

    def abort(self, job: _Job) -> None:
        job.abort_requested = True
        if job.wake is not None:
            _resolve(job.wake)

    async def pump(
        self,
        job: _Job,
        emit: Callable[[int, int, str | None], Awaitable[bool]],
        until: int | None = None,
    ) -> None:
        """Call ``emit(sent, produced, finish)`` on progress until the job ends (or,
        with ``until``, once that many tokens were sent unfinished).

        ``emit`` returns False once the client is gone; the job keeps decoding anyway.
        """
        sent = 0
        while True:
            tick = job.tick
            produced, finish = job.produced, job.finish
            if until is not None and produced >= until and finish is None:
                produced = min(produced, until)
                await emit(sent, produced, None)
                return
            if produced > sent or finish is not None:
                if not await emit(sent, produced, finish):
                    return
                sent = produced
                if finish is not None:
                    return
            else:
                await tick.wait()

    async def run(
        self,
        request: web.Request,
        api: str,
        parse: Callable[[dict[str, Any], web.Request], _Parsed],
        respond: Callable[[web.Request, _Job, _Parsed, float], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        received_at = time.time()
        try:
            body = await request.read()
            try:
                payload = _decode(body)
            except msgspec.DecodeError as exc:
                raise _BadRequest(f"request body is not valid JSON: {exc}") from exc
            if not isinstance(payload, dict):
                raise _BadRequest("request body must be a JSON object")
            if not self.authorized(request):
                return _error(api, 401, "Unauthorized")
            parsed = parse(payload, request)
            parsed.sampling, parsed.extra = requested_settings(api, payload)
            parsed.authorization_crc = _crc(request.headers.get("Authorization"))
            fault = self.faults.draw(parsed.stream)
            if fault is not None and fault != "reset_mid_stream":
                return await self.faults.respond(fault, request, api, parsed, received_at)
            job = self.admit(api, parsed, received_at)
        except _BadRequest as exc:
            return _error(api, 400, str(exc))
        if fault == "reset_mid_stream":
            job.fault = fault
            job.cut_at = max(1, len(job.output.ids) // 2)
        return await respond(request, job, parsed, received_at)

    async def stream(
        self,
        request: web.Request,
        job: _Job,
        render: Callable[[int, int, str | None], list[bytes]],
        tail: list[bytes],
    ) -> web.StreamResponse:
        resp = _sse_response()
        try:
            await resp.prepare(request)
        except ConnectionError:
            return resp

        async def emit(sent: int, produced: int, finish: str | None) -> bool:
            chunks = render(sent, produced, finish)
            if finish is not None:
                chunks += tail
            try:
                await resp.write(b"".join(chunks))
            except ConnectionError:
                # Client hung up: stop writing, keep decoding (the job owns its own task).
                return False
            return True

        if job.cut_at is not None:
            await self.pump(job, emit, until=job.cut_at)
            _drop(request)  # the job decodes on: what it generates is lost to the client
            return resp
        await self.pump(job, emit)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    def prompt(self, text: Any, ids: Any) -> tuple[str, list[int] | None]:
        if ids is not None:
            if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
                raise _BadRequest("input_ids must be a non-empty list of integers")
            # The rules need text to match markers against: the ids decoded, when there
            # is a tokenizer to decode them and they decode to words; else the ids
            # themselves, which match no marker (the profile's default rule).
            decoded = self.tokenizer.decode(ids) if self.tokenizer is not None else ""
            return (decoded if decoded.strip() else " ".join(map(str, ids))), ids
        if not isinstance(text, str):
            raise _BadRequest("text must be a string")
        return text, None

    def authorized(self, request: web.Request) -> bool:
        key = self.config.api_key
        return key is None or request.headers.get("Authorization") == f"Bearer {key}"

    async def shutdown(self) -> None:
        self.stopping.set()
        for job in list(self.jobs.values()):
            self.abort(job)
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


def keyed(
    engine: _Engine, handler: Callable[[web.Request], Awaitable[web.Response]]
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``handler`` behind the API key, as generation is: the log holds what every
    request asked, an outage stops the server, an abort stops an answer."""

    async def checked(request: web.Request) -> web.Response:
        if not engine.authorized(request):
            return _error("sglang", 401, "Unauthorized")
        return await handler(request)

    return checked


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _think_end_id(config: SimulatorConfig, tokenizer: LocalTokenizer | None) -> int | None:
    """The id that ends a thinking simulator's thinking: the tokenizer's ``</think>``
    when it is one token of its vocabulary, else the last id of the vocabulary (no
    other answer id is ever it); None when the simulator does not think."""
    if config.reasoning_style == "none":
        return None
    if tokenizer is not None:
        ids = tokenizer.encode(THINK_END, special=False)
        if len(ids) == 1:
            return ids[0]
    return config.vocab_size - 1


def _load_tokenizer(path: str) -> LocalTokenizer:
    return load_tokenizer(path)
