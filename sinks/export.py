"""``tokenbudget export``: the kept completions in the formats trainers read.

Six formats, every one loadable with Hugging Face ``datasets.load_dataset``: three
of the drafter trainers' own, SpecForge's, vLLM speculators' and Model-Optimizer's
(``specforge``, ``speculators``, ``modelopt``: their records in
:mod:`tokenbudget.sinks.trainers`, built here from the rows), and these:

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

A row without prompt ids whose prompt went as text (SGLang's ``/generate`` returns
none) takes them from ``encode``, the local tokenizer applied to that exact text
(``prompt``), when one is given: they must count what the server counted.

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
from tokenbudget.sinks import trainers
from tokenbudget.sinks.parquet import output_files
from tokenbudget.sinks.schema import conform
from tokenbudget.sinks.trainers import TrainerFormat

Format = Literal["conversations", "messages", "parquet"] | TrainerFormat
FORMATS: tuple[Format, ...] = ("conversations", "messages", "parquet", *trainers.FORMATS)
# Decodes a cut answer's ids to its text (a local tokenizer's decode).
Decode = Callable[[list[int]], str]
# A prompt's ids from its text as sent (a local tokenizer's encode, special tokens
# added as the servers add them to a text prompt).
Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class ExportOptions:
    format: Format
    to: Path
    source: Path  # the sink's output folder
    datasets: frozenset[str] = frozenset()  # empty: all
    with_ids: bool = False
    decode: Decode | None = None
    encode: Encode | None = None
    drop_unfinished: bool = False
    drop_incomplete: bool = False  # conversations regenerated turn by turn, not whole
    per_turn: bool = False  # specforge: a conversation as one record per answer
    reasoning_end: str = ""  # the trainers' text formats split inline thinking here


@dataclass
class ExportSummary:
    rows: Counter[str] = field(default_factory=Counter)  # per dataset
    files: list[Path] = field(default_factory=list)
    decoded: int = 0  # cut answers whose text came from their ids
    unfinished: Counter[str] = field(default_factory=Counter)  # left out, per dataset
    conversations: Counter[str] = field(default_factory=Counter)  # records that are
    incomplete: Counter[str] = field(default_factory=Counter)  # conversations left out
    # the records written of the conversations: more than them when one per answer
    conversation_records: Counter[str] = field(default_factory=Counter)
    encoded: int = 0  # prompts whose ids came from their text, with the tokenizer
    split: int = 0  # answers whose inline thinking went to reasoning_content
    tools_dropped: Counter[str] = field(default_factory=Counter)  # records, per dataset

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": dict(self.rows),
            "files": [str(f) for f in self.files],
            "decoded": self.decoded,
            "unfinished_dropped": dict(self.unfinished),
            "conversations": dict(self.conversations),
            "incomplete_dropped": dict(self.incomplete),
            "prompt_ids_encoded": self.encoded,
            "reasoning_split": self.split,
            "tools_dropped": dict(self.tools_dropped),
        }


def export(options: ExportOptions) -> ExportSummary:
    """Write every kept row of the chosen datasets under ``options.to``."""
    _check(options)
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


def _check(options: ExportOptions) -> None:
    shape = trainers.shape_of(options.format)
    if options.per_turn and not (shape and shape.per_turn):
        raise ExportError(
            f"--per-turn writes conversations one record per answer for SpecForge: "
            f"use --format specforge, or leave --per-turn out of --format {options.format}"
        )
    if options.with_ids and shape and shape.ids == "never":
        raise ExportError(
            f"--with-ids: --format {options.format} holds no token ids (Model-Optimizer "
            "renders the messages with the model's chat template): leave --with-ids out, or "
            "export the server's ids with --format specforge --with-ids or --format speculators"
        )


def _export_jsonl(
    files: list[Path], options: ExportOptions, summary: ExportSummary, out: Any
) -> None:
    records = _chat_records if options.format in ("conversations", "messages") else _trainer
    for rows in _units(files, options, summary):
        written = records(rows, options, summary)
        for record in written:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        summary.rows[rows[0]["dataset"]] += len(written)
        if rows[0]["conversation_id"] is not None:
            summary.conversations[rows[0]["dataset"]] += 1
            summary.conversation_records[rows[0]["dataset"]] += len(written)


def _units(
    files: list[Path], options: ExportOptions, summary: ExportSummary
) -> Iterator[list[dict[str, Any]]]:
    """Each answer alone, as read, then each conversation regenerated turn by turn,
    its rows in turn order (they may be in several files: once all are read),
    without the incomplete ones when asked."""
    turns: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for table in _tables(files, options, summary):
        for row in table.to_pylist():
            if row["conversation_id"] is None:
                yield [row]
            else:
                turns.setdefault((row["dataset"], row["conversation_id"]), []).append(row)
    for (dataset, _), rows in turns.items():
        rows.sort(key=lambda row: row["turn"])
        if options.drop_incomplete and not complete(rows):
            summary.incomplete[dataset] += 1
            continue
        yield rows


def _chat_records(
    rows: list[dict[str, Any]], options: ExportOptions, summary: ExportSummary
) -> list[dict[str, Any]]:
    turns_key = "conversations" if options.format == "conversations" else "messages"
    if rows[0]["conversation_id"] is None:
        return [training_record(rows[0], turns_key, options, summary)]
    return [conversation_record(rows, turns_key, options, summary)]


def _trainer(
    rows: list[dict[str, Any]], options: ExportOptions, summary: ExportSummary
) -> list[dict[str, Any]]:
    shape = trainers.shape_of(options.format)
    assert shape is not None  # _export_jsonl's other formats are _chat_records'
    with_ids = shape.holds_ids(options.with_ids)
    unit = (trainer_ids if with_ids else trainer_unit)(rows, options, summary)
    if unit.tools is not None and not shape.reads_tools:
        summary.tools_dropped[unit.dataset] += 1
    return shape.records(unit, with_ids=with_ids, per_turn=options.per_turn)


def trainer_ids(
    rows: list[dict[str, Any]], options: ExportOptions, summary: ExportSummary
) -> trainers.Unit:
    """An answer, or a conversation's rows in turn order, as the trainers' token id
    formats take it: each answer's ids (the server's), no text."""
    uid = trainers.unit_id(rows[-1])
    answers = [
        trainers.Answer(
            trainers.answer_id(uid, row), row["turn"] or 0, [], row,
            ids=ids_and_mask(row, options, summary),
        )
        for row in rows
    ]  # fmt: skip
    return trainers.Unit(uid, rows[-1]["dataset"], [], rows[-1]["tools"], answers)


def trainer_unit(
    rows: list[dict[str, Any]], options: ExportOptions, summary: ExportSummary
) -> trainers.Unit:
    """An answer, or a conversation's rows in turn order, as the trainers' text
    formats take it: every turn, each answer with its own thinking (split off its
    text when inline); and each answer alone, after the history it was sent (earlier
    answers without their thinking)."""
    last, uid = rows[-1], trainers.unit_id(rows[-1])
    said = [_assistant_turn(row, options, summary) for row in rows]
    # where each answer sits in the later turns' histories: right after its own prompt
    at = [len(row["messages"] or ()) for row in rows]
    answers = []
    for k, row in enumerate(rows):
        history = prompt_turns(row)
        for j in range(k):
            _put(history, at[j], _visible(said[j]))
        answers.append(
            trainers.Answer(
                trainers.answer_id(uid, row), row["turn"] or 0, [*history, said[k]], row
            )
        )
    whole = prompt_turns(last)
    for j in range(len(rows) - 1):
        _put(whole, at[j], said[j])
    return trainers.Unit(uid, last["dataset"], [*whole, said[-1]], last["tools"], answers)


def _put(turns: list[dict[str, Any]], at: int, said: dict[str, Any]) -> None:
    if at < len(turns) and turns[at]["role"] == "assistant":
        turns[at] = said


def _visible(said: dict[str, Any]) -> dict[str, Any]:
    """An earlier answer as a later turn's history shows it: without its thinking
    (what the chat templates of thinking models render, and what went back)."""
    return {key: value for key, value in said.items() if key != "reasoning_content"}


def _assistant_turn(
    row: dict[str, Any], options: ExportOptions, summary: ExportSummary
) -> dict[str, Any]:
    """The row's answer (:func:`reply`), its inline thinking split off into
    ``reasoning_content`` when the server left it in the text."""
    turn = reply(row, options, summary)
    if row["reasoning"] is None:
        parts = trainers.split_reasoning(
            turn["content"], options.reasoning_end, unfinished=bool(row["unfinished"])
        )
        if parts is not None:
            turn["reasoning_content"], turn["content"] = parts
            summary.split += 1
    return turn


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
            "--with-ids (one row per turn, each with its input_ids and loss_mask), or with "
            "--format speculators or --format specforge --with-ids (one record per answer)"
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
        record["input_ids"], record["loss_mask"] = ids_and_mask(row, options, summary)
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


def ids_and_mask(
    row: dict[str, Any], options: ExportOptions, summary: ExportSummary
) -> tuple[list[int], list[int]]:
    prompt, output = row["prompt_ids"], row["output_ids"]
    text_prompt = row["messages"] is None and row["prompt"] is not None
    if prompt is None and output is not None and text_prompt and options.encode is not None:
        prompt = _encoded_prompt(row, options.encode)
        summary.encoded += 1
    if prompt is None or output is None:
        missing = "prompt_ids" if prompt is None else "output_ids"
        if output is None:
            fix = "use a server that returns token ids (return_token_ids)"
        elif text_prompt:
            fix = (
                "pass --tokenizer DIR (or set [inference] tokenizer in --config) to compute "
                "them from the prompt's text as sent, or use a server that returns prompt token ids"
            )
        else:
            fix = (
                "apply the chat template here (template = true with [inference] tokenizer) or "
                "use a server that returns prompt token ids"
            )
        raise ExportError(
            f"--with-ids: answer {row['request_id']} of dataset {row['dataset']!r} has no "
            f"{missing}: {fix}, or export without --with-ids"
        )
    return [*prompt, *output], [0] * len(prompt) + [1] * len(output)


def _encoded_prompt(row: dict[str, Any], encode: Encode) -> list[int]:
    """The prompt's ids from its text as sent; as many as the server counted, or the
    tokenizer is not the server's."""
    ids = encode(row["prompt"])
    if row["prompt_tokens"] is not None and len(ids) != row["prompt_tokens"]:
        raise ExportError(
            f"--with-ids: the prompt of answer {row['request_id']} of dataset "
            f"{row['dataset']!r} is {len(ids)} tokens with the local tokenizer, where the "
            f"server counted {row['prompt_tokens']}: give the model's own tokenizer folder "
            "(--tokenizer DIR or [inference] tokenizer)"
        )
    return ids


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
            table = _with_ids(table, options, summary)
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


def _with_ids(table: pa.Table, options: ExportOptions, summary: ExportSummary) -> pa.Table:
    needed = table.select(
        ["prompt_ids", "output_ids", "request_id", "dataset", "prompt", "messages",
         "prompt_tokens"]
    )  # fmt: skip
    pairs = [ids_and_mask(row, options, summary) for row in needed.to_pylist()]
    return table.append_column(
        "input_ids", pa.array([p[0] for p in pairs], pa.list_(pa.int32()))
    ).append_column("loss_mask", pa.array([p[1] for p in pairs], pa.list_(pa.int8())))
