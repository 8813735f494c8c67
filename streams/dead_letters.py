"""Dead letters: the :class:`~tokenbudget.streams.events.DeadLetter` of a record that
could not be used, or of a dataset row that never became a prompt, always small enough
to send (a bounded excerpt, the record's size, a prefix of its bytes and their hash)."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from tokenbudget.core.errors import DatasetError
from tokenbudget.streams.events import DeadLetter, now


def dead_letter_for(reason: str, record: Any) -> DeadLetter:
    """The dead letter for a consumer record (kafka-python's or aiokafka's: both
    carry ``topic``, ``partition``, ``offset``, ``key`` and ``value``)."""
    return dead_letter(
        reason,
        source_topic=record.topic,
        payload=record.value,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
    )


def bad_row_letter(dataset: str, row: DatasetError, fix: str) -> DeadLetter:
    """The dead letter of a dataset row that is not a prompt: where it is, why, and
    a bounded excerpt of it (never the megabytes of an oversized row)."""
    return DeadLetter(
        reason=f"bad row of dataset {dataset} at {row.where}: {row.message}; {fix}",
        source_topic="",
        key=dataset,
        payload=row.excerpt,
        at=now(),
        source=row.where,
        size=-1 if row.size is None else row.size,
    )


EXCERPT_CHARS = 4096
PREFIX_BYTES = 64 * 1024
_KEY_BYTES = 1024
_REASON_CHARS = 4096


def dead_letter(
    reason: str,
    *,
    source_topic: str,
    payload: bytes | None,
    partition: int = -1,
    offset: int = -1,
    key: bytes | None = None,
) -> DeadLetter:
    """The letter for a record that could not be used: its reason (cut to a few KiB)
    and a bounded excerpt of it, its size and hash, so that a letter is never too big
    to send, whatever the record (a 1.5 MB binary payload makes a letter of ~90 KiB)."""
    data = payload or b""
    return DeadLetter(
        reason=reason[:_REASON_CHARS],
        source_topic=source_topic,
        partition=partition,
        offset=offset,
        key=key[:_KEY_BYTES].decode("utf-8", "replace") if key is not None else None,
        payload=data[: EXCERPT_CHARS * 4].decode("utf-8", "replace")[:EXCERPT_CHARS],
        at=now(),
        size=len(data),
        payload_base64=base64.b64encode(data[:PREFIX_BYTES]).decode(),
        sha256=hashlib.sha256(data).hexdigest(),
    )
