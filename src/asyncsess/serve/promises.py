"""Server-side promises: a request id now, its result (or typed failure) later, fetched by long-poll."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from ..errors import AsyncSessError, InvalidInputError, PoisonedError

__all__ = ["Promise", "PromiseTable", "error_category"]

Category = Literal["user", "server", "unknown"]


def error_category(err: BaseException) -> Category:
    """Tinker's ``RequestFailedError.category``: ``user`` for bad input (and ops poisoned by it)."""
    if isinstance(err, PoisonedError) and err.cause is not None:
        return error_category(err.cause)
    if isinstance(err, (InvalidInputError, ValueError, TypeError)):
        return "user"
    return "server" if isinstance(err, AsyncSessError) else "unknown"


@dataclass
class Promise:
    request_id: str
    kind: str
    done: anyio.Event = field(default_factory=anyio.Event)
    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: Category = "unknown"

    def resolve(self, *, json: dict[str, Any] | None = None, proto: bytes | None = None) -> None:
        self.json, self.proto = json, proto
        self.done.set()

    def fail(self, err: BaseException) -> None:
        self.error = f"{type(err).__name__}: {err}"
        self.category = error_category(err)
        self.done.set()


class PromiseTable:
    """Promises by request id; the oldest finished ones are forgotten past ``keep`` (a later retrieve of a
    forgotten id gets 404, so keep comfortably more than the requests in flight)."""

    def __init__(self, keep: int = 4096) -> None:
        self._items: OrderedDict[str, Promise] = OrderedDict()
        self._ids = itertools.count(1)
        self._keep = keep

    def new(self, kind: str, prefix: str) -> Promise:
        p = Promise(request_id=f"{prefix}:{kind}:{next(self._ids)}", kind=kind)
        self._items[p.request_id] = p
        while len(self._items) > self._keep:
            oldest = next(iter(self._items.values()))
            if not oldest.done.is_set():
                break
            self._items.popitem(last=False)
        return p

    def get(self, request_id: str) -> Promise | None:
        return self._items.get(request_id)

    def forget(self, prefix: str, err: BaseException) -> int:
        """Drop every promise whose id starts with ``prefix:``; unfinished ones fail with ``err`` first, so a
        long-poll waiting on one wakes. Returns how many were dropped."""
        gone = [rid for rid in self._items if rid.startswith(prefix + ":")]
        for rid in gone:
            p = self._items.pop(rid)
            if not p.done.is_set():
                p.fail(err)
        return len(gone)

    async def wait(self, promise: Promise, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            await promise.done.wait()
        return promise.done.is_set()
