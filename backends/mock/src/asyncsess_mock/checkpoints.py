"""Checkpoint records and their ``mock://`` paths.

State: ``mock://<session_id>/weights/<name>`` (delta + AdamW state). Sampler weights:
``mock://<session_id>/sampler_weights/<name>`` (delta only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import numpy as np

from asyncsess.errors import InvalidInputError
from asyncsess.types import Checkpoint, CheckpointResponse

from .optim import AdamState

__all__ = ["StoredCheckpoint", "checkpoint_path", "check_name"]

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_DIRS = {"state": "weights", "sampler": "sampler_weights", "merged": "sampler_weights"}
_TYPES = {"state": "training", "sampler": "sampler", "merged": "merged"}


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidInputError(f"bad checkpoint name {name!r}", field="name", fix="use 1-128 of A-Z a-z 0-9 . _ -")
    return name


def checkpoint_path(session_id: str, kind: Literal["state", "sampler", "merged"], name: str) -> str:
    return f"mock://{session_id}/{_DIRS[kind]}/{name}"


@dataclass(frozen=True)
class StoredCheckpoint:
    path: str
    session_id: str
    name: str
    kind: Literal["state", "sampler", "merged"]
    base_model: str
    seed: int | None
    delta: np.ndarray
    adam: AdamState | None  # only for kind == "state"
    step: int
    time: float
    ephemeral: bool = False
    description: str | None = None
    user_metadata: dict[str, str] | None = None
    ttl_seconds: int | None = None

    def response(self) -> CheckpointResponse:
        return CheckpointResponse.model_construct(path=self.path, kind=self.kind, step=self.step)

    def record(self) -> Checkpoint:
        size = self.delta.nbytes + (self.adam.m.nbytes + self.adam.v.nbytes if self.adam else 0)
        return Checkpoint.model_construct(
            checkpoint_id=f"{_DIRS[self.kind]}/{self.name}",
            checkpoint_type=_TYPES[self.kind],
            path=self.path,
            time=self.time,
            step=self.step,
            size_bytes=size,
            description=self.description,
            user_metadata=self.user_metadata,
            expires_at=self.time + self.ttl_seconds if self.ttl_seconds else None,
        )
