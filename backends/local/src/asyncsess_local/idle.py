"""Idle expiry: the worker stops the sessions and samplers no request has touched for ``ttl`` seconds.

A client that crashed, was killed or lost its network never stops what it opened; without expiry its LoRA and
optimizer state stayed loaded for good and counted against its key's ``max_live_per_key``. Clients keep theirs
alive with a heartbeat (``ServiceClient`` sends one every 10 s by default, as Tinker's SDK does); a request in
flight (an op that runs for longer than ``ttl``) keeps its object alive until it ends.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from asyncsess.serve.defaults import SESSION_TIMEOUT

__all__ = ["IdleClock"]


class IdleClock:
    """When each session or sampler was last touched, and which are busy; ``ttl=None`` (or 0) never expires any."""

    def __init__(self, ttl: float | None = SESSION_TIMEOUT, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl is not None and not (isinstance(ttl, (int, float)) and math.isfinite(ttl) and ttl >= 0):
            raise ValueError(f"session_timeout must be a finite number of seconds >= 0 (0: never), not {ttl!r}")
        self.ttl = ttl or None
        self.clock = clock
        self._last: dict[str, float] = {}
        self._busy: Counter[str] = Counter()

    def touch(self, object_id: str) -> None:
        self._last[object_id] = self.clock()

    @contextmanager
    def using(self, object_id: str) -> Iterator[None]:
        """Hold ``object_id`` alive while a request on it runs."""
        self._busy[object_id] += 1
        self.touch(object_id)
        try:
            yield
        finally:
            self._busy[object_id] -= 1
            if self._busy[object_id] <= 0:
                del self._busy[object_id]
            self.touch(object_id)

    def expired(self, live: Iterable[str]) -> list[str]:
        """Those of ``live`` this clock tracks that are idle past ``ttl``; they are forgotten."""
        if self.ttl is None:
            return []
        now = self.clock()
        out = [i for i in live if i in self._last and i not in self._busy and now - self._last[i] >= self.ttl]
        for i in out:
            del self._last[i]
        return out

    def forget(self, object_id: str) -> None:
        self._last.pop(object_id, None)
