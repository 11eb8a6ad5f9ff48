"""Server-side promises: a request id now, its result (or typed failure) later, fetched by long-poll."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from ..errors import AsyncSessError, InvalidInputError, PoisonedError

__all__ = ["Promise", "PromiseTable", "error_category", "KEEP", "KEEP_BYTES"]

Category = Literal["user", "server", "unknown"]
KEEP = 4096  # finished promises kept per owner
KEEP_BYTES = 256 * 2**20  # bytes of finished results kept per owner (a forward of 1,024 x 2,048 tokens answers ~16 MB)


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
    owner: str | None = None  # the API key whose session made it
    forgotten: bool = False  # its result was freed to bound its owner's share (see PromiseTable)
    table: PromiseTable | None = field(default=None, repr=False)

    def resolve(self, *, json: dict[str, Any] | None = None, proto: bytes | None = None) -> None:
        self.json, self.proto = json, proto
        self._settled()

    def fail(self, err: BaseException) -> None:
        self.error = f"{type(err).__name__}: {err}"
        self.category = error_category(err)
        self._settled()

    def _settled(self) -> None:
        self.done.set()
        if self.table is not None:
            self.table.finished(self)

    @property
    def size(self) -> int:
        """Bytes its result holds (about)."""
        return 256 + len(self.proto or b"") + len(self.error or "")


class PromiseTable:
    """Promises by request id. Finished ones are kept for re-polls, per owner (the API key whose session made
    them) at most ``keep`` and ``keep_bytes`` of results: past either, that owner's least recently finished one is
    forgotten and its result freed (a later retrieve of its id gets 404). So a client that never retrieves stays
    bounded, an unfinished promise holds no finished ones in memory, and one key's flood of requests never forgets
    another key's results."""

    def __init__(self, keep: int = KEEP, keep_bytes: int = KEEP_BYTES) -> None:
        self._items: dict[str, Promise] = {}
        self._groups: dict[str, set[str]] = {}  # the first part of an id (the door's session id) -> the ids held under it
        self._finished: dict[str | None, OrderedDict[str, int]] = {}  # owner -> finished request ids (oldest first) -> size
        self._bytes: dict[str | None, int] = {}
        self._pending: dict[str | None, int] = {}  # owner -> unfinished promises
        self._ids = itertools.count(1)
        self._keep = keep
        self._keep_bytes = keep_bytes

    def new(self, kind: str, prefix: str, owner: str | None = None) -> Promise:
        p = Promise(request_id=f"{prefix}:{kind}:{next(self._ids)}", kind=kind, owner=owner, table=self)
        self._items[p.request_id] = p
        self._groups.setdefault(_group(p.request_id), set()).add(p.request_id)
        self._pending[owner] = self._pending.get(owner, 0) + 1
        return p

    def pending(self, owner: str | None) -> int:
        """How many of ``owner``'s promises are unfinished."""
        return self._pending.get(owner, 0)

    def get(self, request_id: str) -> Promise | None:
        return self._items.get(request_id)

    def finished(self, p: Promise) -> None:
        """Count ``p``'s result against its owner's share; forget the owner's oldest past it (never ``p`` itself)."""
        if self._items.get(p.request_id) is not p:  # already forgotten
            return
        self._pending[p.owner] -= 1
        done = self._finished.setdefault(p.owner, OrderedDict())
        done[p.request_id] = p.size
        self._bytes[p.owner] = self._bytes.get(p.owner, 0) + p.size
        while len(done) > 1 and (len(done) > self._keep or self._bytes[p.owner] > self._keep_bytes):
            rid, size = done.popitem(last=False)
            self._bytes[p.owner] -= size
            old = self._drop(rid)
            old.json, old.proto, old.forgotten = None, None, True  # a re-sent request still holding it (its re-send record) holds no result

    def _drop(self, request_id: str) -> Promise:
        group = _group(request_id)
        self._groups[group].discard(request_id)
        if not self._groups[group]:
            del self._groups[group]
        return self._items.pop(request_id)

    def forget(self, prefix: str, err: BaseException) -> int:
        """Drop every promise whose id starts with ``prefix:``; unfinished ones fail with ``err`` first, so a
        long-poll waiting on one wakes. Returns how many were dropped. Reads only the ids under ``prefix``'s first
        part (a session's), never every key's."""
        gone = [rid for rid in self._groups.get(_group(prefix), ()) if rid.startswith(prefix + ":")]
        for rid in gone:
            p = self._drop(rid)
            if not p.done.is_set():
                self._pending[p.owner] -= 1
                p.fail(err)
            done = self._finished.get(p.owner)
            size = None if done is None else done.pop(rid, None)
            if size is not None:
                self._bytes[p.owner] -= size
        return len(gone)

    async def wait(self, promise: Promise, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            await promise.done.wait()
        return promise.done.is_set()


def _group(request_id: str) -> str:
    """The first ``:``-separated part of a request id (or prefix): the door's session id."""
    return request_id.split(":", 1)[0]
