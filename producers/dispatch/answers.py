"""What of a server's answer is kept, as pure functions of the answer.

The dispatcher keeps an answer as the request allowed it (:func:`within_request`:
ids and count agreeing, never longer than ``max_new_tokens``), then as the budget
allows it (whole or cut at the line: :func:`kept_within`, :func:`cut_answer`), and
says why the kept answer ends (:func:`finish_label`). Nothing here raises; callers
are the request attempt (:mod:`tokenbudget.producers.dispatch.attempt`) and the caps of
revoked leases (:mod:`tokenbudget.producers.dispatch.caps`).
"""

from __future__ import annotations

import dataclasses

from tokenbudget.producers.inference.generation import GenerationResult
from tokenbudget.streams.fields import StopReason

# What within_request found wrong with an answer, as the log names it.
PROBLEMS = {
    "over_request": "more tokens than max_new_tokens",
    "ids_mismatch": "a completion_tokens count that disagrees with its token ids",
}


def within_request(
    result: GenerationResult, max_new_tokens: int
) -> tuple[GenerationResult, str | None]:
    """The answer with ids and count agreeing and at most ``max_new_tokens`` tokens,
    and what was wrong with it, if anything (a key of :data:`PROBLEMS`). Token ids,
    when the server returned them, are the answer; a count without ids (a tokenizer
    recount) is capped."""
    problem: str | None = None
    if result.output_ids and len(result.output_ids) != result.completion_tokens:
        problem = "ids_mismatch"
        result = dataclasses.replace(result, completion_tokens=len(result.output_ids))
    if result.completion_tokens > max_new_tokens:
        problem = problem or "over_request"
        result = cut_answer(result, max_new_tokens)
    return result, problem


def cut_answer(result: GenerationResult, keep: int) -> GenerationResult:
    """The first ``keep`` tokens of an answer, as a server stopping there would give.
    With ids, the ids are the answer: they hold the thinking and the answer as
    generated, so neither text is kept (the thinking comes first: at most ``keep``
    of it is), nor a call, whose arguments may be cut."""
    thinking = result.reasoning_tokens
    return dataclasses.replace(
        result,
        completion_tokens=keep,
        output_ids=None if result.output_ids is None else result.output_ids[:keep],
        text="" if result.output_ids else result.text,
        reasoning=None if result.output_ids else result.reasoning,
        tool_calls=None if result.output_ids else result.tool_calls,
        reasoning_tokens=None if thinking is None else min(thinking, keep),
        finish_reason="length",
    )


def kept_within(result: GenerationResult, cost: int, keep: int | None) -> GenerationResult | None:
    """An answer costing ``cost`` of which the budget lets ``keep`` be kept
    (:func:`tokenbudget.streams.budget.fit`): None when nothing may be, the answer
    whole, or cut at the line (:func:`cut_answer`)."""
    if keep is None:
        return None
    return result if keep == cost else cut_answer(result, keep)


def finish_label(
    kept: GenerationResult, generated: GenerationResult, request_max: int, wanted_max: int
) -> StopReason:
    """Why the kept answer ends (its ``stop_reason``): ``budget`` when the budget's
    line cut it (the answer was cut to fit, or it ran into a max_new_tokens lowered
    below the dataset's own), else the server's finish reason (``stop``, ``length``,
    ``abort``)."""
    if kept.completion_tokens < generated.completion_tokens:
        return "budget"
    if kept.finish_reason == "length" and request_max < wanted_max:
        return "budget"
    return kept.finish_reason
