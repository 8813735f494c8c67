"""The conversation turn step: what follows a turn of a conversation regenerated turn
by turn (``turns = "regenerate"``), published by whoever published the turn's outcome.

A step of the prompt's path (see :mod:`tokenbudget.producers.dispatch.step`), first after the
dispatcher:
for a turn, once the next step has published its outcome, it publishes what follows
(the next turn's prompt, or skips of the turns that will not be sent:
:func:`tokenbudget.producers.prompts.conversations.follow_up`) before the dispatcher may commit the
turn's offset. A stop before then leaves that to the prompt's redelivery, or to a
rerun's producer (:func:`tokenbudget.producers.conversations.resume`). Any other prompt passes
straight through.

What a turn led to is learnt from the outcomes themselves: the
:class:`~tokenbudget.producers.prompts.conversations.Outcomes` given here is the one the
:class:`~tokenbudget.producers.dispatch.outcomes.Publisher` shows every event it publishes.
"""

from __future__ import annotations

import time

from tokenbudget.core import metrics
from tokenbudget.producers.dispatch.outcomes import Publisher
from tokenbudget.producers.dispatch.slots import Slot
from tokenbudget.producers.dispatch.step import Step
from tokenbudget.producers.prompts import conversations
from tokenbudget.streams import events as ev


class ConversationTurns:
    """Passes each prompt to ``next_step``, then publishes what follows a turn.
    ``turns`` is what the publisher saw each turn lead to; ``max_prompt_bytes`` bounds
    the next turn's prompt (``[producer] max_prompt_bytes``)."""

    def __init__(
        self,
        next_step: Step,
        publisher: Publisher,
        turns: conversations.Outcomes,
        *,
        max_prompt_bytes: int,
    ) -> None:
        self.next_step = next_step
        self.publisher = publisher
        self.turns = turns
        self.max_prompt_bytes = max_prompt_bytes

    async def submit(self, prompt: ev.PromptEvent, slot: Slot | None = None) -> None:
        """The :class:`~tokenbudget.producers.dispatch.step.Step` contract: ``prompt`` to its
        outcome
        through the next step, and, for a turn, what follows it, published before
        this returns. Raises what the next step raises (what follows is then not
        published) and what :meth:`Publisher.publish` raises. Called by the
        dispatcher for every prompt it consumes."""
        if not self.turns.expect(prompt):
            await self.next_step.submit(prompt, slot)
            return
        try:
            await self.next_step.submit(prompt, slot)
        except BaseException:
            self.turns.take(prompt.prompt_id)
            raise
        after = conversations.follow_up(
            prompt,
            self.turns.take(prompt.prompt_id),
            max_prompt_bytes=self.max_prompt_bytes,
            at=time.time(),
        )
        topics = self.publisher.topics
        if after.prompt is not None:
            await self.publisher.publish(topics.prompts, prompt.dataset, after.prompt)
            metrics.EVENTS_PRODUCED.labels(topic="prompts").inc()
        for skipped in after.skipped:
            await self.publisher.publish(topics.outcomes, prompt.dataset, skipped)
            metrics.SKIPPED_PROMPTS.labels(dataset=prompt.dataset).inc()
            metrics.EVENTS_PRODUCED.labels(topic="outcomes").inc()
