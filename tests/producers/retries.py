"""A retry loop for tests: one backend call retried under a :class:`RetryPolicy`.

The dispatcher has its own loop (with its metrics and leases); this one lets the
tests check what a backend's errors mean for retrying (which are retryable, how
many attempts a policy allows) without a dispatcher.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tokenbudget.core.errors import InferenceError
from tokenbudget.producers.inference.generation import (
    GenerationRequest,
    GenerationResult,
    InferenceBackend,
    RetryPolicy,
)


async def generate_with_retries(
    backend: InferenceBackend,
    request: GenerationRequest,
    policy: RetryPolicy,
    *,
    on_error: Callable[[InferenceError], object] | None = None,
) -> tuple[GenerationResult, int]:
    """Returns the result and the number of attempts it took; raises the last
    error once retries are spent or at once for errors that are not retryable."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return await backend.generate(request), attempt
        except InferenceError as exc:
            if on_error is not None:
                on_error(exc)
            if not exc.retryable or attempt > policy.retries:
                raise
            await asyncio.sleep(policy.delay(attempt))
