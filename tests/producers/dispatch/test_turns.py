"""The conversation turn step (producers/dispatch/turns.py), without a broker: once the next
step has published a turn's outcome, what follows it is published before the step
returns; a turn stopped before its outcome leads to nothing; a plain prompt passes
straight through."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tests.producers.dispatch.test_admission import TOPICS, run
from tests.producers.dispatch.test_dispatcher_caps import Recorder
from tests.producers.prompts.test_conversations import FOUR, completion, first_turn, prompt_of
from tokenbudget.producers.dispatch.outcomes import Publisher
from tokenbudget.producers.dispatch.slots import Slot
from tokenbudget.producers.dispatch.step import DispatchReport
from tokenbudget.producers.dispatch.turns import ConversationTurns
from tokenbudget.producers.prompts import conversations
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import ChatMessage


class Publishing:
    """A next step that publishes ``outcome(prompt)`` as the prompt's outcome, or
    raises ``error`` instead."""

    def __init__(self, publisher: Publisher, error: BaseException | None = None) -> None:
        self.publisher = publisher
        self.error = error
        self.submitted: list[str] = []

    async def submit(self, prompt: ev.PromptEvent, slot: Slot | None = None) -> None:
        self.submitted.append(prompt.prompt_id)
        if self.error is not None:
            raise self.error
        await self.publisher.publish(TOPICS.completions, prompt.dataset, completion(prompt, "b0"))


def turns_step(error: BaseException | None = None) -> tuple[ConversationTurns, Recorder]:
    kafka = Recorder()
    seen = conversations.Outcomes()
    publisher = Publisher(kafka, TOPICS, DispatchReport(), seen=seen.saw)  # type: ignore[arg-type]
    step = ConversationTurns(Publishing(publisher, error), publisher, seen, max_prompt_bytes=10**6)
    return step, kafka


def test_a_turns_outcome_is_followed_by_the_next_turns_prompt(tmp_path: Path) -> None:
    prompt = prompt_of(first_turn(tmp_path, FOUR))
    step, kafka = turns_step()
    run(step.submit(prompt))
    done, following = kafka.sent
    assert isinstance(done, ev.CompletionEvent) and done.prompt_id == prompt.prompt_id
    assert isinstance(following, ev.PromptEvent) and following.turn == 1
    assert following.messages is not None and following.messages[-2:] == (
        ChatMessage("assistant", "b0"),
        ChatMessage("user", "u1"),
    )


def test_a_turn_stopped_before_its_outcome_leads_to_nothing(tmp_path: Path) -> None:
    prompt = prompt_of(first_turn(tmp_path, FOUR))
    step, kafka = turns_step(error=RuntimeError("stopped"))
    with pytest.raises(RuntimeError):
        run(step.submit(prompt))
    assert kafka.sent == []
    assert step.turns.take(prompt.prompt_id) is None  # nothing kept for it either


def test_a_plain_prompt_passes_straight_through(tmp_path: Path) -> None:
    prompt = msgspec.structs.replace(prompt_of(first_turn(tmp_path, FOUR)), conversation_id=None)
    step, kafka = turns_step()
    run(step.submit(prompt))
    assert [type(e) for e in kafka.sent] == [ev.CompletionEvent]
