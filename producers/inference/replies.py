"""What an inference server's reply may hold, read and bounded: HTTP statuses that say the
server is busy or away (and its ``Retry-After``), server-sent events decoded (an error
sent in the stream is the server's), the finish reason, a thinking model's reasoning,
and the counts and token ids it reports.

A count the server sends is a JSON integer within 0..:data:`MAX_COUNT`
(:func:`count_of`), or the answer is refused (never charged: a negative cost would
give budget back); token ids likewise (:func:`token_ids_of`).
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

import msgspec

from tokenbudget.core import sizes
from tokenbudget.core.errors import (
    InferenceBadCountError,
    InferenceProtocolError,
    InferenceServerError,
)
from tokenbudget.streams.fields import FinishReason

# Statuses that say the server is busy or away, not that the request is wrong.
AWAY_STATUSES = frozenset({408, 429, 502, 503, 504})
# Of those, the server's own word that it takes no more now (not a proxy's).
BUSY_STATUSES = frozenset({429, 503})
# A Retry-After beyond this is taken as this: a job waits, it does not sleep for days.
RETRY_AFTER_MAX_S = 600.0


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from ``Retry-After`` (delay-seconds or an HTTP date), capped at
    :data:`RETRY_AFTER_MAX_S`; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return min(RETRY_AFTER_MAX_S, max(0.0, seconds))


def reasoning_of(message: Any, fields: tuple[str, ...]) -> str:
    """The reasoning a chat message or delta carries in one of ``fields`` (the API's
    ``reasoning_fields``), "" when none. A server that sends both names (vLLM while
    renaming) sends the same text in each."""
    if isinstance(message, dict):
        for name in fields:
            value = message.get(name)
            if isinstance(value, str) and value:
                return value
    return ""


#: the largest token count a server may report: the events' own bound
#: (:data:`tokenbudget.core.sizes.MAX_COUNT`), as wide as a token id
MAX_COUNT = sizes.MAX_COUNT


def count_of(value: Any, name: str, where: str) -> int:
    """``value`` as a token count: a JSON integer within 0..:data:`MAX_COUNT`. Anything
    else (negative, a float, a bool, a string, null, beyond any answer) raises
    :class:`~tokenbudget.core.errors.InferenceBadCountError` naming the field
    (``name``) and the server (``where``): the answer is refused, not charged."""
    if type(value) is int and 0 <= value <= MAX_COUNT:
        return value
    shown = repr(value)
    shown = shown if len(shown) <= 40 else f"{shown[:40]}..."
    raise InferenceBadCountError(
        f"{where}: {name} is {shown}, not a token count (an integer within "
        f"0..{MAX_COUNT}): the answer is refused, not charged"
    )


def token_ids_of(value: Any, name: str, where: str) -> list[int] | None:
    """``value`` as token ids (None: the server sent none): a list of integers within
    0..:data:`MAX_COUNT` (an integral float, as some servers write one, is taken as
    its integer). Anything else raises
    :class:`~tokenbudget.core.errors.InferenceProtocolError` naming the field and the
    server: an id past int32 would fail only when the completion is encoded, a bool or
    a fraction is no token."""
    if value is None:
        return None
    if isinstance(value, list):
        if all(type(i) is int for i in value):
            if not value or (min(value) >= 0 and max(value) <= MAX_COUNT):
                return value
        elif all(type(i) in (int, float) and i == int(i) for i in value):
            return token_ids_of([int(i) for i in value], name, where)
    shown = repr(value)
    shown = shown if len(shown) <= 60 else f"{shown[:60]}..."
    raise InferenceProtocolError(
        f"{where}: {name} is {shown}, not token ids (integers within 0..{MAX_COUNT}): "
        "the answer is refused, not charged"
    )


def reasoning_tokens_of(usage: Any, completion_tokens: int, where: str) -> int | None:
    """``usage.completion_tokens_details.reasoning_tokens`` (vLLM, newer SGLang), at
    most ``completion_tokens``, which counts thinking and answer; None when absent
    (or null). One that is not a count raises, as :func:`count_of` does."""
    details = usage.get("completion_tokens_details") if isinstance(usage, dict) else None
    value = details.get("reasoning_tokens") if isinstance(details, dict) else None
    if value is None:
        return None
    name = "usage.completion_tokens_details.reasoning_tokens"
    return min(count_of(value, name, where), completion_tokens)


# Chat answers that end by calling functions: the model ended its turn.
_CALLS_FINISH = frozenset({"tool_calls", "function_call"})


def calls_end(finish: Any) -> Any:
    return "stop" if isinstance(finish, str) and finish in _CALLS_FINISH else finish


def as_finish(value: Any) -> FinishReason:
    kind = value.get("type") if isinstance(value, dict) else value
    if kind in ("stop", "length", "abort"):
        return kind  # type: ignore[no-any-return]
    if kind is None:
        return "stop"
    raise InferenceProtocolError(f"unknown finish_reason {value!r}")


def field_at(body: Any, *path: str | int) -> Any:
    node = body
    for part in path:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError) as exc:
            dotted = ".".join(str(p) for p in path)
            raise InferenceProtocolError(f"response lacks {dotted}: {str(body)[:200]}") from exc
    return node


def int_list(value: Any) -> list[Any] | None:
    """A list the server sent as ids, as it is (checked once the answer is whole:
    :func:`token_ids_of`), or None."""
    return value if isinstance(value, list) else None


def model_of(body: Any) -> str:
    """The model an OpenAI-compatible response names ("" when it names none)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else ""


def stream_event(url: str, data: bytes) -> Any:
    """A server-sent event's data, decoded: data that is not JSON is a protocol error,
    an error the server sends in the stream is the server's."""
    try:
        event = _decode(data)
    except (msgspec.DecodeError, RecursionError):
        # What msgspec refuses and Python's decoder reads as before: invalid UTF-8
        # (replaced), NaN and Infinity; JSON nested too deep for either is not JSON.
        try:
            event = json.loads(data.decode("utf-8", "replace"))
        except (json.JSONDecodeError, RecursionError) as exc:
            raise not_json(url, data) from exc
    if isinstance(event, dict) and ("error" in event or event.get("object") == "error"):
        raise error_in_stream(url, data)
    return event


def not_json(url: str, data: bytes) -> InferenceProtocolError:
    return InferenceProtocolError(
        f"POST {url}: stream chunk is not JSON: {data[:120].decode('utf-8', 'replace')!r}"
    )


def error_in_stream(url: str, data: bytes) -> InferenceServerError:
    return InferenceServerError(
        f"POST {url}: error in stream: {data[:200].decode('utf-8', 'replace')}"
    )


_decode = msgspec.json.Decoder().decode
