"""retry_until: what the attempt returns once it returns; errors it is told to
retry are tried again on a schedule until the timeout, others are raised at once."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Iterator

import pytest
from kafka.errors import KafkaError

from tokenbudget.core import retry, roles
from tokenbudget.core.errors import KafkaRefusedError
from tokenbudget.core.retry import retry_until, retry_until_async


class Clock:
    """Time that passes only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 6))
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    clock = Clock()
    monkeypatch.setattr(
        retry, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep)
    )
    monkeypatch.setattr(retry, "asyncio", types.SimpleNamespace(sleep=clock.async_sleep))
    yield clock


def failing(times: int, error: BaseException, result: str = "answer") -> types.SimpleNamespace:
    state = types.SimpleNamespace(calls=0)

    def attempt() -> str:
        state.calls += 1
        if state.calls <= times:
            raise error
        return result

    state.attempt = attempt
    return state


def test_the_result_once_the_attempt_answers(clock: Clock) -> None:
    f = failing(3, ConnectionError("not yet"))
    assert retry_until(f.attempt, timeout=10, retry_on=ConnectionError, interval=0.5) == "answer"
    assert f.calls == 4
    assert clock.sleeps == [0.5, 0.5, 0.5]


def test_an_error_it_is_not_told_to_retry_is_raised_at_once(clock: Clock) -> None:
    f = failing(1, KeyError("a bug"))
    with pytest.raises(KeyError):
        retry_until(f.attempt, timeout=10, retry_on=ConnectionError)
    assert f.calls == 1 and clock.sleeps == []


def test_the_interval_doubles_up_to_its_most(clock: Clock) -> None:
    f = failing(5, ConnectionError())
    retry_until(f.attempt, timeout=None, retry_on=ConnectionError, interval=0.5, max_interval=3)
    assert clock.sleeps == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_at_the_timeout_the_last_error_is_raised_after_an_attempt_at_the_deadline(
    clock: Clock,
) -> None:
    errors = iter(range(100))

    def attempt() -> None:
        raise ConnectionError(f"refused {next(errors)}")

    with pytest.raises(ConnectionError, match="refused 3"):
        retry_until(attempt, timeout=5, retry_on=ConnectionError, interval=2)
    assert clock.sleeps == [2, 2, 1]  # never past the deadline
    assert clock.now == 5


def test_give_up_says_what_the_caller_means_from_the_last_error(clock: Clock) -> None:
    f = failing(100, ConnectionError("refused"))
    with pytest.raises(RuntimeError, match="not ready after 1 s") as raised:
        retry_until(
            f.attempt,
            timeout=1,
            retry_on=ConnectionError,
            give_up=lambda last: RuntimeError(f"not ready after 1 s ({last})"),
        )
    assert isinstance(raised.value.__cause__, ConnectionError)


def test_on_retry_sees_each_error_before_the_wait_and_may_stop_the_asking(clock: Clock) -> None:
    seen: list[str] = []

    def on_retry(error: BaseException) -> None:
        seen.append(str(error))
        if len(seen) == 2:
            raise RuntimeError("the process died: it will not answer")

    f = failing(100, ConnectionError("refused"))
    with pytest.raises(RuntimeError, match="process died"):
        retry_until(f.attempt, timeout=None, retry_on=ConnectionError, on_retry=on_retry)
    assert seen == ["refused", "refused"]
    assert f.calls == 2 and len(clock.sleeps) == 1


def test_the_async_form_keeps_the_same_contract(clock: Clock) -> None:
    f = failing(2, ConnectionError("not yet"))

    async def attempt() -> str:
        return f.attempt()

    result = asyncio.run(
        retry_until_async(
            attempt, timeout=None, retry_on=ConnectionError, interval=1, max_interval=5
        )
    )
    assert result == "answer" and clock.sleeps == [1, 2]
    g = failing(100, ConnectionError("refused"))

    async def never() -> str:
        return g.attempt()

    with pytest.raises(ConnectionError):
        asyncio.run(retry_until_async(never, timeout=3, retry_on=ConnectionError, interval=1))
    assert clock.sleeps[2:] == [1, 1, 1]


def test_a_wait_of_the_callers_own_may_end_the_asking(clock: Clock) -> None:
    class Stopped(Exception):
        pass

    waits: list[float] = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 2:
            raise Stopped  # the caller was stopped while it waited

    f = failing(100, ConnectionError())
    with pytest.raises(Stopped):
        retry_until(f.attempt, timeout=None, retry_on=ConnectionError, interval=2, sleep=wait)
    assert waits == [2, 2] and f.calls == 2
    assert clock.sleeps == []  # time.sleep was not used


class GroupAuthorizationFailedError(KafkaError):
    """As kafka-python and aiokafka name Kafka's refusal of a group."""


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_refusal_of_kafkas_authorizer_is_raised_at_once_naming_the_role(
    asynchronous: bool,
) -> None:
    """No attempt can change an ACL: waiting on one hung a dispatcher whose principal
    was refused its group, asking again every 5 s for ever."""
    calls: list[int] = []

    def attempt() -> None:
        calls.append(1)
        raise GroupAuthorizationFailedError("ns-dispatch")

    async def attempt_async() -> None:
        attempt()

    with roles.acting_as("dispatcher"), pytest.raises(KafkaRefusedError) as info:
        if asynchronous:
            asyncio.run(retry_until_async(attempt_async, timeout=None, retry_on=KafkaError))
        else:
            retry_until(attempt, timeout=None, retry_on=KafkaError, sleep=lambda s: None)
    assert calls == [1]
    assert str(info.value).startswith("Kafka refused the dispatcher's principal: ")
    assert "tokenbudget acls --config FILE" in str(info.value)
