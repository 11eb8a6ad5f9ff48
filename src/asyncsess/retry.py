"""The one retry policy every backend call goes through (tenacity, jittered exponential backoff).

The first retry of a transient fault goes out at once, while the client's :class:`RetryBudget` says faults
are rare; later retries, and every retry once faults are common, back off exponentially with jitter.
"""

from __future__ import annotations

import email.utils
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import anyio
import httpx
from tenacity import AsyncRetrying, RetryCallState, RetryError, retry_if_exception, stop_after_attempt

from .errors import DeadlineExceededError, InvalidInputError, RetriesExhaustedError, TransientError

__all__ = ["RetryPolicy", "RetryEvent", "RetryBudget", "is_retryable", "call_with_retry", "retry_after_seconds"]

log = logging.getLogger("asyncsess.retry")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How transient faults are retried. One policy per ServiceClient (``retry=RetryPolicy(...)``).

    - ``max_attempts``: tries per op, the first included.
    - ``immediate_first_retry``: the first retry of a transient fault goes out without a sleep, as long
      as the client's :class:`RetryBudget` holds (faults are rare); a lost response always does.
    - ``initial_backoff`` / ``max_backoff`` (s): retry *k* sleeps ``min(max_backoff, initial_backoff *
      2**(k-1))`` plus up to ``jitter`` s of random jitter; a ``retry_after`` hint from the backend (HTTP
      ``Retry-After``) is never cut short: the sleep is at least the hint, and exactly the hint on a
      first retry.
    - ``attempt_timeout`` (s): one try that takes longer is abandoned and retried (the backend's
      idempotency makes that safe).
    - ``deadline`` (s): the whole op, retries included, fails with ``DeadlineExceededError`` past this; a
      backoff (or a server's ``Retry-After``) that would end past it fails at once instead of sleeping.

    Every number must be finite and not negative (the timeouts, when set, positive; ``max_attempts`` at
    least 1): anything else is refused when the policy is built, naming the field.
    """

    max_attempts: int = 8
    initial_backoff: float = 0.2
    max_backoff: float = 10.0
    jitter: float = 0.2
    attempt_timeout: float | None = 600.0
    deadline: float | None = 3600.0
    immediate_first_retry: bool = True

    def __post_init__(self) -> None:
        n = self.max_attempts
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidInputError(f"{n!r:.40} is not a whole number of tries >= 1", field="max_attempts", fix="e.g. max_attempts=8")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("max_attempts", "immediate_first_retry") or (value is None and f.name in ("attempt_timeout", "deadline")):
                continue
            positive = f.name in ("attempt_timeout", "deadline")
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0 or (positive and value == 0):
                bound = "> 0 (or None for no limit)" if positive else ">= 0"
                raise InvalidInputError(
                    f"{value!r:.40} is not a finite number of seconds {bound}", field=f.name, fix=f"give {f.name} {bound}"
                )

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


class RetryBudget:
    """Who may retry at once: a token bucket shared by one client's calls (after gRPC's retry throttling).

    Each failed try spends a token and each success earns ``refund`` back; an immediate retry is allowed
    only while more than half of ``capacity`` is left. A lost response spends nothing: it says the network
    dropped an answer, not that the backend is overloaded. Faults in fewer than ``refund / (1 + refund)``
    of tries (a third, by default) do not drain the bucket; a backend that keeps failing drains it within
    ``capacity / 2`` failures, and from then on every retry backs off.
    """

    def __init__(self, capacity: float = 20.0, refund: float = 0.5) -> None:
        self.capacity = capacity
        self.refund = refund
        self.tokens = capacity

    def failed(self, err: BaseException | None = None) -> bool:
        """Spend a token for a failed try (none for a lost response); return whether the next retry may go out at once."""
        if not getattr(err, "lost_response", False):
            self.tokens = max(0.0, self.tokens - 1.0)
        return self.tokens > self.capacity / 2

    def succeeded(self) -> None:
        self.tokens = min(self.capacity, self.tokens + self.refund)


MAX_RETRY_AFTER = 3600.0
"""The longest ``Retry-After`` honoured (s); a longer hint is cut to this (the op's deadline usually fires first)."""


def retry_after_seconds(value: Any, *, now: float | None = None) -> float | None:
    """A server's ``Retry-After`` (seconds, or an HTTP date) as seconds to wait, at most :data:`MAX_RETRY_AFTER`;
    ``None`` for anything else (garbage, NaN, infinity, a negative number), so a hostile hint never makes a sleep
    that is negative, NaN or endless."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, (str, bytes)):
        text = (value.decode("latin-1") if isinstance(value, bytes) else value).strip()[:100]
        try:
            seconds = float(text)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(text)
            except (TypeError, ValueError, IndexError, OverflowError):
                return None
            if when.tzinfo is None:
                return None
            seconds = max(0.0, when.timestamp() - (time.time() if now is None else now))
    else:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_AFTER)


def _delay(policy: RetryPolicy, attempt: int, err: BaseException | None, *, may_hurry: bool = True) -> float:
    """The sleep before retry ``attempt`` (1 = the first retry) after ``err``."""
    hint = retry_after_seconds(getattr(err, "retry_after", None))
    if attempt == 1 and getattr(err, "lost_response", False) and not hint:
        return 0.0  # only the answer was lost: fetch the stored result now, a backoff would buy nothing
    if attempt == 1 and policy.immediate_first_retry and may_hurry:
        return hint if hint else 0.0  # a throttle's Retry-After is honoured exactly
    delay = min(policy.max_backoff, policy.initial_backoff * 2 ** (attempt - 1)) + random.uniform(0, policy.jitter)
    return max(delay, hint) if hint else delay


async def call_with_retry(
    policy: RetryPolicy,
    fn: Callable[[], Awaitable[T]],
    *,
    operation: str,
    seq: int | None = None,
    on_retry: Callable[[RetryEvent], None] | None = None,
    budget: RetryBudget | None = None,
) -> T:
    """Call ``fn`` until it succeeds, fails for good, or the policy runs out.

    The first attempt takes a fast path (one cancel scope, no retry machinery); tenacity drives the
    attempts after a retryable failure. ``budget`` (shared by the calls of one client) records every
    try's outcome and decides whether a first retry may skip its backoff; without one it always may.
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
        result = await attempt()
    except Exception as err:
        if not is_retryable(err):
            raise
        first_error: BaseException = err
    else:
        if budget is not None:
            budget.succeeded()
        return result
    may_hurry = budget.failed(first_error) if budget is not None else True

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
    first_sleep = _delay(policy, 1, first_error, may_hurry=may_hurry)
    if anyio.current_time() + first_sleep >= deadline_at:
        raise DeadlineExceededError(f"not done within the {policy.deadline:g}s deadline", operation=operation, seq=seq) from first_error
    announce(1, first_error, first_sleep)
    await anyio.sleep(first_sleep)

    def before_sleep(state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome else None
        if err is not None:
            if budget is not None:
                budget.failed(err)
            if anyio.current_time() + state.upcoming_sleep >= deadline_at:  # still asleep at the deadline: fail now
                raise DeadlineExceededError(f"not done within the {policy.deadline:g}s deadline", operation=operation, seq=seq) from err
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
                result = await attempt()
                if budget is not None:
                    budget.succeeded()
                return result
    except RetryError as err:
        last = err.last_attempt.exception()
        if budget is not None:
            budget.failed(last)
        raise exhausted(last) from last
    raise AssertionError("unreachable")  # pragma: no cover
