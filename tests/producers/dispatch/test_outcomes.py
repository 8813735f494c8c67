"""A dispatcher's outcomes (producers/dispatch/outcomes.py), without a broker: sent until
Kafka takes them, an event too large for a message refused with the fix, every event
shown to ``seen`` before it goes, a failure's dead letter before its outcome."""

from __future__ import annotations

import pytest
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError

from tests.producers.dispatch.test_admission import DS, TOPICS, run
from tests.producers.dispatch.test_dispatcher_caps import Recorder, prompt
from tokenbudget.core.errors import KafkaLimitsError
from tokenbudget.producers.dispatch.outcomes import Publisher
from tokenbudget.producers.dispatch.step import DispatchReport
from tokenbudget.streams import events as ev


class Refusing(Recorder):
    """Kafka refuses the first ``refusals`` sends with ``error``."""

    def __init__(self, refusals: int, error: Exception) -> None:
        super().__init__()
        self.refusals = refusals
        self.error = error
        self.topics: list[str] = []

    async def send_and_wait(self, topic: str, key: bytes, value: bytes) -> None:
        if self.refusals:
            self.refusals -= 1
            raise self.error
        self.topics.append(topic)
        await super().send_and_wait(topic, key, value)


def publisher(producer: Recorder, seen: list[ev.Event] | None = None) -> Publisher:
    return Publisher(
        producer,  # type: ignore[arg-type]
        TOPICS,
        DispatchReport(),
        seen=None if seen is None else seen.append,
    )


def test_an_outcome_is_sent_again_until_kafka_takes_it() -> None:
    kafka = Refusing(2, KafkaConnectionError("broker away"))
    out = publisher(kafka)
    run(out.skip(prompt(0), "budget reached"))
    assert [type(e) for e in kafka.sent] == [ev.PromptSkipped]
    assert out.report.skipped == 1


def test_an_event_larger_than_a_message_is_refused_with_the_fix() -> None:
    kafka = Refusing(1, MessageSizeTooLargeError())
    with pytest.raises(KafkaLimitsError, match="max_new_tokens"):
        run(publisher(kafka).skip(prompt(0), "r"))
    assert kafka.sent == []


def test_every_event_published_is_seen_first_and_a_failure_sends_its_dead_letter_first() -> None:
    kafka, seen = Refusing(0, RuntimeError()), []
    out = publisher(kafka, seen)
    run(out.fail(prompt(0), 3, "HTTP 500"))
    assert [type(e) for e in seen] == [ev.DeadLetter, ev.PromptFailed]
    assert kafka.topics == [TOPICS.dead_letter, TOPICS.outcomes]
    [failed] = [e for e in kafka.sent if isinstance(e, ev.PromptFailed)]
    assert (failed.dataset, failed.attempts, failed.reason) == (DS, 3, "HTTP 500")
    assert out.report.failed == 1


def test_a_record_that_is_not_a_prompt_is_dead_lettered_once_unseen() -> None:
    class Record:
        topic, partition, offset, key, value = TOPICS.prompts, 0, 7, DS.encode(), b"{"

    kafka, seen = Refusing(0, RuntimeError()), []
    out = publisher(kafka, seen)
    run(out.dead_letter("not JSON", Record()))
    [letter] = kafka.sent
    assert isinstance(letter, ev.DeadLetter) and "not JSON" in letter.reason
    assert seen == [] and out.report.dead_lettered == 1
