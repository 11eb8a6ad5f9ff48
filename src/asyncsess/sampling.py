"""The bounded pool that concurrent sampling requests pass through (count and bytes in flight)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

import anyio

__all__ = ["QueueState", "SamplingLimiter", "SamplingStats"]


class QueueState(Enum):
    """Tinker's queue states, as passed to ``SamplingClient.on_queue_state_change``."""

    ACTIVE = "active"
    PAUSED_RATE_LIMIT = "paused_rate_limit"
    PAUSED_CAPACITY = "paused_capacity"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class SamplingStats:
    """What callers can observe of the backpressure."""

    in_flight: int
    queued: int
    bytes_in_flight: int
    max_in_flight: int
    max_bytes: int
    completed: int
    waited: int = 0
    """Requests, so far, that had to queue for a slot."""
    peak_in_flight: int = 0
    """The most requests that were ever in flight at once."""


class SamplingLimiter:
    """Admits requests FIFO while fewer than ``max_in_flight`` run and their bytes fit in ``max_bytes``.

    A single request larger than ``max_bytes`` is still admitted when nothing else runs, so it cannot
    wait forever.
    """

    def __init__(self, max_in_flight: int = 256, max_bytes: int = 64 * 2**20) -> None:
        self.max_in_flight = max_in_flight
        self.max_bytes = max_bytes
        self._in_flight = 0
        self._bytes = 0
        self._completed = 0
        self._waited = 0
        self._peak = 0
        self._waiters: deque[tuple[int, anyio.Event]] = deque()

    def stats(self) -> SamplingStats:
        return SamplingStats(
            self._in_flight,
            len(self._waiters),
            self._bytes,
            self.max_in_flight,
            self.max_bytes,
            self._completed,
            waited=self._waited,
            peak_in_flight=self._peak,
        )

    def _fits(self, nbytes: int) -> bool:
        if self._in_flight >= self.max_in_flight:
            return False
        return self._in_flight == 0 or self._bytes + nbytes <= self.max_bytes

    def wait_reason(self, nbytes: int) -> str | None:
        """Why a request of ``nbytes`` asked for now would wait (naming the bound), or ``None`` if it would not."""
        if self._waiters:
            return f"{len(self._waiters)} earlier sampling requests are queued (max_samples_in_flight={self.max_in_flight})"
        if self._in_flight >= self.max_in_flight:
            return f"max_samples_in_flight={self.max_in_flight} requests are in flight"
        if not self._fits(nbytes):
            return f"max_sample_bytes={self.max_bytes}: {self._bytes} bytes are in flight and this request needs {nbytes}"
        return None

    async def acquire(self, nbytes: int) -> None:
        """Wait for a slot for a request of ``nbytes``; pair with :meth:`release`."""
        if not self._waiters and self._fits(nbytes):
            self._admit(nbytes)
            return
        entry = (nbytes, anyio.Event())
        self._waiters.append(entry)
        self._waited += 1
        try:
            await entry[1].wait()
        except BaseException:
            if entry in self._waiters:  # a cancelled waiter may have held back smaller ones behind it: admit them
                self._waiters.remove(entry)
                self._wake()
            else:  # admitted while being cancelled: give the slot back
                self._release(nbytes)
            raise

    def release(self, nbytes: int) -> None:
        self._completed += 1
        self._release(nbytes)

    def _admit(self, nbytes: int) -> None:
        self._in_flight += 1
        self._bytes += nbytes
        self._peak = max(self._peak, self._in_flight)

    def _release(self, nbytes: int) -> None:
        self._in_flight -= 1
        self._bytes -= nbytes
        self._wake()

    def _wake(self) -> None:
        """Admit the waiters at the head of the queue while they fit."""
        while self._waiters and self._fits(self._waiters[0][0]):
            n, ev = self._waiters.popleft()
            self._admit(n)
            ev.set()
