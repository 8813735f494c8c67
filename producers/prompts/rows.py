"""A dataset's row as prompts: each row format's parse function (:data:`PARSERS`, one
per row of :data:`tokenbudget.core.formats.FORMAT_TRAITS`), the column mapping
(:mod:`tokenbudget.core.columns`: ``prompt_field``, ``prompt_template``,
``messages_field``, ``id_field``), and the turns a conversation gives (``turns``).

* ``prompt``   rows ``{"prompt": "..."}``
* ``openai``   rows ``{"messages": [{"role", "content"}, ...]}`` (OpenAI chat)
* ``sharegpt`` rows ``{"conversations": [{"from", "value"}, ...]}`` (``human``/``gpt``/
  ``system``...), mapped to chat messages
* ``auto``     any of the above, per row

Chat rows may hold tool use as OpenAI's chat format writes it: assistant turns with
``tool_calls`` (their ``content`` may then be null), ``tool`` turns with
``tool_call_id``, and the row's ``tools`` (the definitions, a list or its JSON text).

Conversations give one prompt (``turns = "first"``: the turns up to and including
the first user turn) or one per assistant turn (``turns = "all"``: the history
before each assistant turn, which is regenerated; plus a trailing user turn that
has no answer yet). With ``turns = "regenerate"`` a conversation gives the prompt
of its first turn only, carrying the whole conversation as recorded
(:mod:`tokenbudget.producers.prompts.conversations`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenbudget.core.columns import (
    DEFAULT_COLUMNS,
    Columns,
    FieldError,
    field_text,
)
from tokenbudget.core.errors import DatasetError
from tokenbudget.core.formats import DEFAULT_FORMAT, DatasetFormat, Turns
from tokenbudget.streams.fields import ChatMessage, ToolCall

# Deeper rows are bad rows: parsers, encoders and the event decoders that read a row's
# values again (kept columns, tools) recurse once per level, and real rows (chat
# turns, tool schemas) nest a dozen levels at most.
MAX_ROW_DEPTH = 64
TOO_DEEP = f"nested more than {MAX_ROW_DEPTH} deep; flatten the row or drop it"
TOO_DEEP_VALUE = object()  # what a value nested past the parser's recursion limit reads as

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
            value = TOO_DEEP_VALUE
        except ValueError as exc:
            raise DatasetError(path, f"'tools' is not valid JSON: {exc}", line=line) from None
        if value is TOO_DEEP_VALUE or deeper_than(value, MAX_ROW_DEPTH):
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


def chat_shaped(value: Any) -> bool:
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


def deeper_than(value: Any, limit: int) -> bool:
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
