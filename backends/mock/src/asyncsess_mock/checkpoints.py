"""Checkpoint records and their ``mock://`` paths.

State: ``mock://<session_id>/weights/<name>`` (delta + AdamW state). Sampler weights:
``mock://<session_id>/sampler_weights/<name>`` (delta only). They live in the process; with
``?checkpoint_dir=DIR`` they are also written to ``DIR`` (:class:`DiskStore`), where another process finds them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np

from asyncsess.errors import InvalidInputError
from asyncsess.types import Checkpoint, CheckpointResponse

from .optim import AdamState

__all__ = ["DiskStore", "StoredCheckpoint", "checkpoint_path", "check_name"]

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
    rank: int = 32  # the LoRA settings of the session that saved it (a session resumed from it reports them)
    alpha: float = 32.0

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


_STORED = re.compile(r"mock://([A-Za-z0-9._-]{1,128})/(weights|sampler_weights)/([A-Za-z0-9._-]{1,128})")


class DiskStore:
    """Checkpoints as ``.npz`` files under ``root`` (``mock://?checkpoint_dir=``), so another process can resume
    from them, as from a remote backend's storage. A file is written whole or not at all (rename)."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _file(self, path: str) -> Path | None:
        m = _STORED.fullmatch(path)
        if m is None or any(part in (".", "..") for part in m.groups()):
            return None
        return self.root / m[1] / m[2] / f"{m[3]}.npz"

    def save(self, ckpt: StoredCheckpoint) -> None:
        file = self._file(ckpt.path)
        assert file is not None, ckpt.path  # paths come from checkpoint_path(), whose parts are checked
        file.parent.mkdir(parents=True, exist_ok=True)
        meta = {f.name: getattr(ckpt, f.name) for f in fields(ckpt) if f.name not in ("delta", "adam")}
        arrays: dict[str, Any] = {"delta": ckpt.delta, "meta": np.array(json.dumps(meta))}
        if ckpt.adam is not None:
            arrays.update(adam_m=ckpt.adam.m, adam_v=ckpt.adam.v, adam_step=np.array(ckpt.adam.step))
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, file)

    def load(self, path: str) -> StoredCheckpoint | None:
        file = self._file(path)
        if file is None or not file.is_file():
            return None
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            adam = AdamState(z["adam_m"], z["adam_v"], int(z["adam_step"])) if "adam_m" in z else None
            return StoredCheckpoint(delta=z["delta"], adam=adam, **meta)

    def delete(self, path: str) -> bool:
        file = self._file(path)
        if file is None or not file.is_file():
            return False
        file.unlink()
        return True

    def paths(self) -> list[str]:
        """The paths of every stored checkpoint."""
        return sorted(f"mock://{f.parent.parent.name}/{f.parent.name}/{f.stem}" for f in self.root.glob("*/*/*.npz"))
