"""Tenants of the worker: an API key stands for a tenant (a digest of the key), which owns the sessions,
samplers and model ids it created; no other tenant sees them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from asyncsess.errors import SessionGoneError

__all__ = ["Owners", "tenant_of"]


class Owners:
    """Which tenant (a digest of its API key) owns which session, sampler and model id.

    Training sessions are journaled to ``<checkpoint root>/.owners.jsonl``, so a restarted worker still
    knows whose checkpoints are whose (a run resumes after a crash); the keys themselves are never stored.
    The worker forgets (:meth:`forget`) an object once it is stopped and holds nothing its tenant may still name (a
    sampler; a session without checkpoints), so the table holds the live objects and the sessions with
    checkpoints, not every id ever made; the journal is rewritten without the forgotten ones once they make up
    most of it.
    """

    def __init__(self, journal: Path | None = None) -> None:
        self.by_id: dict[str, str] = {}
        # training session -> its last save_weights path, and how many it made (a save over one name is new weights)
        self.latest_weights: dict[str, tuple[str, int]] = {}
        self.durable: set[str] = set()  # the journaled ids
        self._journal = journal
        self._lines = 0  # lines in the journal
        if journal is not None and journal.exists():
            for line in journal.read_text().splitlines():
                self._lines += 1
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    record = json.loads(line)
                    self.by_id[str(record["id"])] = str(record["tenant"])
                    self.durable.add(str(record["id"]))

    def own(self, object_id: str, key: str, *, durable: bool = False) -> None:
        """``key`` owns ``object_id``; ``durable``: journaled first (an ``OSError`` there, a full disk, leaves it unowned)."""
        if durable and self._journal is not None:
            with self._journal.open("a") as f:
                f.write(json.dumps({"id": object_id, "tenant": key}) + "\n")
            self._lines += 1
            self.durable.add(object_id)
        self.by_id[object_id] = key

    def forget(self, object_id: str) -> None:
        """``object_id`` is stopped and nothing of it is left to name: drop it (from the journal too, in time)."""
        self.by_id.pop(object_id, None)
        self.latest_weights.pop(object_id, None)
        if object_id in self.durable:
            self.durable.discard(object_id)
            if self._lines > 2 * len(self.durable) + COMPACT_SLACK:
                self.compact()

    def compact(self) -> None:
        """Rewrite the journal with the ids still owned, if it holds others (a new file moved over the old: a crash
        leaves one or the other)."""
        if self._journal is None or self._lines == len(self.durable):
            return
        tmp = self._journal.with_name(self._journal.name + ".tmp")
        tmp.write_text("".join(json.dumps({"id": i, "tenant": self.by_id[i]}) + "\n" for i in self.durable))
        os.replace(tmp, self._journal)
        self._lines = len(self.durable)

    def saved_weights(self, session_id: str, path: str) -> None:
        """A session saved sampler weights at ``path``: its OpenAI ``model`` serves them from the next call on."""
        self.latest_weights[session_id] = (path, self.latest_weights.get(session_id, ("", 0))[1] + 1)

    def check(self, key: str, object_id: str) -> None:
        if self.by_id.get(object_id) != key:
            raise SessionGoneError(f"no session {object_id!r} for this API key")


COMPACT_SLACK = 64
"""Forgotten lines the journal may hold beyond as many as it has live ones, before it is rewritten."""


def tenant_of(key: str | bytes) -> str:
    """The tenant an API key stands for: a digest, so that no key is ever stored or logged."""
    return hashlib.sha256(key.encode("utf-8") if isinstance(key, str) else key).hexdigest()[:32]
