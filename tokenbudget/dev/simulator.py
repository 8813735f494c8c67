"""A simulated SGLang / vLLM inference server for machines without GPUs.

It speaks the real wire formats (SGLang native ``/generate`` + ``/abort_request`` and the
OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` of both servers), so
the client code runs unchanged against a real server.  Completion lengths come from a
per-profile lognormal distribution chosen by a marker in the prompt text, and are a pure
function of ``(seed, prompt text)`` so a rerun reproduces the same token counts.

Behaviour worth knowing when reading client code against it:

* Decoding takes ``tokens / tokens_per_second`` of wall time per request, independent of
  how many requests run at once (a real server batches, so per-request speed is what the
  client experiences).
* A client that disconnects does NOT stop the request: like SGLang, the simulator keeps
  decoding to the natural end and logs the full ``completion_tokens``.  Only
  ``/abort_request`` stops a request early.
* A rid that is still decoding cannot be reused (SGLang rejects duplicate request ids
  with 400), which matters for clients that retry with the same rid after a timeout.
* With ``reasoning_style`` other than ``none`` it is a thinking model: each answer
  thinks first (a share of its length drawn from the prompt), closed by one token
  that renders as ``</think>``, then answers. Chat answers send the thinking in
  ``message.reasoning_content`` (SGLang's ``--reasoning-parser``) or
  ``message.reasoning`` (vLLM), streamed in the same fields of ``delta``, and count
  it in ``usage.completion_tokens_details.reasoning_tokens``; raw APIs send it inline.
  ``chat_template_kwargs`` turning thinking off, or a prompt ending in ``</think>``
  (a template that closed the block), make it answer straight away.
* With ``tool_calls``, a chat request that offers ``tools`` and ends with a user's
  turn is answered by a call to the first one (``finish_reason`` ``tool_calls``),
  with the arguments ``{"query": <that user turn's content>}``; one that ends with a
  tool's result is answered in text, as a model reads the result and answers.
* Its request log (``log_file``) says, for a chat request, what each message held
  (role, a crc32 of its content, its tool calls' ids, a tool result's call id,
  whether it carried reasoning), and the ids of the calls it answered with: enough
  to tell, from outside, which history each turn of a conversation was sent.

The server is a few parts composed by ``_SimServer``: the generation engine every API
shares (``_Engine``), the routes of each API (``ROUTES``: ``_SGLangRoutes``,
``_OpenAIRoutes``; what sets the APIs apart is their traits, ``tokenbudget.core.apis``),
the injected faults (``_Faults``) and the request log (``_RequestLog``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import random
import signal
import sys
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from aiohttp import web

from tokenbudget.core import tasks
from tokenbudget.core.apis import API_TRAITS, openai_api
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.sampling import SAMPLING_KEYS, VERBATIM_KEY
from tokenbudget.producers.templates import load_tokenizer

if TYPE_CHECKING:
    from tokenbudget.producers.templates import LocalTokenizer

__all__ = [
    "PROFILES",
    "Faults",
    "LengthRule",
    "RequestRecord",
    "RunningSimulator",
    "SimulatorConfig",
    "chat_prompt_text",
    "completion_length",
    "serve",
    "start",
]

# What the simulator's thinking model names its thinking in a chat answer; "none": it
# does not think.
REASONING_STYLES = ("none", "reasoning_content", "reasoning")
# How the token that ends the thinking renders in raw text.
THINK_END = "</think>"

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LengthRule:
    """Completion length distribution used when ``marker`` occurs in the prompt text."""

    marker: str
    mean: float
    sigma: float = 0.5


@dataclass(frozen=True)
class Faults:
    """Shares of requests (0..1) that fail in each way.

    ``busy`` answers 429 and ``unavailable`` 503, both with ``Retry-After``
    (``retry_after_s``), as an overloaded or restarting server does; ``reset_mid_stream``
    sends part of a streamed answer, then drops the connection (the request decodes on,
    its tokens are wasted, as when a proxy between client and server restarts).
    ``bad_counts`` answers a token whose count (prompt or completion, drawn) is one
    of :data:`BAD_COUNTS`, as a buggy or hostile server might; ``endless`` sends a
    200 whose body (streamed: its first line) never ends, until the client hangs up.
    """

    http_500: float = 0.0
    timeout: float = 0.0
    reset: float = 0.0
    malformed: float = 0.0
    busy: float = 0.0
    unavailable: float = 0.0
    reset_mid_stream: float = 0.0
    bad_counts: float = 0.0
    endless: float = 0.0
    retry_after_s: float = 1.0

    def shares(self) -> dict[str, float]:
        return {
            "http_500": self.http_500,
            "timeout": self.timeout,
            "reset": self.reset,
            "malformed": self.malformed,
            "busy": self.busy,
            "unavailable": self.unavailable,
            "reset_mid_stream": self.reset_mid_stream,
            "bad_counts": self.bad_counts,
            "endless": self.endless,
        }


#: what the ``bad_counts`` fault sends for a count: negative (which, charged, would give
#: budget back), not an integer, beyond any answer
BAD_COUNTS: tuple[Any, ...] = (-1_000_000, 3.5, True, 2**63)


@dataclass(frozen=True)
class SimulatorConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    profile: str = "demo"
    tokens_per_second: float = 4000.0
    model: str = "tokenbudget-sim"
    seed: int = 0
    faults: Faults = Faults()
    vocab_size: int = 32000
    # SGLang --incremental-streaming-output: stream chunks carry only the new text/ids.
    incremental_streaming: bool = False
    # Servers that count nothing: no usage (OpenAI APIs) ...
    omit_usage: bool = False
    # ... and no token ids even when return_token_ids is asked for.
    omit_token_ids: bool = False
    # Like vLLM's --api-key: generation and /v1/models need "Authorization: Bearer KEY".
    api_key: str | None = None
    # Append every request's record (RequestRecord, one JSON object per line) here: the
    # server's own account of what it generated, kept across restarts of the simulator.
    log_file: str | None = None
    # A local tokenizer folder, as SGLang loads the model's: prompts sent as input_ids
    # are decoded with it, so the length rules find their markers in templated chats
    # (and its "</think>" token, when it has one, is the id that ends the thinking).
    tokenizer: str | None = None
    # A thinking model (one of REASONING_STYLES; see the module's docstring).
    reasoning_style: str = "none"
    # Chat requests offering tools are answered with a call to the first one.
    tool_calls: bool = False


@dataclass(frozen=True)
class RequestRecord:
    rid: str
    api: str
    received_at: float
    finished_at: float
    prompt_tokens: int
    max_new_tokens: int
    completion_tokens: int
    finish: str
    text_head: str
    # crc32 of the little-endian int32 bytes of the ids produced (0 when none)
    output_crc: int = 0
    # crc32 of the int32 bytes of the prompt ids, when the prompt came as ids (else 0)
    prompt_crc: int = 0
    # crc32 of the int32 bytes of the prompt ids it answered with (OpenAI APIs asked
    # for return_token_ids: prompt_token_ids), else 0
    returned_prompt_crc: int = 0
    # crc32 of the UTF-8 prompt text, when the prompt came as text (else 0): the whole
    # text a request carried, checkable without the log holding it
    text_crc: int = 0
    fault: str = ""
    # The answer's length had max_new_tokens not stopped it (0 for a fault): a request
    # sent with less room than this was cut by its limit.
    natural_tokens: int = 0
    # The sampling settings the request asked for, by their names on the wire
    # (SGLang's sampling_params minus max_new_tokens; OpenAI's sampling fields), and
    # any other top-level field the request carried (extra_body).
    sampling: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # What the answer held, as sent: its thinking tokens (None: not a thinking
    # simulator; 0: told not to think), crc32s of the UTF-8 reasoning text sent in a
    # chat reasoning field and of the text sent as the answer (chat content, the whole
    # text of the raw APIs; 0 when none), and the tool calls sent instead of content.
    reasoning_tokens: int | None = None
    reasoning_crc: int = 0
    content_crc: int = 0
    tool_calls: int = 0
    # A chat request's messages (message_digest), and the ids of the calls sent back.
    messages: list[dict[str, Any]] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    # crc32 of the request's Authorization header (0: it had none): which key a
    # server was sent, without the log holding it
    authorization_crc: int = 0


PROFILES: dict[str, tuple[LengthRule, ...]] = {
    # The product demo's 8 source datasets; the more specific markers come first because
    # "#long-code" contains "#code".
    "demo": (
        LengthRule("#long-code", 3793.0, 0.35),
        LengthRule("#code", 1200.0, 0.5),
        LengthRule("#chat", 1500.0, 0.5),
        LengthRule("#math", 2200.0, 0.45),
        LengthRule("#reasoning", 3000.0, 0.4),
        LengthRule("#short", 300.0, 0.6),
        LengthRule("", 1000.0, 0.5),
    ),
    "uniform": (LengthRule("", 1000.0, 0.5),),
    "short": (LengthRule("", 64.0, 0.5),),
    # Answers of nearly one length (coefficient of variation 0.1): what a plan of a
    # budget should predict closely from a few of them.
    "steady": (LengthRule("", 1000.0, 0.1),),
    # Answers of a long-context model's full length (~100k tokens), for what sizes
    # the pipeline must carry: run it at a high --tokens-per-second.
    "long": (LengthRule("", 100_000.0, 0.05),),
    # A thinking model's answers: a mean of 20k tokens spread wide (median ~14.5k, 1%
    # over ~93k, 3 in 1,000 over 131,072), for the budget's last answers at such sizes.
    "thinking": (LengthRule("", 20_000.0, 0.8),),
}

# A streamed chunk every ~32 tokens is what real servers look like on the wire; one chunk
# per token would make Python the bottleneck of the demo.
_CHUNK_TOKENS = 32
# Below ~1 ms asyncio timer overhead dominates, so faster decoding just gets bigger chunks.
_MIN_STREAM_SLICE = 0.001
# Longer than any client timeout: the client must give up, not the simulator.
_HANG_SECONDS = 3600.0
# SGLang's SamplingParams default and vLLM's /v1/completions default.
_SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
_OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Chat requests without max_tokens may use the rest of the context window, as in vLLM.
_MAX_MODEL_LEN = 32768
# SGLang reports the EOS id that stopped generation as finish_reason.matched.
_EOS_TOKEN_ID = 2
_SHUTDOWN_TIMEOUT = 2.0

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


# --------------------------------------------------------------------------------------
# Pure, deterministic generation
# --------------------------------------------------------------------------------------


def _rng_for(seed: int, text: str) -> random.Random:
    # Python's hash() is salted per process; a rerun must reproduce the same lengths.
    digest = hashlib.blake2b(
        f"{seed}\x1f{text}".encode("utf-8", "surrogatepass"), digest_size=16
    ).digest()
    return random.Random(int.from_bytes(digest, "big"))


def _rule_for(rules: Sequence[LengthRule], text: str) -> LengthRule:
    for rule in rules:
        if rule.marker in text:
            return rule
    # A profile without a "" rule still needs an answer; the last rule is the catch-all.
    return rules[-1]


def _draw_length(rules: Sequence[LengthRule], rng: random.Random, text: str) -> int:
    rule = _rule_for(rules, text)
    # Parametrise so the distribution's MEAN (not median) is rule.mean: budgets are sums.
    mu = math.log(rule.mean) - rule.sigma * rule.sigma / 2.0
    return max(1, round(rng.lognormvariate(mu, rule.sigma)))


def completion_length(rules: Sequence[LengthRule], seed: int, text: str) -> int:
    """Natural (uncapped) completion length in tokens for ``text`` under ``rules``."""
    if not rules:
        raise ConfigError("simulator.profile", "a profile needs at least one LengthRule")
    return _draw_length(rules, _rng_for(seed, text), text)


def chat_prompt_text(messages: Sequence[dict[str, Any]]) -> str:
    """The prompt text the simulator sees for a chat request: all contents concatenated."""
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            # OpenAI content-part arrays: only text parts carry prompt text.
            parts.extend(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return "".join(parts)


def _generate(
    rules: Sequence[LengthRule],
    seed: int,
    text: str,
    max_new_tokens: int,
    vocab_size: int,
    think_end: int | None = None,
) -> tuple[list[int], str, int, int]:
    """(ids, finish, thinking tokens, natural length): with ``think_end`` (the id
    ending the thinking) the answer thinks first, that id closing its thinking, and no
    other id is it; the natural length is the answer's had max_new_tokens not cut it."""
    rng = _rng_for(seed, text)
    natural = _draw_length(rules, rng, text)
    n = min(natural, max_new_tokens)
    # Ids come from the same stream after the length draw, so a capped answer is a prefix
    # of the uncapped one.
    ids = [int(rng.random() * vocab_size) for _ in range(n)]
    think = 0
    if think_end is not None and natural > 1:
        # Its own stream, so the ids stay those of the same prompt without thinking.
        share = _rng_for(seed, f"think\x1f{text}").uniform(0.3, 0.8)
        think = min(natural - 1, max(1, round(natural * share)))
        ids = [(i + 1) % vocab_size if i == think_end else i for i in ids]
        if think <= n:
            ids[think - 1] = think_end
    return ids, ("length" if natural > max_new_tokens else "stop"), think, natural


def _text_crc(parsed: _Parsed) -> int:
    if parsed.prompt_ids is not None:
        return 0
    return zlib.crc32(parsed.text.encode("utf-8", "surrogatepass"))


def _prompt_ids_from_text(text: str, vocab_size: int) -> list[int]:
    words = text.split()
    if not words:
        return [1]
    return [zlib.crc32(w.encode("utf-8", "surrogatepass")) % vocab_size for w in words]


def returned_prompt_ids(parsed: _Parsed, vocab_size: int) -> list[int]:
    """The prompt ids an OpenAI API answers with (``prompt_token_ids``): those sent, or
    the text's."""
    if parsed.prompt_ids is not None:
        return parsed.prompt_ids
    return _prompt_ids_from_text(parsed.text, vocab_size)


class _Output:
    """Generated ids and their synthetic text, with cheap prefix/delta slicing. The
    first ``think`` tokens are thinking, the last of them the one ending it."""

    __slots__ = ("_offsets", "_text", "ids", "think")

    def __init__(self, ids: list[int], think: int = 0) -> None:
        self.ids = ids
        self.think = think
        self._text: str | None = None
        self._offsets: list[int] | None = None

    def _render(self) -> tuple[str, list[int]]:
        if self._text is None or self._offsets is None:
            # Each token renders with a leading space (like BPE word tokens), so streamed
            # deltas concatenate to exactly the full text.
            pieces = [f" w{i}" for i in self.ids]
            if 0 < self.think <= len(pieces):
                pieces[self.think - 1] = f" {THINK_END}"
            self._text = "".join(pieces)
            self._offsets = list(itertools.accumulate(map(len, pieces), initial=0))
        return self._text, self._offsets

    def text(self, start: int, end: int) -> str:
        text, offsets = self._render()
        return text[offsets[start] : offsets[end]]

    def reasoning(self, start: int, end: int) -> str:
        """The thinking among tokens ``start:end``, as a reasoning parser sends it
        (without the token ending it)."""
        end = min(end, self.think - 1)
        return self.text(start, end) if end > start else ""

    def answer(self, start: int, end: int) -> str:
        """The answer among tokens ``start:end`` (after the thinking)."""
        start = max(start, self.think)
        return self.text(start, end) if end > start else ""

    def thinking_tokens(self, produced: int) -> int:
        return min(produced, self.think)


# --------------------------------------------------------------------------------------
# Server state
# --------------------------------------------------------------------------------------


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


class _RequestLog:
    """The simulator's account of every request, one :class:`RequestRecord` each: kept
    in memory (``GET /sim/log``, :attr:`RunningSimulator.log`) and appended to
    ``log_file``, one JSON line each, when given (kept across restarts)."""

    def __init__(self, log_file: str | None) -> None:
        self.records: list[RequestRecord] = []
        self._file = open(log_file, "ab") if log_file else None  # noqa: SIM115

    def record(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(_encode(record) + b"\n")
            self._file.flush()

    async def handle_log(self, request: web.Request) -> web.Response:
        return web.Response(body=_encode(self.records), content_type="application/json")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


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


class _SGLangRoutes:
    """SGLang's native API: ``/generate``, ``/abort_request``, ``/get_model_info`` and
    its Prometheus ``/metrics``; and ``/health`` (``/health_generate``), which vLLM
    answers at the same path."""

    def __init__(self, engine: _Engine, faults: _Faults) -> None:
        self.engine = engine
        self.faults = faults
        self.config = engine.config

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/generate", self.handle_generate),
            # Behind the key as generation is (SGLang's --api-key guards every route but
            # the health checks): an abort stops someone's answer, the info names the model.
            web.post("/abort_request", keyed(self.engine, self.handle_abort)),
            web.get("/health", self.handle_health),
            web.get("/health_generate", self.handle_health),
            web.get("/get_model_info", keyed(self.engine, self.handle_model_info)),
            web.get("/metrics", self.handle_metrics),
        ]

    def _parse(self, p: dict[str, Any], request: web.Request) -> _Parsed:
        text, input_ids = p.get("text"), p.get("input_ids")
        if (text is None) == (input_ids is None):
            raise _BadRequest("Either text or input_ids should be provided.")
        if isinstance(text, list) or (
            isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)
        ):
            raise _BadRequest("batch requests are not supported by the simulator")
        sp = p.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise _BadRequest("sampling_params must be an object")
        max_new = _int_field(sp, "max_new_tokens", _SGLANG_DEFAULT_MAX_NEW_TOKENS)
        if max_new < 0:
            raise _BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
        rid = p.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise _BadRequest("rid must be a string")
        text, prompt_ids = self.engine.prompt(text, input_ids)
        return _Parsed(
            rid=rid or uuid.uuid4().hex,
            text=text,
            prompt_ids=prompt_ids,
            prompt_tokens=len(prompt_ids) if prompt_ids is not None else _count(text),
            max_new_tokens=max_new,
            stream=bool(p.get("stream", False)),
        )

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.run(request, "sglang", self._parse, self._respond)

    async def _respond(
        self, request: web.Request, job: _Job, parsed: _Parsed, received_at: float
    ) -> web.StreamResponse:
        def body(produced: int, finish: str | None, start: int = 0) -> dict[str, Any]:
            return {
                "text": job.output.text(start, produced),
                "output_ids": job.output.ids[start:produced],
                "meta_info": {
                    "id": job.rid,
                    "finish_reason": _sglang_finish(job, finish, produced),
                    "prompt_tokens": job.prompt_tokens,
                    "completion_tokens": produced,
                    "cached_tokens": 0,
                    "e2e_latency": time.time() - received_at,
                },
            }

        if not parsed.stream:
            await job.done.wait()
            return _json(body(job.produced, job.finish))

        def render(sent: int, produced: int, finish: str | None) -> list[bytes]:
            start = sent if self.config.incremental_streaming else 0
            return [b"data: " + _encode(body(produced, finish, start)) + b"\n\n"]

        return await self.engine.stream(request, job, render, [b"data: [DONE]\n\n"])

    async def handle_abort(self, request: web.Request) -> web.Response:
        try:
            payload = _decode(await request.read() or b"{}")
        except msgspec.DecodeError:
            return _error("sglang", 400, "request body is not valid JSON")
        if not isinstance(payload, dict):
            return _error("sglang", 400, "request body must be a JSON object")
        if payload.get("abort_all"):
            for job in list(self.engine.jobs.values()):
                self.engine.abort(job)
        else:
            rid = payload.get("rid")
            target = self.engine.jobs.get(rid) if isinstance(rid, str) else None
            if target is not None:
                self.engine.abort(target)
        return web.Response(status=200)

    async def handle_health(self, request: web.Request) -> web.Response:
        if self.faults.out():
            return web.Response(status=503)
        return web.Response(status=200)

    async def handle_model_info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {"model_path": self.config.model, "is_generation": True}
        if self.config.tokenizer:  # as SGLang names the tokenizer it loaded
            info["tokenizer_path"] = self.config.tokenizer
        return _json(info)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        label = '{model_name="' + _prom_escape(self.config.model) + '"}'
        c = self.engine.counters
        series = [
            ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             c.prompt_tokens),
            ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
             c.generation_tokens),
            ("sglang:num_requests_total", "counter", "Number of requests processed.", c.requests),
            ("sglang:num_aborted_requests_total", "counter", "Number of requests aborted.",
             c.aborted),
            ("sglang:num_running_reqs", "gauge", "The number of running requests.",
             len(self.engine.jobs)),
            ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", 0),
        ]  # fmt: skip
        lines: list[str] = []
        for name, kind, help_text, value in series:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{label} {float(value)}")
        return web.Response(
            text="\n".join(lines) + "\n",
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Prometheus-Format": "0.0.4"},
        )


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


# The routes that serve each API (tokenbudget.core.apis.API_TRAITS, which this covers):
# SGLang's own, and the OpenAI-compatible ones its server and vLLM's share.
ROUTES: Mapping[str, type[_SGLangRoutes | _OpenAIRoutes]] = {
    "sglang": _SGLangRoutes,
    "openai-completions": _OpenAIRoutes,
    "openai-chat": _OpenAIRoutes,
}


class _SimServer:
    """The simulator's parts, composed: the request log, the faults, the generation
    engine and the routes of each API, on one aiohttp application."""

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.stopping = asyncio.Event()
        self.log = _RequestLog(config.log_file)
        self.faults = _Faults(config, self.log, self.stopping)
        self.engine = _Engine(config, self.log, self.faults, self.stopping)
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.add_routes(
            [
                *(
                    route
                    for routes in dict.fromkeys(ROUTES.values())
                    for route in routes(self.engine, self.faults).routes()
                ),
                web.get("/sim/log", keyed(self.engine, self.log.handle_log)),
                web.post("/sim/outage", keyed(self.engine, self.faults.handle_outage)),
            ]
        )

    async def shutdown(self) -> None:
        await self.engine.shutdown()
        self.log.close()


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


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


def _drop(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        # abort(), not close(): no graceful flush, the client just sees the socket die.
        transport.abort()


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


def _sglang_finish(job: _Job, finish: str | None, produced: int) -> dict[str, Any] | None:
    if finish is None:
        return None
    if finish == "stop":
        return {"type": "stop", "matched": _EOS_TOKEN_ID}
    if finish == "length":
        return {"type": "length", "length": produced}
    return {"type": "abort", "message": f"Abort request {job.rid}"}


def _usage(job: _Job) -> dict[str, int]:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.produced,
        "total_tokens": job.prompt_tokens + job.produced,
    }


def _chat_finish(job: _Job, finish: str | None) -> str | None:
    """A chat answer's finish_reason: a tool call that ran to its end says so."""
    return "tool_calls" if job.tool is not None and finish == "stop" else finish


def _crc(text: str | None) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) if text else 0


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


def ids_crc(ids: Sequence[int]) -> int:
    """crc32 of token ids as little-endian int32 bytes (how completions carry them)."""
    if not len(ids):
        return 0
    return zlib.crc32(np.asarray(ids, dtype="<i4").tobytes())


def _prom_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _load_tokenizer(path: str) -> LocalTokenizer:
    return load_tokenizer(path)


def _validate(config: SimulatorConfig) -> None:
    if config.profile not in PROFILES:
        known = ", ".join(sorted(PROFILES))
        raise ConfigError(
            "simulator.profile", f"unknown profile {config.profile!r} (known: {known})"
        )
    if not (config.tokens_per_second > 0 and math.isfinite(config.tokens_per_second)):
        raise ConfigError(
            "simulator.tokens_per_second",
            f"must be a positive number, got {config.tokens_per_second}",
        )
    if not 0 <= config.port <= 65535:
        raise ConfigError("simulator.port", f"must be 0..65535, got {config.port}")
    if config.vocab_size < 1:
        raise ConfigError("simulator.vocab_size", f"must be >= 1, got {config.vocab_size}")
    if config.reasoning_style not in REASONING_STYLES:
        raise ConfigError(
            "simulator.reasoning_style",
            f"{config.reasoning_style!r}: use one of {', '.join(REASONING_STYLES)}",
        )
    if config.tokenizer and not Path(config.tokenizer).is_dir():
        raise ConfigError("simulator.tokenizer", f"{config.tokenizer} is not a tokenizer folder")
    shares = config.faults.shares()
    if config.faults.retry_after_s < 0:
        raise ConfigError("simulator.faults.retry_after_s", "must be >= 0")
    for name, share in shares.items():
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"simulator.faults.{name}", f"must be within 0..1, got {share}")
    if sum(shares.values()) > 1.0 + 1e-9:
        raise ConfigError("simulator.faults", "the fault shares must add up to at most 1")


# --------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------


class RunningSimulator:
    """A simulator listening in the current event loop; ``await stop()`` to shut it down."""

    def __init__(self, server: _SimServer, runner: web.AppRunner, host: str, port: int) -> None:
        self._server = server
        self._runner = runner
        self.port = port
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{port}"
        self.log: list[RequestRecord] = server.log.records

    async def stop(self) -> None:
        await self._server.shutdown()
        await self._runner.cleanup()

    async def __aenter__(self) -> RunningSimulator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def start(config: SimulatorConfig) -> RunningSimulator:
    """Start a simulator in the running event loop; ``port=0`` picks a free port."""
    _validate(config)
    server = _SimServer(config)
    # No access log: at hundreds of requests per second it would drown everything else.
    runner = web.AppRunner(
        server.app, access_log=None, handle_signals=False, shutdown_timeout=_SHUTDOWN_TIMEOUT
    )
    await runner.setup()
    # aiohttp's default backlog of 128 makes a burst of hundreds of client connections hit
    # SYN retransmits (1 s, 3 s, ...); uvicorn under SGLang/vLLM listens with 2048.
    site = web.TCPSite(runner, config.host, config.port, backlog=2048)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(
            "simulator.port", f"cannot listen on {config.host}:{config.port}: {exc}"
        ) from exc
    port = int(runner.addresses[0][1])
    return RunningSimulator(server, runner, config.host, port)


def serve(config: SimulatorConfig) -> None:
    """Run a simulator until SIGINT or SIGTERM (the ``tokenbudget simulate`` command)."""
    tasks.run(_serve_until_signalled(config))


async def _serve_until_signalled(config: SimulatorConfig) -> None:
    sim = await start(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    print(
        f"tokenbudget simulator on {sim.url} (profile {config.profile}, "
        f"{config.tokens_per_second:g} tok/s per request, model {config.model})",
        file=sys.stderr,
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await sim.stop()
        _log.info("simulator on %s stopped after %d requests", sim.url, len(sim.log))
