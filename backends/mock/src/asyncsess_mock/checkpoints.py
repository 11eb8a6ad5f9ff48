"""Checkpoint records and their ``mock://`` paths.

State: ``mock://<session_id>/weights/<name>`` (delta + AdamW state). Sampler weights:
``mock://<session_id>/sampler_weights/<name>`` (delta only). They live in the process; with
``?checkpoint_dir=DIR`` they are also written to ``DIR`` (:class:`DiskStore`), where another process finds them.
"""

from __future__ import annotations

import json
import math
import os
import re
import zipfile
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
    from them, as from a remote backend's storage. A file is written whole or not at all (rename).

    A file is checked when read (:meth:`load`): no pickle, no link, the arrays and metadata a save writes, of
    the ``vocab_size`` x ``vocab_size`` shape, finite; anything else is an InvalidInputError naming the path."""

    def __init__(self, root: str, vocab_size: int) -> None:
        self.root = Path(root)
        self.shape = (vocab_size, vocab_size)

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

    def load(self, path: str, field: str = "path") -> StoredCheckpoint | None:
        """The checkpoint stored for ``path`` (``None`` if there is none); a file that is not one a save wrote
        is an InvalidInputError naming ``field``."""
        file = self._file(path)
        if file is None or not (file.is_file() or file.is_symlink()):
            return None
        try:
            if file.is_symlink() or file.parent.is_symlink() or file.parent.parent.is_symlink():
                raise ValueError("it is reached through a link")
            with np.load(file, allow_pickle=False) as z:
                if set(z.files) - {"delta", "meta", "adam_m", "adam_v", "adam_step"}:
                    raise ValueError(f"unexpected arrays {sorted(z.files)[:4]}")
                meta = json.loads(str(z["meta"][()]))
                arrays = {k: z[k] for k in ("delta", "adam_m", "adam_v") if k in z.files}
                adam_step = z["adam_step"][()] if "adam_step" in z.files else None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, RecursionError) as err:
            raise _bad(path, field, f"is not a checkpoint file ({type(err).__name__}: {str(err)[:60]})") from None
        for key, a in arrays.items():
            if a.shape != self.shape or a.dtype != np.float64 or not np.isfinite(a).all():
                raise _bad(path, field, f"{key}: not finite float64 numbers of shape {self.shape}")
        if ("adam_m" in arrays) != ("adam_v" in arrays) or ("adam_m" in arrays) != (adam_step is not None):
            raise _bad(path, field, "holds part of an optimizer state")
        meta = _check_meta(path, field, meta)
        if (meta["kind"] == "state") != ("adam_m" in arrays) or meta["path"] != path:
            raise _bad(path, field, "does not hold what a save of its kind writes")
        adam = None
        if adam_step is not None:
            if not isinstance(adam_step, np.integer) or not 0 <= int(adam_step) < 2**53:
                raise _bad(path, field, "adam_step is not a step count")
            adam = AdamState(arrays["adam_m"], arrays["adam_v"], int(adam_step))
        return StoredCheckpoint(delta=arrays["delta"], adam=adam, **meta)

    def delete(self, path: str) -> bool:
        file = self._file(path)
        if file is None or not file.is_file():
            return False
        file.unlink()
        return True

    def paths(self) -> list[str]:
        """The paths of every stored checkpoint."""
        return sorted(f"mock://{f.parent.parent.name}/{f.parent.name}/{f.stem}" for f in self.root.glob("*/*/*.npz"))


def _bad(path: str, field: str, what: str) -> InvalidInputError:
    return InvalidInputError(f"{path}: {what}", field=field, fix="pass the .path of a checkpoint a mock:// backend saved, as it saved it")


_META: dict[str, tuple[type, ...]] = {
    "path": (str,),
    "session_id": (str,),
    "name": (str,),
    "kind": (str,),
    "base_model": (str,),
    "seed": (int, type(None)),
    "step": (int,),
    "time": (float, int),
    "ephemeral": (bool,),
    "description": (str, type(None)),
    "user_metadata": (dict, type(None)),
    "ttl_seconds": (int, type(None)),
    "rank": (int,),
    "alpha": (float, int),
}


def _check_meta(path: str, field: str, meta: Any) -> dict[str, Any]:
    """The metadata of a stored checkpoint: exactly :class:`StoredCheckpoint`'s fields, each of its type."""
    if not isinstance(meta, dict) or set(meta) - set(_META) or not {"path", "session_id", "name", "kind", "base_model"} <= set(meta):
        raise _bad(path, field, "its metadata is not a checkpoint's")
    for key, value in meta.items():
        types = _META[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise _bad(path, field, f"its metadata's {key} is {value!r:.40}")
        if isinstance(value, float) and not math.isfinite(value):
            raise _bad(path, field, f"its metadata's {key} is not finite")
    if meta["kind"] not in _DIRS or not 0 <= meta.get("step", 0) < 2**53 or not 1 <= meta.get("rank", 1) <= 1 << 16:
        raise _bad(path, field, "its metadata's kind, step or rank is out of range")
    return meta
