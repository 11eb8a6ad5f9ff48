"""The one retry policy every backend call goes through (tenacity, jittered exponential backoff)."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
import httpx
from tenacity import AsyncRetrying, RetryCallState, RetryError, retry_if_exception, stop_after_attempt

from .errors import DeadlineExceededError, RetriesExhaustedError, TransientError

__all__ = ["RetryPolicy", "RetryEvent", "is_retryable", "call_with_retry"]

log = logging.getLogger("asyncsess.retry")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How transient faults are retried. One policy per ServiceClient (``retry=RetryPolicy(...)``).

    - ``max_attempts``: tries per op, the first included.
    - ``initial_backoff`` / ``max_backoff`` (s): exponential backoff bounds, with up to ``jitter`` s of
      random jitter; a ``retry_after`` hint from the backend (HTTP ``Retry-After``) wins when longer.
    - ``attempt_timeout`` (s): one try that takes longer is abandoned and retried (the backend's
      idempotency makes that safe).
    - ``deadline`` (s): the whole op, retries included, fails with ``DeadlineExceededError`` past this.
    """

    max_attempts: int = 8
    initial_backoff: float = 0.2
    max_backoff: float = 10.0
    jitter: float = 0.2
    attempt_timeout: float | None = 600.0
    deadline: float | None = 3600.0

    @classmethod
    def none(cls) -> RetryPolicy:
        return cls(max_attempts=1)


@dataclass(frozen=True, slots=True)
class RetryEvent:
    """Passed to the ServiceClient's ``on_retry`` hook before each backoff sleep."""

    operation: str
    seq: int | None
    attempt: int
    error: BaseException
    sleep: float


def is_retryable(err: BaseException) -> bool:
    if isinstance(err, DeadlineExceededError):
        return False
    return isinstance(err, (TransientError, TimeoutError, ConnectionError, httpx.TimeoutException, httpx.NetworkError))


async def call_with_retry(
    policy: RetryPolicy,
    fn: Callable[[], Awaitable[T]],
    *,
    operation: str,
    seq: int | None = None,
    on_retry: Callable[[RetryEvent], None] | None = None,
) -> T:
    """Call ``fn`` until it succeeds, fails for good, or the policy runs out."""
    def wait(state: RetryCallState) -> float:
        delay = min(policy.max_backoff, policy.initial_backoff * 2 ** (state.attempt_number - 1)) + random.uniform(0, policy.jitter)
        err = state.outcome.exception() if state.outcome else None
        hint = getattr(err, "retry_after", None)
        return max(delay, hint) if hint else delay

    def before_sleep(state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome else None
        sleep = state.upcoming_sleep
        log.info("retrying %s (seq %s) after attempt %d: %r; sleeping %.3fs", operation, seq, state.attempt_number, err, sleep)
        if on_retry is not None and err is not None:
            on_retry(RetryEvent(operation, seq, state.attempt_number, err, sleep))

    async def attempt() -> T:
        if policy.attempt_timeout is None:
            return await fn()
        with anyio.move_on_after(policy.attempt_timeout) as scope:
            return await fn()
        assert scope.cancelled_caught
        raise TransientError(f"no answer within {policy.attempt_timeout:g}s", operation=operation, seq=seq)

    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.max_attempts),
        wait=wait,
        retry=retry_if_exception(is_retryable),
        before_sleep=before_sleep,
        sleep=anyio.sleep,
    )

    async def run() -> T:
        try:
            async for tries in retrying:
                with tries:
                    return await attempt()
        except RetryError as err:
            last = err.last_attempt.exception()
            raise RetriesExhaustedError(
                f"gave up after {policy.max_attempts} attempts: {last}", attempts=policy.max_attempts, operation=operation, seq=seq
            ) from last
        raise AssertionError("unreachable")  # pragma: no cover

    if policy.deadline is None:
        return await run()
    with anyio.move_on_after(policy.deadline) as scope:
        return await run()
    assert scope.cancelled_caught
    raise DeadlineExceededError(f"not done within the {policy.deadline:g}s deadline", operation=operation, seq=seq)
