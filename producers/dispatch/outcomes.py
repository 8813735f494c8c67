"""A dispatcher's outcomes, published to Kafka and counted.

Every prompt the dispatcher takes ends with one outcome event, sent here by the step
that decides it: a completion (:meth:`Publisher.completed`, by the request attempt),
a skip (:meth:`Publisher.skip`: its dataset has no budget left for it), a failure
with its dead letter (:meth:`Publisher.fail`), or, for an event that is not a
prompt, a dead letter alone (:meth:`Publisher.dead_letter`, by the dispatcher).
What a conversation's turn leads to (the next turn's prompt, skips of later turns)
goes out through :meth:`Publisher.publish`.

An outcome is never given up on: a send Kafka refuses is tried again until it takes
it (a broker away is waited out). The one error that gets out is
:class:`~tokenbudget.core.errors.KafkaLimitsError`, for an event larger than a Kafka
message, which no retry can send. The same event sent twice is harmless: readers
keep the first outcome of a prompt, and a repeated request id is recognised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError

from tokenbudget.core import metrics, sizes
from tokenbudget.core.errors import KafkaLimitsError
from tokenbudget.core.retry import retry_until_async
from tokenbudget.producers.dispatch.step import DispatchReport, about
from tokenbudget.producers.inference.reasoning import ReasoningRows
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.dead_letters import dead_letter, dead_letter_for
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)


class Publisher:
    """Sends outcomes with ``producer`` to the namespace's ``topics`` and counts them
    in ``report`` and the metrics. ``seen``, if given, is shown every event
    :meth:`publish` sends, before it is sent (the conversation turn step learns
    from it what each turn led to)."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        topics: Topics,
        report: DispatchReport,
        *,
        seen: Callable[[ev.Event], None] | None = None,
    ) -> None:
        self.producer = producer
        self.topics = topics
        self.report = report
        self._seen = seen

    async def publish(self, topic: str, dataset: str, event: ev.Event) -> None:
        """Send ``event`` to ``topic`` under the dataset's key until Kafka has it.
        Raises :class:`~tokenbudget.core.errors.KafkaLimitsError` when it is larger than a
        Kafka message; a cancellation stops the retries."""
        value = codec.encode(event)
        if self._seen is not None:
            self._seen(event)

        async def send() -> None:
            try:
                await self.producer.send_and_wait(topic, key=dataset.encode(), value=value)
            except MessageSizeTooLargeError as exc:
                # Sending it again cannot help. Prompts take at most half a message
                # (tokenbudget.core.sizes), so only an answer of hundreds of thousands of
                # tokens gets here.
                raise KafkaLimitsError(
                    f"a {type(event).__name__} of dataset {dataset} is {len(value):,} bytes, "
                    f"over the {sizes.MESSAGE_BYTES:,}-byte Kafka message every topic "
                    "accepts; fix: lower [inference] max_new_tokens (or the dataset's)"
                ) from exc

        def warn(exc: BaseException) -> None:
            log.warning("publishing to %s failed (%r); trying again", topic, exc)

        await retry_until_async(
            send, timeout=None, retry_on=KafkaError, max_interval=5.0, on_retry=warn
        )

    async def completed(self, completion: ev.CompletionEvent) -> None:
        """Publish a prompt's completion and count it (by dataset and stop reason,
        and its tokens by thinking and answer). Raises as :meth:`publish` does,
        counting nothing then."""
        await self.publish(self.topics.completions, completion.dataset, completion)
        metrics.EVENTS_PRODUCED.labels(topic="completions").inc()
        metrics.COMPLETIONS.labels(
            dataset=completion.dataset, finish_reason=completion.stop_reason
        ).inc()
        ReasoningRows.count(completion)
        self.report.completed += 1

    async def skip(self, prompt: ev.PromptEvent, reason: str) -> None:
        """Publish that ``prompt`` is not generated, for ``reason`` (its dataset has no
        budget left for it), and count it. Raises as :meth:`publish` does."""
        skipped = ev.PromptSkipped(
            prompt_id=prompt.prompt_id, dataset=prompt.dataset, reason=reason, at=time.time()
        )
        await self.publish(self.topics.outcomes, prompt.dataset, skipped)
        self.report.skipped += 1
        metrics.SKIPPED_PROMPTS.labels(dataset=prompt.dataset).inc()
        metrics.EVENTS_PRODUCED.labels(topic="outcomes").inc()

    async def fail(self, prompt: ev.PromptEvent, attempts: int, reason: str) -> None:
        """Publish that ``prompt`` failed for good after ``attempts``, with a dead
        letter holding it and ``reason`` (sent first), and count it. Raises as
        :meth:`publish` does."""
        log.warning("%s: failed for good (%s); see the dead-letter topic", about(prompt), reason)
        failed = ev.PromptFailed(
            prompt_id=prompt.prompt_id,
            dataset=prompt.dataset,
            reason=reason,
            attempts=attempts,
            at=time.time(),
        )
        letter = dead_letter(reason, source_topic=self.topics.prompts, payload=codec.encode(prompt))
        await self.publish(self.topics.dead_letter, prompt.dataset, letter)
        await self.publish(self.topics.outcomes, prompt.dataset, failed)
        self.report.failed += 1
        metrics.DEAD_LETTERED.labels(topic="prompts").inc()
        metrics.EVENTS_PRODUCED.labels(topic="outcomes").inc()

    async def dead_letter(self, reason: str, record: Any) -> None:
        """Send the consumed ``record`` (not a prompt: undecodable, or another event)
        to the dead-letter topic with ``reason``, once: its error, a broker away
        included, is raised to the caller."""
        letter = dead_letter_for(reason, record)
        await self.producer.send_and_wait(
            self.topics.dead_letter,
            key=record.key,
            value=codec.encode(letter),
        )
        self.report.dead_lettered += 1
        metrics.DEAD_LETTERED.labels(topic="prompts").inc()
        log.warning("dead-lettered a prompt event: %s", reason)
