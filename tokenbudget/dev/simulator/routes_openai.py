"""The OpenAI-compatible API of vLLM and SGLang on the simulator (``_OpenAIRoutes``):
``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from tokenbudget.core.apis import API_TRAITS, openai_api
from tokenbudget.dev.simulator.engine import _Engine
from tokenbudget.dev.simulator.faults import _Faults
from tokenbudget.dev.simulator.generation import chat_prompt_text
from tokenbudget.dev.simulator.request import (
    _Answer,
    _BadRequest,
    _count,
    _int_field,
    _is_int,
    _Job,
    _message_text,
    _Parsed,
    message_digest,
    returned_prompt_ids,
)
from tokenbudget.dev.simulator.wire import _error, _json, _sse

# vLLM's /v1/completions default.
_OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Chat requests without max_tokens may use the rest of the context window, as in vLLM.
_MAX_MODEL_LEN = 32768


class _OpenAIRoutes:
    """The OpenAI-compatible API of vLLM and SGLang: ``/v1/models``,
    ``/v1/completions`` and ``/v1/chat/completions`` (a thinking model's reasoning
    field and tool calls included)."""

    def __init__(self, engine: _Engine, faults: _Faults) -> None:
        self.engine = engine
        self.config = engine.config

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.handle_models),
            web.post("/v1/completions", self.handle_completions),
            web.post("/v1/chat/completions", self.handle_chat),
        ]

    async def handle_models(self, request: web.Request) -> web.Response:
        if not self.engine.authorized(request):
            return _error(openai_api(chat=False), 401, "Unauthorized")  # any OpenAI API's
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "tokenbudget",
                    }
                ],
            }
        )

    def _parse_common(
        self, p: dict[str, Any], request: web.Request
    ) -> tuple[str, bool, bool, bool]:
        rid = p.get("request_id") or p.get("rid") or request.headers.get("X-Request-Id")
        if rid is not None and not isinstance(rid, str):
            raise _BadRequest("request_id must be a string")
        n = p.get("n")
        if n not in (None, 1):
            raise _BadRequest("n > 1 is not supported by the simulator")
        opts = p.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise _BadRequest("stream_options must be an object")
        stream = bool(p.get("stream", False))
        return (
            rid or uuid.uuid4().hex,
            stream,
            stream and bool(opts.get("include_usage", False)) and not self.config.omit_usage,
            bool(p.get("return_token_ids", False)) and not self.config.omit_token_ids,
        )

    def _parse_completions(self, p: dict[str, Any], request: web.Request) -> _Parsed:
        rid, stream, include_usage, return_ids = self._parse_common(p, request)
        prompt = p.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            text, ids = self.engine.prompt(prompt, None)
        elif isinstance(prompt, list) and prompt and all(_is_int(i) for i in prompt):
            text, ids = self.engine.prompt(None, prompt)
        elif prompt is None:
            raise _BadRequest("prompt is required")
        else:
            raise _BadRequest("prompt must be a string or a list of token ids (no batches)")
        max_tokens = _int_field(p, "max_tokens", _OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS)
        if max_tokens < 0:
            raise _BadRequest(f"max_tokens must be at least 0, got {max_tokens}.")
        prompt_tokens = len(ids) if ids is not None else _count(text)
        return _Parsed(rid, text, ids, prompt_tokens, max_tokens, stream, include_usage, return_ids)

    def _parse_chat(self, p: dict[str, Any], request: web.Request) -> _Parsed:
        rid, stream, include_usage, return_ids = self._parse_common(p, request)
        messages = p.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("messages must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise _BadRequest("each message must be an object")
        text = chat_prompt_text(messages)
        prompt_tokens = _count(text)
        # vLLM: max_completion_tokens wins over the deprecated max_tokens.
        default = max(0, _MAX_MODEL_LEN - prompt_tokens)
        max_tokens = _int_field(p, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = _int_field(p, "max_tokens", default)
        if max_tokens < 0:
            raise _BadRequest(f"max_tokens must be at least 0, got {max_tokens}.")
        last = messages[-1]
        return _Parsed(
            rid, text, None, prompt_tokens, max_tokens, stream, include_usage, return_ids,
            messages=[message_digest(m) for m in messages],
            query=_message_text(last) if last.get("role") == "user" else None,
        )  # fmt: skip

    def _prompt_ids(self, parsed: _Parsed) -> list[int]:
        return returned_prompt_ids(parsed, self.config.vocab_size)

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.run(
            request, "openai-completions", self._parse_completions, self._respond_completions
        )

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.run(request, "openai-chat", self._parse_chat, self._respond_chat)

    async def _respond_completions(
        self, request: web.Request, job: _Job, parsed: _Parsed, received_at: float
    ) -> web.StreamResponse:
        head = {
            "id": f"cmpl-{job.rid}",
            "object": "text_completion",
            "created": int(received_at),
            "model": self.config.model,
        }
        if not parsed.stream:
            await job.done.wait()
            choice: dict[str, Any] = {
                "index": 0,
                "text": job.output.text(0, job.produced),
                "logprobs": None,
                "finish_reason": job.finish,
            }
            out = {**head, "choices": [choice], "usage": self._usage(job)}
            if parsed.return_token_ids:
                choice["token_ids"] = job.output.ids[: job.produced]
                out["prompt_token_ids"] = self._prompt_ids(parsed)
            return _json(out)

        def render(sent: int, produced: int, finish: str | None) -> list[bytes]:
            choice: dict[str, Any] = {
                "index": 0,
                "text": job.output.text(sent, produced),
                "logprobs": None,
                "finish_reason": finish,
            }
            if parsed.return_token_ids:
                choice["token_ids"] = job.output.ids[sent:produced]
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if parsed.include_usage:
                chunk["usage"] = None
            if parsed.return_token_ids and sent == 0:
                chunk["prompt_token_ids"] = self._prompt_ids(parsed)
            out = [_sse(chunk)]
            if finish is not None and parsed.include_usage:
                out.append(_sse({**head, "choices": [], "usage": _usage(job)}))
            return out

        return await self.engine.stream(request, job, render, [b"data: [DONE]\n\n"])

    async def _respond_chat(
        self, request: web.Request, job: _Job, parsed: _Parsed, received_at: float
    ) -> web.StreamResponse:
        rid = f"chatcmpl-{job.rid}"
        created = int(received_at)
        model = self.config.model
        if not parsed.stream:
            await job.done.wait()
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", **self._chat_fields(self.engine.sent(job))},
                "logprobs": None,
                "finish_reason": _chat_finish(job, job.finish),
            }
            out: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": self._usage(job),
            }
            if parsed.return_token_ids:
                choice["token_ids"] = job.output.ids[: job.produced]
                out["prompt_token_ids"] = self._prompt_ids(parsed)
            return _json(out)

        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            c: dict[str, Any] = {**head, "choices": [choice]}
            if parsed.include_usage:
                c["usage"] = None
            return c

        def render(sent: int, produced: int, finish: str | None) -> list[bytes]:
            out: list[bytes] = []
            if sent == 0:
                first = chunk(
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
                if parsed.return_token_ids:
                    first["prompt_token_ids"] = self._prompt_ids(parsed)
                out.append(_sse(first))
            part = self.engine.sent(job, sent, produced, final=finish is not None)
            choice: dict[str, Any] = {
                "index": 0,
                "delta": self._chat_fields(part, delta=True),
                "logprobs": None,
                "finish_reason": _chat_finish(job, finish),
            }
            if parsed.return_token_ids:
                choice["token_ids"] = job.output.ids[sent:produced]
            out.append(_sse(chunk(choice)))
            if finish is not None and parsed.include_usage:
                out.append(_sse({**head, "choices": [], "usage": self._usage(job, always=True)}))
            return out

        return await self.engine.stream(request, job, render, [b"data: [DONE]\n\n"])

    def _chat_fields(self, answer: _Answer, *, delta: bool = False) -> dict[str, Any]:
        """A chat message's (or delta's) fields for ``answer``. A message has content
        (null when a thinking model said nothing after its thinking, or called a tool)
        and, on a thinking server, its reasoning field (null when it did not think); a
        delta carries only what it has, as servers stream."""
        fields: dict[str, Any] = {}
        if answer.tool_calls:
            if not delta:
                fields["content"] = None
            calls = list(answer.tool_calls)
            if delta:  # streamed calls say which one each part belongs to
                calls = [{"index": i, **call} for i, call in enumerate(calls)]
            fields["tool_calls"] = calls
        elif delta:
            if answer.content or not answer.reasoning:
                fields["content"] = answer.content or ""
        else:
            silent = not answer.content and answer.reasoning_tokens is not None
            fields["content"] = None if silent else answer.content
        style = self.config.reasoning_style
        if style != "none" and (answer.reasoning or not delta):
            fields[style] = answer.reasoning
        return fields

    def _usage(self, job: _Job, *, always: bool = False) -> dict[str, Any] | None:
        """The usage of an answer (None with ``omit_usage``, unless ``always``: the
        stream asked for it, which ``omit_usage`` already refused); a thinking chat
        answer's says how many of its tokens were thinking."""
        if self.config.omit_usage and not always:
            return None
        usage: dict[str, Any] = _usage(job)
        if API_TRAITS[job.api].reasoning_fields and self.engine.think_end is not None:
            thinking = job.output.thinking_tokens(job.produced)
            usage["completion_tokens_details"] = {"reasoning_tokens": thinking}
        return usage


def _usage(job: _Job) -> dict[str, int]:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.produced,
        "total_tokens": job.prompt_tokens + job.produced,
    }


def _chat_finish(job: _Job, finish: str | None) -> str | None:
    """A chat answer's finish_reason: a tool call that ran to its end says so."""
    return "tool_calls" if job.tool is not None and finish == "stop" else finish
