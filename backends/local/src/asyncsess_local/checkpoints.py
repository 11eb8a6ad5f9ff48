"""Checkpoints on disk under one storage root, addressed by ``local://`` URIs.

Layout: ``<root>/<model_id>/<kind>/<name>/`` with kind ``state`` (adapter + optimizer + step, for
resuming), ``sampler`` (a PEFT adapter directory) or ``merged`` (a full transformers model directory
plus its adapter). Every directory holds ``asyncsess.json`` (what it is). The URI of a directory is
``local://`` + its absolute path; paths that resolve outside the root are refused, so a worker never
reads or writes elsewhere. Tensors are stored with safetensors only. ``local://ephemeral/...`` names
an in-memory sampler snapshot that has no directory.

A path from a caller is checked as text first (at most 1024 characters, no NUL, no lone surrogate,
no ``://`` inside), then normalised without touching the disk (:meth:`CheckpointStore.owner`), so a
worker can refuse another tenant's path before it learns whether that path exists.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncsess.errors import InvalidInputError
from asyncsess.types import Checkpoint

__all__ = ["CheckpointStore", "EPHEMERAL", "KINDS"]

KINDS = {"state": "training", "sampler": "sampler", "merged": "merged"}
EPHEMERAL = "local://ephemeral/"
META = "asyncsess.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # matched with fullmatch: no trailing newline
MAX_PATH_CHARS = 1024


def _show(value: str, limit: int = 80) -> str:
    """``repr`` of a caller's string, cut short (errors never echo 5,000 characters back)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class CheckpointStore:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root if root is not None else tempfile.mkdtemp(prefix="asyncsess-checkpoints-")).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def check_name(name: str) -> str:
        if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
            raise InvalidInputError(
                f"{_show(str(name))} is not a valid checkpoint name",
                field="name",
                fix="use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
            )
        return name

    def uri(self, path: Path) -> str:
        return f"local://{path}"

    def _lexical(self, uri: str, field: str) -> Path:
        """The absolute path a URI names, normalised as text (no disk access); refuses bad text and escapes."""
        if not isinstance(uri, str) or not uri:
            raise InvalidInputError("no checkpoint path", field=field, fix="pass the .path of a save result")
        if len(uri) > MAX_PATH_CHARS or not uri.isprintable() or _has_surrogate(uri):
            raise InvalidInputError(
                f"{_show(uri)} is not a checkpoint path",
                field=field,
                fix=f"pass the .path of a save result (printable, at most {MAX_PATH_CHARS} characters)",
            )
        raw = uri[len("local://") :] if uri.startswith("local://") else uri
        if "://" in raw:
            raise InvalidInputError(f"{_show(uri)} is not a local checkpoint", field=field, fix="pass a local:// path from this worker")
        path = Path(os.path.normpath(raw if raw.startswith("/") else self.root / raw))
        if not path.is_relative_to(self.root) or path == self.root:
            raise InvalidInputError(
                f"{_show(uri)} is outside the checkpoint root", field=field, fix=f"use a path under local://{self.root}"
            )
        return path

    def owner(self, uri: str, field: str = "path") -> str:
        """The model id a checkpoint URI belongs to, read from the text alone (its first part under the root)."""
        return self._lexical(uri, field).relative_to(self.root).parts[0]

    def resolve(self, uri: str, field: str = "path") -> Path:
        """The directory a URI names, refusing anything outside the root (symlinks included)."""
        path = self._lexical(uri, field)
        try:
            real = path.resolve()
            found = real.is_relative_to(self.root) and (real / META).is_file()
        except (OSError, ValueError):
            found = False
        if not found:
            raise InvalidInputError(
                f"no checkpoint at {_show(uri)}", field=field, fix="pass the .path of a save result (see list_checkpoints)"
            )
        return real

    def begin(self, model_id: str, kind: str, name: str) -> tuple[Path, Path]:
        """A scratch directory to write into and the final directory it will become (see :meth:`commit`)."""
        final = self.root / model_id / kind / self.check_name(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}.")), final

    def commit(self, scratch: Path, final: Path, meta: dict[str, Any]) -> str:
        """Write the metadata and move ``scratch`` into place (replacing an older save of that name)."""
        (scratch / META).write_text(json.dumps({**meta, "time": time.time()}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        scratch.rename(final)
        return self.uri(final)

    @staticmethod
    def meta(path: Path) -> dict[str, Any]:
        return json.loads((path / META).read_text())

    def list(self, model_id: str | None = None) -> list[Checkpoint]:
        pattern = f"{model_id}/*/*/{META}" if model_id else f"*/*/*/{META}"
        out = []
        for meta_file in sorted(self.root.glob(pattern)):
            d = meta_file.parent
            meta = json.loads(meta_file.read_text())
            out.append(
                Checkpoint(
                    checkpoint_id=f"{d.parent.parent.name}/{d.parent.name}/{d.name}",
                    checkpoint_type=KINDS[d.parent.name],  # type: ignore[arg-type]
                    path=self.uri(d),
                    time=meta.get("time", 0.0),
                    step=meta.get("step", 0),
                    size_bytes=sum(f.stat().st_size for f in d.rglob("*") if f.is_file()),
                    description=meta.get("description"),
                    user_metadata=meta.get("user_metadata"),
                    expires_at=meta["time"] + meta["ttl_seconds"] if meta.get("ttl_seconds") and "time" in meta else None,
                )
            )
        return sorted(out, key=lambda c: c.time)
