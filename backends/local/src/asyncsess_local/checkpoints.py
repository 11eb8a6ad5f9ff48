"""Checkpoints on disk under one storage root, addressed by ``local://`` URIs.

Layout: ``<root>/<model_id>/<kind>/<name>/`` with kind ``state`` (adapter + optimizer + step, for
resuming), ``sampler`` (a PEFT adapter directory) or ``merged`` (a full transformers model directory
plus its adapter). Every directory holds ``asyncsess.json`` (what it is). A save is written into a hidden
scratch directory (``.<name>.*``, never listed) and renamed into place, so a name only ever holds a whole
checkpoint; a name that holds one is refused unless the save says ``overwrite``. A write that fails for the disk
(any ``OSError``: ENOSPC, EDQUOT, EFBIG) removes the scratch copy and is a void :class:`InsufficientStorageError`. The URI of a directory is
``local://`` + its absolute path; paths that resolve outside the root are refused, so a worker never
reads or writes elsewhere. Tensors are stored with safetensors only. ``local://ephemeral/<model_id>/<seq>``
names an in-memory sampler snapshot that has no directory (see :mod:`.sessions`): it is never read as a
path on disk (:meth:`CheckpointStore.ephemeral_owner` checks its form).

The store also writes and reads a session's checkpoints (:meth:`CheckpointStore.save_state`,
:meth:`~CheckpointStore.load_state`, :meth:`~CheckpointStore.save_weights`); torch, safetensors and
peft are imported when one is written or read.

What a checkpoint directory holds is checked before anything is allocated for it (:meth:`CheckpointStore.meta`,
:func:`adapter_config`, :func:`read_tensors`): its metadata (kind, base model, a LoRA rank of 1..``MAX_LORA_RANK``,
known target modules) and each safetensors file's header (the tensors a session of that shape has, in a float
dtype, whose bytes are in the file) before it is read, and its numbers (finite) after; anything else is an
:class:`InvalidInputError` naming the file, so a tampered or truncated checkpoint is a 4xx, never a 5xx or an OOM.

A path from a caller is checked as text first (at most 1024 characters, no NUL, no lone surrogate,
no ``://`` inside), then normalised without touching the disk (:meth:`CheckpointStore.owner`), so a
worker can refuse another tenant's path before it learns whether that path exists.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncsess.backends import LoadStateOp, SaveStateOp, SaveWeightsOp
from asyncsess.errors import InsufficientStorageError, InvalidInputError
from asyncsess.types import Checkpoint, CheckpointResponse
from asyncsess.validation import check_overwrite, free_name

if TYPE_CHECKING:
    import torch

    from .adapters import LoraHost
    from .sessions import Slot
    from .trainer import TrainSession

__all__ = ["CheckpointStore", "EPHEMERAL", "KINDS", "MAX_LORA_RANK", "adapter_config", "read_tensors", "save_bytes", "tree_bytes"]

KINDS = {"state": "training", "sampler": "sampler", "merged": "merged"}
EPHEMERAL = "local://ephemeral/"
META = "asyncsess.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # matched with fullmatch: no trailing newline
_EPHEMERAL = re.compile(re.escape(EPHEMERAL) + r"([A-Za-z0-9_-]{1,64})/[0-9]{1,20}")  # what Sessions.snapshot names
MAX_PATH_CHARS = 1024
MAX_LORA_RANK = 256
MAX_HEADER_BYTES = 16 << 20  # a safetensors header of a LoRA adapter or its optimizer state is a few KB
MAX_META_BYTES = 1 << 20
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}  # what a checkpoint's tensors are stored in


def _show(value: str, limit: int = 80) -> str:
    """``repr`` of a caller's string, cut short (errors never echo 5,000 characters back)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _save_meta(op: SaveStateOp | SaveWeightsOp) -> dict[str, Any]:
    """What the caller asked to keep with a checkpoint (description, user metadata, lifetime)."""
    return {k: v for k, v in (("description", op.description), ("user_metadata", op.user_metadata), ("ttl_seconds", op.ttl_seconds)) if v}


def _session_meta(sess: TrainSession, kind: str) -> dict[str, Any]:
    """What a checkpoint records of the session it comes from."""
    return {
        "kind": kind,
        "model_id": sess.model_id,
        "base_model": sess.base_model,
        "rank": sess.rank,
        "alpha": sess.alpha,
        "targets": sess.targets,
        "step": sess.step,
        "seed": sess.seed,
    }


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

    @staticmethod
    def ephemeral_owner(uri: str, field: str = "path") -> str:
        """The model id a ``local://ephemeral/<model_id>/<seq>`` URI belongs to; any other spelling is refused."""
        match = _EPHEMERAL.fullmatch(uri)
        if match is None:
            raise InvalidInputError(
                f"{_show(uri)} is not a sampler snapshot path", field=field, fix="pass the .path of an ephemeral save_weights result"
            )
        return match.group(1)

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
        if uri.startswith(EPHEMERAL):  # an in-memory snapshot: no directory, whatever follows the prefix
            raise InvalidInputError(
                f"{_show(uri)} is a sampler snapshot, not a checkpoint on disk",
                field=field,
                fix="pass the .path of a durable save (a snapshot path only opens a sampler)",
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

    def target(self, model_id: str, kind: str, name: str, overwrite: bool) -> Path:
        """The directory a save of ``name`` goes to; a ConflictError naming ``overwrite`` when a checkpoint is
        there already and ``overwrite`` is not set."""
        final = self.root / model_id / kind / self.check_name(name)
        check_overwrite(name, final.exists(), overwrite)
        return final

    def write(self, final: Path, meta: dict[str, Any], fill: Callable[[Path], None]) -> str:
        """``fill`` a scratch directory next to ``final``, then swap it in whole: a save that fails (or a crash)
        leaves the older checkpoint of that name as it was, never a half-written one under the name."""
        scratch: Path | None = None
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
            fill(scratch)
            (scratch / META).write_text(json.dumps({**meta, "time": time.time()}, indent=2))
            _swap_in(scratch, final)
        except Exception as err:
            if _disk_failure(err):
                raise _storage_error(final.name, err) from err
            raise
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        return self.uri(final)

    def meta(self, path: Path, field: str = "path") -> dict[str, Any]:
        """The ``asyncsess.json`` of checkpoint directory ``path``, checked: a known ``kind``, a ``base_model``
        name and, for a ``state``, the LoRA shape (:func:`check_lora`) and a ``step``."""
        file = path / META
        try:
            _own_file(file)
            if file.stat().st_size > MAX_META_BYTES:
                raise ValueError(f"{file.stat().st_size} bytes")
            meta = json.loads(file.read_bytes().decode("utf-8"))
        except (OSError, ValueError, RecursionError) as err:
            raise _bad(self.uri(path), META, f"is not checkpoint metadata ({type(err).__name__})", field) from None
        if not isinstance(meta, dict) or meta.get("kind") not in KINDS or not isinstance(meta.get("base_model"), str):
            raise _bad(self.uri(path), META, "has no known kind or base_model", field)
        if meta["kind"] == "state":
            check_lora(self.uri(path), META, meta.get("rank"), meta.get("alpha"), meta.get("targets"), field)
        step = meta.get("step", 0)
        if type(step) is not int or not 0 <= step < 2**53:
            raise _bad(self.uri(path), META, f"step {step!r:.40} is not a step count", field)
        return meta

    def list(self, model_id: str | None = None) -> list[Checkpoint]:
        pattern = f"{model_id}/*/*/{META}" if model_id else f"*/*/*/{META}"
        out = []
        for meta_file in sorted(self.root.glob(pattern)):
            d = meta_file.parent
            if d.name.startswith("."):  # a save being written, or an older one being replaced
                continue
            try:
                meta = self.meta(d)
            except InvalidInputError:  # a damaged checkpoint is refused when opened, not a failed listing
                continue
            if d.parent.name not in KINDS:
                continue
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

    # ------------------------------------------------------------------- a session's checkpoints

    def save_state(self, host: LoraHost, sess: TrainSession, op: SaveStateOp) -> CheckpointResponse:
        """Adapter weights, optimizer state and step under ``state/`` (resumable with :meth:`load_state`)."""
        from safetensors.torch import save_file

        from .trainer import optimizer_tensors

        def fill(d: Path) -> None:
            save_file({k: v.cpu() for k, v in host.state_dict(sess.adapter).items()}, str(d / "adapter.safetensors"))
            save_file(optimizer_tensors(sess), str(d / "optimizer.safetensors"))

        return self._save(sess, op, fill)

    def check_state(self, path: Path, sess: TrainSession, field: str = "path") -> dict[str, Any]:
        """The metadata of a ``save_state`` directory that ``sess`` can load (its base model, LoRA rank, alpha and targets);
        anything else is an InvalidInputError naming ``field``."""
        meta = self.meta(path, field)
        if meta.get("kind") != "state":
            raise InvalidInputError(f"{self.uri(path)} is a {meta.get('kind')} checkpoint", field=field, fix="pass a save_state path")
        if meta.get("base_model") != sess.base_model:  # module names and shapes may match on another base: never load it there
            raise InvalidInputError(
                f"the checkpoint was trained on {_show(str(meta.get('base_model')))}, this session is on {_show(sess.base_model)}",
                field=field,
                fix="load it into a session on its base model (or create one with from_path)",
            )
        saved = (int(meta["rank"]), float(meta["alpha"]), list(meta["targets"]))
        if saved != (sess.rank, sess.alpha, sess.targets):  # another alpha scales the same weights into another model
            raise InvalidInputError(
                f"the checkpoint's LoRA (rank {saved[0]}, alpha {saved[1]:g}) or its targets differ from this session's "
                f"(rank {sess.rank}, alpha {sess.alpha:g})",
                field=field,
                fix="load it into a session created with its rank, alpha and train_* options (or with from_path)",
            )
        return meta

    def load_state(self, host: LoraHost, sess: TrainSession, path: Path, *, with_optimizer: bool, field: str = "path") -> None:
        """Put a ``save_state`` directory's weights (and optimizer state, else a fresh one) into ``sess``."""
        from .trainer import load_optimizer_tensors

        meta = self.check_state(path, sess, field)
        shapes = {k: tuple(p.shape) for k, p in sess.params.items()}
        weights = read_tensors(self.uri(path), path / "adapter.safetensors", shapes, field=field)
        optimizer = (
            read_tensors(self.uri(path), path / "optimizer.safetensors", _adam_shapes(shapes), partial=True, field=field)
            if with_optimizer
            else None
        )
        host.load_state_dict(sess.adapter, weights)
        for p in sess.params.values():
            p.grad = None
        sess.step = int(meta.get("step", 0))
        if optimizer is not None:
            load_optimizer_tensors(sess, optimizer)
        else:
            sess.optimizer.state.clear()

    def load_state_op(self, host: LoraHost, sess: TrainSession, op: LoadStateOp) -> None:
        """:meth:`load_state` for a ``load_state`` op (its path resolved under the root, checked again: it may
        have changed since the op was queued)."""
        self.load_state(host, sess, self.resolve(op.path), with_optimizer=op.with_optimizer)

    def save_weights(self, slot: Slot, sess: TrainSession, op: SaveWeightsOp, dtype: torch.dtype) -> CheckpointResponse:
        """A PEFT adapter directory under ``sampler/``, or with ``merge_weights`` a full model under ``merged/``."""

        def fill(d: Path) -> None:
            if op.merge_weights:
                slot.host.export_peft(sess.adapter, d / "adapter")
                _write_merged(slot, d / "adapter", d, dtype)
            else:
                slot.host.export_peft(sess.adapter, d)

        return self._save(sess, op, fill)

    def _save(self, sess: TrainSession, op: SaveStateOp | SaveWeightsOp, fill: Callable[[Path], None]) -> CheckpointResponse:
        """Write ``op``'s checkpoint (``fill`` writes the files) under its name, or a free ``step-<step>-<seq>`` without one."""
        kind = op.checkpoint_kind
        name = op.name or free_name(f"step-{sess.step:06d}-{op.seq}", lambda n: (self.root / sess.model_id / kind / n).exists())
        final = self.target(sess.model_id, kind, name, op.overwrite)
        uri = self.write(final, {**_session_meta(sess, kind), **_save_meta(op)}, fill)
        return CheckpointResponse(path=uri, kind=kind, step=sess.step)


def _swap_in(scratch: Path, final: Path) -> None:
    """Rename ``scratch`` to ``final``; an older ``final`` is renamed aside first and removed once the new one is
    in place (put back if that fails). Each rename is atomic, so ``final`` is only ever a whole checkpoint."""
    if not final.exists():
        scratch.rename(final)
        return
    old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old.")) / final.name
    final.rename(old)
    try:
        scratch.rename(final)
    except BaseException:
        old.rename(final)
        raise
    finally:
        shutil.rmtree(old.parent, ignore_errors=True)


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``, links not followed and hidden entries (a save being written, an older one
    being replaced) skipped; 0 when there is nothing."""
    total = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    for entry in entries:
        if entry.name.startswith("."):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                total += tree_bytes(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def save_bytes(slot: Slot, sess: TrainSession, op: SaveStateOp | SaveWeightsOp, dtype: torch.dtype) -> int:
    """About the bytes a durable save of ``sess`` writes: its adapter; a ``save_state`` adds AdamW's two float32
    moments per parameter; a merged ``save_weights`` adds a full copy of the base model in ``dtype``."""
    adapter = sum(p.numel() * p.element_size() for p in sess.params.values())
    if isinstance(op, SaveStateOp):
        return adapter + sum(p.numel() * 8 for p in sess.params.values())
    if not op.merge_weights:
        return adapter
    base = slot.host.peft.get_base_model()
    return adapter + sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n) * dtype.itemsize


def _disk_failure(err: BaseException) -> bool:
    """Whether writing a checkpoint failed for the disk: an OSError (ENOSPC, EDQUOT, EFBIG, ...), or safetensors'
    own error wrapping one (its Rust writer raises ``SafetensorError: ... IoError``)."""
    return isinstance(err, OSError) or (type(err).__name__ == "SafetensorError" and "IoError" in str(err))


def _storage_error(name: str, err: BaseException) -> InsufficientStorageError:
    """The void answer to a save that failed for the disk (nothing is left under ``name``)."""
    code = errno.errorcode.get(getattr(err, "errno", None) or 0, type(err).__name__)
    return InsufficientStorageError(
        f"checkpoint {name!r} was not saved: writing it failed ({code}: {str(err)[:120]}); nothing was kept under the name",
        void=True,
        fix="free space on the worker's disk (delete checkpoints you no longer need: DELETE /v1/checkpoints?path=...), then save again",
    )


def _write_merged(slot: Slot, adapter_dir: Path, out: Path, dtype: torch.dtype) -> None:
    """A full model with the adapter merged in: a fresh copy of the base, so the live one stays untouched."""
    import torch
    from peft import PeftModel

    from . import models

    base = models.load_model(slot.source, torch.device("cpu"), dtype)
    head = base.get_output_embeddings()
    if getattr(base.config, "tie_word_embeddings", False) and head is not None:
        # merging a LoRA on a tied LM head would also change the input embeddings: untie first
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        base.config.tie_word_embeddings = False
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    slot.tokenizer.save_pretrained(str(out))


def _own_file(file: Path) -> None:
    """Refuse a file reached through a symlink (the worker writes none; one may point out of the root)."""
    if os.path.realpath(file) != os.path.normpath(os.path.abspath(file)):
        raise OSError(f"{file.name} is a link")
    if not file.is_file():
        raise OSError(f"{file.name} is not a file")


def _bad(uri: str, file: str, what: str, field: str) -> InvalidInputError:
    return InvalidInputError(
        f"{_show(uri)}: {file} {what}", field=field, fix="pass the .path of a checkpoint this worker saved, as it saved it"
    )


def check_lora(uri: str, file: str, rank: Any, alpha: Any, targets: Any, field: str = "path") -> tuple[int, float, list[str]]:
    """A checkpoint's LoRA shape, checked before an adapter is allocated for it: a whole rank of 1..MAX_LORA_RANK,
    a finite alpha > 0 and a non-empty list of module names."""
    if type(rank) is not int or not 1 <= rank <= MAX_LORA_RANK:
        raise _bad(uri, file, f"rank {rank!r:.40} is not a LoRA rank of 1..{MAX_LORA_RANK}", field)
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0:
        raise _bad(uri, file, f"alpha {alpha!r:.40} is not a LoRA alpha (a finite number > 0)", field)
    if (
        not isinstance(targets, list)
        or not targets
        or len(targets) > 64
        or not all(isinstance(t, str) and _NAME.fullmatch(t) for t in targets)
    ):
        raise _bad(uri, file, f"targets {targets!r:.60} are not module names", field)
    return rank, float(alpha), list(targets)


def adapter_config(uri: str, path: Path, known: set[str], field: str = "path") -> tuple[int, float, list[str]]:
    """The rank, alpha and target modules of the PEFT adapter directory ``path`` (its ``adapter_config.json``),
    checked (:func:`check_lora`, each target one of the base model's ``known`` linear layers)."""
    file = path / "adapter_config.json"
    try:
        _own_file(file)
        if file.stat().st_size > MAX_META_BYTES:
            raise ValueError(f"{file.stat().st_size} bytes")
        config = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise _bad(uri, file.name, f"is not a PEFT adapter config ({type(err).__name__})", field) from None
    if not isinstance(config, dict):
        raise _bad(uri, file.name, "is not a JSON object", field)
    targets = config.get("target_modules")
    rank, alpha, targets = check_lora(uri, file.name, config.get("r"), config.get("lora_alpha"), targets, field)
    if unknown := sorted(set(targets) - known):
        raise _bad(uri, file.name, f"targets modules the base model lacks: {unknown[:3]}", field)
    return rank, alpha, sorted(targets)


def _adam_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The tensors of AdamW's state for parameters of ``shapes`` (see :func:`.trainer.optimizer_tensors`)."""
    out: dict[str, tuple[int, ...]] = {}
    for key, shape in shapes.items():
        out.update({f"{key}::step": (), f"{key}::exp_avg": shape, f"{key}::exp_avg_sq": shape})
    return out


def read_tensors(
    uri: str, file: Path, shapes: dict[str, tuple[int, ...]], *, partial: bool = False, field: str = "path"
) -> dict[str, torch.Tensor]:
    """The tensors of safetensors ``file``, which must be exactly ``shapes`` (with ``partial``: those of some
    parameters, each whole), in a float dtype, all finite. Its header is checked before anything is read: a
    file that claims more bytes than it has, another format (a pickle), or unexpected tensors is refused."""
    from safetensors.torch import load_file

    name = file.name
    try:
        _own_file(file)
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError("not a safetensors file")
            header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, ValueError, RecursionError, struct.error) as err:
        raise _bad(uri, name, f"is not a safetensors file ({str(err)[:60]})", field) from None
    if not isinstance(header, dict):
        raise _bad(uri, name, "has no safetensors header", field)
    header.pop("__metadata__", None)
    if partial:
        owners = {k.split("::", 1)[0] for k in header}
        expected = {k: v for k, v in shapes.items() if k.split("::", 1)[0] in owners}
    else:
        expected = shapes
    if set(header) != set(expected):
        missing, extra = sorted(set(expected) - set(header))[:2], sorted(set(header) - set(expected))[:2]
        raise _bad(uri, name, f"does not hold this adapter's tensors (missing {missing}, unexpected {extra})", field)
    end = size - 8 - n
    for key, info in header.items():
        ok = isinstance(info, dict) and info.get("dtype") in _DTYPES and info.get("shape") == list(expected[key])
        offsets = info.get("data_offsets") if ok else None
        if not (
            ok
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= end
            and offsets[1] - offsets[0] == math.prod(expected[key]) * _DTYPES[info["dtype"]]
        ):
            raise _bad(uri, name, f"{key!r:.80}: not a float tensor of shape {list(expected[key])} within the file", field)
    try:
        tensors = load_file(str(file))
    except Exception as err:  # the header checked out, the data did not
        raise _bad(uri, name, f"cannot be read ({type(err).__name__})", field) from None
    for key, t in tensors.items():
        if not bool(t.isfinite().all()):
            raise _bad(uri, name, f"{key!r:.80} holds NaN or infinite values", field)
    return tensors
