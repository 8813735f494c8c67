"""Events on the wire: their JSON bytes (:func:`encode`, :func:`decode`, which checks
the schema version before the shape, the bounds, a completion's counts
(:func:`count_problem`) and that the event travels on the topic it was read from,
:data:`ON_TOPIC`), and the key each keyed event is written with (:func:`event_key`).
Whatever is wrong with a record is an :class:`~tokenbudget.core.errors.EventDecodeError`."""

from __future__ import annotations

from typing import Any

import msgspec

from tokenbudget.core.errors import EventDecodeError
from tokenbudget.streams.events import (
    COMPLETION_VERSIONS,
    FLEET_KEY,
    PROMPT_VERSIONS,
    SCHEMA_VERSION,
    SUPPORTED_VERSIONS,
    BudgetExceeded,
    BudgetRaised,
    BudgetSet,
    CompletionEvent,
    DeadLetter,
    Event,
    FleetReport,
    JobIdentity,
    LeaseDenied,
    LeaseExpired,
    LeaseFenced,
    LeaseGranted,
    LeaseReleased,
    LeaseRenewed,
    LeaseRequested,
    LeaseRevoked,
    LedgerSnapshot,
    ProducerDone,
    PromptEvent,
    PromptFailed,
    PromptSkipped,
    ServerAdded,
    ServerDrained,
    SnapshotAsked,
    _Event,
)
from tokenbudget.streams.fields import TokenIds, _token_ids_from_wire


def count_problem(
    prompt_tokens: int,
    completion_tokens: int,
    ids: int | None,
    max_new_tokens: int,
    count_source: str = "server",
) -> str | None:
    """What makes a completion's counts impossible, or None. Every reader (ledger,
    sink, replay) rejects such a completion the same way, to the dead-letter topic:
    counting it could take a dataset past its budget. ``ids`` is the number of
    output_ids, None when the event has none (the server returned none)."""
    if prompt_tokens < 0 or completion_tokens < 0:
        return f"negative token count ({prompt_tokens} prompt, {completion_tokens} completion)"
    if ids is None and count_source == "server":
        return "output_ids is null, but count_source 'server' says the server returned them"
    if ids and ids != completion_tokens:
        return f"completion_tokens {completion_tokens} but {ids} output_ids"
    if max_new_tokens > 0 and completion_tokens > max_new_tokens:
        return f"completion_tokens {completion_tokens} above max_new_tokens {max_new_tokens}"
    return None


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, TokenIds):
        return obj.tobytes()  # msgspec writes bytes as base64
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is TokenIds:
        return _token_ids_from_wire(obj)  # its ValueError becomes a ValidationError
    raise NotImplementedError(f"cannot decode {kind.__name__}")


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(
    Event,  # type: ignore[arg-type]
    dec_hook=_dec_hook,
)


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


class _Header(msgspec.Struct):
    type: str = "?"
    v: int = SCHEMA_VERSION


_header_decoder = msgspec.json.Decoder(_Header)


def supported_versions(tag: str) -> frozenset[int]:
    """The schema versions this build reads for events of type ``tag``."""
    if tag == "completion":
        return COMPLETION_VERSIONS
    return PROMPT_VERSIONS if tag == "prompt" else SUPPORTED_VERSIONS


# What travels on each topic (by its role, the last part of its name), and so who
# writes it: a reader refuses any other event there, so that one role's principal,
# which Kafka's ACLs let write only its own topics, cannot speak for another (an
# operator's command is believed from the control topic only, a halt or a grant from
# the ledger's budgets topic only). docs/kafka.md, Roles and ACLs.
ON_TOPIC: dict[str, tuple[type[_Event], ...]] = {
    "prompts": (PromptEvent,),
    "completions": (CompletionEvent, LeaseFenced),
    "control": (BudgetSet, ServerAdded, ServerDrained, JobIdentity),
    "budgets": (
        BudgetExceeded,
        BudgetRaised,
        LedgerSnapshot,
        LeaseGranted,
        LeaseDenied,
        LeaseRevoked,
    ),
    "outcomes": (PromptSkipped, PromptFailed, ProducerDone, SnapshotAsked),
    "reservations": (LeaseRequested, LeaseRenewed, LeaseReleased, LeaseExpired, FleetReport),
    "deadletter": (DeadLetter,),
}


def topic_of(event_type: type[_Event]) -> str:
    """The role of the topic ``event_type`` travels on (a key of :data:`ON_TOPIC`)."""
    return next(role for role, kinds in ON_TOPIC.items() if event_type in kinds)


def decode(data: bytes, topic: str | None = None) -> Event:
    """Decode one event read from ``topic`` (its name; None: from anywhere, for
    tools and tests), or raise EventDecodeError saying what is wrong with it. Any
    failure is that error: a record nested past the parser's depth, a value out of
    its bounds, an event that does not travel on ``topic``.

    The version is checked before the shape, so an event from a newer writer is
    reported as such rather than as a missing or unknown field.
    """
    try:
        event = _decode(data)
    except EventDecodeError:
        raise
    except Exception as exc:  # RecursionError (nested ~1,000 deep), MemoryError, ...
        raise EventDecodeError(f"not a tokenbudget event: {type(exc).__name__}: {exc}") from exc
    if topic is not None:
        role = topic.rsplit(".", 1)[-1]
        if type(event) not in ON_TOPIC.get(role, ()):
            tag = type(event).__struct_config__.tag
            raise EventDecodeError(
                f"a {tag!r} event does not travel on {topic}: only on "
                f"{topic.rsplit('.', 1)[0]}.{topic_of(type(event))}"
            )
    return event


def _decode(data: bytes) -> Event:
    try:
        header = _header_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not a tokenbudget event: {exc}") from exc
    supported = supported_versions(header.type)
    if header.v not in supported:
        raise EventDecodeError(
            f"'{header.type}' event has schema version {header.v}; this build reads "
            f"versions {sorted(supported)}: upgrade tokenbudget"
        )
    try:
        event = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not a tokenbudget event: {exc}") from exc
    if isinstance(event, CompletionEvent):
        problem = count_problem(
            event.prompt_tokens,
            event.completion_tokens,
            None if event.output_ids is None else len(event.output_ids),
            event.max_new_tokens,
            event.count_source,
        )
        if problem is not None:
            raise EventDecodeError(f"impossible counts in completion {event.request_id}: {problem}")
    return event


def event_key(event: Event) -> bytes | None:
    dataset = getattr(event, "dataset", None)
    if isinstance(dataset, str):
        return dataset.encode()
    if isinstance(event, ServerAdded | ServerDrained | FleetReport):
        return FLEET_KEY
    return None
