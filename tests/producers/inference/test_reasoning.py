"""Whether a kept answer began: the rule that marks a thinking model's row
unfinished, an answer cut at the budget's line, the warning for a dataset that asked
to save reasoning the server does not send, and the token split it counts."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tokenbudget.core.sections import ReasoningMode
from tokenbudget.producers.dispatch.answers import cut_answer
from tokenbudget.producers.inference.generation import GenerationResult
from tokenbudget.producers.inference.reasoning import ReasoningRows, unfinished
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import StopReason


def answer(tokens: int = 10, text: str = "", **fields: Any) -> GenerationResult:
    return GenerationResult("r", 3, tokens, list(range(tokens)), text, "length", **fields)


def marked(result: GenerationResult, stop: StopReason = "length", *, saves: bool) -> bool:
    return unfinished(result, result, stop, raw_thinks=saves, end_marker="</think>")


@pytest.mark.parametrize(
    ("result", "saves", "expected"),
    [
        # the server's count: every token thinking, or some answer after it
        (answer(reasoning="hmm", reasoning_tokens=10), False, True),
        (answer(text=" 42", reasoning="hmm", reasoning_tokens=9), False, False),
        # its count wins over the text (the answer's text may be blank tokens)
        (answer(text=" ", reasoning="hmm", reasoning_tokens=8), False, False),
        # no count: the answer's text says
        (answer(text="", reasoning="hmm"), False, True),
        (answer(text=" \n", reasoning="hmm"), False, True),
        (answer(text="42", reasoning="hmm"), False, False),
        # raw text, of a dataset that said it thinks: the end marker, and what follows it
        (answer(text="let me see"), True, True),
        (answer(text="let me see </think> \n"), True, True),
        (answer(text="let me see </think> 42"), True, False),
        (answer(text="<think> a </think> b <think> c"), True, False),  # the last marker
        # raw text of a dataset that did not say: cannot be told, not marked
        (answer(text="let me see"), False, False),
        (answer(text=""), True, False),
    ],
)
def test_a_cut_answer_is_unfinished_when_it_never_left_its_thinking(
    result: GenerationResult, saves: bool, expected: bool
) -> None:
    assert marked(result, "length", saves=saves) is expected
    assert marked(result, "budget", saves=saves) is expected
    # an answer the model ended, or an abort, is never called unfinished
    assert marked(result, "stop", saves=saves) is False
    assert marked(result, "abort", saves=saves) is False


def test_an_answer_cut_at_the_budgets_line_is_judged_by_what_it_kept() -> None:
    whole = answer(20, reasoning="hmm", reasoning_tokens=12, text=" 42")
    # the ids are kept, the texts cannot be cut: the thinking tokens are, at the cut
    kept = cut_answer(whole, 8)
    assert (kept.completion_tokens, kept.reasoning_tokens, kept.output_ids) == (
        8,
        8,
        list(range(8)),
    )
    assert kept.text == "" and kept.reasoning is None
    assert unfinished(kept, whole, "budget", raw_thinks=False, end_marker="</think>")
    past_thinking = cut_answer(whole, 15)
    assert past_thinking.reasoning_tokens == 12
    assert not unfinished(past_thinking, whole, "budget", raw_thinks=False, end_marker="</think>")
    # no count from the server: the whole answer tells, when it never began
    raw = answer(20, text="still thinking")
    assert unfinished(cut_answer(raw, 5), raw, "budget", raw_thinks=True, end_marker="</think>")
    began = answer(20, text="a </think> b")
    assert not unfinished(
        cut_answer(began, 5), began, "budget", raw_thinks=True, end_marker="</think>"
    )
    # an answer without ids keeps its texts (its count is cut, as before)
    no_ids = dataclasses.replace(whole, output_ids=None)
    assert cut_answer(no_ids, 8).reasoning == "hmm" and cut_answer(no_ids, 8).text == " 42"


def test_save_warns_once_per_dataset_when_the_chat_server_splits_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    modes: dict[str, ReasoningMode | None] = {"saved": "save", "unset": None}
    rows = ReasoningRows(modes, "</think>", "openai-chat", "http://gpu:8000")
    bare = answer(text="<think> hmm </think> 42")
    with caplog.at_level(logging.WARNING, logger="tokenbudget.producers.inference.reasoning"):
        for dataset in ("saved", "saved", "unset"):
            rows.unfinished(dataset, bare, bare, "stop")
        rows.unfinished("saved", answer(reasoning="hmm"), answer(reasoning="hmm"), "stop")
    [record] = caplog.records
    assert 'dataset saved has reasoning = "save"' in record.getMessage()
    assert "http://gpu:8000" in record.getMessage() and "--reasoning-parser" in record.getMessage()
    # raw APIs hold the thinking inline by design: nothing to warn about
    raw = ReasoningRows(modes, "</think>", "sglang", "http://gpu:30000")
    with caplog.at_level(logging.WARNING, logger="tokenbudget.producers.inference.reasoning"):
        raw.unfinished("saved", bare, bare, "stop")
    assert len(caplog.records) == 1


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_the_kept_tokens_are_counted_by_part() -> None:
    def event(tokens: int, thinking: int | None, cut: bool) -> ev.CompletionEvent:
        return ev.CompletionEvent(
            request_id="r", prompt_id="p", dataset="split-ds", prompt_tokens=1,
            completion_tokens=tokens, output_ids=None, count_source="usage",
            finish_reason="length", max_new_tokens=100, reasoning_tokens=thinking,
            unfinished=cut,
        )  # fmt: skip

    parts = "tokenbudget_completion_token_parts_total"
    before = {
        p: sample(parts, dataset="split-ds", part=p) for p in ("reasoning", "answer", "unsplit")
    }
    cut_before = sample("tokenbudget_unfinished_answers_total", dataset="split-ds")
    for e in (event(30, 20, False), event(10, 10, True), event(7, None, False)):
        ReasoningRows.count(e)
    after = {p: sample(parts, dataset="split-ds", part=p) - before[p] for p in before}
    assert after == {"reasoning": 30, "answer": 10, "unsplit": 7}
    assert sample("tokenbudget_unfinished_answers_total", dataset="split-ds") == cut_before + 1
