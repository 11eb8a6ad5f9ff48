"""Idempotent creates: an ``Idempotency-Key`` on ``POST /v1/sessions`` and ``POST /v1/samplers`` (as Stripe's
``Idempotency-Key`` and AWS's ``ClientToken``).

A create whose reply is lost (the connection drops after the worker made the session) is retried by the client;
without a key the retry made a second session, whose LoRA and optimizer state stayed loaded until the idle timeout.
With one, the worker remembers (tenant, key) → the reply: a retry with the same body gets the same reply (the same
session or sampler id, nothing made again), the same key with another body (or route) a 409 ``ConflictError``
naming the header, and a retry that arrives while the first is still being created waits for it. A create that
fails leaves no trace (its retry runs again). Keys are per tenant: another API key's same key is another create.
Replies are kept :data:`TTL` seconds, at most :data:`MAX_PER_TENANT` per tenant (the oldest dropped first).

A client that gave up on a create (every reply lost, its deadline passed) says so with ``DELETE /v1/creates/{key}``
(:meth:`Creates.abandon`): what that create made is stopped (once a create under way ends), and the key is refused
from then on (409), so a try still in the network makes nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from asyncsess.backends.http_wire import IDEMPOTENCY_HEADER
from asyncsess.errors import ConflictError, InvalidInputError

__all__ = ["IDEMPOTENCY_HEADER", "MAX_KEY_CHARS", "MAX_PER_TENANT", "TTL", "Creates", "Replay", "check_key"]

MAX_KEY_CHARS = 255
TTL = 3600.0
"""Seconds a reply is kept: the client's default :attr:`~asyncsess.retry.RetryPolicy.deadline`, past which no retry comes."""
MAX_PER_TENANT = 1024
"""Replies kept per tenant (four times the default ``max_live_per_key``)."""
_KEY = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_KEY_CHARS - 1}}}")
_FIX = f"send 1 to {MAX_KEY_CHARS} characters of A-Z a-z 0-9 . _ : - (a UUID), one key per create, the same on its retries"


def check_key(values: list[str]) -> str | None:
    """The request's ``Idempotency-Key`` (None without one); a 400 :class:`InvalidInputError` naming it when it is
    garbage (too long, empty, another charset) or sent twice."""
    if not values:
        return None
    if len(values) > 1:
        raise InvalidInputError(f"{len(values)} {IDEMPOTENCY_HEADER} headers", field=IDEMPOTENCY_HEADER, fix=f"send one: {_FIX}")
    if not _KEY.fullmatch(values[0]):
        shown = repr(values[0][:40]) + ("..." if len(values[0]) > 40 else "")
        raise InvalidInputError(f"{IDEMPOTENCY_HEADER} {shown} is not a key", field=IDEMPOTENCY_HEADER, fix=_FIX)
    return values[0]


@dataclass
class Replay:
    """One create under way: ``reply`` is set to the stored reply of an earlier create (answer it, make nothing),
    or by the route when it made the object (stored on a clean exit)."""

    reply: Any = None


@dataclass
class _Entry:
    fingerprint: str
    at: float
    done: anyio.Event = field(default_factory=anyio.Event)
    reply: Any = None
    abandoned: bool = False  # the client gave up on this create: the key is refused


class Creates:
    """The replies of keyed creates, per tenant, bounded by ``ttl`` (s) and ``max_per_tenant``."""

    def __init__(self, ttl: float = TTL, max_per_tenant: int = MAX_PER_TENANT, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.max_per_tenant, self.clock = ttl, max_per_tenant, clock
        self._by_tenant: dict[str, dict[str, _Entry]] = {}  # tenant -> key -> entry, oldest first

    def __len__(self) -> int:
        return sum(len(e) for e in self._by_tenant.values())

    @asynccontextmanager
    async def once(self, tenant: str, key: str | None, route: str, body: Any) -> AsyncIterator[Replay]:
        """Run a create at most once per (``tenant``, ``key``): see the module's docstring. ``body`` (JSON-able, the
        parsed request) and ``route`` make its fingerprint."""
        if key is None:
            yield Replay()
            return
        fingerprint = hashlib.sha256(json.dumps([route, body], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        entries = self._by_tenant.setdefault(tenant, {})
        while True:
            self._prune(tenant)
            entry = entries.get(key)
            if entry is not None and entry.abandoned:
                raise ConflictError(
                    f"{IDEMPOTENCY_HEADER} {key!r} belongs to a create the client gave up on",
                    field=IDEMPOTENCY_HEADER,
                    fix="send a new key for a new create",
                )
            if entry is not None and entry.fingerprint != fingerprint:
                raise ConflictError(
                    f"{IDEMPOTENCY_HEADER} {key!r} was already used for another request",
                    field=IDEMPOTENCY_HEADER,
                    fix="send a new key for each create; a retry sends the same body (and route) as the first try",
                )
            if entry is None:
                break
            if entry.done.is_set():
                yield Replay(entry.reply)
                return
            await entry.done.wait()  # the first try is still creating: its reply answers this one too
        entry = entries[key] = _Entry(fingerprint, self.clock())
        replay = Replay()
        try:
            yield replay
        finally:
            if replay.reply is not None:
                entry.reply = replay.reply
            elif entries.get(key) is entry:
                del entries[key]  # failed or cancelled: nothing was made, a retry runs again
            entry.done.set()

    async def abandon(self, tenant: str, key: str) -> Any:
        """The client gave up on the create of ``key``: the reply of what it made (after a create under way ends), or
        None; from now on the key is refused (kept like a reply: :data:`TTL`, :data:`MAX_PER_TENANT`)."""
        entries = self._by_tenant.setdefault(tenant, {})
        self._prune(tenant)
        entry = entries.get(key)
        if entry is not None and not entry.done.is_set():
            await entry.done.wait()
            entry = entries.get(key)
        made = entry.reply if entry is not None and not entry.abandoned else None
        gone = _Entry("", self.clock(), abandoned=True)
        gone.done.set()
        entries.pop(key, None)
        entries[key] = gone  # newest last, as _prune expects
        return made

    def _prune(self, tenant: str) -> None:
        """Drop ``tenant``'s replies older than ``ttl``, and its oldest while it holds ``max_per_tenant`` (never a create
        under way): the entries are in the order they were made, so this stops at the first one to keep."""
        entries, now = self._by_tenant[tenant], self.clock()
        extra = len(entries) + 1 - self.max_per_tenant  # room for one more
        stale = []
        for k, e in entries.items():
            if extra <= 0 and now - e.at < self.ttl:
                break
            if e.done.is_set():
                stale.append(k)
                extra -= 1
        for k in stale:
            del entries[k]
