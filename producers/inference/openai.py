"""The OpenAI-compatible APIs: ``POST /v1/completions`` and ``POST /v1/chat/completions``.
Streamed, they send deltas; ``stream_options.include_usage`` makes them send the
usage in a final chunk.

Tool use (chat only): the messages' ``tool_calls`` and ``tool_call_id`` and the
request's ``tools`` are sent as OpenAI's chat API takes them; an answer that calls
functions (``message.tool_calls``, streamed as indexed parts of ``delta.tool_calls``,
``finish_reason`` ``tool_calls``) is the model ending its turn: it finishes as
``stop`` with the calls in ``tool_calls``.
"""

from __future__ import annotations

import json
import time
from abc import abstractmethod
from typing import Any

from tokenbudget.core.apis import API_TRAITS
from tokenbudget.core.errors import (
    InferenceProtocolError,
    InferenceTransportError,
)
from tokenbudget.core.sampling import VERBATIM_KEY
from tokenbudget.producers.inference.generation import (
    GenerationRequest,
    GenerationResult,
    InferenceBackend,
)
from tokenbudget.producers.inference.replies import (
    as_finish,
    calls_end,
    count_of,
    field_at,
    int_list,
    model_of,
    reasoning_of,
    reasoning_tokens_of,
    token_ids_of,
)
from tokenbudget.streams.fields import ChatMessage, ToolCall


class _OpenAIBackend(InferenceBackend):
    path: str

    @abstractmethod
    def _body(self, request: GenerationRequest) -> dict[str, Any]: ...

    @abstractmethod
    def _text(self, choice: Any) -> str: ...

    @abstractmethod
    def _delta(self, choice: Any) -> str: ...

    def _reasoning(self, choice: Any) -> str:
        """The reasoning of a whole answer's choice ("" when none): chat only."""
        return ""

    def _delta_reasoning(self, choice: Any) -> str:
        """The reasoning of a streamed choice's delta ("" when none): chat only."""
        return ""

    def _calls(self, choice: Any) -> tuple[ToolCall, ...] | None:
        """The functions a whole answer's choice calls (None: none): chat only."""
        return None

    def _delta_calls(self, choice: Any) -> list[Any]:
        """The parts of calls a streamed choice's delta carries: chat only."""
        return []

    def _full_body(self, request: GenerationRequest) -> dict[str, Any]:
        body = self._body(request)
        body.update(model=self.model, stream=self.stream, return_token_ids=True)
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for key, value in request.sampling.items():
            if key == "chat_template_kwargs" and not API_TRAITS[self.api].chat:
                continue  # only a chat route applies a template
            if key != VERBATIM_KEY:
                body[key] = value
        body.update(request.sampling.get(VERBATIM_KEY) or {})
        return body

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        body = self._full_body(request)
        if self.stream:
            return await self._generate_streaming(request, body)
        data = await self._request("POST", self.path, body, request.max_new_tokens)
        choice = field_at(data, "choices", 0)
        usage = data.get("usage")
        prompt_ids = int_list(choice.get("prompt_token_ids", data.get("prompt_token_ids")))
        return self._result(
            request,
            usage=usage,
            output_ids=int_list(choice.get("token_ids")),
            prompt_ids=prompt_ids,
            text=self._text(choice),
            finish=choice.get("finish_reason"),
            first_token_at=None,
            model=model_of(data),
            reasoning=self._reasoning(choice),
            tool_calls=self._calls(choice),
        )

    async def _generate_streaming(
        self, request: GenerationRequest, body: dict[str, Any]
    ) -> GenerationResult:
        parts: list[str] = []
        thoughts: list[str] = []
        ids: list[int] = []
        has_ids = False
        prompt_ids: list[int] | None = None
        usage: Any = None
        model = ""
        finish: Any = None
        finished = False
        content_chunks = 0
        first_token_at: float | None = None
        calls = _StreamedCalls()
        async for events in self._events(self.path, body, request.max_new_tokens):
            for chunk in events:
                if not isinstance(chunk, dict):
                    raise InferenceProtocolError(
                        f"stream chunk is not an object: {str(chunk)[:200]}"
                    )
                if chunk.get("usage"):  # llama.cpp: in the chunk that has finish_reason
                    usage = chunk["usage"]
                model = model or model_of(chunk)
                prompt_ids = int_list(chunk.get("prompt_token_ids")) or prompt_ids
                for choice in chunk.get("choices") or ():
                    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                        continue
                    prompt_ids = int_list(choice.get("prompt_token_ids")) or prompt_ids
                    delta = self._delta(choice)
                    thought = self._delta_reasoning(choice)
                    new_ids = int_list(choice.get("token_ids"))
                    call_parts = self._delta_calls(choice)
                    calls.add(call_parts)
                    if new_ids is not None:
                        has_ids = True
                        ids.extend(new_ids)
                    if delta or thought or new_ids or call_parts:
                        content_chunks += 1
                        parts.append(delta)
                        thoughts.append(thought)
                        if first_token_at is None:
                            first_token_at = time.time()
                    if choice.get("finish_reason") is not None:
                        finish, finished = choice["finish_reason"], True
            if has_ids:
                tokens = len(ids)
            elif isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                tokens = usage["completion_tokens"]  # continuous_usage_stats
            else:
                tokens = content_chunks  # about one token per chunk
            self._progress(request, tokens)
        if not finished:
            raise InferenceTransportError(
                f"POST {self.base_url}{self.path}: the stream ended before the request finished"
            )
        return self._result(
            request,
            usage=usage,
            output_ids=ids if has_ids else None,
            prompt_ids=prompt_ids,
            text="".join(parts),
            finish=finish,
            first_token_at=first_token_at,
            model=model,
            reasoning="".join(thoughts),
            tool_calls=calls.calls(),
        )

    def _result(
        self,
        request: GenerationRequest,
        *,
        usage: Any,
        output_ids: list[int] | None,
        prompt_ids: list[int] | None,
        text: str,
        finish: Any,
        first_token_at: float | None,
        model: str,
        reasoning: str,
        tool_calls: tuple[ToolCall, ...] | None = None,
    ) -> GenerationResult:
        """The answer, counted. ``reasoning`` "" means the server sent none."""
        prompt_tokens = completion_tokens = None
        where = self.base_url + self.path
        output_ids = token_ids_of(output_ids, "token_ids", where)
        prompt_ids = token_ids_of(prompt_ids, "prompt_token_ids", where)
        if usage:  # present: it must be whole
            prompt_tokens = count_of(field_at(usage, "prompt_tokens"), "usage.prompt_tokens", where)
            completion_tokens = count_of(
                field_at(usage, "completion_tokens"), "usage.completion_tokens", where
            )
        prompt, completion, source = self._counts(
            request,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            text=text,
        )
        return GenerationResult(
            rid=request.rid,
            prompt_tokens=prompt,
            completion_tokens=completion,
            output_ids=output_ids,
            text=text,
            finish_reason=as_finish(calls_end(finish)),
            first_token_at=first_token_at,
            count_source="usage" if source == "server" and output_ids is None else source,
            model=model,
            prompt_ids=prompt_ids,
            reasoning=reasoning or None,
            reasoning_tokens=reasoning_tokens_of(usage, completion, where) if usage else None,
            tool_calls=tool_calls,
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
        return str(choice.get("text") or "")

    def _delta(self, choice: Any) -> str:
        return str(choice.get("text") or "")


class OpenAIChatBackend(_OpenAIBackend):
    api = "openai-chat"
    path = "/v1/chat/completions"

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        messages = request.messages or (ChatMessage(role="user", content=request.text or ""),)
        body: dict[str, Any] = {
            "messages": [chat_message(m) for m in messages],
            "max_tokens": request.max_new_tokens,
            "request_id": request.rid,
        }
        if request.tools is not None:
            body["tools"] = request.tools
        return body

    def _sent_prompt(
        self, request: GenerationRequest
    ) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
        return None, request.messages or (ChatMessage(role="user", content=request.text or ""),)

    def _text(self, choice: Any) -> str:
        message = choice.get("message") or {}
        return str(message.get("content") or "")

    def _delta(self, choice: Any) -> str:
        delta = choice.get("delta") or {}
        return str(delta.get("content") or "") if isinstance(delta, dict) else ""

    def _reasoning(self, choice: Any) -> str:
        return reasoning_of(choice.get("message"), API_TRAITS[self.api].reasoning_fields)

    def _delta_reasoning(self, choice: Any) -> str:
        return reasoning_of(choice.get("delta"), API_TRAITS[self.api].reasoning_fields)

    def _calls(self, choice: Any) -> tuple[ToolCall, ...] | None:
        message = choice.get("message")
        value = message.get("tool_calls") if isinstance(message, dict) else None
        if not value:
            return None
        calls = _StreamedCalls()
        calls.add([{"index": i, **call} for i, call in enumerate(value) if isinstance(call, dict)])
        return calls.calls()

    def _delta_calls(self, choice: Any) -> list[Any]:
        delta = choice.get("delta")
        value = delta.get("tool_calls") if isinstance(delta, dict) else None
        return value if isinstance(value, list) else []


def chat_message(message: ChatMessage) -> dict[str, Any]:
    """A chat turn as OpenAI's chat API takes it: a turn that only calls functions
    has null content, and tool fields appear only on the turns that have them."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
        out["content"] = message.content or None
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


class _StreamedCalls:
    """Function calls assembled from their parts: a streamed ``delta.tool_calls``
    entry names its call by ``index``; its id and name come once, its arguments in
    pieces to join (a whole answer's calls are one part each)."""

    def __init__(self) -> None:
        self._parts: dict[int, dict[str, str]] = {}

    def add(self, parts: list[Any]) -> None:
        for part in parts:
            if not isinstance(part, dict):
                raise InferenceProtocolError(f"a tool call is not an object: {str(part)[:200]}")
            index = part.get("index", len(self._parts))
            call = self._parts.setdefault(index, {"id": "", "name": "", "arguments": ""})
            function = part.get("function") or {}
            if isinstance(part.get("id"), str) and part["id"]:
                call["id"] = part["id"]
            if isinstance(function.get("name"), str) and function["name"]:
                call["name"] = function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call["arguments"] += arguments
            elif arguments is not None:  # some servers send the object itself
                call["arguments"] += json.dumps(arguments)

    def calls(self) -> tuple[ToolCall, ...] | None:
        if not self._parts:
            return None
        out = []
        for index in sorted(self._parts):
            part = self._parts[index]
            if not part["name"]:
                raise InferenceProtocolError(f"tool call {index} came without a function name")
            out.append(ToolCall(id=part["id"] or f"call_{index}", name=part["name"],
                                arguments=part["arguments"]))  # fmt: skip
        return tuple(out)
