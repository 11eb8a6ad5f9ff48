"""One frozen base model hosting many LoRA adapters (peft multi-adapter), isolated from each other.

Training sessions and sampler snapshots are peft adapters of one ``PeftModel``; exactly one is active
(and trainable) per training pass, and sampling batches may mix adapters row by row. A permanent rank-1
zero adapter keeps peft's bookkeeping valid when no session is open. Adapter weights cross the
boundary under portable keys: peft's own (``base_model.model.<module>.lora_A.weight``), without the
adapter name, so a checkpoint fits any adapter of the same shape.
"""

from __future__ import annotations

import copy
import itertools
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .models import ModelSource

__all__ = ["LoraHost", "BASE", "linear_groups", "target_modules"]

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch
_ANCHOR = "anchor"
POOL_PER_SHAPE = 2  # released snapshot adapters kept for reuse, per (rank, alpha, targets)
_ATTN = re.compile(r"attn|attention", re.IGNORECASE)


def linear_groups(model: Any) -> dict[str, list[str]]:
    """Names (last path component) of the model's linear layers by role: ``attn``, ``mlp``, ``unembed``.

    Call it on the plain model, before peft wraps it.
    """
    head = model.get_output_embeddings()
    groups: dict[str, set[str]] = {"attn": set(), "mlp": set(), "unembed": set()}
    for full, module in model.named_modules():
        if isinstance(module, nn.Linear):
            role = "unembed" if module is head else "attn" if _ATTN.search(full) else "mlp"
            groups[role].add(full.rsplit(".", 1)[-1])
    return {k: sorted(v) for k, v in groups.items()}


def target_modules(
    groups: dict[str, list[str]], *, train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True
) -> list[str]:
    """The layers to adapt for the given switches."""
    chosen = (groups["attn"] if train_attn else []) + (groups["mlp"] if train_mlp else []) + (groups["unembed"] if train_unembed else [])
    return sorted(set(chosen))


@dataclass
class AdapterInfo:
    rank: int
    alpha: float
    targets: list[str]


class LoraHost:
    """A base model wrapped once by peft; adapters are added, activated and removed by name."""

    def __init__(self, model: nn.Module, source: ModelSource) -> None:
        from peft import LoraConfig, PeftModel

        self.source = source
        self._alias: dict[str, str] = {}  # a snapshot's name -> the pooled peft adapter that holds it
        self._free: dict[tuple[int, float, tuple[str, ...]], list[str]] = {}  # released pooled adapters by shape
        self._pooled = itertools.count()
        self.pool_per_shape = POOL_PER_SHAPE  # 0: every snapshot adds a peft adapter (bench/bench_refresh.py's baseline)
        self.groups = linear_groups(model)
        first = next(n for n, m in model.named_modules() if isinstance(m, nn.Linear))
        anchor = LoraConfig(r=1, lora_alpha=1, target_modules=[first], lora_dropout=0.0, init_lora_weights=False)
        with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`: not ours to fix
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            self.peft = PeftModel(model, anchor, adapter_name=_ANCHOR)
        with torch.no_grad():
            for p in self._raw_params(_ANCHOR).values():
                p.zero_()
        self.peft.eval()
        self._active = (_ANCHOR, True)
        self.info: dict[str, AdapterInfo] = {}

    # ------------------------------------------------------------------------------ lifecycle

    def add(self, name: str, *, rank: int, alpha: float, targets: list[str], seed: int | None) -> dict[str, nn.Parameter]:
        """Add a fresh adapter (A random, B zero: a no-op until trained); return its parameters."""
        from peft import LoraConfig

        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")  # type: ignore[arg-type]  # peft types alpha as int; a float scales alike
        config.base_model_name_or_path = self.source.name
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.peft.add_adapter(name, config)
        self._set(_ANCHOR, trainable=True)
        self.peft.eval()
        self.info[name] = AdapterInfo(rank, alpha, list(targets))
        return self.params(name)

    def remove(self, name: str) -> None:
        """Drop adapter ``name``; a snapshot's pooled adapter is kept for the next :meth:`copy` of its shape."""
        pooled = self._alias.pop(name, None)
        if pooled is not None:
            info = self.info.pop(name)
            free = self._free.setdefault((info.rank, info.alpha, tuple(info.targets)), [])
            if len(free) < self.pool_per_shape:
                free.append(pooled)
                return
            name = pooled
        if name in self.info:
            self._set(_ANCHOR, trainable=True)
            self.peft.delete_adapter(name)
            del self.info[name]

    def peft_name(self, name: str) -> str:
        """The peft adapter behind ``name`` (a snapshot lives in a pooled one; others are their own)."""
        return self._alias.get(name, name)

    def activate(self, name: str, *, trainable: bool) -> None:
        """Make ``name`` the adapter every forward uses (trainable: its parameters get gradients)."""
        name = self.peft_name(name)
        if self._active != (name, trainable):
            self._set(name, trainable=trainable)

    def activate_base(self) -> None:
        """Forward through the plain base model (the anchor adapter is all zeros: it adds exactly 0)."""
        self.activate(_ANCHOR, trainable=False)

    def _set(self, name: str, *, trainable: bool) -> None:
        self.peft.set_adapter(name, inference_mode=not trainable)  # walks every module: done only on a change
        self._active = (name, trainable)

    def config(self, name: str) -> Any:
        return self.peft.peft_config[self.peft_name(name)]

    # -------------------------------------------------------------------------------- weights

    def _raw_params(self, name: str) -> dict[str, nn.Parameter]:
        tag = f".{self.peft_name(name)}."
        return {n.replace(tag, "."): p for n, p in self.peft.named_parameters() if tag in n and ".lora_" in n}

    def params(self, name: str) -> dict[str, nn.Parameter]:
        """The adapter's parameters under portable keys, in a fixed order."""
        return dict(sorted(self._raw_params(name).items()))

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone().contiguous() for k, p in self.params(name).items()}

    def load_state_dict(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        params = self.params(name)
        if set(params) != set(tensors):
            missing, extra = sorted(set(params) - set(tensors))[:3], sorted(set(tensors) - set(params))[:3]
            raise ValueError(f"adapter keys do not match (missing {missing}, unexpected {extra})")
        with torch.no_grad():
            for k, p in params.items():
                t = tensors[k]
                if t.shape != p.shape:
                    raise ValueError(f"{k}: shape {tuple(t.shape)} does not fit {tuple(p.shape)}")
                p.copy_(t.to(p.device, p.dtype))

    def copy(self, src: str, dst: str) -> None:
        """Add ``dst`` as a frozen copy of ``src`` (a sampler snapshot), in a pooled peft adapter: one released by
        an earlier snapshot of the same shape when there is one (adding a peft adapter walks every module of the
        model: ~0.2-0.3 s on a 135M model, most of a refresh), else a new one."""
        info = self.info[src]
        free = self._free.get((info.rank, info.alpha, tuple(info.targets)))
        pooled = free.pop() if free and self.pool_per_shape else None
        if pooled is None:
            pooled = f"pooled-{next(self._pooled)}"
            self.add(pooled, rank=info.rank, alpha=info.alpha, targets=info.targets, seed=None)
            for p in self.params(pooled).values():
                p.requires_grad_(False)
        self._alias[dst] = pooled
        self.info[dst] = info
        source = self.params(src)
        with torch.no_grad():
            for k, p in self.params(dst).items():
                p.copy_(source[k])

    def nbytes(self, name: str, dtype: torch.dtype | None = None) -> int:
        """The adapter's size in bytes (in ``dtype`` if given)."""
        size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
        return sum(p.numel() * (size or p.element_size()) for p in self.params(name).values())

    def export_peft(self, name: str, path: Path, *, dtype: torch.dtype | None = None) -> None:
        """Write a PEFT adapter directory that ``peft.PeftModel.from_pretrained`` (and vLLM) load.

        ``dtype`` casts the tensors (vLLM stages them in bf16, the precision it computes in); default: as trained.
        """
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: (v if dtype is None else v.to(dtype)).cpu() for k, v in self.state_dict(name).items()}
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = copy.deepcopy(self.config(name))
        config.base_model_name_or_path = self.source.path if Path(self.source.path).exists() else self.source.name
        config.inference_mode = True
        config.save_pretrained(str(path))

    def known_targets(self) -> set[str]:
        """The names of the base model's linear layers (what an adapter may target)."""
        return {m for names in self.groups.values() for m in names}

    def import_peft(self, name: str, path: Path, uri: str, field: str = "model_path") -> None:
        """Add adapter ``name`` (frozen) from a PEFT adapter directory (``uri``: its name in errors); its config and
        tensors are checked (:mod:`.checkpoints`) before the adapter is allocated and filled."""
        from .checkpoints import adapter_config, read_tensors

        rank, alpha, targets = adapter_config(uri, path, self.known_targets(), field)
        self.add(name, rank=rank, alpha=alpha, targets=targets, seed=None)
        try:
            shapes = {k: tuple(p.shape) for k, p in self.params(name).items()}
            self.load_state_dict(name, read_tensors(uri, path / "adapter_model.safetensors", shapes, field=field))
        except BaseException:
            self.remove(name)
            raise
        for p in self.params(name).values():
            p.requires_grad_(False)
