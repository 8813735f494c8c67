"""``tokenbudget export``: the kept completions in the formats trainers read.

Three formats, every one loadable with Hugging Face ``datasets.load_dataset``:

* ``conversations``: JSONL, one object per kept answer, ``{"id", "conversations":
  [{"role", "content"}, ...]}``: the prompt's turns (or the prompt as one user
  turn), then the answer as the assistant turn, with the thinking the server split
  off in its ``reasoning_content`` (the shape thinking models' Hugging Face chat
  templates read). The shape SpecForge's and vLLM speculators' regeneration scripts
  write.
* ``messages``: the same turns under ``"messages"`` (OpenAI chat format).
* ``parquet``: a folder of Parquet files (``data/train-*.parquet``) with every
  column of the sink's rows.

Every record also carries ``dataset``, ``prompt_id``, ``sample_index``, ``model``,
``finish_reason`` (the server's), ``stop_reason`` (``budget`` where the budget's
line ended the answer, else the server's reason), ``reasoning_tokens``,
``unfinished`` and the row's kept input columns (``[[datasets]] keep_columns``, at
the top level in JSONL, as their JSON text in Parquet). ``with_ids`` adds
``input_ids`` (the prompt's ids then the answer's) and ``loss_mask`` (0 over the
prompt, 1 over the answer), for drafter training. The answer's ids are every token
the model generated, its thinking included (the server's ids are the raw output,
whether or not it split the reasoning off the text), so the mask covers the
thinking as the chat template renders it in the last assistant turn.
``drop_unfinished`` leaves out the rows cut while still thinking (they hold no
answer).

The rows come from the sink's Parquet output, any version's files
(:func:`sinks.parquet.read_rows`); ``tokenbudget export --from-topic`` first
replays the completion topic with the sink's rules (:mod:`sinks.replay`).

Contract: an answer is exported whole or the export stops with what to fix. An
answer cut at the budget's line keeps its token ids but no text (the text cannot
be cut without the tokenizer): it is decoded with ``tokenizer`` when one is
given; otherwise it is a :class:`~tokenbudget.errors.ExportError`, unless
``with_ids`` (the ids are the training data). A ``with_ids`` export of a row
without prompt or answer ids is an error too. Files are written whole (temporary
name, then rename), so a failed export leaves no half file behind.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sinks.parquet import conform, output_files
from tokenbudget.errors import ExportError

Format = Literal["conversations", "messages", "parquet"]
FORMATS: tuple[Format, ...] = ("conversations", "messages", "parquet")
# Decodes a cut answer's ids to its text (a local tokenizer's decode).
Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class ExportOptions:
    format: Format
    to: Path
    source: Path  # the sink's output folder
    datasets: frozenset[str] = frozenset()  # empty: all
    with_ids: bool = False
    decode: Decode | None = None
    drop_unfinished: bool = False


@dataclass
class ExportSummary:
    rows: Counter[str] = field(default_factory=Counter)  # per dataset
    files: list[Path] = field(default_factory=list)
    decoded: int = 0  # cut answers whose text came from their ids
    unfinished: Counter[str] = field(default_factory=Counter)  # left out, per dataset

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": dict(self.rows),
            "files": [str(f) for f in self.files],
            "decoded": self.decoded,
            "unfinished_dropped": dict(self.unfinished),
        }


def export(options: ExportOptions) -> ExportSummary:
    """Write every kept row of the chosen datasets under ``options.to``."""
    if options.datasets:
        files = [f for name in sorted(options.datasets) for f in output_files(options.source, name)]
    else:
        files = output_files(options.source)
    if not files:
        raise ExportError(
            f"no rows to export in {options.source}: run the job (or `tokenbudget export "
            "--from-topic`) first, or check --dataset"
        )
    summary = ExportSummary()
    if options.format == "parquet":
        _export_parquet(files, options, summary)
    else:
        _write_whole(options.to, lambda out: _export_jsonl(files, options, summary, out))
        summary.files.append(options.to)
    return summary


def _tables(
    files: list[Path], options: ExportOptions, summary: ExportSummary
) -> Iterator[pa.Table]:
    """Each file's rows in the sink's schema (file by file: memory stays bounded),
    without the unfinished ones when asked."""
    for file in files:
        table = conform(pq.read_table(file))
        table = table.set_column(
            table.schema.get_field_index("dataset"),
            "dataset",
            table.column("dataset").cast(pa.string()),  # datasets can't load dictionaries
        )
        if options.drop_unfinished:
            cut = pc.fill_null(table.column("unfinished"), False)
            summary.unfinished.update(table.filter(cut).column("dataset").to_pylist())
            table = table.filter(pc.invert(cut))
        yield table


def _export_jsonl(
    files: list[Path], options: ExportOptions, summary: ExportSummary, out: Any
) -> None:
    turns_key = "conversations" if options.format == "conversations" else "messages"
    for table in _tables(files, options, summary):
        for row in table.to_pylist():
            record = training_record(row, turns_key, options, summary)
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            summary.rows[row["dataset"]] += 1


def training_record(
    row: dict[str, Any], turns_key: str, options: ExportOptions, summary: ExportSummary
) -> dict[str, Any]:
    """One row as a JSONL record: its kept input columns, then ours (which win a
    name both have)."""
    record: dict[str, Any] = json.loads(row["input_columns"] or "{}")
    record.update(
        id=row["row_id"] if row["row_id"] is not None else row["prompt_id"],
        dataset=row["dataset"],
        prompt_id=row["prompt_id"],
        sample_index=row["sample_index"] or 0,
        model=row["model"],
        finish_reason=row["finish_reason"],
        stop_reason=row["stop_reason"],
        reasoning_tokens=row["reasoning_tokens"],
        unfinished=row["unfinished"],
    )
    reply = {"role": "assistant", "content": answer(row, options, summary)}
    if row["reasoning"] is not None:
        reply["reasoning_content"] = row["reasoning"]
    record[turns_key] = [*prompt_turns(row), reply]
    if options.with_ids:
        record["input_ids"], record["loss_mask"] = ids_and_mask(row)
    return record


def prompt_turns(row: dict[str, Any]) -> list[dict[str, str]]:
    if row["messages"] is not None:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    return [{"role": "user", "content": row["prompt"] or ""}]


def answer(row: dict[str, Any], options: ExportOptions, summary: ExportSummary) -> str:
    """The answer's text; a cut answer's from its ids (see the module's contract). A
    row with reasoning has its texts (its answer may be empty: cut while thinking)."""
    text: str = row["text"] or ""
    ids = row["output_ids"]
    if text or not ids or row["reasoning"] is not None:
        return text
    if options.decode is not None:
        summary.decoded += 1
        return options.decode(ids)
    if options.with_ids:
        return ""
    raise ExportError(
        f"answer {row['request_id']} of dataset {row['dataset']!r} was cut at the budget's "
        "line and kept as token ids only: pass --tokenizer DIR (or set [inference] "
        "tokenizer in --config) to decode it, or export --with-ids"
    )


def ids_and_mask(row: dict[str, Any]) -> tuple[list[int], list[int]]:
    prompt, output = row["prompt_ids"], row["output_ids"]
    if prompt is None or output is None:
        missing = "prompt_ids" if prompt is None else "output_ids"
        fix = (
            "apply the chat template here (template = true with [inference] tokenizer) or "
            "use a server that returns prompt token ids"
            if prompt is None
            else "use a server that returns token ids (return_token_ids)"
        )
        raise ExportError(
            f"--with-ids: answer {row['request_id']} of dataset {row['dataset']!r} has no "
            f"{missing}: {fix}, or export without --with-ids"
        )
    return [*prompt, *output], [0] * len(prompt) + [1] * len(output)


def _export_parquet(files: list[Path], options: ExportOptions, summary: ExportSummary) -> None:
    folder = options.to / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("train-*.parquet"):
        stale.unlink()  # a re-export replaces the last one
    for i, table in enumerate(_tables(files, options, summary)):
        table = _with_answers(table, options, summary)
        if options.with_ids:
            table = _with_ids(table)
        # "train-NNNNN" is a name datasets.load_dataset(folder) reads as the train split
        path = folder / f"train-{i:05d}.parquet"
        _write_whole(path, functools.partial(pq.write_table, table), binary=True)
        summary.files.append(path)
        summary.rows.update(table.column("dataset").to_pylist())


def _with_answers(table: pa.Table, options: ExportOptions, summary: ExportSummary) -> pa.Table:
    """The ``text`` column with every cut answer's text (see :func:`answer`)."""
    needed = table.select(["text", "reasoning", "output_ids", "request_id", "dataset"])
    texts = [answer(row, options, summary) for row in needed.to_pylist()]
    return table.set_column(table.schema.get_field_index("text"), "text", pa.array(texts))


def _with_ids(table: pa.Table) -> pa.Table:
    needed = table.select(["prompt_ids", "output_ids", "request_id", "dataset"])
    pairs = [ids_and_mask(row) for row in needed.to_pylist()]
    return table.append_column(
        "input_ids", pa.array([p[0] for p in pairs], pa.list_(pa.int32()))
    ).append_column("loss_mask", pa.array([p[1] for p in pairs], pa.list_(pa.int8())))


def _write_whole(path: Path, write: Callable[[Any], None], *, binary: bool = False) -> None:
    """``write(handle)`` into a temporary beside ``path``, renamed over it on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with temporary.open("wb" if binary else "w", encoding=None if binary else "utf-8") as out:
            write(out)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
