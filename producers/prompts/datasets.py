"""Dataset readers: turn rows of a file into prompts with stable ids.

Formats (``[[datasets]] format``):

* ``prompt``   rows ``{"prompt": "..."}``
* ``openai``   rows ``{"messages": [{"role", "content"}, ...]}`` (OpenAI chat)
* ``sharegpt`` rows ``{"conversations": [{"from", "value"}, ...]}`` (``human``/``gpt``/
  ``system``...), mapped to chat messages
* ``hf``       a Hugging Face dataset saved with ``save_to_disk`` (a folder, read
  with ``datasets.load_from_disk``), whose rows are any of the above
* ``auto``     any of the above, per row (a folder is read as ``hf``)

What a format allows is its row of :data:`tokenbudget.core.formats.FORMAT_TRAITS`;
how it reads a row, its entry in :data:`PARSERS`.

Every row may carry an ``id``. JSONL, Parquet and Hugging Face datasets take the
same columns. Rows that hold the prompt elsewhere are read through the dataset's
column mapping (:mod:`tokenbudget.core.columns`: ``prompt_field``, ``prompt_template``,
``messages_field``, ``id_field``).

Conversations give one prompt (``turns = "first"``: the turns up to and including
the first user turn) or one per assistant turn (``turns = "all"``: the history
before each assistant turn, which is regenerated; plus a trailing user turn that
has no answer yet). With ``turns = "regenerate"`` a conversation gives the prompt
of its first turn only, carrying the whole conversation as recorded: each later
turn's prompt is made from the answers the model gave
(:mod:`tokenbudget.producers.prompts.conversations`).

Chat rows may hold tool use as OpenAI's chat format writes it: assistant turns with
``tool_calls`` (their ``content`` may then be null), ``tool`` turns with
``tool_call_id``, and the row's ``tools`` (the definitions, a list or its JSON text).

``prompt_id`` is a hash of the dataset name and the row's identity: its ``id`` when
it has one, else its content (with an occurrence number, so two identical rows stay
two prompts), plus the turn for ``turns = "all"``. The same file therefore yields
the same ids on every run, in any order (``order``, ``shuffle_seed``:
:mod:`tokenbudget.producers.prompts.order`), which is what lets a resumed run recognise work
already done.

Bad rows raise :class:`DatasetError` naming file and line, with an excerpt of the
row for its dead letter; :func:`read_prompts` either skips them (reporting each
through ``on_bad_row``) or stops, per config. A prompt over ``max_prompt_bytes`` of
UTF-8 (or ``max_prompt_tokens`` once templated) is a bad row too, and so is a row the
readers refuse before any rule sees it: a JSONL line over :data:`ROW_BYTES` (found
by its length: never held whole), one nested deeper than :data:`MAX_ROW_DEPTH`, and
any row whose parsing or conversion raised (a 5,000-digit number, a Parquet date
past the year 9999): whatever went wrong, only that row is lost.
Before a job starts, :func:`check_datasets` reads the first rows of every dataset
and stops with the config key to fix when a dataset cannot work at all.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import pyarrow.parquet as pq
from msgspec.structs import replace as msgspec_replace

from tokenbudget.core import sizes
from tokenbudget.core.apis import API_TRAITS
from tokenbudget.core.columns import (
    DEFAULT_COLUMNS,
    Columns,
    FieldError,
    PromptTemplate,
    field_text,
)
from tokenbudget.core.config import Dataset
from tokenbudget.core.config_checks import resolve_order, untemplated_chat
from tokenbudget.core.errors import ConfigError, DatasetError
from tokenbudget.core.extras import require
from tokenbudget.core.formats import DEFAULT_FORMAT, FORMAT_TRAITS, DatasetFormat, Turns
from tokenbudget.core.sections import PROMPT_LENGTH, DatasetOrder
from tokenbudget.producers.prompts.order import prompt_length, stratified
from tokenbudget.producers.templates import config_tokenizer
from tokenbudget.streams.fields import ChatMessage, ToolCall

if TYPE_CHECKING:
    from tokenbudget.core.config import Config

Template = Callable[[Sequence[ChatMessage]], list[int]]

# ShareGPT speakers -> chat roles. Exports differ in naming; these cover the common ones.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


@dataclass(frozen=True)
class PromptRow:
    prompt_id: str
    source: str  # "path:line" (line counted from 1; Parquet and HF: row number)
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    input_ids: tuple[int, ...] | None = None  # the chat template applied locally
    row_id: str | None = None  # the row's own "id"
    input_columns: dict[str, Any] | None = None  # the row's keep_columns (missing: null)
    sample_index: int = 0  # which of the dataset's n answers to this prompt
    stratum: Any = None  # the row's stratify_by field, read for order = "stratified"
    tools: list[dict[str, Any]] | None = None  # the row's tool definitions
    # turns = "regenerate": the conversation, which of its turns this prompt is, how
    # many it has, and the conversation as the dataset recorded it
    conversation_id: str | None = None
    turn: int = 0
    turns: int = 1
    reference: tuple[ChatMessage, ...] | None = None


def stable_prompt_id(dataset: str, identity: str) -> str:
    return hashlib.blake2b(f"{dataset}\x00{identity}".encode(), digest_size=16).hexdigest()


def turn_prompt_id(dataset: str, conversation_id: str, turn: int) -> str:
    """The prompt id of a regenerated conversation's turn ``turn`` (from 0): stable,
    so whoever builds that turn's prompt, on any run, gives it the same id."""
    return stable_prompt_id(dataset, f"{conversation_id}@turn{turn}")


def _parse_messages(
    value: Any, path: str, line: int, field: str = "messages"
) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise DatasetError(path, f"{field!r} must be a non-empty list", line=line)
    parsed: list[ChatMessage] = []
    for i, message in enumerate(value):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if content is None and calls:
            content = ""  # a turn that only calls functions
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(content, str)
        ):
            raise DatasetError(
                path,
                f"{field}[{i}] must be an object with string 'role' and 'content'",
                line=line,
            )
        parsed.append(
            ChatMessage(
                role=message["role"],
                content=content,
                tool_calls=_tool_calls(calls, path, line, f"{field}[{i}]") if calls else None,
                tool_call_id=_optional_text(message, "tool_call_id", path, line, f"{field}[{i}]"),
                name=_optional_text(message, "name", path, line, f"{field}[{i}]"),
            )
        )
    return tuple(parsed)


def _optional_text(
    message: dict[str, Any], key: str, path: str, line: int, where: str
) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise DatasetError(path, f"{where}.{key} must be a string", line=line)
    return value


def _tool_calls(value: Any, path: str, line: int, where: str) -> tuple[ToolCall, ...]:
    """OpenAI's ``tool_calls`` (``{id, type, function: {name, arguments}}``);
    arguments given as an object are kept as their JSON text, as a model writes them."""
    if not isinstance(value, list):
        raise DatasetError(path, f"{where}.tool_calls must be a list", line=line)
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DatasetError(
                path, f"{where}.tool_calls[{j}] needs function.name (a string)", line=line
            )
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call_id = call.get("id")
        call_id = call_id if isinstance(call_id, str) else f"call_{j}"
        calls.append(ToolCall(id=call_id, name=function["name"], arguments=arguments))
    return tuple(calls)


def parse_tools(row: Any, path: str, line: int) -> list[dict[str, Any]] | None:
    """A row's ``tools`` (tool definitions, sent to the chat API as they are): a list
    of objects, or its JSON text; None when the row has none."""
    value = row.get("tools") if isinstance(row, dict) else None
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except RecursionError:
            value = _TOO_DEEP
        except ValueError as exc:
            raise DatasetError(path, f"'tools' is not valid JSON: {exc}", line=line) from None
        if value is _TOO_DEEP or _deeper_than(value, MAX_ROW_DEPTH):
            raise DatasetError(path, f"'tools' {TOO_DEEP}", line=line)
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise DatasetError(path, "'tools' must be a list of tool definitions", line=line)
    return value


def _parse_conversations(
    value: Any, path: str, line: int, field: str = "conversations"
) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise DatasetError(path, f"{field!r} must be a non-empty list", line=line)
    parsed: list[ChatMessage] = []
    for i, turn in enumerate(value):
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("from"), str)
            or not isinstance(turn.get("value"), str)
        ):
            raise DatasetError(
                path,
                f"{field}[{i}] must be an object with string 'from' and 'value'",
                line=line,
            )
        role = SHAREGPT_ROLES.get(turn["from"].strip().lower())
        if role is None:
            known = ", ".join(sorted(SHAREGPT_ROLES))
            raise DatasetError(
                path,
                f"{field}[{i}]: unknown speaker {turn['from']!r} (known: {known})",
                line=line,
            )
        parsed.append(ChatMessage(role=role, content=turn["value"]))
    return tuple(parsed)


def parse_row(
    row: Any,
    path: str,
    line: int,
    format: DatasetFormat = DEFAULT_FORMAT,
    columns: Columns = DEFAULT_COLUMNS,
) -> tuple[str | None, str | None, tuple[ChatMessage, ...] | None]:
    """Validate one row; returns (id, text, messages) or raises DatasetError."""
    if not isinstance(row, dict):
        raise DatasetError(path, f"expected a JSON object, got {type(row).__name__}", line=line)
    row_id = row.get(columns.id_field)
    if row_id is not None and not isinstance(row_id, (str, int)):
        raise DatasetError(
            path, f"{columns.id_field!r} must be a string or integer, got {row_id!r}", line=line
        )
    key = None if row_id is None else str(row_id)
    if columns.key:
        return (key, *_mapped_row(row, path, line, format, columns))
    return (key, *PARSERS[format].row(row, path, line))


# A row's prompt: (text, None) or (None, chat messages).
Parsed = tuple[str | None, tuple[ChatMessage, ...] | None]


@dataclass(frozen=True)
class RowParser:
    """How one format reads its rows: ``row`` a row's own fields, ``turns`` the chat
    turns in a field the column mapping names (``messages_field``)."""

    row: Callable[[dict[str, Any], str, int], Parsed]
    turns: Callable[[Any, str, int, str], tuple[ChatMessage, ...]]


def _prompt_text(prompt: Any, path: str, line: int) -> str:
    if not isinstance(prompt, str):
        raise DatasetError(
            path, f"'prompt' must be a string, got {type(prompt).__name__}", line=line
        )
    if not prompt.strip():
        raise DatasetError(path, "'prompt' is empty", line=line)
    return prompt


def _prompt_row(row: dict[str, Any], path: str, line: int) -> Parsed:
    prompt = row.get("prompt")
    if prompt is None:
        raise DatasetError(path, "format 'prompt': row has no 'prompt' (a string)", line=line)
    return _prompt_text(prompt, path, line), None


def _openai_row(row: dict[str, Any], path: str, line: int) -> Parsed:
    messages = row.get("messages")
    if messages is None:
        raise DatasetError(path, "format 'openai': row has no 'messages' (a chat list)", line=line)
    return None, _with_content(_parse_messages(messages, path, line), path, line)


def _sharegpt_row(row: dict[str, Any], path: str, line: int) -> Parsed:
    conversations = row.get("conversations")
    if conversations is None:
        raise DatasetError(
            path, "format 'sharegpt': row has no 'conversations' ({from, value} turns)", line=line
        )
    return None, _with_content(_parse_conversations(conversations, path, line), path, line)


def _any_row(row: dict[str, Any], path: str, line: int) -> Parsed:
    """A row of any of the formats: a prompt, else messages, else ShareGPT turns."""
    prompt = row.get("prompt")
    messages = row.get("messages")
    conversations = row.get("conversations")
    if prompt is None and messages is None and conversations is None:
        raise DatasetError(
            path,
            "row has neither 'prompt' (a string) nor 'messages' (a chat list) "
            "nor 'conversations' (ShareGPT turns)",
            line=line,
        )
    if prompt is not None:
        return _prompt_text(prompt, path, line), None
    if messages is not None:
        return None, _with_content(_parse_messages(messages, path, line), path, line)
    return None, _with_content(_parse_conversations(conversations, path, line), path, line)


def _with_content(
    messages: tuple[ChatMessage, ...], path: str, line: int
) -> tuple[ChatMessage, ...]:
    if not any(m.content.strip() for m in messages):
        raise DatasetError(path, "every message's 'content' is empty", line=line)
    return messages


def _mapped_row(
    row: dict[str, Any], path: str, line: int, format: DatasetFormat, columns: Columns
) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
    """(text, messages) of a row read through the dataset's column mapping."""
    try:
        if columns.prompt_field:
            return field_text(row, columns.prompt_field), None
        if columns.prompt_template is not None:
            text = columns.prompt_template.render(row)
            if not text.strip():
                raise DatasetError(path, "prompt_template left every paragraph out", line=line)
            return text, None
    except FieldError as exc:
        raise DatasetError(path, str(exc), line=line) from None
    field = columns.messages_field
    value = row.get(field)
    if value is None:
        raise DatasetError(path, f"field {field!r} is missing", line=line)
    return None, _with_content(PARSERS[format].turns(value, path, line, field), path, line)


def _sharegpt_shaped(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and isinstance(value[0], dict)
        and ("from" in value[0])
    )


def _turns_by_shape(value: Any, path: str, line: int, field: str) -> tuple[ChatMessage, ...]:
    """Chat turns of either kind, told apart by their shape: ShareGPT's or messages."""
    parse = _parse_conversations if _sharegpt_shaped(value) else _parse_messages
    return parse(value, path, line, field)


# Each format's parse functions, by its name in tokenbudget.core.formats.FORMAT_TRAITS
# (which this covers); "auto" and "hf" read any row.
PARSERS: Mapping[str, RowParser] = {
    "auto": RowParser(_any_row, _turns_by_shape),
    "prompt": RowParser(_prompt_row, _turns_by_shape),
    "openai": RowParser(_openai_row, _parse_messages),
    "sharegpt": RowParser(_sharegpt_row, _parse_conversations),
    "hf": RowParser(_any_row, _turns_by_shape),
}


def _chat_shaped(value: Any) -> bool:
    if not isinstance(value, list) or not value or not isinstance(value[0], dict):
        return False
    return {"role", "content"} <= value[0].keys() or {"from", "value"} <= value[0].keys()


def turn_positions(messages: Sequence[ChatMessage]) -> list[int]:
    """Where a regenerated conversation's turns are: the index of every assistant
    turn after the first user turn, and ``len(messages)`` when the conversation ends
    with a turn that awaits an answer (a user's, or a tool's result). Turn ``k``'s
    prompt is everything before ``positions[k]``."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        return []
    positions = [i for i, m in enumerate(messages) if m.role == "assistant" and i > users[0]]
    if messages[-1].role in ("user", "tool"):
        positions.append(len(messages))
    return positions


def select_turns(
    messages: tuple[ChatMessage, ...], turns: Turns, path: str, line: int
) -> list[tuple[int, tuple[ChatMessage, ...]]]:
    """The prompts a conversation gives: ``(turn index, messages to send)``.

    ``first``: everything up to and including the first user turn.
    ``all``: the history before every assistant turn (that has a user turn before
    it), and the whole conversation when it ends with an unanswered user turn.
    ``regenerate``: the history before the first turn to regenerate (see
    :func:`turn_positions`); the others are made from the model's answers.
    """
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        raise DatasetError(path, "the conversation has no user turn", line=line)
    if turns == "first":
        return [(users[0], messages[: users[0] + 1])]
    if turns == "regenerate":
        positions = turn_positions(messages)
        if not positions:
            raise DatasetError(path, "the conversation has no turn to generate", line=line)
        return [(0, messages[: positions[0]])]
    prompts = [
        (i, messages[:i]) for i, m in enumerate(messages) if m.role == "assistant" and i > users[0]
    ]
    if messages[-1].role == "user":
        prompts.append((len(messages), messages))
    if not prompts:
        raise DatasetError(path, "the conversation has no turn to generate", line=line)
    return prompts


class DatasetReader(ABC):
    """Yields ``(line, row)`` pairs or raises DatasetError for rows it cannot parse.

    Row-level errors are yielded as DatasetError instances so the caller decides
    whether one bad row stops the run.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def name(self) -> str:
        return str(self.path)

    @abstractmethod
    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]: ...


# A JSONL line longer than this is a bad row found by its length, never parsed: what
# a row gives its prompt event (prompt, id, kept columns, tools) takes at most
# PROMPT_EVENT_BYTES once the event is encoded, and a file may write each of those
# bytes as a JSON escape of up to six ("\u0041" for "A"), so a longer line cannot
# give an event that fits unless most of it is fields the job never reads (drop those).
ROW_BYTES = 6 * sizes.PROMPT_EVENT_BYTES
# Deeper rows are bad rows: parsers, encoders and the event decoders that read a row's
# values again (kept columns, tools) recurse once per level, and real rows (chat
# turns, tool schemas) nest a dozen levels at most.
MAX_ROW_DEPTH = 64
TOO_DEEP = f"nested more than {MAX_ROW_DEPTH} deep; flatten the row or drop it"
_TOO_DEEP = object()  # what a value nested past the parser's recursion limit reads as
# What a line is read in, so that one over ROW_BYTES is never held whole.
_PIECE_BYTES = 1024 * 1024


class JsonlReader(DatasetReader):
    """Lines are read in bounded pieces: one over :data:`ROW_BYTES` is a bad row
    and its remainder is passed over unread into memory; a line that cannot be
    parsed, or nests deeper than :data:`MAX_ROW_DEPTH`, is a bad row, whatever the
    parser raised."""

    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]:
        try:
            handle = self.path.open("rb")
        except OSError as exc:
            raise DatasetError(str(self.path), f"cannot open: {exc.strerror}") from exc
        with handle:
            number = 0
            while line := _bounded_line(handle):
                number += 1
                if len(line) - line.endswith(b"\n") > ROW_BYTES:
                    yield number, self._too_long(line, handle, number)
                elif line.strip():
                    yield number, self._parsed(line, number)

    def _parsed(self, raw: bytearray, number: int) -> Any | DatasetError:
        try:
            row = json.loads(raw)
        except RecursionError:
            message = TOO_DEEP
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, 5,000-digit ints
            message = f"not valid JSON: {exc}"
        except Exception as exc:  # MemoryError and the like: still this row's problem
            message = f"cannot be parsed: {type(exc).__name__}: {exc}"
        else:
            if not (_may_nest(raw) and _deeper_than(row, MAX_ROW_DEPTH)):
                return row
            message = TOO_DEEP
        text = raw.decode("utf-8", "replace").rstrip("\n")
        return DatasetError(
            str(self.path), message, line=number, excerpt=sizes.excerpt(text), size=len(raw)
        )

    def _too_long(self, head: bytearray, handle: BinaryIO, number: int) -> DatasetError:
        """The bad row of a line over :data:`ROW_BYTES` (``head``: what was read of
        it), its remainder read past and dropped piece by piece."""
        size = len(head)
        while not head.endswith(b"\n") and (piece := handle.readline(_PIECE_BYTES)):
            size += len(piece)
            if piece.endswith(b"\n"):
                break
        shown = head[: sizes.EXCERPT_CHARS].decode("utf-8", "ignore")
        return DatasetError(
            str(self.path),
            f"the line is {size:,} bytes, over the {ROW_BYTES:,} a row may take (six times "
            f"the {sizes.PROMPT_EVENT_BYTES:,} of its prompt event); split the row, or drop "
            "the fields the job does not read",
            line=number,
            excerpt=f"{shown}... (the rest of its {size:,} bytes not read)",
            size=size,
        )


def _bounded_line(handle: BinaryIO) -> bytearray:
    """The next line, or as much of it as goes past :data:`ROW_BYTES` (empty at the
    end of the file), read in pieces so that no more is ever held."""
    line = bytearray()
    while len(line) <= ROW_BYTES and (piece := handle.readline(_PIECE_BYTES)):
        line += piece
        if line.endswith(b"\n"):
            break
    return line


def _may_nest(raw: bytearray) -> bool:
    """Whether a line holds enough brackets to nest past :data:`MAX_ROW_DEPTH` (the
    common row does not, and is not walked)."""
    return raw.count(b"[") + raw.count(b"{") > MAX_ROW_DEPTH


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests lists and objects more than ``limit``
    deep; walked without recursion. (Parquet and Hugging Face rows need no walk:
    pyarrow refuses a Parquet schema nested past 49 lists, and ``datasets`` one past
    about 60, both under :data:`MAX_ROW_DEPTH`, and such a file is unreadable.)"""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _batch_rows(
    name: str,
    before: int,
    count: int,
    whole: Callable[[], list[Any]],
    one: Callable[[int], Any],
) -> Iterator[tuple[int, Any | DatasetError]]:
    """The rows of a batch of a table (rows ``before + 1`` on), converted to Python
    at once, or one by one when that fails (``one(i)``: its row ``i``), so that a
    value Python cannot hold (a date past the year 9999) is a bad row with its
    number, not the end of the reader."""
    try:
        rows: list[Any] | None = whole()
    except Exception:
        rows = None
    if rows is not None and len(rows) != count:
        rows = None
    for i in range(count):
        number = before + i + 1
        if rows is not None:
            yield number, rows[i]
            continue
        try:
            row = one(i)
        except Exception as exc:
            row = _as_row_error(exc, name, number)
        yield number, row


def _row_of(batch: Any) -> Callable[[int], Any]:
    """Row ``i`` of a record batch, converted alone."""

    def one(i: int) -> Any:
        return batch.slice(i, 1).to_pylist()[0]

    return one


class ParquetReader(DatasetReader):
    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]:
        try:
            parquet = pq.ParquetFile(self.path)
        except Exception as exc:  # OSError, ArrowInvalid, a schema nested too deep
            raise DatasetError(str(self.path), f"cannot read as Parquet: {exc}") from exc
        number = 0
        batches = parquet.iter_batches(batch_size=1024)
        while True:
            try:
                batch = next(batches, None)
            except (OSError, ValueError) as exc:  # a corrupt page: the rest is unreadable
                raise DatasetError(
                    str(self.path), f"cannot read past row {number:,}: {exc}"
                ) from exc
            if batch is None:
                return
            yield from _batch_rows(
                self.name, number, batch.num_rows, batch.to_pylist, _row_of(batch)
            )
            number += batch.num_rows


class SplitError(DatasetError):
    """A saved Hugging Face dataset has no such split, or needs one chosen."""


# Rows of a saved Hugging Face dataset converted at once.
_HF_BATCH = 1024


class HFDiskReader(DatasetReader):
    """A dataset saved with ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.

    Rows are numbered from 1; a ``DatasetDict`` needs ``split`` unless it has only
    one split or a ``train`` split.
    """

    def __init__(self, path: Path, split: str = "") -> None:
        super().__init__(path)
        self.split = split

    @property
    def name(self) -> str:
        return f"{self.path}[{self.split}]" if self.split else str(self.path)

    def _load(self) -> Any:
        if not self.path.is_dir():
            raise DatasetError(str(self.path), "a Hugging Face dataset on disk is a folder")
        datasets = require("datasets", f"{self.path}: format 'hf'")
        try:
            loaded = datasets.load_from_disk(str(self.path))
        except Exception as exc:  # OSError, ValueError, RecursionError of a deep schema
            raise DatasetError(
                str(self.path), f"cannot load with datasets.load_from_disk: {exc}"
            ) from exc
        if isinstance(loaded, datasets.DatasetDict):
            splits = list(loaded)
            split = self.split or ("train" if "train" in loaded else "")
            if not split and len(splits) == 1:
                split = splits[0]
            if split not in loaded:
                raise SplitError(
                    str(self.path),
                    f"choose a split with 'split' (this dataset has {', '.join(splits)})"
                    if not self.split
                    else f"no split {self.split!r} (this dataset has {', '.join(splits)})",
                )
            self.split = split
            return loaded[split]
        if self.split:
            raise SplitError(str(self.path), f"a single Dataset has no split {self.split!r}")
        return loaded

    def rows(self) -> Iterator[tuple[int, Any | DatasetError]]:
        dataset = self._load()
        for start in range(0, len(dataset), _HF_BATCH):
            count = min(_HF_BATCH, len(dataset) - start)
            yield from _batch_rows(self.name, start, count, *_hf_batch(dataset, start, count))


def _hf_batch(
    dataset: Any, start: int, count: int
) -> tuple[Callable[[], list[Any]], Callable[[int], Any]]:
    """The rows ``start``.. of a Hugging Face dataset, all at once and one at a time."""

    def whole() -> list[Any]:
        columns = dataset[start : start + count]
        return [
            dict(zip(columns, values, strict=True))
            for values in zip(*columns.values(), strict=True)
        ]

    def one(i: int) -> Any:
        return dataset[start + i]

    return whole, one


def _is_hf_folder(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def reader_for(
    path: Path, format: DatasetFormat = DEFAULT_FORMAT, split: str = ""
) -> DatasetReader:
    folder = FORMAT_TRAITS[format].folder
    if folder or (folder is None and _is_hf_folder(path)):
        return HFDiskReader(path, split)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return JsonlReader(path)
    if suffix in (".parquet", ".pq"):
        return ParquetReader(path)
    if path.is_dir():
        raise DatasetError(
            str(path), "a folder is read only as a saved Hugging Face dataset (format 'hf')"
        )
    raise DatasetError(str(path), f"{_unknown_type(path)}; {SUPPORTED}")


SUPPORTED = (
    "tokenbudget reads JSON lines (.jsonl, .json, .ndjson), Parquet (.parquet, .pq) "
    'and a folder saved by Hugging Face datasets\' save_to_disk (format = "hf")'
)


def _unknown_type(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return (
            "CSV is not read (its values have no types); convert it, e.g. python -c "
            '"import pyarrow.csv as c, pyarrow.parquet as p; '
            f"p.write_table(c.read_csv('{path.name}'), '{path.stem}.parquet')\""
        )
    return f"unknown file type {suffix!r}" if suffix else "a file without a suffix"


def _content_identity(text: str | None, messages: tuple[ChatMessage, ...] | None) -> str:
    content = (
        text if text is not None else json.dumps([[m.role, m.content] for m in messages or ()])
    )
    return "content:" + hashlib.blake2b(content.encode(), digest_size=16).hexdigest()


def _with_excerpt(exc: DatasetError, row: Any) -> DatasetError:
    """``exc`` with an excerpt of ``row`` for its dead letter, unless it has one."""
    if not exc.excerpt and not isinstance(row, DatasetError):
        whole = json.dumps(row, ensure_ascii=False, default=str)
        exc.excerpt, exc.size = sizes.excerpt(whole), len(whole.encode())
    return exc


def _as_row_error(exc: Exception, name: str, line: int) -> DatasetError:
    if isinstance(exc, DatasetError):
        return exc
    return DatasetError(name, f"cannot be read: {type(exc).__name__}: {exc}", line=line)


def _in_file_order(
    dataset: str,
    reader: DatasetReader,
    format: DatasetFormat,
    turns: Turns,
    on_bad_row: Callable[[DatasetError], None] | None,
    keep_columns: Sequence[str] = (),
    columns: Columns = DEFAULT_COLUMNS,
    stratum_field: str = "",
) -> Iterator[PromptRow]:
    occurrences: dict[str, int] = {}
    name = reader.name
    for line, row in reader.rows():
        try:
            if isinstance(row, DatasetError):
                raise row
            row_id, text, messages = parse_row(row, name, line, format, columns)
            selected = (
                [(-1, messages)] if messages is None else select_turns(messages, turns, name, line)
            )
            tools = parse_tools(row, name, line)
        except Exception as exc:  # a DatasetError, or what no rule foresaw: this row only
            error = _with_excerpt(_as_row_error(exc, name, line), row)
            if on_bad_row is None:
                raise error from (None if error is exc else exc)
            on_bad_row(error)
            continue
        identity = f"id:{row_id}" if row_id is not None else _content_identity(text, messages)
        seen = occurrences.get(identity, 0)
        occurrences[identity] = seen + 1
        if seen and row_id is not None:
            duplicate = DatasetError(name, f"duplicate id {row_id!r}", line=line)
            if on_bad_row is None:
                raise duplicate
            on_bad_row(_with_excerpt(duplicate, row))
            continue
        if seen:
            identity = f"{identity}#{seen}"
        kept = {c: row.get(c) for c in keep_columns} if keep_columns else None
        if turns == "regenerate" and messages is not None:
            conversation = stable_prompt_id(dataset, identity)
            yield PromptRow(
                prompt_id=turn_prompt_id(dataset, conversation, 0),
                source=f"{name}:{line}",
                messages=selected[0][1],
                row_id=row_id,
                input_columns=kept,
                tools=tools,
                conversation_id=conversation,
                turns=len(turn_positions(messages)),
                reference=messages,
                stratum=row.get(stratum_field) if stratum_field else None,
            )
            continue
        for turn, chosen in selected:
            # turns = "first" keeps the row's own identity (the ids of earlier
            # versions); every regenerated turn of "all" is a prompt of its own.
            key = f"{identity}@turn{turn}" if turns == "all" and chosen is not None else identity
            yield PromptRow(
                prompt_id=stable_prompt_id(dataset, key),
                source=f"{name}:{line}",
                text=text,
                messages=chosen,
                row_id=row_id,
                input_columns=kept,
                tools=tools,
                stratum=row.get(stratum_field) if stratum_field else None,
            )


def prompt_text(row: PromptRow) -> str:
    """The prompt's text, or its messages' contents joined: what its size is of."""
    if row.text is not None:
        return row.text
    return "\n".join(m.content for m in row.messages or ())


def row_error(row: PromptRow, message: str) -> DatasetError:
    """A bad row found after parsing (``row.source`` is ``path:line``), with an
    excerpt of its prompt."""
    path, _, line = row.source.rpartition(":")
    text = prompt_text(row)
    return DatasetError(
        path, message, line=int(line), excerpt=sizes.excerpt(text), size=len(text.encode())
    )


def _within_bytes(
    rows: Iterator[PromptRow], limit: int, on_bad_row: Callable[[DatasetError], None] | None
) -> Iterator[PromptRow]:
    for row in rows:
        size = len(prompt_text(row).encode())
        if size <= limit:
            yield row
            continue
        # Beyond any model's context window, and too large to carry through Kafka
        # with its answer: the server would refuse it after the wait for a slot.
        exc = row_error(
            row,
            f"the prompt is {size:,} bytes of UTF-8, over [producer] max_prompt_bytes = "
            f"{limit:,}; shorten the row or drop it",
        )
        if on_bad_row is None:
            raise exc
        on_bad_row(exc)


def _with_template(
    rows: Iterator[PromptRow],
    template: Template,
    on_bad_row: Callable[[DatasetError], None] | None,
    max_tokens: int | None = None,
) -> Iterator[PromptRow]:
    for row in rows:
        messages = row.messages or (ChatMessage(role="user", content=row.text or ""),)
        try:
            try:
                ids = template(messages)
            except DatasetError:
                raise
            except Exception as exc:  # jinja errors, role rules raised by the template
                raise row_error(row, f"the chat template failed: {exc}") from exc
            if not ids:
                raise row_error(row, "the chat template gave no tokens")
            if max_tokens and len(ids) > max_tokens:
                raise row_error(
                    row,
                    f"the templated prompt is {len(ids):,} tokens, over [producer] "
                    f"max_prompt_tokens = {max_tokens:,}; shorten the row or drop it",
                )
        except DatasetError as exc:
            if on_bad_row is None:
                raise
            on_bad_row(exc)
            continue
        yield replace(row, input_ids=tuple(ids))


def read_prompts(
    dataset: str,
    path: Path,
    *,
    on_bad_row: Callable[[DatasetError], None] | None = None,
    limit: int | None = None,
    format: DatasetFormat = DEFAULT_FORMAT,
    turns: Turns = "first",
    shuffle_seed: int | None = None,
    order: DatasetOrder | None = None,
    stratify_by: str = PROMPT_LENGTH,
    split: str = "",
    template: Template | None = None,
    keep_columns: Sequence[str] = (),
    samples: int = 1,
    columns: Columns = DEFAULT_COLUMNS,
    max_prompt_bytes: int | None = None,
    max_prompt_tokens: int | None = None,
) -> Iterator[PromptRow]:
    """Yield the dataset's prompts in ``order`` (:mod:`tokenbudget.producers.prompts.order`): the
    file's,
    shuffled, or stratified by ``stratify_by``, both seeded by ``shuffle_seed`` (0
    when unset); ``order`` unset: shuffled when there is a seed, else the file's.

    With ``on_bad_row`` set, bad rows are passed to it and skipped; without, the
    first bad row raises. ``limit`` counts prompts (after turns and ordering), so
    with a seed it takes a fixed random sample. ``template`` (messages -> ids)
    fills ``input_ids``; a plain prompt is templated as one user turn.
    ``keep_columns`` are copied from each row; ``samples`` (the dataset's ``n``)
    repeats each prompt as that many prompts of their own (:func:`with_samples`).
    ``columns`` says where the rows hold the prompt and the id.
    A prompt over ``max_prompt_bytes`` of UTF-8, or over ``max_prompt_tokens``
    once templated, is a bad row (None: no limit).
    """
    reader = reader_for(path, format, split)
    order = resolve_order(order, shuffle_seed)
    by_field = stratify_by if order == "stratified" and stratify_by != PROMPT_LENGTH else ""
    rows: Iterator[PromptRow] = _in_file_order(
        dataset, reader, format, turns, on_bad_row, keep_columns, columns, by_field
    )
    if max_prompt_bytes is not None:
        rows = _within_bytes(rows, max_prompt_bytes, on_bad_row)
    # Ids are fixed in file order first, so the order never changes an id.
    if order == "shuffled":
        everything = list(rows)
        random.Random(shuffle_seed or 0).shuffle(everything)
        rows = iter(everything)
    elif order == "stratified":
        key = _field_stratum if by_field else _length_stratum
        rows = iter(stratified(list(rows), key, shuffle_seed or 0))
    if template is not None:
        rows = _with_template(rows, template, on_bad_row, max_prompt_tokens)
    if limit is not None:
        rows = itertools.islice(rows, max(0, limit))
    return with_samples(dataset, rows, samples) if samples > 1 else rows


def _field_stratum(row: PromptRow) -> Any:
    return row.stratum


def _length_stratum(row: PromptRow) -> int:
    return prompt_length(row.text, row.messages)


def with_samples(dataset: str, rows: Iterator[PromptRow], samples: int) -> Iterator[PromptRow]:
    """Each prompt as ``samples`` prompts, one answer each: every answer is then
    budgeted, admitted, counted and deduplicated on its own, like any prompt. The
    first keeps the prompt's id (a run with n = 1 before it counts as that one)."""
    for row in rows:
        yield row
        for index in range(1, samples):
            yield replace(
                row,
                prompt_id=stable_prompt_id(dataset, f"{row.prompt_id}#sample{index}"),
                sample_index=index,
            )


def read_options(config: Config, dataset: Dataset) -> dict[str, Any]:
    """The :func:`read_prompts` keywords a configured dataset asks for."""
    template: Template | None = None
    if dataset.template:
        tokenizer = config_tokenizer(config)
        if tokenizer is None:  # config validation names the key first
            raise DatasetError(str(dataset.path), "template = true needs [inference] tokenizer")
        if not tokenizer.has_chat_template:
            raise ConfigError(
                "inference.tokenizer",
                f"{config.tokenizer_path} has no chat_template, which template = true applies",
                source=config.source,
            )
        options = dataset.sampling.get("chat_template_kwargs")
        template = functools.partial(tokenizer.apply_chat_template, options=options)
    return {
        "format": dataset.format,
        "turns": dataset.turns,
        "shuffle_seed": dataset.shuffle_seed,
        "order": dataset.order,
        "stratify_by": dataset.stratify_by,
        "split": dataset.split,
        "template": template,
        "keep_columns": dataset.keep_columns,
        "samples": dataset.n,
        "columns": dataset.columns,
        "max_prompt_bytes": config.producer.max_prompt_bytes,
        "max_prompt_tokens": config.producer.max_prompt_tokens or None,
    }


# Enough rows to see what a dataset holds, few enough to cost nothing before a run.
PEEK_ROWS = 1000


def first_chat_row(
    path: Path,
    format: DatasetFormat = DEFAULT_FORMAT,
    split: str = "",
    *,
    peek: int = PEEK_ROWS,
    columns: Columns = DEFAULT_COLUMNS,
) -> str | None:
    """``path:line`` of the first conversation among the first ``peek`` rows, or None.

    Bad and unreadable rows are passed over: reading the dataset reports them."""
    try:
        reader = reader_for(path, format, split)
        for line, row in itertools.islice(reader.rows(), peek):
            if not isinstance(row, DatasetError) and _chat_row(
                reader.name, line, row, format, columns
            ):
                return f"{reader.name}:{line}"
    except DatasetError:
        pass  # a file that cannot be read stops the producer with its own error
    return None


def _chat_row(name: str, line: int, row: Any, format: DatasetFormat, columns: Columns) -> bool:
    try:
        return parse_row(row, name, line, format, columns)[2] is not None
    except DatasetError:
        return False


# ---- before a job starts: what the first rows of each dataset say -------------------

# Fields that often hold the prompt, in the order they are suggested.
PROMPT_FIELD_GUESSES = ("question", "query", "problem", "instruction", "input", "text")
ALPACA_TEMPLATE = "{instruction}\n\n{input?}"


def check_datasets(config: Config, *, peek: int = PEEK_ROWS) -> None:
    """Everything about the datasets that can be known before a job starts, from the
    first ``peek`` rows of each (never a whole file), so that ``run`` and ``produce``
    stop before any broker or server is touched: a dataset at all; each file there,
    of a known type and readable; its rows giving prompts through the dataset's
    format and column mapping; an ``id_field`` other than ``id`` in its rows; no chat
    rows bound untemplated for a raw-text API. Raises ConfigError naming the key.
    (A ``keep_columns`` entry no row has is allowed: it is kept as null.)"""
    config.require_datasets()
    for index, dataset in enumerate(config.datasets):
        key = f"datasets[{index}]"
        name, rows = _peek(dataset, key, config.source, peek)
        _check_rows(config, dataset, key, name, rows, peek)


def _peek(dataset: Dataset, key: str, source: str, peek: int) -> tuple[str, list[tuple[int, Any]]]:
    """The reader's name for the dataset and its first ``peek`` rows."""
    if not dataset.path.exists():
        raise ConfigError(
            f"{key}.path",
            f"{dataset.path} does not exist (a relative path is read from the config "
            "file's folder)",
            source=source,
        )
    try:
        reader = reader_for(dataset.path, dataset.format, dataset.split)
        return reader.name, list(itertools.islice(reader.rows(), peek))
    except SplitError as exc:
        raise ConfigError(f"{key}.split", str(exc), source=source) from exc
    except DatasetError as exc:
        raise ConfigError(f"{key}.path", str(exc), source=source) from exc


@dataclass(frozen=True)
class _Survey:
    """What a dataset's first rows give through its format and column mapping."""

    prompts: int  # rows that give a prompt
    first_error: DatasetError | None
    chat_at: str | None  # path:line of the first chat row
    objects: list[dict[str, Any]]  # the rows that are objects


def _survey(dataset: Dataset, name: str, rows: list[tuple[int, Any]]) -> _Survey:
    first_error: DatasetError | None = None
    prompts = 0
    chat_at = None
    for line, row in rows:
        try:
            if isinstance(row, DatasetError):
                raise row
            messages = parse_row(row, name, line, dataset.format, dataset.columns)[2]
        except DatasetError as exc:
            first_error = first_error or exc
            continue
        prompts += 1
        if messages is not None and chat_at is None:
            chat_at = f"{name}:{line}"
    objects = [row for _, row in rows if isinstance(row, dict)]
    return _Survey(prompts, first_error, chat_at, objects)


def _check_rows(
    config: Config,
    dataset: Dataset,
    key: str,
    name: str,
    rows: list[tuple[int, Any]],
    peek: int,
) -> None:
    survey = _survey(dataset, name, rows)
    first_error, chat_at, objects = survey.first_error, survey.chat_at, survey.objects
    if first_error is not None and not survey.prompts:
        read = _rows_read(len(rows), peek)
        raise _no_prompts(dataset, key, read, first_error, objects, config.source)
    if dataset.turns == "regenerate" and survey.prompts and chat_at is None:
        raise ConfigError(
            f"{key}.turns",
            f"'regenerate' regenerates conversations turn by turn, but "
            f"{_rows_read(len(rows), peek)} of {name} hold plain prompts: point "
            'messages_field at the conversations, or set turns = "first"',
            source=config.source,
        )
    api = config.inference.api
    # Explicit chat formats never get here untemplated: config validation refused them.
    if chat_at and not API_TRAITS[api].chat and not dataset.template:
        found = f"{chat_at} holds messages"
        raise untemplated_chat(key, dataset.name, api, found, config.source)
    # Rows without an id are identified by their content: a misspelt id_field would
    # change every prompt id, the key a rerun resumes by.
    id_field = dataset.columns.id_field
    missing = bool(objects) and not any(id_field in row for row in objects)
    if id_field != DEFAULT_COLUMNS.id_field and missing:
        raise ConfigError(
            f"{key}.id_field",
            f"no field {id_field!r} in {_rows_read(len(rows), peek)} of {name} "
            f"(their fields: {_fields(objects)})",
            source=config.source,
        )
    # A misspelt stratify_by would put every row in one stratum: file order in effect.
    by = dataset.stratify_by
    by_field = dataset.order == "stratified" and by != PROMPT_LENGTH
    if by_field and objects and not any(by in row for row in objects):
        raise ConfigError(
            f"{key}.stratify_by",
            f"no field {by!r} in {_rows_read(len(rows), peek)} of {name} (their fields: "
            f'{_fields(objects)}); or stratify_by = "{PROMPT_LENGTH}"',
            source=config.source,
        )


def _rows_read(count: int, peek: int) -> str:
    if count >= peek:
        return f"the first {count} rows"
    return "the only row" if count == 1 else f"the {count} rows"


def _fields(objects: list[dict[str, Any]], most: int = 20) -> str:
    names = list(dict.fromkeys(name for row in objects for name in row))
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def suggest_mapping(row: dict[str, Any]) -> tuple[str, str] | None:
    """The column mapping a row's fields suggest: (key, value), or None."""
    if isinstance(row.get("instruction"), str) and "input" in row:
        return "prompt_template", ALPACA_TEMPLATE
    for name, value in row.items():
        if name not in ("messages", "conversations") and _chat_shaped(value):
            return "messages_field", name
    for name in PROMPT_FIELD_GUESSES:
        if isinstance(row.get(name), str):
            return "prompt_field", name
    return None


def _suggestion(dataset: Dataset, row: dict[str, Any]) -> tuple[str, str] | None:
    """What to set for a dataset whose first rows give no prompt, judged from ``row``."""
    if FORMAT_TRAITS[dataset.format].chat is not None:  # a format of one kind of rows
        try:
            parse_row(row, "", 0, DEFAULT_FORMAT, dataset.columns)
            return "format", DEFAULT_FORMAT  # the rows are fine, the format is not theirs
        except DatasetError:
            pass
    suggestion = suggest_mapping(row)
    return None if suggestion == dataset.columns.mapping else suggestion


def _no_prompts(
    dataset: Dataset,
    key: str,
    read: str,
    error: DatasetError,
    objects: list[dict[str, Any]],
    source: str,
) -> ConfigError:
    """The first rows give no prompt at all: which key to set, and to what."""
    columns = dataset.columns
    message = f"no prompt in {read} (first problem: {error})"
    if objects:
        message += f"; their fields: {_fields(objects)}"
    suggestion = _suggestion(dataset, objects[0]) if objects else None
    if suggestion is None:
        option = columns.key or "prompt_field"
        fix = (
            'say where the prompt is with prompt_field = "<field>", prompt_template = '
            '"<text with {field} and {field?}>" or messages_field = "<field>"'
        )
    else:
        option, value = suggestion
        fix = f"set {option} = {json.dumps(value)}"
        if columns.key and option != "format" and columns.key != option:
            fix += f" in place of {columns.key}"
        if option in FORMAT_TRAITS[dataset.format].conflicts:
            fix += f' and format = "{DEFAULT_FORMAT}"'
    message = f"{message}: {fix} (docs/datasets.md: Column mapping)"
    return ConfigError(f"{key}.{option}", message, source=source)


# ---- a dataset nobody has configured yet (tokenbudget init) ---------------------------


@dataclass(frozen=True)
class DatasetShape:
    """What the first rows of a dataset file say about it, for ``tokenbudget init``."""

    read_as: str  # JSON lines, Parquet, a saved Hugging Face dataset
    rows: int  # rows read (at most PEEK_ROWS)
    prompts: int  # of them, the rows that give a prompt
    mapping: tuple[str, str] | None  # the column mapping they need: (key, value)
    chat: bool  # they give chat turns
    fields: str  # the rows' fields


_READ_AS = {
    JsonlReader: "JSON lines",
    ParquetReader: "Parquet",
    HFDiskReader: "a saved Hugging Face dataset",
}


def describe_dataset(path: Path, key: str, source: str, *, peek: int = PEEK_ROWS) -> DatasetShape:
    """Read the first ``peek`` rows of ``path`` as :func:`check_datasets` does and say
    what they hold: with ``format = "auto"``, the rows as they are, else through the
    column mapping their fields suggest (:func:`suggest_mapping`). Raises the same
    ConfigError as :func:`check_datasets` (under ``key``) when they give no prompt."""
    # Only the reading matters here: the budget and max_new_tokens are never used.
    dataset = Dataset(
        name="new", path=path, budget=1, format=DEFAULT_FORMAT, max_new_tokens=1, limit=None
    )
    name, rows = _peek(dataset, key, source, peek)
    if not rows:
        raise ConfigError(f"{key}.path", f"{name} has no rows", source=source)
    survey = _survey(dataset, name, rows)
    mapping = None
    if not survey.prompts and survey.objects:
        mapping = _suggestion(dataset, survey.objects[0])
        if mapping is not None:
            columns = _mapped_columns(*mapping)
            survey = _survey(msgspec_replace(dataset, columns=columns), name, rows)
    if not survey.prompts:
        error = survey.first_error or DatasetError(name, "no prompt")
        read = _rows_read(len(rows), peek)
        raise _no_prompts(dataset, key, read, error, survey.objects, source)
    return DatasetShape(
        read_as=_READ_AS.get(type(reader_for(path)), "rows"),
        rows=len(rows),
        prompts=survey.prompts,
        mapping=mapping,
        chat=survey.chat_at is not None,
        fields=_fields(survey.objects),
    )


def _mapped_columns(key: str, value: str) -> Columns:
    if key == "prompt_template":
        return Columns(prompt_template=PromptTemplate.parse(value))
    if key == "messages_field":
        return Columns(messages_field=value)
    return Columns(prompt_field=value)
