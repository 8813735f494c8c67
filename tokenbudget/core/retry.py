"""Trying again until something answers: the one loop behind every wait for Kafka
(a broker starting or restarting, a topic's metadata, a group coordinator).

What "Kafka is ready" means is :func:`tokenbudget.core.kafka_admin.check_ready`'s
business; this module only says how long to keep asking and how often.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypedDict, TypeVar, Unpack

from tokenbudget.core import roles
from tokenbudget.core.errors import KafkaRefusedError, refused_by_kafka

T = TypeVar("T")

Errors = type[BaseException] | tuple[type[BaseException], ...]


class RetryOptions(TypedDict, total=False):
    """How :func:`retry_until` asks again (every key optional)."""

    retry_on: Errors  # the errors that mean "not yet" (default: any Exception)
    interval: float  # seconds before the next attempt (default 0.2)
    max_interval: float | None  # the interval doubles up to this (None: it stays)
    on_retry: Callable[[BaseException], None]  # sees each error before the wait
    give_up: Callable[[BaseException], BaseException]  # the error at the timeout
    # retry_until only: how to wait (default time.sleep), e.g. a wait that ends, and
    # raises, when the caller is stopped
    sleep: Callable[[float], object]


class _Schedule:
    """When to stop asking, and how long to wait before asking again."""

    def __init__(self, timeout: float | None, options: RetryOptions) -> None:
        self.retry_on: Errors = options.get("retry_on", Exception)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.delay = options.get("interval", 0.2)
        self.max_interval = options.get("max_interval")
        self.on_retry = options.get("on_retry")
        self.give_up = options.get("give_up")

    def next_delay(self, error: BaseException) -> float:
        """Seconds to wait before the next attempt; raises once the time is up, and
        at once for what no attempt can change (Kafka's ACLs refusing the role)."""
        if refused_by_kafka(error):
            role = roles.current_role()
            who = f"the {role}'s principal" if role else "this process's principal"
            raise KafkaRefusedError(
                f"Kafka refused {who}: {error!r}: its ACLs are missing, or it logs in as "
                "another role's user; `tokenbudget acls --config FILE` prints (and with "
                "--apply creates) what each role needs (docs/kafka.md, Roles and ACLs)"
            ) from error
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            if self.give_up is None:
                raise error
            raise self.give_up(error) from error
        if self.on_retry is not None:
            self.on_retry(error)
        delay = self.delay
        if self.max_interval is not None:
            self.delay = min(self.max_interval, self.delay * 2)
        if self.deadline is not None:
            delay = min(delay, self.deadline - now)  # a last attempt at the deadline
        return delay


def retry_until(
    attempt: Callable[[], T], *, timeout: float | None, **options: Unpack[RetryOptions]
) -> T:
    """What ``attempt()`` returns, once it returns: an error of ``retry_on`` it
    raises is followed by another attempt, ``interval`` seconds later (doubled each
    time up to ``max_interval``; None: always ``interval``). Other errors are raised
    at once.

    Once ``timeout`` seconds have passed since the call (None: never), the last
    error is raised, or ``give_up(error)`` is raised from it. ``on_retry(error)``
    is called before each wait, to log it, or to raise and stop asking (a process
    that died will not answer). Blocking: see :func:`retry_until_async`."""
    schedule = _Schedule(timeout, options)
    sleep = options.get("sleep") or time.sleep
    while True:
        try:
            return attempt()
        except schedule.retry_on as error:
            delay = schedule.next_delay(error)
        sleep(delay)


async def retry_until_async(
    attempt: Callable[[], Awaitable[T]], *, timeout: float | None, **options: Unpack[RetryOptions]
) -> T:
    """:func:`retry_until` for a coroutine function: the same contract, waiting
    without blocking the event loop."""
    schedule = _Schedule(timeout, options)
    while True:
        try:
            return await attempt()
        except schedule.retry_on as error:
            delay = schedule.next_delay(error)
        await asyncio.sleep(delay)
