"""Topics read whole, with kafka-python's blocking client: a small topic (budgets,
outcomes) from its beginning to its end (:func:`read_to_end`), and the completions
the sink keeps, as the completions topic holds them now (:func:`kept_completions`).

Used by the replay's ledger audit and by plain code elsewhere (the runner's resume,
the jobs' tools), outside any event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import msgspec

from tokenbudget.core.errors import EventDecodeError
from tokenbudget.core.kafka import read_topic
from tokenbudget.sinks.base import RECEIVE_BUFFER
from tokenbudget.sinks.rows import FirstCompletion
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics


def read_to_end(
    bootstrap: str, topic: str, apply: Callable[[ev.Event], None], timeout: float = 60
) -> None:
    """Decode every event of a (small) topic, from the beginning to its current end,
    and ``apply`` it; an event that does not decode is passed over. Raises
    :class:`BrokerError` if the topic is missing or not read within ``timeout``
    seconds (:func:`tokenbudget.core.kafka.read_topic`). Blocking."""

    def decode(record: Any) -> None:
        with contextlib.suppress(EventDecodeError):
            apply(codec.decode(record.value, record.topic))

    read_topic(bootstrap, topic, decode, timeout=timeout, extra_options=RECEIVE_BUFFER)


class _Head(msgspec.Struct):
    type: str = ""
    dataset: str = ""
    prompt_id: str = ""
    lease_id: str = ""


_read_head = msgspec.json.Decoder(_Head).decode

# Reading a whole completions topic may take long on a long job; a broker away for
# longer than this is not waited for.
KEPT_READ_TIMEOUT_S = 3600.0


def kept_completions(
    bootstrap: str, topics: Topics, datasets: frozenset[str]
) -> dict[str, ev.CompletionEvent]:
    """The completions of ``datasets`` the sink keeps (:class:`FirstCompletion`: the
    first of each prompt, none of a lease fenced before it), by prompt id, read from
    the completions topic as it is now: what a rerun of conversations regenerated
    turn by turn resumes from (the topic is the record; the sink's files may lag).
    Other datasets' events are passed over unread. Blocking."""
    rule = FirstCompletion()
    kept: dict[str, ev.CompletionEvent] = {}

    def apply(record: Any) -> None:
        try:
            head = _read_head(record.value)
        except Exception:  # any record is input (a RecursionError for one nested deep)
            return
        if head.dataset not in datasets:
            return
        if head.type == "lease_fenced":
            rule.fence(head.lease_id)
            return
        if head.type != "completion":
            return
        try:
            event = codec.decode(record.value)
        except EventDecodeError:
            return  # dead-lettered by the sink, kept by no one
        if isinstance(event, ev.CompletionEvent) and rule.keep(
            event.prompt_id, event.lease_id, event.dataset
        ):
            kept[event.prompt_id] = event

    read_topic(
        bootstrap,
        topics.completions,
        apply,
        timeout=KEPT_READ_TIMEOUT_S,
        extra_options=RECEIVE_BUFFER,
    )
    return kept
