"""Before a job starts: :func:`check_datasets` reads the first rows of every dataset and
stops with the config key to fix when a dataset cannot work at all (no prompt where
the mapping looks, chat rows bound for a raw-text API without a template), suggesting
a mapping when the rows hold the prompt under another name; :func:`describe_dataset`
says what a file holds, for ``tokenbudget init``.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace as msgspec_replace

from tokenbudget.core.apis import API_TRAITS
from tokenbudget.core.columns import (
    DEFAULT_COLUMNS,
    Columns,
    PromptTemplate,
)
from tokenbudget.core.config import Dataset
from tokenbudget.core.config_checks import untemplated_chat
from tokenbudget.core.errors import ConfigError, DatasetError
from tokenbudget.core.formats import DEFAULT_FORMAT, FORMAT_TRAITS, DatasetFormat
from tokenbudget.core.sections import PROMPT_LENGTH
from tokenbudget.producers.prompts.readers import (
    HFDiskReader,
    JsonlReader,
    ParquetReader,
    SplitError,
    reader_for,
)
from tokenbudget.producers.prompts.rows import chat_shaped, parse_row

if TYPE_CHECKING:
    from tokenbudget.core.config import Config


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
        if name not in ("messages", "conversations") and chat_shaped(value):
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
