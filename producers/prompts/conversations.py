"""Conversations regenerated turn by turn (``[[datasets]] turns = "regenerate"``).

The dataset records a conversation; the model answers it again, one turn at a time,
each turn on the history of its own earlier answers, so the training data follows
the model's distribution over the whole conversation and not only its last turn.

As events (the completions topic stays the source of truth):

* The producer publishes the prompt of a conversation's first turn, carrying the
  recorded conversation (``reference``) and the conversation's id (a key a router
  can send every turn to one server by).
* Whoever publishes turn ``k``'s outcome publishes what follows it (:func:`follow_up`,
  before the prompt's offset is committed): turn ``k + 1``'s prompt (its history,
  the model's answer, then the recorded turns up to the next answer), or, when the
  conversation ends early, a skip for each later turn, so every turn of every
  conversation still gets exactly one outcome and the dataset is counted out.
* Every turn's prompt id is stable (:func:`tokenbudget.producers.prompts.ids.turn_prompt_id`):
  a
  rerun recognises a turn done, or queued, whoever built it. :func:`resume` rebuilds
  the next prompt of a conversation from its last finished turn's completion, as
  the completions topic holds it.

A conversation ends early, keeping the turns it has, when a turn was not generated
(skipped: its budget is spent; failed), when its answer did not end on its own
(cut at the budget's line or by ``max_new_tokens``, aborted, unfinished), or when
the model called other functions than the dataset recorded (another name, other
arguments, another number of calls: ``tool_mismatch``), since the recorded results
would not answer them. Exports mark such conversations incomplete.

Tool use: the model's own calls go into the history, then the dataset's recorded
results (``tool`` turns), in their order, their ``tool_call_id`` pointing at the
model's calls (the i-th result answers the i-th call when its recorded id names no
recorded call).

Reasoning: the history sent for later turns carries earlier answers' content and
tool calls, never their reasoning. That is what Qwen3's, DeepSeek-R1's and Kimi's
chat templates do with earlier turns' thinking (and SpecForge's ``--reasoning
save``); each turn's own reasoning is kept in its row and exported beside its turn.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from tokenbudget.core import sizes
from tokenbudget.producers.prompts.datasets import prompt_text
from tokenbudget.producers.prompts.ids import turn_prompt_id
from tokenbudget.producers.prompts.rows import PromptRow, turn_positions
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import ChatMessage, ToolCall


def answer_turn(text: str, tool_calls: Sequence[ToolCall] | None) -> ChatMessage:
    """The model's answer as the assistant turn the next prompt's history holds
    (without its reasoning: see the module docstring)."""
    return ChatMessage(role="assistant", content=text, tool_calls=tuple(tool_calls or ()) or None)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: compared as written


def calls_match(recorded: Sequence[ToolCall], regenerated: Sequence[ToolCall]) -> bool:
    """The same functions, in the same order, with the same arguments (as JSON
    values: spacing and key order do not matter)."""
    return len(recorded) == len(regenerated) and all(
        a.name == b.name and _arguments(a.arguments) == _arguments(b.arguments)
        for a, b in zip(recorded, regenerated, strict=True)
    )


def tool_mismatch(
    reference: Sequence[ChatMessage], turn: int, regenerated: Sequence[ToolCall] | None
) -> bool:
    """Whether the model's calls for ``turn`` differ from those the dataset recorded
    there (a turn past the recorded conversation has none to differ from)."""
    position = turn_positions(reference)[turn]
    if position >= len(reference):
        return False
    return not calls_match(reference[position].tool_calls or (), regenerated or ())


def spliced(
    between: Sequence[ChatMessage],
    recorded: Sequence[ToolCall],
    regenerated: Sequence[ToolCall],
) -> tuple[ChatMessage, ...]:
    """The recorded turns between two answers, their tool results pointing at the
    model's calls: a result's recorded ``tool_call_id`` is mapped to the model's call
    in the same place, and a result whose id names no recorded call answers the
    call in its own place among the results."""
    ids = {old.id: new.id for old, new in zip(recorded, regenerated, strict=False)}
    out = []
    nth = 0
    for message in between:
        if message.role == "tool":
            if message.tool_call_id in ids:
                new_id: str | None = ids[message.tool_call_id]
            elif nth < len(regenerated):
                new_id = regenerated[nth].id
            else:
                new_id = message.tool_call_id
            nth += 1
            message = msgspec.structs.replace(message, tool_call_id=new_id)
        out.append(message)
    return tuple(out)


def next_messages(
    reference: Sequence[ChatMessage],
    turn: int,
    history: Sequence[ChatMessage],
    text: str,
    tool_calls: Sequence[ToolCall] | None,
) -> tuple[ChatMessage, ...]:
    """Turn ``turn + 1``'s prompt: turn ``turn``'s (``history``), the model's answer
    to it, then the recorded turns that come before the next answer, spliced."""
    positions = turn_positions(reference)
    here, after = positions[turn], positions[turn + 1]
    recorded = (reference[here].tool_calls or ()) if here < len(reference) else ()
    between = spliced(reference[here + 1 : after], recorded, tool_calls or ())
    return (*history, answer_turn(text, tool_calls), *between)


def completion_fields(
    prompt: ev.PromptEvent, tool_calls: Sequence[ToolCall] | None
) -> dict[str, Any]:
    """What a completion of ``prompt`` says of its tools and its conversation."""
    fields: dict[str, Any] = {"tools": prompt.tools}
    if prompt.conversation_id is None or prompt.reference is None or prompt.turn is None:
        return fields
    return {
        **fields,
        "conversation_id": prompt.conversation_id,
        "turn": prompt.turn,
        "turns": prompt.turns,
        "tool_mismatch": tool_mismatch(prompt.reference, prompt.turn, tool_calls),
    }


def ending(completion: ev.CompletionEvent) -> str | None:
    """Why a conversation ends with this turn although turns remain (None: it goes
    on): the model's calls differ from the recorded ones, or the answer did not end
    on its own."""
    if completion.tool_mismatch:
        return "tool_mismatch"
    if completion.unfinished:
        return "unfinished"
    if completion.stop_reason not in (None, "stop"):
        return completion.stop_reason
    return None


@dataclass(frozen=True)
class FollowUp:
    """What a turn's outcome leads to: the next turn's prompt, or a skip for each
    turn that will not be generated."""

    prompt: ev.PromptEvent | None = None
    skipped: tuple[ev.PromptSkipped, ...] = ()


def skip_rest(
    dataset: str, conversation_id: str, after: int, turns: int, reason: str, at: float
) -> tuple[ev.PromptSkipped, ...]:
    """Skips for turns ``after + 1`` to the last."""
    return tuple(
        ev.PromptSkipped(
            prompt_id=turn_prompt_id(dataset, conversation_id, k),
            dataset=dataset,
            reason=reason,
            at=at,
        )
        for k in range(after + 1, turns)
    )


def too_large(event: ev.PromptEvent, max_prompt_bytes: int) -> str | None:
    """Why a next turn's prompt cannot be sent (the limits a dataset row has), or None."""
    size = len("\n".join(m.content for m in event.messages or ()).encode())
    if size > max_prompt_bytes:
        return f"its next prompt is {size:,} bytes, over [producer] max_prompt_bytes"
    encoded = len(codec.encode(event))
    if encoded > sizes.PROMPT_EVENT_BYTES:
        return f"its next prompt event is {encoded:,} bytes, over a prompt's share of a message"
    return None


def follow_up(
    prompt: ev.PromptEvent,
    outcome: ev.CompletionEvent | ev.PromptSkipped | ev.PromptFailed | None,
    *,
    max_prompt_bytes: int,
    at: float,
) -> FollowUp:
    """What follows ``prompt``'s ``outcome`` (None: no outcome was published, e.g. the
    prompt was completed before; a rerun then rebuilds what is missing)."""
    conversation, turn, turns = prompt.conversation_id, prompt.turn, prompt.turns
    if conversation is None or turn is None or turns is None or prompt.reference is None:
        return FollowUp()
    if outcome is None or turn + 1 >= turns:
        return FollowUp()
    dataset = prompt.dataset
    if not isinstance(outcome, ev.CompletionEvent):
        what = "skipped" if isinstance(outcome, ev.PromptSkipped) else "failed"
        reason = f"conversation ended at turn {turn}: {what} ({outcome.reason})"
        return FollowUp(skipped=skip_rest(dataset, conversation, turn, turns, reason, at))
    why = ending(outcome)
    if why is None:
        messages = next_messages(
            prompt.reference, turn, outcome.messages or (), outcome.text, outcome.tool_calls
        )
        successor = msgspec.structs.replace(
            prompt,
            prompt_id=turn_prompt_id(dataset, conversation, turn + 1),
            messages=messages,
            turn=turn + 1,
            produced_at=at,
            input_ids=None,
        )
        why = too_large(successor, max_prompt_bytes)
        if why is None:
            return FollowUp(prompt=successor)
    reason = f"conversation ended at turn {turn}: {why}"
    return FollowUp(skipped=skip_rest(dataset, conversation, turn, turns, reason, at))


class Outcomes:
    """The outcome a dispatcher published for each conversation turn it handles, kept
    from the moment it starts on the turn (:meth:`expect`) until :meth:`take`: the
    first one, as every reader keeps the first. Nothing else is kept."""

    def __init__(self) -> None:
        self._open: set[str] = set()
        self._seen: dict[str, ev.CompletionEvent | ev.PromptSkipped | ev.PromptFailed] = {}

    def expect(self, prompt: ev.PromptEvent) -> bool:
        """Start on ``prompt``; False when it is no conversation's turn."""
        if prompt.conversation_id is None:
            return False
        self._open.add(prompt.prompt_id)
        return True

    def saw(self, event: ev.Event) -> None:
        match event:
            case ev.CompletionEvent() | ev.PromptSkipped() | ev.PromptFailed():
                if event.prompt_id in self._open:
                    self._seen.setdefault(event.prompt_id, event)

    def take(
        self, prompt_id: str
    ) -> ev.CompletionEvent | ev.PromptSkipped | ev.PromptFailed | None:
        self._open.discard(prompt_id)
        return self._seen.pop(prompt_id, None)


# ---- a rerun: where each conversation stands ---------------------------------------


@dataclass(frozen=True)
class Resumed:
    """Where a conversation stands on a rerun: ``row`` is the turn to produce now
    (None: nothing to produce); ``done`` turns finished before; ``queued`` turns
    on the prompts topic still (the one queued, and the turns after it that its
    outcome will lead to); ``skipped``: the outcomes of turns that will never be
    sent (the conversation ended; a killed run did not publish them all)."""

    row: PromptRow | None
    done: int = 0
    queued: int = 0
    skipped: tuple[ev.PromptSkipped, ...] = ()


def resume(
    dataset: str,
    row: PromptRow,
    finished: Mapping[str, ev.CompletionEvent],
    queued: Set[str],
    done: Set[str] = frozenset(),
    *,
    max_prompt_bytes: int,
    at: float,
) -> Resumed:
    """Where ``row``'s conversation (its first turn's row) stands, from the kept
    completions of its turns (``finished``, by prompt id: the completions topic read
    with the sink's rules) and the prompts still queued: the first turn with neither
    is produced, built from the last finished turn's completion. A turn finished is
    never produced again, whether or not a prompt of it is still queued. ``done``:
    turns known completed otherwise (the ledger, the sink's files), whose answer the
    topic may no longer hold: the conversation cannot go on past such a turn."""
    conversation, turns = row.conversation_id, row.turns
    if conversation is None or row.reference is None:
        return Resumed(row)
    last: ev.CompletionEvent | None = None
    for k in range(turns):
        prompt_id = turn_prompt_id(dataset, conversation, k)
        completion = finished.get(prompt_id)
        if completion is not None:
            last = completion
            why = ending(completion)
            if why is not None and k + 1 < turns:
                reason = f"conversation ended at turn {k}: {why}"
                return Resumed(None, done=k + 1, skipped=skip_rest(
                    dataset, conversation, k, turns, reason, at))  # fmt: skip
            continue
        if prompt_id in done:
            last = None  # completed, but its answer is gone from the topic
            continue
        if prompt_id in queued:
            return Resumed(None, done=k, queued=turns - k)
        if k == 0:
            return Resumed(row)
        if last is None:
            reason = (
                f"conversation ended at turn {k - 1}: its answer is no longer on the "
                "completions topic (completion_retention_ms)"
            )
            return Resumed(None, done=k, skipped=skip_rest(
                dataset, conversation, k - 1, turns, reason, at))  # fmt: skip
        messages = next_messages(
            row.reference, k - 1, last.messages or (), last.text, last.tool_calls
        )
        if (
            len(prompt_text(dataclasses.replace(row, messages=messages)).encode())
            > max_prompt_bytes
        ):
            reason = f"conversation ended at turn {k - 1}: its next prompt is over max_prompt_bytes"
            return Resumed(None, done=k, skipped=skip_rest(
                dataset, conversation, k - 1, turns, reason, at))  # fmt: skip
        return Resumed(
            dataclasses.replace(row, prompt_id=prompt_id, messages=messages, turn=k), done=k
        )
    return Resumed(None, done=turns)


class _Counts(Protocol):
    already_done: int
    already_queued: int
    turns: int


def resumed_rows(
    dataset: str,
    rows: Iterator[PromptRow],
    finished: Mapping[str, ev.CompletionEvent],
    done: Set[str],
    queued: Set[str],
    report: _Counts,
    skipped: list[ev.PromptSkipped],
    *,
    max_prompt_bytes: int,
    at: float,
) -> Iterator[PromptRow]:
    """The rows of a dataset regenerated turn by turn, each as the turn its
    conversation is to go on from (:func:`resume`), counting its turns in
    ``report.turns`` (every one gets an outcome, on some run) and those done and
    queued; the skips of conversations that ended are added to ``skipped``, to send."""
    for row in rows:
        report.turns += row.turns
        if row.conversation_id is None:  # a plain prompt: as any dataset's
            if row.prompt_id in done:
                report.already_done += 1
            elif row.prompt_id in queued:
                report.already_queued += 1
            else:
                yield row
            continue
        where = resume(
            dataset, row, finished, queued, done, max_prompt_bytes=max_prompt_bytes, at=at
        )
        report.already_done += where.done
        report.already_queued += where.queued
        skipped.extend(where.skipped)
        if where.row is not None:
            yield where.row
