"""A dataset's prompts, with stable ids: its file read (:mod:`.readers`), each row parsed
by its format (:mod:`.rows`), templated, bounded, and put in the order the dataset
asks for (:mod:`tokenbudget.producers.prompts.order`).

    readers.py         a file, row by row (JSONL, Parquet, a saved Hugging Face folder)
    rows.py            a row as prompts: the formats' parse functions, the column
                       mapping, the turns a conversation gives
    ids.py             prompt ids, stable across runs and orders
    dataset_checks.py  the first rows of every dataset, read before a job starts
    datasets.py        :func:`read_prompts`: all of it, for the prompt producer

Bad rows raise :class:`~tokenbudget.core.errors.DatasetError` naming file and line,
with an excerpt of the row for its dead letter; :func:`read_prompts` either skips them
(reporting each through ``on_bad_row``) or stops, per config. A prompt over
``max_prompt_bytes`` of UTF-8 (or ``max_prompt_tokens`` once templated) is a bad row
too, and so is a row the readers refuse before any rule sees it.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenbudget.core import sizes
from tokenbudget.core.columns import (
    DEFAULT_COLUMNS,
    Columns,
)
from tokenbudget.core.config import Dataset
from tokenbudget.core.config_checks import resolve_order
from tokenbudget.core.errors import ConfigError, DatasetError
from tokenbudget.core.formats import DEFAULT_FORMAT, DatasetFormat, Turns
from tokenbudget.core.sections import PROMPT_LENGTH, DatasetOrder
from tokenbudget.producers.prompts.ids import content_identity, stable_prompt_id, turn_prompt_id
from tokenbudget.producers.prompts.order import prompt_length, stratified
from tokenbudget.producers.prompts.readers import DatasetReader, as_row_error, reader_for
from tokenbudget.producers.prompts.rows import (
    PromptRow,
    Template,
    parse_row,
    parse_tools,
    select_turns,
    turn_positions,
)
from tokenbudget.producers.templates import config_tokenizer
from tokenbudget.streams.fields import ChatMessage

if TYPE_CHECKING:
    from tokenbudget.core.config import Config


def _with_excerpt(exc: DatasetError, row: Any) -> DatasetError:
    """``exc`` with an excerpt of ``row`` for its dead letter, unless it has one."""
    if not exc.excerpt and not isinstance(row, DatasetError):
        whole = json.dumps(row, ensure_ascii=False, default=str)
        exc.excerpt, exc.size = sizes.excerpt(whole), len(whole.encode())
    return exc


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
            error = _with_excerpt(as_row_error(exc, name, line), row)
            if on_bad_row is None:
                raise error from (None if error is exc else exc)
            on_bad_row(error)
            continue
        identity = f"id:{row_id}" if row_id is not None else content_identity(text, messages)
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
