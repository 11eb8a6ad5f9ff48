"""The one retry policy every backend call goes through (tenacity, jittered exponential backoff)."""

from __future__ import annotations

import logging
import math
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


def _delay(policy: RetryPolicy, attempt: int, err: BaseException | None) -> float:
    if attempt == 1 and getattr(err, "lost_response", False) and not getattr(err, "retry_after", None):
        return 0.0  # only the answer was lost: fetch the stored result now, a backoff would buy nothing
    delay = min(policy.max_backoff, policy.initial_backoff * 2 ** (attempt - 1)) + random.uniform(0, policy.jitter)
    hint = getattr(err, "retry_after", None)
    return max(delay, hint) if hint else delay


async def call_with_retry(
    policy: RetryPolicy,
    fn: Callable[[], Awaitable[T]],
    *,
    operation: str,
    seq: int | None = None,
    on_retry: Callable[[RetryEvent], None] | None = None,
) -> T:
    """Call ``fn`` until it succeeds, fails for good, or the policy runs out.

    The first attempt takes a fast path (one cancel scope, no retry machinery); tenacity drives the
    attempts after a retryable failure.
    """
    deadline_at = anyio.current_time() + policy.deadline if policy.deadline is not None else math.inf

    async def attempt() -> T:
        remaining = deadline_at - anyio.current_time()
        limit = min(policy.attempt_timeout or math.inf, remaining)
        if limit == math.inf:
            return await fn()
        with anyio.move_on_after(limit):
            return await fn()
        if limit >= remaining:
            raise DeadlineExceededError(f"not done within the {policy.deadline:g}s deadline", operation=operation, seq=seq)
        raise TransientError(f"no answer within {policy.attempt_timeout:g}s", operation=operation, seq=seq)

    try:
        return await attempt()
    except Exception as err:
        if not is_retryable(err):
            raise
        first_error: BaseException = err

    def exhausted(last: BaseException | None) -> RetriesExhaustedError:
        n = policy.max_attempts
        return RetriesExhaustedError(f"gave up after {n} attempts: {last}", attempts=n, operation=operation, seq=seq)

    def announce(attempt_number: int, err: BaseException, sleep: float) -> None:
        log.info("retrying %s (seq %s) after attempt %d: %r; sleeping %.3fs", operation, seq, attempt_number, err, sleep)
        if on_retry is not None:
            on_retry(RetryEvent(operation, seq, attempt_number, err, sleep))

    if policy.max_attempts <= 1:
        raise exhausted(first_error) from first_error
    # Attempt 1 already failed: tenacity's attempt k is our attempt k + 1.
    first_sleep = _delay(policy, 1, first_error)
    if anyio.current_time() + first_sleep >= deadline_at:
        raise DeadlineExceededError(f"not done within the {policy.deadline:g}s deadline", operation=operation, seq=seq) from first_error
    announce(1, first_error, first_sleep)
    await anyio.sleep(first_sleep)

    def before_sleep(state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome else None
        if err is not None:
            announce(state.attempt_number + 1, err, state.upcoming_sleep)

    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.max_attempts - 1),
        wait=lambda s: _delay(policy, s.attempt_number + 1, s.outcome.exception() if s.outcome else None),
        retry=retry_if_exception(is_retryable),
        before_sleep=before_sleep,
        sleep=anyio.sleep,
    )
    try:
        async for tries in retrying:
            with tries:
                return await attempt()
    except RetryError as err:
        last = err.last_attempt.exception()
        raise exhausted(last) from last
    raise AssertionError("unreachable")  # pragma: no cover
