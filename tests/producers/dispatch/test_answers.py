"""What of an answer is kept (producers/dispatch/answers.py): ids and count made to agree
and cut to the request, and why the kept answer ends."""

from __future__ import annotations

from tokenbudget.producers.dispatch.answers import (
    cut_answer,
    finish_label,
    kept_within,
    within_request,
)
from tokenbudget.producers.inference.generation import GenerationResult


def answer(tokens: int, finish: str = "stop") -> GenerationResult:
    return GenerationResult("r", 3, tokens, list(range(tokens)), "t", finish)


def test_within_request_makes_ids_and_count_agree() -> None:
    base = GenerationResult("r", 3, 10, list(range(12)), "t", "stop")
    fixed, problem = within_request(base, 100)
    assert (fixed.completion_tokens, problem) == (12, "ids_mismatch")
    fixed, problem = within_request(base, 8)
    assert (fixed.completion_tokens, len(fixed.output_ids), problem) == (8, 8, "ids_mismatch")
    counted = GenerationResult("r", 3, 120, [], "text", "stop", count_source="tokenizer")
    fixed, problem = within_request(counted, 100)
    assert (fixed.completion_tokens, fixed.text, problem) == (100, "text", "over_request")
    assert within_request(cut_answer(base, 10), 10) == (cut_answer(base, 10), None)


def test_kept_within_keeps_an_answer_whole_cut_at_the_line_or_not_at_all() -> None:
    whole = answer(10)
    assert kept_within(whole, 10, 10) is whole
    cut = kept_within(whole, 10, 4)
    assert cut is not None and (cut.completion_tokens, cut.output_ids) == (4, [0, 1, 2, 3])
    assert kept_within(whole, 10, None) is None


def test_finish_label_tells_the_budgets_cut_from_the_models_own_ends() -> None:
    assert finish_label(answer(10), answer(10), 100, 100) == "stop"
    assert finish_label(answer(100, "length"), answer(100, "length"), 100, 100) == "length"
    # cut at the line after it was generated
    assert finish_label(answer(40, "length"), answer(90), 100, 100) == "budget"
    # ran into a max_new_tokens the budget had lowered
    assert finish_label(answer(30, "length"), answer(30, "length"), 30, 100) == "budget"
    # a lowered limit it never reached: the model stopped by itself
    assert finish_label(answer(20), answer(20), 30, 100) == "stop"
