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
answer). Rows with tools carry them (``tools``), turns with tool calls carry them as
OpenAI's chat format writes them (``tool_calls``, ``tool_call_id``).

Conversations regenerated turn by turn (``turns = "regenerate"``: rows with a
``conversation_id``) are one record each in the JSONL formats: every turn in order,
each assistant turn with its own ``reasoning_content``, marked ``complete`` only when
every turn the dataset has was regenerated and ended by the model with the calls
the dataset recorded (``tool_mismatch`` says when a call differed). Such a record
has ``conversation_id``, ``prompt_ids`` (every turn's; ``prompt_id`` is the first's),
``turns`` (regenerated), ``turns_in_dataset``, ``complete``, ``tool_mismatch``, the
last turn's ``finish_reason`` and ``stop_reason``, and ``reasoning_tokens`` summed;
``drop_incomplete`` leaves the incomplete ones out (in ``parquet`` too, every row of
them). Their ids are per turn: ``with_ids`` takes the ``parquet`` format, one row
per turn.

The rows come from the sink's Parquet output, any version's files
(:func:`tokenbudget.sinks.parquet.read_rows`); ``tokenbudget export --from-topic`` first
replays the completion topic with the sink's rules (:mod:`tokenbudget.sinks.replay`).

Contract: an answer is exported whole or the export stops with what to fix. An
answer cut at the budget's line keeps its token ids but no text (the text cannot
be cut without the tokenizer): it is decoded with ``tokenizer`` when one is
given; otherwise it is a :class:`~tokenbudget.core.errors.ExportError`, unless
``with_ids`` (the ids are the training data). A ``with_ids`` export of a row
without prompt or answer ids is an error too. Files are written whole (temporary
name, then rename), so a failed export leaves no half file behind.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenbudget.core.errors import ExportError
from tokenbudget.core.files import atomic_file
from tokenbudget.sinks.parquet import conform, output_files

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
    drop_incomplete: bool = False  # conversations regenerated turn by turn, not whole


@dataclass
class ExportSummary:
    rows: Counter[str] = field(default_factory=Counter)  # per dataset
    files: list[Path] = field(default_factory=list)
    decoded: int = 0  # cut answers whose text came from their ids
    unfinished: Counter[str] = field(default_factory=Counter)  # left out, per dataset
    conversations: Counter[str] = field(default_factory=Counter)  # records that are
    incomplete: Counter[str] = field(default_factory=Counter)  # conversations left out

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": dict(self.rows),
            "files": [str(f) for f in self.files],
            "decoded": self.decoded,
            "unfinished_dropped": dict(self.unfinished),
            "conversations": dict(self.conversations),
            "incomplete_dropped": dict(self.incomplete),
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
        with atomic_file(options.to) as out:
            _export_jsonl(files, options, summary, out)
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
    # A conversation's turns may be in several files: written once all are read.
    turns: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for table in _tables(files, options, summary):
        for row in table.to_pylist():
            if row["conversation_id"] is not None:
                turns.setdefault((row["dataset"], row["conversation_id"]), []).append(row)
                continue
            record = training_record(row, turns_key, options, summary)
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            summary.rows[row["dataset"]] += 1
    for (dataset, _), rows in turns.items():
        rows.sort(key=lambda row: row["turn"])
        if options.drop_incomplete and not complete(rows):
            summary.incomplete[dataset] += 1
            continue
        record = conversation_record(rows, turns_key, options, summary)
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        summary.rows[dataset] += 1
        summary.conversations[dataset] += 1


def complete(rows: list[dict[str, Any]]) -> bool:
    """A conversation's turns (in order) are every turn it has, each ended by the
    model (no cut, no unfinished answer) with the calls the dataset recorded."""
    return [row["turn"] for row in rows] == list(range(rows[-1]["turns"] or 0)) and all(
        row["stop_reason"] in (None, "stop") and not row["unfinished"] and not row["tool_mismatch"]
        for row in rows
    )


def conversation_record(
    rows: list[dict[str, Any]], turns_key: str, options: ExportOptions, summary: ExportSummary
) -> dict[str, Any]:
    """One conversation's rows (in turn order) as one JSONL record: the last turn's
    history (the dataset's turns and the model's earlier answers, as sent), its
    answer, and each assistant turn's own reasoning."""
    if options.with_ids:
        raise ExportError(
            f"--with-ids: dataset {rows[0]['dataset']!r} holds conversations regenerated "
            "turn by turn, whose token ids are per turn: export them with --format parquet "
            "--with-ids (one row per turn, each with its input_ids and loss_mask)"
        )
    last = rows[-1]
    turns = [*prompt_turns(last), reply(last, options, summary)]
    for row in rows[:-1]:
        # the history a later turn was sent holds this turn's answer right after its
        # own prompt
        at = len(row["messages"] or ())
        if at < len(turns) and turns[at]["role"] == "assistant" and row["reasoning"] is not None:
            turns[at]["reasoning_content"] = row["reasoning"]
    record: dict[str, Any] = json.loads(last["input_columns"] or "{}")
    thinking = [row["reasoning_tokens"] for row in rows if row["reasoning_tokens"] is not None]
    # The keys a single answer's record has keep their types, so one file may hold
    # both kinds and still load as one table.
    record.update(
        id=last["row_id"] if last["row_id"] is not None else last["conversation_id"],
        dataset=last["dataset"],
        prompt_id=rows[0]["prompt_id"],
        sample_index=0,
        model=last["model"],
        finish_reason=last["finish_reason"],
        stop_reason=last["stop_reason"],
        reasoning_tokens=sum(thinking) if thinking else None,
        unfinished=any(bool(row["unfinished"]) for row in rows),
        conversation_id=last["conversation_id"],
        prompt_ids=[row["prompt_id"] for row in rows],
        turns=len(rows),
        turns_in_dataset=last["turns"],
        complete=complete(rows),
        tool_mismatch=any(bool(row["tool_mismatch"]) for row in rows),
    )
    if last["tools"] is not None:
        record["tools"] = json.loads(last["tools"])
    record[turns_key] = turns
    return record


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
    if row["tools"] is not None:
        record["tools"] = json.loads(row["tools"])
    record[turns_key] = [*prompt_turns(row), reply(row, options, summary)]
    if options.with_ids:
        record["input_ids"], record["loss_mask"] = ids_and_mask(row)
    return record


def reply(row: dict[str, Any], options: ExportOptions, summary: ExportSummary) -> dict[str, Any]:
    """The row's answer as the assistant turn: its text, its reasoning and its calls."""
    turn: dict[str, Any] = {"role": "assistant", "content": answer(row, options, summary)}
    if row["reasoning"] is not None:
        turn["reasoning_content"] = row["reasoning"]
    if row["tool_calls"]:
        turn["tool_calls"] = _openai_calls(row["tool_calls"])
    return turn


def prompt_turns(row: dict[str, Any]) -> list[dict[str, Any]]:
    if row["messages"] is not None:
        return [message_turn(m) for m in row["messages"]]
    return [{"role": "user", "content": row["prompt"] or ""}]


def message_turn(message: dict[str, Any]) -> dict[str, Any]:
    """A stored chat turn as OpenAI's format writes it (tool fields only when set)."""
    turn: dict[str, Any] = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        turn["tool_calls"] = _openai_calls(message["tool_calls"])
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            turn[key] = message[key]
    return turn


def _openai_calls(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    return [
        {"id": c["id"], "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]  # fmt: skip


def answer(row: dict[str, Any], options: ExportOptions, summary: ExportSummary) -> str:
    """The answer's text; a cut answer's from its ids (see the module's contract). A
    row with reasoning has its texts (its answer may be empty: cut while thinking),
    and so has one that calls functions (its answer is the calls)."""
    text: str = row["text"] or ""
    ids = row["output_ids"]
    if text or not ids or row["reasoning"] is not None or row["tool_calls"]:
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
    incomplete = _incomplete_conversations(files, summary) if options.drop_incomplete else set()
    for i, table in enumerate(_tables(files, options, summary)):
        if incomplete:
            left_out = pc.is_in(table.column("conversation_id"), pa.array(sorted(incomplete)))
            table = table.filter(pc.invert(pc.fill_null(left_out, False)))
        table = _with_answers(table, options, summary)
        if options.with_ids:
            table = _with_ids(table)
        # "train-NNNNN" is a name datasets.load_dataset(folder) reads as the train split
        path = folder / f"train-{i:05d}.parquet"
        with atomic_file(path, binary=True) as out:
            pq.write_table(table, out)
        summary.files.append(path)
        summary.rows.update(table.column("dataset").to_pylist())


def _incomplete_conversations(files: list[Path], summary: ExportSummary) -> set[str]:
    """The conversations (regenerated turn by turn) that are not whole, counted per
    dataset in ``summary.incomplete``; read from their few columns only."""
    columns = ["dataset", "conversation_id", "turn", "turns", "stop_reason", "unfinished",
               "tool_mismatch"]  # fmt: skip
    turns: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for file in files:
        table = conform(pq.read_table(file)).select(columns)
        table = table.filter(pc.is_valid(table.column("conversation_id")))
        for row in table.to_pylist():
            turns.setdefault((row["dataset"], row["conversation_id"]), []).append(row)
    incomplete = set()
    for (dataset, conversation), rows in turns.items():
        rows.sort(key=lambda row: row["turn"])
        if not complete(rows):
            incomplete.add(conversation)
            summary.incomplete[dataset] += 1
    return incomplete


def _with_answers(table: pa.Table, options: ExportOptions, summary: ExportSummary) -> pa.Table:
    """The ``text`` column with every cut answer's text (see :func:`answer`)."""
    needed = table.select(
        ["text", "reasoning", "tool_calls", "output_ids", "request_id", "dataset"]
    )
    texts = [answer(row, options, summary) for row in needed.to_pylist()]
    return table.set_column(table.schema.get_field_index("text"), "text", pa.array(texts))


def _with_ids(table: pa.Table) -> pa.Table:
    needed = table.select(["prompt_ids", "output_ids", "request_id", "dataset"])
    pairs = [ids_and_mask(row) for row in needed.to_pylist()]
    return table.append_column(
        "input_ids", pa.array([p[0] for p in pairs], pa.list_(pa.int32()))
    ).append_column("loss_mask", pa.array([p[1] for p in pairs], pa.list_(pa.int8())))
