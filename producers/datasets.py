"""Dataset readers: turn rows of a file into prompts with stable ids.

A row is either ``{"prompt": "..."}`` or ``{"messages": [{"role", "content"}, ...]}``
(OpenAI chat), with an optional ``id``. JSONL and Parquet take the same columns.

``prompt_id`` is a hash of the dataset name and the row's identity: its ``id`` when
it has one, else its content (with an occurrence number, so two identical rows stay
two prompts). The same file therefore yields the same ids on every run, which is
what lets a resumed run recognise work already done.

Bad rows raise :class:`DatasetError` naming file and line; :func:`read_prompts`
either skips them (reporting each through ``on_bad_row``) or stops, per config.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streams.events import ChatMessage
from tokenbudget.errors import DatasetError


@dataclass(frozen=True)
class PromptRow:
    prompt_id: str
    source: str  # "path:line" (line counted from 1; Parquet: row number)
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None


def stable_prompt_id(dataset: str, identity: str) -> str:
    return hashlib.blake2b(f"{dataset}\x00{identity}".encode(), digest_size=16).hexdigest()


def parse_row(
    row: Any, path: str, line: int
) -> tuple[str | None, str | None, tuple[ChatMessage, ...] | None]:
    """Validate one row; returns (id, text, messages) or raises DatasetError."""
    if not isinstance(row, dict):
        raise DatasetError(path, f"expected a JSON object, got {type(row).__name__}", line=line)
    row_id = row.get("id")
    if row_id is not None and not isinstance(row_id, (str, int)):
        raise DatasetError(path, f"'id' must be a string or integer, got {row_id!r}", line=line)
    prompt = row.get("prompt")
    messages = row.get("messages")
    if prompt is None and messages is None:
        raise DatasetError(
            path, "row has neither 'prompt' (a string) nor 'messages' (a chat list)", line=line
        )
    if prompt is not None:
        if not isinstance(prompt, str):
            raise DatasetError(
                path, f"'prompt' must be a string, got {type(prompt).__name__}", line=line
            )
        if not prompt.strip():
            raise DatasetError(path, "'prompt' is empty", line=line)
        return (None if row_id is None else str(row_id)), prompt, None
    if not isinstance(messages, list) or not messages:
        raise DatasetError(path, "'messages' must be a non-empty list", line=line)
    parsed: list[ChatMessage] = []
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                path,
                f"messages[{i}] must be an object with string 'role' and 'content'",
                line=line,
            )
        parsed.append(ChatMessage(role=message["role"], content=message["content"]))
    if not any(m.content.strip() for m in parsed):
        raise DatasetError(path, "every message's 'content' is empty", line=line)
    return (None if row_id is None else str(row_id)), None, tuple(parsed)


class DatasetReader(ABC):
    """Yields ``(line, row)`` pairs or raises DatasetError for rows it cannot parse.

    Row-level errors are yielded as DatasetError instances so the caller decides
    whether one bad row stops the run.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @abstractmethod
    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]: ...


class JsonlReader(DatasetReader):
    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]:
        try:
            handle = self.path.open("rb")
        except OSError as exc:
            raise DatasetError(str(self.path), f"cannot open: {exc.strerror}") from exc
        with handle:
            for number, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                try:
                    yield number, json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    yield (
                        number,
                        DatasetError(str(self.path), f"not valid JSON: {exc}", line=number),
                    )


class ParquetReader(DatasetReader):
    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]:
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(self.path)
        except (OSError, ValueError) as exc:
            raise DatasetError(str(self.path), f"cannot read as Parquet: {exc}") from exc
        number = 0
        for batch in parquet.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                number += 1
                yield number, row


def reader_for(path: Path) -> DatasetReader:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return JsonlReader(path)
    if suffix in (".parquet", ".pq"):
        return ParquetReader(path)
    raise DatasetError(str(path), "unknown file type: use .jsonl or .parquet")


def read_prompts(
    dataset: str,
    path: Path,
    *,
    on_bad_row: Callable[[DatasetError], None] | None = None,
    limit: int | None = None,
) -> Iterator[PromptRow]:
    """Yield the dataset's prompts in file order.

    With ``on_bad_row`` set, bad rows are passed to it and skipped; without, the
    first bad row raises.
    """
    occurrences: dict[str, int] = {}
    produced = 0
    for line, row in reader_for(path).rows():
        if limit is not None and produced >= limit:
            return
        try:
            if isinstance(row, DatasetError):
                raise row
            row_id, text, messages = parse_row(row, str(path), line)
        except DatasetError as exc:
            if on_bad_row is None:
                raise
            on_bad_row(exc)
            continue
        if row_id is not None:
            identity = f"id:{row_id}"
        else:
            content = (
                text
                if text is not None
                else json.dumps([[m.role, m.content] for m in messages or ()])
            )
            digest = hashlib.blake2b(content.encode(), digest_size=16).hexdigest()
            identity = f"content:{digest}"
        seen = occurrences.get(identity, 0)
        occurrences[identity] = seen + 1
        if seen and row_id is not None:
            duplicate = DatasetError(str(path), f"duplicate id {row_id!r}", line=line)
            if on_bad_row is None:
                raise duplicate
            on_bad_row(duplicate)
            continue
        if seen:
            identity = f"{identity}#{seen}"
        produced += 1
        yield PromptRow(
            prompt_id=stable_prompt_id(dataset, identity),
            source=f"{path}:{line}",
            text=text,
            messages=messages,
        )
