"""Tenants of the worker: an API key stands for a tenant (a digest of the key), which owns the sessions,
samplers and model ids it created; no other tenant sees them."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from asyncsess.errors import SessionGoneError

__all__ = ["Owners", "tenant_of"]


class Owners:
    """Which tenant (a digest of its API key) owns which session, sampler and model id.

    Training sessions are journaled to ``<checkpoint root>/.owners.jsonl``, so a restarted worker still
    knows whose checkpoints are whose (a run resumes after a crash); the keys themselves are never stored.
    """

    def __init__(self, journal: Path | None = None) -> None:
        self.by_id: dict[str, str] = {}
        self.latest_weights: dict[str, str] = {}  # training session -> its last save_weights path
        self.weight_steps: dict[str, int] = {}  # save_weights path -> the optimizer step it holds
        self._journal = journal
        if journal is not None and journal.exists():
            for line in journal.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    record = json.loads(line)
                    self.by_id[str(record["id"])] = str(record["tenant"])

    def own(self, object_id: str, key: str, *, durable: bool = False) -> None:
        self.by_id[object_id] = key
        if durable and self._journal is not None:
            with self._journal.open("a") as f:
                f.write(json.dumps({"id": object_id, "tenant": key}) + "\n")

    def saved_weights(self, session_id: str, path: str, step: int) -> None:
        """A session saved sampler weights: its OpenAI ``model`` now serves them (a capture's weight version: ``step``)."""
        self.latest_weights[session_id] = path
        self.weight_steps[path] = step

    def check(self, key: str, object_id: str) -> None:
        if self.by_id.get(object_id) != key:
            raise SessionGoneError(f"no session {object_id!r} for this API key")


def tenant_of(key: str | bytes) -> str:
    """The tenant an API key stands for: a digest, so that no key is ever stored or logged."""
    return hashlib.sha256(key.encode("utf-8") if isinstance(key, str) else key).hexdigest()[:32]
