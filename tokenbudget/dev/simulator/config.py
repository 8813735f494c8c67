"""What the simulator is told and what it tells: its config (:class:`SimulatorConfig`,
the injected :class:`Faults`, the answer-length profiles of :data:`PROFILES`), checked
by ``_validate``, and the :class:`RequestRecord` its request log keeps of every request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenbudget.core.errors import ConfigError

# What the simulator's thinking model names its thinking in a chat answer; "none": it
# does not think.
REASONING_STYLES = ("none", "reasoning_content", "reasoning")
# How the token that ends the thinking renders in raw text.
THINK_END = "</think>"


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
