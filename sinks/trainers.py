"""The records three drafter trainers load as they are, each format a function
(:data:`FORMATS` names them); :mod:`tokenbudget.sinks.export` reads the rows and
writes the files.

What each trainer's loader reads (their sources, August 2026):

* ``specforge`` (sgl-project/SpecForge): ``{"id", "conversations", "status":
  "success"}``, the shape its ``scripts/regenerate_train_data.py`` writes, plus
  ``tools`` as JSON text where the rows had tools (``data/preprocessing.py``
  parses it; every other top-level key would reach the chat template as a keyword
  argument). Each answer's thinking is in its turn's ``reasoning_content`` (what
  ``ThinkingParser`` renders); tool turns and calls as OpenAI writes them, which
  its parsers render (its validate and expand scripts take user and assistant turns
  only: a conversation with tools needs neither, see ``per_turn``). ``per_turn``:
  one record per answer, ``<id>#turn<k>``, with the history that answer was sent
  (earlier answers without their thinking) and its own thinking, as
  ``scripts/expand_reasoning_conversations.py`` writes them, for
  ``data.train_only_last_turn``. With ids: ``{"id", "input_ids", "loss_mask"}``
  per answer, the pre-tokenized rows of ``data.prompts_path``
  (``data/prompt_builder.py``: both keys, integers, a 0/1 mask of equal length).
* ``speculators`` (vllm-project/speculators): per answer ``{"id":
  "<primary_id>_gen<k>", "primary_id", "input_ids", "loss_mask", "metadata"}``, as
  ``scripts/response_regeneration/script.py`` writes it (prompt ids, then the answer's,
  masked 0 then 1; ``data_generation/preprocessing.py`` passes such rows through).
  Its review-only ``text`` (a decode of the ids) is not written.
* ``modelopt`` (NVIDIA/Model-Optimizer): ``{"conversation_id", "messages"}``
  (``modelopt/torch/utils/plugins/transformers_dataset.py`` reads ``messages``; its
  hidden-state dumps assert ``conversation_id`` and name their files after it, its
  streaming dataset skips records without one). It renders ``messages`` with the
  model's template and never passes ``tools`` to it, so a record keeps its calls and
  tool turns and leaves its tools out (what Model-Optimizer's own agentic data
  preparation does), and the export warns how many; it reads no token ids.

Ids are unique across datasets, samples and turns, and stable across reruns and
replays: a record's is its dataset's name and its conversation's id (turn by turn
regeneration) or its prompt's (one per sample), hashes of the dataset row's own
identity (one that could not name a file, from elsewhere, hashed again); an answer's
adds its turn. Nothing positional, no clock.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

TrainerFormat = Literal["specforge", "speculators", "modelopt"]
# What of a prompt's or conversation's id goes into a record's id as it is: ours are
# 32 hex digits; any other (an event from elsewhere) is hashed, as it may not name a file.
_FILE_SAFE = re.compile(r"[0-9A-Za-z_.-]{1,64}")


@dataclass(frozen=True)
class Answer:
    """One answer the model generated, as the per-answer records take it."""

    id: str
    turn: int  # in its conversation (0 for a single answer)
    turns: list[dict[str, Any]]  # the history it was sent, then it with its thinking
    row: dict[str, Any]  # the sink's row
    ids: tuple[list[int], list[int]] | None = None  # input_ids and loss_mask, when asked


@dataclass(frozen=True)
class Unit:
    """A single answer, or a conversation regenerated turn by turn: one record of
    the whole-conversation formats."""

    id: str
    dataset: str
    turns: list[dict[str, Any]]  # every turn, each answer with its own thinking
    tools: str | None  # the tool definitions offered, as JSON text
    answers: list[Answer] = field(default_factory=list)


def unit_id(row: dict[str, Any]) -> str:
    """The record's id: its dataset, then its conversation's id or (one answer) its
    prompt's (hex; each sample's prompt has its own). Letters, digits, ``_ . -``
    only (a dataset's name is such), so it can name a file."""
    key: str = row["conversation_id"] or row["prompt_id"]
    if not _FILE_SAFE.fullmatch(key):
        key = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    return f"{row['dataset']}-{key}"


def answer_id(unit: str, row: dict[str, Any]) -> str:
    """An answer's id in a per-answer record: the record's, and for a conversation
    its turn (as SpecForge's expand script numbers them)."""
    return unit if row["conversation_id"] is None else f"{unit}#turn{row['turn'] or 0}"


def split_reasoning(text: str, end: str, *, unfinished: bool) -> tuple[str, str] | None:
    """An answer's inline thinking and its answer (the raw text of SGLang's
    ``/generate``: ``...</think> answer``), split at the first ``end`` marker as
    SGLang's reasoning parsers split it, stripped, without a leading start marker
    (``end`` without its first ``/``); an ``unfinished`` answer without the marker
    is all thinking. None when there is nothing to split."""
    if not end:
        return None
    thinking, marker, answer = text.partition(end)
    if not marker and not unfinished:
        return None
    thinking = thinking.strip()
    start = end.replace("/", "", 1)
    if start != end and thinking.startswith(start):
        thinking = thinking[len(start) :].strip()
    return thinking, answer.strip()


# ------------------------------------------------------------------------- formats


def specforge(unit: Unit, *, with_ids: bool, per_turn: bool) -> list[dict[str, Any]]:
    if with_ids:
        return [_ids(answer.id, answer) for answer in unit.answers]
    if per_turn:
        return [_specforge(answer.id, answer.turns, unit.tools) for answer in unit.answers]
    return [_specforge(unit.id, unit.turns, unit.tools)]


def _specforge(id_: str, turns: list[dict[str, Any]], tools: str | None) -> dict[str, Any]:
    record: dict[str, Any] = {"id": id_, "conversations": turns, "status": "success"}
    if tools is not None:
        record["tools"] = tools
    return record


def _ids(id_: str, answer: Answer) -> dict[str, Any]:
    assert answer.ids is not None  # FORMATS says which formats the export gives ids
    input_ids, loss_mask = answer.ids
    return {"id": id_, "input_ids": input_ids, "loss_mask": loss_mask}


def speculators(unit: Unit, *, with_ids: bool, per_turn: bool) -> list[dict[str, Any]]:
    records = []
    for answer in unit.answers:
        ids = _ids(f"{unit.id}_gen{answer.turn}", answer)
        records.append(
            {"id": ids["id"], "primary_id": unit.id, "input_ids": ids["input_ids"],
             "loss_mask": ids["loss_mask"], "metadata": _metadata(answer)}
        )  # fmt: skip
    return records


def _metadata(answer: Answer) -> dict[str, Any]:
    """Where the answer came from and how it ended (speculators keeps its finish
    reason, whether it called a tool, and the server's usage); every key in every
    record, each of one type, so the file loads as one table."""
    row = answer.row
    return {
        "dataset": row["dataset"],
        "row_id": row["row_id"],
        "prompt_id": row["prompt_id"],
        "request_id": row["request_id"],
        "sample_index": row["sample_index"] or 0,
        "turn": answer.turn,
        "model": row["model"],
        "finish_reason": row["finish_reason"],
        "stop_reason": row["stop_reason"],
        "is_tool_call": bool(row["tool_calls"]),
        "usage": {
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "reasoning_tokens": row["reasoning_tokens"],
        },
    }


def modelopt(unit: Unit, *, with_ids: bool, per_turn: bool) -> list[dict[str, Any]]:
    return [{"conversation_id": unit.id, "messages": unit.turns}]


class Records(Protocol):
    def __call__(self, unit: Unit, *, with_ids: bool, per_turn: bool) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class Shape:
    """A trainer's format: its records, whether they hold token ids (``asked``: with
    ``with_ids``), and whether the trainer reads the tools offered."""

    records: Records
    ids: Literal["asked", "always", "never"]
    reads_tools: bool = True
    per_turn: bool = False  # takes ``per_turn``

    def holds_ids(self, with_ids: bool) -> bool:
        return self.ids == "always" or (self.ids == "asked" and with_ids)


FORMATS: dict[TrainerFormat, Shape] = {
    "specforge": Shape(specforge, "asked", per_turn=True),
    "speculators": Shape(speculators, "always"),
    "modelopt": Shape(modelopt, "never", reads_tools=False),
}


def shape_of(format_name: str) -> Shape | None:
    """The trainer format of this name; None for the export's other formats."""
    return next((shape for name, shape in FORMATS.items() if name == format_name), None)
