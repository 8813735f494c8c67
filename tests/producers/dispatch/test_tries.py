"""A prompt's tries (producers/dispatch/tries.py) around a stand-in attempt, without a broker:
an error outside the request is tried again until it has happened
``UNEXPECTED_ERRORS`` times, then the prompt is recorded as failed, while Kafka's
errors are waited out for ever; a prompt done already is not sent; a halted dataset's
prompt is skipped and the refusal noted. (What the server's errors mean for retrying
is in ``test_dispatcher_faults``, through the whole path.)"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokafka.errors import KafkaConnectionError

from tests.producers.dispatch.test_admission import DS, TOPICS, run
from tests.producers.dispatch.test_dispatcher_caps import Recorder, prompt
from tokenbudget.producers.dispatch.leases import Ticket
from tokenbudget.producers.dispatch.outcomes import Publisher
from tokenbudget.producers.dispatch.slots import Slot
from tokenbudget.producers.dispatch.step import DispatchReport
from tokenbudget.producers.dispatch.tries import UNEXPECTED_ERRORS, Tries, prompt_token_estimate
from tokenbudget.producers.inference.generation import RetryPolicy
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.fields import ChatMessage


class OpenFleet:
    """A fleet with a server ready at all times."""

    async def wait_ready(self) -> None:
        return None


@dataclass
class FailingAttempt:
    """The route step's stand-in: raises ``errors`` in turn, then succeeds
    (publishing nothing itself)."""

    errors: list[Exception]
    calls: list[int] = field(default_factory=list)  # the attempts' numbers
    fleet: OpenFleet = field(default_factory=OpenFleet)

    async def submit(
        self,
        prompt: ev.PromptEvent,
        ticket: Ticket | None,
        max_new: int,
        attempts: int,
        slot: Slot | None,
        failed_at: set[str],
    ) -> None:
        self.calls.append(attempts)
        if self.errors:
            raise self.errors.pop(0)


@dataclass
class Done:
    completed: set[str] = field(default_factory=set)


def tries(
    attempt: FailingAttempt, board: BudgetBoard | None = None, done: Done | None = None
) -> tuple[Tries, Recorder]:
    kafka = Recorder()
    report = DispatchReport()
    publisher = Publisher(kafka, TOPICS, report)  # type: ignore[arg-type]
    return (
        Tries(
            attempt,  # type: ignore[arg-type]
            publisher,
            board or BudgetBoard(),
            None,
            done or Done(),  # type: ignore[arg-type]
            RetryPolicy(retries=1, backoff=0.0, backoff_max=0.0),
            max_new_tokens=100,
            report=report,
            refused_at={},
        ),
        kafka,
    )


def test_a_prompt_an_error_outside_the_request_keeps_failing_is_recorded_as_failed() -> None:
    attempt = FailingAttempt([RuntimeError("a bug")] * UNEXPECTED_ERRORS)
    step, kafka = tries(attempt)
    run(step.submit(prompt(0)))
    assert len(attempt.calls) == UNEXPECTED_ERRORS
    [failed] = [e for e in kafka.sent if isinstance(e, ev.PromptFailed)]
    assert failed.attempts == UNEXPECTED_ERRORS and "a bug" in failed.reason


def test_kafka_away_never_fails_a_prompt() -> None:
    attempt = FailingAttempt([KafkaConnectionError("broker away")] * (UNEXPECTED_ERRORS + 2))
    step, kafka = tries(attempt)
    run(step.submit(prompt(0)))
    assert len(attempt.calls) == UNEXPECTED_ERRORS + 3  # the last one went through
    assert kafka.sent == [] and step.report.failed == 0


def test_a_prompt_done_already_is_not_sent_again() -> None:
    attempt = FailingAttempt([])
    step, kafka = tries(attempt, done=Done({"p0"}))
    run(step.submit(prompt(0)))
    assert attempt.calls == [] and kafka.sent == []
    assert step.report.already_completed == 1


def test_a_halted_datasets_prompt_is_skipped_and_the_refusal_noted() -> None:
    board = BudgetBoard()
    board.apply(ev.BudgetExceeded(dataset=DS, budget=10, used=10))
    attempt = FailingAttempt([])
    step, kafka = tries(attempt, board=board)
    run(step.submit(prompt(0)))
    [skipped] = kafka.sent
    assert isinstance(skipped, ev.PromptSkipped) and skipped.reason == "budget reached"
    assert attempt.calls == [] and DS in step.refused_at


def test_a_prompts_token_estimate_bounds_its_bytes() -> None:
    chat = ev.PromptEvent(
        prompt_id="c",
        dataset=DS,
        messages=(ChatMessage("user", "héllo"), ChatMessage("assistant", "ok")),
    )
    assert prompt_token_estimate(chat) == len("héllook".encode()) + 16 * 3
    assert prompt_token_estimate(prompt(0)) == len(b"q0") + 16
