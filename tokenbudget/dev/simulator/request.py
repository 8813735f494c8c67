"""A request as the simulator holds it: what it asked for once parsed (``_Parsed``: its
prompt, limits, sampling settings and other fields, a chat's messages as the log keeps
them), the job it became (``_Job``), what an answer carries (``_Answer``), and the
parsing helpers every API's routes share."""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field
from typing import Any

from tokenbudget.core.apis import API_TRAITS
from tokenbudget.core.sampling import SAMPLING_KEYS, VERBATIM_KEY
from tokenbudget.dev.simulator.config import THINK_END
from tokenbudget.dev.simulator.generation import (
    _crc,
    _Output,
    _prompt_ids_from_text,
    chat_prompt_text,
)


def _text_crc(parsed: _Parsed) -> int:
    if parsed.prompt_ids is not None:
        return 0
    return zlib.crc32(parsed.text.encode("utf-8", "surrogatepass"))


def returned_prompt_ids(parsed: _Parsed, vocab_size: int) -> list[int]:
    """The prompt ids an OpenAI API answers with (``prompt_token_ids``): those sent, or
    the text's."""
    if parsed.prompt_ids is not None:
        return parsed.prompt_ids
    return _prompt_ids_from_text(parsed.text, vocab_size)


class _BadRequest(Exception):
    pass


@dataclass(eq=False)
class _Job:
    rid: str
    api: str
    received_at: float
    prompt_tokens: int
    max_new_tokens: int
    output: _Output
    natural_finish: str
    natural_tokens: int
    text_head: str
    prompt_crc: int = 0
    returned_prompt_crc: int = 0
    text_crc: int = 0
    produced: int = 0
    finish: str | None = None
    abort_requested: bool = False
    tick: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    wake: asyncio.Future[None] | None = None
    fault: str = ""
    cut_at: int | None = None  # reset_mid_stream: the stream breaks after this many tokens
    sampling: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    tool: str | None = None  # the tool it answers with a call to
    query: str = ""  # the user's turn the call passes on
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat: as logged
    authorization_crc: int = 0

    def notify(self) -> None:
        # Swap in a fresh event before setting the old one so waiters never miss a tick
        # and never spin on an already-set event.
        old, self.tick = self.tick, asyncio.Event()
        old.set()


@dataclass
class _Parsed:
    rid: str
    text: str
    prompt_ids: list[int] | None
    prompt_tokens: int
    max_new_tokens: int
    stream: bool
    include_usage: bool = False
    return_token_ids: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat: message_digest
    # chat: the content of the user's turn that ends the request (None: it does not
    # end with one, e.g. it ends with a tool's result)
    query: str | None = None
    authorization_crc: int = 0  # RequestRecord.authorization_crc


@dataclass(frozen=True)
class _Answer:
    """What a response carries of an answer (or of a streamed part of it)."""

    reasoning: str | None  # the chat reasoning field's text (None: not sent)
    content: str | None  # chat content, or the raw APIs' text (None: a tool call instead)
    reasoning_tokens: int | None  # thinking tokens of the whole answer so far
    tool_calls: tuple[dict[str, Any], ...]


@dataclass
class _Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0
    aborted: int = 0


# The request fields each API defines beside the sampling settings.
_GENERATE_FIELDS = frozenset({"text", "input_ids", "sampling_params", "rid", "stream"})
_OPENAI_FIELDS = frozenset(
    {
        "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
        "stream_options", "return_token_ids", "request_id", "rid", "n", "user",
    }
)  # fmt: skip
# The OpenAI APIs take the settings at the top of the body, where extra_body's own
# keys go too: those are not settings.
_OPENAI_SAMPLING = frozenset(SAMPLING_KEYS) - {VERBATIM_KEY}


def requested_settings(api: str, payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sampling settings, other fields) of a request, as the request log keeps them."""
    if not API_TRAITS[api].openai_compatible:  # SGLang's own: settings in sampling_params
        params = payload.get("sampling_params") or {}
        sampling = {k: v for k, v in params.items() if k != "max_new_tokens"}
        return sampling, {k: v for k, v in payload.items() if k not in _GENERATE_FIELDS}
    sampling = {k: v for k, v in payload.items() if k in _OPENAI_SAMPLING}
    known = _OPENAI_FIELDS | _OPENAI_SAMPLING
    return sampling, {k: v for k, v in payload.items() if k not in known}


def thinking_turned_off(sampling: dict[str, Any], prompt: str) -> bool:
    """Whether a request asks for an answer without thinking: its template switches say
    so (Qwen3's enable_thinking, DeepSeek's and Kimi's thinking), or the prompt already
    closes the thinking block (a template applied with thinking off)."""
    switches = sampling.get("chat_template_kwargs") or {}
    if isinstance(switches, dict) and any(
        switches.get(name) is False for name in ("enable_thinking", "thinking")
    ):
        return True
    return prompt.rstrip().endswith(THINK_END)


def _message_text(message: dict[str, Any]) -> str:
    return chat_prompt_text([message])


def message_digest(message: dict[str, Any]) -> dict[str, Any]:
    """What the request log keeps of a chat message: its role, a crc32 of its
    content, and, when it has them, its calls' ids, the call a tool result answers,
    and whether it carried reasoning."""
    digest: dict[str, Any] = {"role": message.get("role"), "crc": _crc(_message_text(message))}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        digest["calls"] = [c.get("id") for c in calls if isinstance(c, dict)]
    if message.get("tool_call_id") is not None:
        digest["tool_call_id"] = message["tool_call_id"]
    if any(message.get(name) for name in ("reasoning_content", "reasoning")):
        digest["reasoning"] = True
    return digest


def first_tool(extra: dict[str, Any]) -> str | None:
    """The name of the first function a chat request offers in ``tools``."""
    tools = extra.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[0], dict):
        function = tools[0].get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_field(d: dict[str, Any], key: str, default: Any) -> Any:
    v = d.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise _BadRequest(f"{key} must be an integer")
    return v


def _count(text: str) -> int:
    return max(1, len(text.split()))
