"""Conversations regenerated turn by turn, without a broker: the next turn's messages
from the model's answer, the tool results spliced after its calls, what a turn's
outcome leads to, and where a conversation stands on a rerun."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.producers.prompts.test_producer import RecordingProducer
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ConfigError
from tokenbudget.producers.prompts import conversations, resume
from tokenbudget.producers.prompts.conversations import (
    calls_match,
    follow_up,
    next_messages,
    spliced,
)
from tokenbudget.producers.prompts.dataset_checks import check_datasets
from tokenbudget.producers.prompts.datasets import read_prompts
from tokenbudget.producers.prompts.ids import turn_prompt_id
from tokenbudget.producers.prompts.producer import PromptProducer
from tokenbudget.producers.prompts.rows import PromptRow
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.fields import ChatMessage, StopReason, ToolCall

M = ChatMessage


def call(name: str = "search", arguments: str = '{"query": "q"}', id: str = "rec_1") -> ToolCall:
    return ToolCall(id=id, name=name, arguments=arguments)


FOUR = (
    M("system", "be brief"),
    M("user", "u0"), M("assistant", "a0"),
    M("user", "u1"), M("assistant", "a1"),
    M("user", "u2"), M("assistant", "a2"),
    M("user", "u3"), M("assistant", "a3"),
)  # fmt: skip
TOOLS = (
    M("user", "weather?"),
    M("assistant", "", tool_calls=(call(id="rec_1"),)),
    M("tool", "sunny", tool_call_id="rec_1"),
    M("assistant", "It is sunny."),
)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def as_rows(messages: tuple[ChatMessage, ...]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        row: dict[str, Any] = {"role": m.role, "content": m.content or None}
        if m.tool_calls:
            row["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in m.tool_calls
            ]  # fmt: skip
        if m.tool_call_id:
            row["tool_call_id"] = m.tool_call_id
        out.append(row)
    return out


def first_turn(tmp_path: Path, messages: tuple[ChatMessage, ...], **row: Any) -> PromptRow:
    path = write_rows(tmp_path / "c.jsonl", [{"id": "c0", "messages": as_rows(messages), **row}])
    [first] = read_prompts("d", path, turns="regenerate")
    return first


def prompt_of(row: PromptRow) -> ev.PromptEvent:
    return ev.PromptEvent(
        prompt_id=row.prompt_id,
        dataset="d",
        messages=row.messages,
        tools=row.tools,
        conversation_id=row.conversation_id,
        turn=row.turn,
        turns=row.turns,
        reference=row.reference,
        row_id=row.row_id,
        source=row.source,
    )


def completion(
    prompt: ev.PromptEvent,
    text: str,
    *,
    stop: StopReason = "stop",
    calls: tuple[ToolCall, ...] | None = None,
    reasoning: str | None = "thinking...",
) -> ev.CompletionEvent:
    return ev.CompletionEvent(
        request_id=f"r-{prompt.prompt_id}",
        prompt_id=prompt.prompt_id,
        dataset="d",
        prompt_tokens=10,
        completion_tokens=5,
        output_ids=None,
        count_source="usage",
        finish_reason="length" if stop in ("length", "budget") else "stop",
        max_new_tokens=100,
        text=text,
        messages=prompt.messages,
        stop_reason=stop,
        reasoning=reasoning,
        tool_calls=calls,
        unfinished=False,
        **conversations.completion_fields(prompt, calls),
    )


# ---- reading: a conversation gives its first turn, carrying the whole of it ----------


def test_a_conversation_gives_its_first_turn_with_stable_turn_ids(tmp_path: Path) -> None:
    row = first_turn(tmp_path, FOUR)
    assert row.messages == FOUR[:2] and row.reference == FOUR
    assert (row.turn, row.turns) == (0, 4)
    assert row.conversation_id is not None
    assert row.prompt_id == turn_prompt_id("d", row.conversation_id, 0)
    assert first_turn(tmp_path, FOUR).prompt_id == row.prompt_id  # on every read
    ids = {turn_prompt_id("d", row.conversation_id, k) for k in range(4)}
    assert len(ids) == 4  # each turn a prompt of its own
    # a conversation ending in a user's turn has one more turn: that answer
    assert first_turn(tmp_path, (*FOUR, M("user", "u4"))).turns == 5


def test_tool_use_is_read_as_the_chat_format_writes_it(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    row = first_turn(tmp_path, TOOLS, tools=json.dumps(tools))  # JSON text is read too
    assert row.tools == tools and row.turns == 2
    assert row.reference is not None
    called = row.reference[1]
    assert called.content == "" and called.tool_calls == (call(id="rec_1"),)
    # arguments given as an object are kept as the JSON text a model writes
    assert json.loads(called.tool_calls[0].arguments) == {"query": "q"}
    assert row.reference[2].tool_call_id == "rec_1"


# ---- building the next turn ----------------------------------------------------------


def test_the_next_turn_is_sent_on_the_models_answer_without_its_reasoning() -> None:
    history = FOUR[:2]
    messages = next_messages(FOUR, 0, history, "my own a0", None)
    assert messages == (*FOUR[:2], M("assistant", "my own a0"), M("user", "u1"))
    assert FOUR[2] not in messages  # the dataset's answer is not in it


def test_tool_results_are_spliced_after_the_models_calls_pointing_at_them() -> None:
    regenerated = (call(id="new_1"),)
    messages = next_messages(TOOLS, 0, TOOLS[:1], "", regenerated)
    assert messages == (
        TOOLS[0],
        M("assistant", "", tool_calls=regenerated),
        M("tool", "sunny", tool_call_id="new_1"),
    )


def test_results_are_matched_to_calls_by_recorded_id_else_by_place() -> None:
    recorded = (call(id="a"), call("fetch", id="b"))
    regenerated = (call(id="x"), call("fetch", id="y"))
    between = (M("tool", "B", tool_call_id="b"), M("tool", "A", tool_call_id="a"))
    assert [m.tool_call_id for m in spliced(between, recorded, regenerated)] == ["y", "x"]
    anonymous = (M("tool", "1"), M("tool", "2"), M("user", "thanks"))
    out = spliced(anonymous, recorded, regenerated)
    assert [m.tool_call_id for m in out] == ["x", "y", None]


def test_calls_match_by_name_and_arguments_as_json_values() -> None:
    assert calls_match([call(arguments='{"a": 1, "b": 2}')], [call(arguments='{"b":2,"a":1}')])
    assert not calls_match([call()], [call("lookup")])
    assert not calls_match([call(arguments='{"query": "q"}')], [call(arguments='{"query": "r"}')])
    assert not calls_match([call()], [call(), call()])
    assert calls_match([], [])


# ---- what a turn's outcome leads to ------------------------------------------------------


def test_a_finished_turn_leads_to_the_next_turns_prompt(tmp_path: Path) -> None:
    prompt = prompt_of(first_turn(tmp_path, FOUR))
    answer = completion(prompt, "my own a0")
    after = follow_up(prompt, answer, max_prompt_bytes=10**6, at=1.0)
    assert after.skipped == () and after.prompt is not None
    nxt = after.prompt
    assert nxt.prompt_id == turn_prompt_id("d", prompt.conversation_id or "", 1)
    assert (nxt.turn, nxt.turns, nxt.conversation_id) == (1, 4, prompt.conversation_id)
    assert nxt.messages == (*FOUR[:2], M("assistant", "my own a0"), M("user", "u1"))
    assert nxt.reference == FOUR and nxt.row_id == "c0"
    assert nxt.v == ev.PROMPT_VERSION  # a build reading only v1 cannot follow it up
    # the last turn leads to nothing
    last = msgspec.structs.replace(prompt, turn=3)
    assert follow_up(last, completion(last, "a"), max_prompt_bytes=10**6, at=1.0).prompt is None


@pytest.mark.parametrize("stop", ["budget", "length", "abort"])
def test_an_answer_the_model_did_not_end_ends_the_conversation(tmp_path: Path, stop: str) -> None:
    prompt = prompt_of(first_turn(tmp_path, FOUR))
    after = follow_up(prompt, completion(prompt, "a", stop=stop), max_prompt_bytes=10**6, at=1.0)  # type: ignore[arg-type]
    assert after.prompt is None
    skipped = [s.prompt_id for s in after.skipped]
    assert skipped == [turn_prompt_id("d", prompt.conversation_id or "", k) for k in (1, 2, 3)]
    assert all(stop in s.reason for s in after.skipped)


def test_a_turn_not_generated_ends_the_conversation(tmp_path: Path) -> None:
    prompt = prompt_of(first_turn(tmp_path, FOUR))
    skip = ev.PromptSkipped(prompt_id=prompt.prompt_id, dataset="d", reason="budget reached")
    failed = ev.PromptFailed(prompt_id=prompt.prompt_id, dataset="d", reason="500", attempts=4)
    for outcome in (skip, failed):
        after = follow_up(prompt, outcome, max_prompt_bytes=10**6, at=1.0)
        assert after.prompt is None and len(after.skipped) == 3
    # no outcome published (the prompt was completed before): nothing to do here
    assert follow_up(prompt, None, max_prompt_bytes=10**6, at=1.0) == conversations.FollowUp()


def test_other_calls_than_recorded_mark_the_turn_and_end_the_conversation(tmp_path: Path) -> None:
    prompt = prompt_of(first_turn(tmp_path, TOOLS))
    same = completion(prompt, "", calls=(call(id="new", arguments='{ "query":"q" }'),))
    other = completion(prompt, "", calls=(call("lookup", id="new"),))
    text = completion(prompt, "I think it is sunny")  # answered without calling
    assert same.tool_mismatch is False
    assert follow_up(prompt, same, max_prompt_bytes=10**6, at=1.0).prompt is not None
    for answer in (other, text):
        assert answer.tool_mismatch is True
        after = follow_up(prompt, answer, max_prompt_bytes=10**6, at=1.0)
        assert after.prompt is None and ["tool_mismatch" in s.reason for s in after.skipped] == [
            True
        ]


def test_a_next_prompt_over_the_limit_ends_the_conversation(tmp_path: Path) -> None:
    prompt = prompt_of(first_turn(tmp_path, FOUR))
    after = follow_up(prompt, completion(prompt, "x" * 100), max_prompt_bytes=50, at=1.0)
    assert after.prompt is None and "max_prompt_bytes" in after.skipped[0].reason


def test_the_dispatchers_tracker_keeps_only_the_first_outcome_of_turns_it_handles(
    tmp_path: Path,
) -> None:
    prompt = prompt_of(first_turn(tmp_path, FOUR))
    other = ev.PromptSkipped(prompt_id="elsewhere", dataset="d", reason="r")
    tracker = conversations.Outcomes()
    tracker.saw(other)  # not a turn it handles
    assert tracker.expect(prompt)
    first, second = completion(prompt, "a"), completion(prompt, "b")
    tracker.saw(first)
    tracker.saw(second)
    assert tracker.take(prompt.prompt_id) is first
    assert tracker.take(prompt.prompt_id) is None and tracker.take("elsewhere") is None
    assert not tracker.expect(msgspec.structs.replace(prompt, conversation_id=None))


# ---- a rerun: where each conversation stands ------------------------------------------


def finished_turns(
    row: PromptRow, answers: list[str], **last: Any
) -> dict[str, ev.CompletionEvent]:
    """The completions of ``row``'s first turns, each on the one before."""
    out = {}
    prompt = prompt_of(row)
    for k, text in enumerate(answers):
        options = last if k == len(answers) - 1 else {}
        done = completion(prompt, text, **options)
        out[prompt.prompt_id] = done
        after = follow_up(prompt, done, max_prompt_bytes=10**6, at=1.0)
        if after.prompt is None:
            break
        prompt = after.prompt
    return out


def test_a_rerun_goes_on_from_the_last_finished_turn(tmp_path: Path) -> None:
    row = first_turn(tmp_path, FOUR)
    finished = finished_turns(row, ["b0", "b1"])
    where = conversations.resume("d", row, finished, set(), max_prompt_bytes=10**6, at=1.0)
    assert where.done == 2 and where.row is not None
    assert where.row.prompt_id == turn_prompt_id("d", row.conversation_id or "", 2)
    assert where.row.turn == 2
    assert where.row.messages == (
        *FOUR[:2], M("assistant", "b0"), M("user", "u1"), M("assistant", "b1"), M("user", "u2")
    )  # fmt: skip


def test_a_rerun_never_produces_a_finished_or_queued_turn(tmp_path: Path) -> None:
    row = first_turn(tmp_path, FOUR)
    cid = row.conversation_id or ""
    finished = finished_turns(row, ["b0", "b1"])
    # turn 1 finished but its prompt still queued (killed before its commit): turn 2
    queued = {turn_prompt_id("d", cid, 1)}
    where = conversations.resume("d", row, finished, queued, max_prompt_bytes=10**6, at=1.0)
    assert where.row is not None and where.row.turn == 2
    # turn 2 queued: the dispatcher that gets it goes on
    queued = {turn_prompt_id("d", cid, 2)}
    where = conversations.resume("d", row, finished, queued, max_prompt_bytes=10**6, at=1.0)
    assert (where.row, where.done, where.queued) == (None, 2, 2)
    # every turn finished: nothing
    everything = finished_turns(row, ["b0", "b1", "b2", "b3"])
    where = conversations.resume("d", row, everything, set(), max_prompt_bytes=10**6, at=1.0)
    assert (where.row, where.done) == (None, 4)
    # nothing finished: the first turn, as read
    assert conversations.resume("d", row, {}, set(), max_prompt_bytes=10**6, at=1.0).row == row


def test_a_rerun_skips_the_turns_of_a_conversation_that_ended(tmp_path: Path) -> None:
    """A run killed between a cut answer and the skips it leads to: the rerun sends
    them, so every turn has its outcome."""
    row = first_turn(tmp_path, FOUR)
    finished = finished_turns(row, ["b0", "b1"], stop="budget")
    where = conversations.resume("d", row, finished, set(), max_prompt_bytes=10**6, at=1.0)
    assert where.row is None and where.done == 2
    assert [s.prompt_id for s in where.skipped] == [
        turn_prompt_id("d", row.conversation_id or "", k) for k in (2, 3)
    ]


def test_a_turn_done_whose_answer_left_the_topic_ends_the_conversation(tmp_path: Path) -> None:
    row = first_turn(tmp_path, FOUR)
    done = {turn_prompt_id("d", row.conversation_id or "", 0)}
    where = conversations.resume("d", row, {}, set(), done, max_prompt_bytes=10**6, at=1.0)
    assert where.row is None and len(where.skipped) == 3
    assert "no longer on the completions topic" in where.skipped[0].reason


# ---- the producer: every turn counted, halted conversations skipped whole --------------


def make_config(tmp_path: Path, rows: list[dict[str, Any]]) -> config_module.Config:
    write_rows(tmp_path / "c.jsonl", rows)
    return config_module.build(
        {
            "kafka": {"bootstrap": "127.0.0.1:1", "namespace": "t"},
            "inference": {"api": "openai-chat"},
            "datasets": [{"name": "d", "path": "c.jsonl", "budget": 1000, "turns": "regenerate"}],
        },
        base_dir=tmp_path,
        environ={},
    )


@pytest.fixture
def nothing_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resume, "completed_prompt_ids", lambda *a, **k: set())
    monkeypatch.setattr(resume, "queued_prompt_ids", lambda *a, **k: set())


@pytest.mark.usefixtures("nothing_done")
def test_the_producer_counts_every_turn_and_resumes_from_the_topic(tmp_path: Path) -> None:
    rows = [{"id": f"c{i}", "messages": as_rows(FOUR)} for i in range(3)]
    config = make_config(tmp_path, rows)
    [first, second, third] = read_prompts("d", tmp_path / "c.jsonl", turns="regenerate")
    kept = {**finished_turns(second, ["b0"]), **finished_turns(third, ["c0"], stop="length")}
    recorder = RecordingProducer()
    producer = PromptProducer(
        config, "127.0.0.1:1", BudgetBoard(), producer=recorder,  # type: ignore[arg-type]
        kept_completions=lambda datasets: kept if datasets == {"d"} else {},
    )  # fmt: skip

    report = asyncio.run(producer.run())["d"]

    prompts = [e for _, e in recorder.sent if isinstance(e, ev.PromptEvent)]
    assert [(p.conversation_id, p.turn) for p in prompts] == [
        (first.conversation_id, 0),
        (second.conversation_id, 1),  # on its finished turn 0
    ]
    assert prompts[1].messages is not None and prompts[1].messages[2].content == "b0"
    skipped = [e.prompt_id for _, e in recorder.sent if isinstance(e, ev.PromptSkipped)]
    assert skipped == [turn_prompt_id("d", third.conversation_id or "", k) for k in (1, 2, 3)]
    [done] = [e for _, e in recorder.sent if isinstance(e, ev.ProducerDone)]
    assert done.produced == 12 == report.turns  # every turn gets an outcome
    assert (report.produced, report.already_done) == (2, 2)


@pytest.mark.usefixtures("nothing_done")
def test_a_halted_producer_skips_every_turn_of_the_conversations_not_sent(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path, [{"id": f"c{i}", "messages": as_rows(FOUR)} for i in range(2)])
    board = BudgetBoard()
    board.apply(ev.BudgetExceeded(dataset="d", budget=1000, used=1000))
    recorder = RecordingProducer()
    producer = PromptProducer(config, "127.0.0.1:1", board, producer=recorder)  # type: ignore[arg-type]

    report = asyncio.run(producer.run())["d"]

    skipped = {e.prompt_id for _, e in recorder.sent if isinstance(e, ev.PromptSkipped)}
    assert len(skipped) == 8 == report.not_sent
    assert [e.produced for _, e in recorder.sent if isinstance(e, ev.ProducerDone)] == [8]


# ---- config --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inference", "dataset", "key", "message"),
    [
        ({"api": "sglang"}, {}, "datasets[0].turns", 'api = "openai-chat"'),
        ({"api": "openai-chat", "n": 2}, {}, "datasets[0].n", "set n = 1"),
        ({"api": "openai-chat"}, {"n": 3}, "datasets[0].n", "set n = 1"),
        ({"api": "openai-chat"}, {"prompt_field": "q"}, "datasets[0].turns", "needs conversations"),
    ],
)
def test_regenerate_needs_the_chat_api_and_one_answer_per_turn(
    inference: dict[str, Any], dataset: dict[str, Any], key: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        config_module.build(
            {
                "inference": inference,
                "datasets": [
                    {"name": "d", "path": "d.jsonl", "budget": 1, "turns": "regenerate", **dataset}
                ],
            },
            environ={},
        )
    assert info.value.key == key


def test_a_dataset_of_plain_prompts_cannot_be_regenerated_turn_by_turn(tmp_path: Path) -> None:
    config = make_config(tmp_path, [{"prompt": "tell me"}, {"prompt": "and more"}])
    with pytest.raises(ConfigError, match="hold plain prompts") as info:
        check_datasets(config)
    assert info.value.key == "datasets[0].turns"
    check_datasets(make_config(tmp_path, [{"messages": as_rows(FOUR)}]))  # conversations: fine
