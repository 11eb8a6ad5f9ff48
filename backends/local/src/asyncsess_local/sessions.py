"""What lives on the device: base models (slots), training sessions, samplers and their weight snapshots.

A :class:`Slot` is one loaded base model with its LoRA host, tokenizer and sampler (torch, and vLLM when
it samples). A training session is an adapter on a slot; a sampler points at a slot's base weights or at
a *snapshot*: an adapter copied from a session by an ephemeral ``save_weights`` (``local://ephemeral/``),
or loaded from a saved checkpoint. Snapshots are reference-counted by the samplers on them and dropped
when none uses them (a live session's newest one stays); a snapshot vLLM can load is staged into it.

A sampler refresh (ephemeral ``save_weights`` + ``create_sampler``) never touches disk: the adapter is
copied in memory under a versioned name ``<model_id>-v<step>-<n>``. ``retain_snapshots`` (engine option,
``local://?retain_snapshots=N``; 0 = no bound) keeps at most N ephemeral snapshots per training session:
taking one more drops the oldest, and samplers still on it answer :class:`SessionGoneError` (an RL loop
with ``max_staleness = k`` needs ``N >= k + 2``: the versions rollouts may still use plus the new one).

Everything here runs on the engine thread (see :mod:`.engine`).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncsess.backends import SamplerSpec, SaveWeightsOp, TrainingSessionSpec
from asyncsess.errors import InvalidInputError, SessionGoneError
from asyncsess.types import CheckpointResponse, GetInfoResponse, SupportedModel

from . import models, trainer
from .adapters import BASE, LoraHost, target_modules
from .checkpoints import EPHEMERAL, MAX_LORA_RANK, CheckpointStore, read_tensors
from .logprobs import head_is_plain
from .models import ModelSource, load_tokenizer, resolve_model
from .sampler import TorchSampler
from .vllm_sampler import VllmOptions, VllmSampler

__all__ = ["Sessions", "Slot", "SamplerRef", "MAX_LORA_RANK"]

log = logging.getLogger("asyncsess.local")
CHECKPOINT_LAYERS_ABOVE = 10**9  # parameters: checkpoint_layers=auto turns it on for models this big (on CUDA)


@dataclass
class Slot:
    """One base model on the device, with its adapters and sampler."""

    name: str
    source: ModelSource
    host: LoraHost
    tokenizer: Any
    sampler: TorchSampler
    vocab_size: int
    max_context: int
    plain_head: bool
    vllm: VllmSampler | None = None  # when set, it samples instead of ``sampler`` (adapters it can load)
    checkpointed_layers: int = 0

    def sample_context(self, adapter: str) -> int:
        """The longest prompt + completion a sampler on ``adapter`` takes (vLLM's ``max_model_len`` may be lower)."""
        if self.vllm is not None and (adapter == BASE or self.vllm.has(adapter)):
            return min(self.max_context, self.vllm.max_model_len)
        return self.max_context

    def describe(self) -> SupportedModel:
        return SupportedModel(model_name=self.name, max_context_length=self.max_context, vocab_size=self.vocab_size)


@dataclass
class SamplerRef:
    """What a sampler samples from: a slot and an adapter on it (``BASE``: the base weights)."""

    slot: Slot
    adapter: str
    path: str | None
    step: int = 0  # the optimizer step of the weights it samples (0: base weights)


@dataclass
class _Snapshot:
    slot: Slot
    adapter: str
    owner: str | None  # the training session it was taken from (ephemeral snapshots)
    step: int = 0  # the optimizer step its weights were saved at
    refs: int = 0
    lineage: str = ""  # the training session its weights come from (names its vLLM versions)
    peft_dir: Path | None = None  # a PEFT directory on disk holding these weights, if any
    in_vllm: bool = False


@dataclass
class SlotOptions:
    """How base models are loaded (from the engine's configuration)."""

    device: torch.device
    dtype: torch.dtype
    sampler_kind: str  # torch or vllm
    sampler_choice: str  # what was asked for: auto, torch or vllm
    checkpoint_layers: str  # auto, on or off
    attention: str  # auto, grouped or sdpa (models.ATTENTION)
    models: dict[str, str]
    vllm: VllmOptions
    retain_snapshots: int = 0  # ephemeral snapshots kept per training session (0: as long as samplers use them)


class Sessions:
    """The slots, training sessions and samplers of one engine, and the snapshots samplers use."""

    def __init__(self, options: SlotOptions, store: CheckpointStore) -> None:
        self.options = options
        self.store = store
        self.slots: dict[str, Slot] = {}
        self.sessions: dict[str, trainer.TrainSession] = {}
        self.samplers: dict[str, SamplerRef] = {}
        self._snapshots: dict[str, _Snapshot] = {}  # path -> snapshot adapter
        self._latest: dict[str, str] = {}  # training session -> path of its newest ephemeral snapshot
        self._names = itertools.count(1)
        self._retired: dict[str, str] = {}  # sampler id -> why its snapshot was dropped while it was live

    # ---------------------------------------------------------------------------- base models

    def slot(self, name: str) -> Slot:
        """The loaded base model called ``name``, loading it on first use."""
        if name in self.slots:
            return self.slots[name]
        opts = self.options
        source = resolve_model(name, opts.models)
        for s in self.slots.values():
            if s.source.path == source.path and s.source.kwargs == source.kwargs:
                self.slots[name] = s
                return s
        model = models.load_model(source, opts.device, opts.dtype, opts.attention)
        tokenizer = load_tokenizer(source)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else []), tokenizer.eos_token_id} - {None})
        plain = head_is_plain(model, opts.device)
        layers = self._checkpointed(model)
        host = LoraHost(model, source)
        max_context = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        slot = Slot(
            name=name,
            source=source,
            host=host,
            tokenizer=tokenizer,
            sampler=TorchSampler(host, tokenizer, opts.device, eos_ids),
            vocab_size=int(model.config.vocab_size),
            max_context=max_context,
            plain_head=plain,
            checkpointed_layers=layers,
        )
        if opts.sampler_kind == "vllm":
            slot.vllm = self._start_vllm(source, eos_ids, max_context)
        self.slots[name] = slot
        log.info("loaded %s from %s on %s (%s, %d layers checkpointed)", name, source.path, opts.device, opts.dtype, layers)
        return slot

    def distinct_slots(self) -> list[Slot]:
        """Each loaded base model once (two names may share a slot)."""
        return list({id(s): s for s in self.slots.values()}.values())

    def _checkpointed(self, model: Any) -> int:
        """Turn on activation checkpointing of the decoder layers if configured (auto: CUDA and >= 1B parameters)."""
        choice = self.options.checkpoint_layers
        if choice == "auto":
            big = sum(p.numel() for p in model.parameters()) >= CHECKPOINT_LAYERS_ABOVE
            choice = "on" if self.options.device.type == "cuda" and big else "off"
        return trainer.checkpoint_layers(model) if choice == "on" else 0

    def _start_vllm(self, source: ModelSource, eos_ids: list[int], max_context: int) -> VllmSampler | None:
        if source.kwargs:  # e.g. a GGUF file: vLLM gets plain model directories only
            if self.options.sampler_choice == "vllm":
                raise InvalidInputError(f"vLLM cannot serve {source.name!r}", field="sampler", fix="use a model directory or sampler=torch")
            log.warning("sampling %s with torch: vLLM gets plain model directories only", source.name)
            return None
        return VllmSampler(
            source.path,
            dtype=self.options.dtype,
            max_context=max_context,
            eos_ids=eos_ids,
            options=self.options.vllm,
            device=self.options.device,
            fallback_staging=self.store.root,
        )

    # ------------------------------------------------------------------------ training sessions

    def create_session(self, spec: TrainingSessionSpec) -> GetInfoResponse:
        meta: dict[str, Any] = {}
        ckpt: Path | None = None
        if spec.from_path:
            ckpt = self.store.resolve(spec.from_path, "from_path")
            meta = self.store.meta(ckpt, "from_path")
            if meta.get("kind") != "state":
                raise InvalidInputError(
                    f"{spec.from_path} is a {meta.get('kind')} checkpoint", field="from_path", fix="pass a save_state path"
                )
        base_name = spec.base_model or meta.get("base_model", "")
        slot = self.slot(base_name)
        if meta and slot.name != meta.get("base_model"):  # another name of the same model is fine (one slot)
            raise InvalidInputError(
                f"{spec.from_path} was trained on {meta.get('base_model')!r}, not {spec.base_model!r}",
                field="base_model",
                fix="leave base_model out: a session from a checkpoint is on the checkpoint's base model",
            )
        if meta:
            rank, alpha, targets = meta["rank"], float(meta["alpha"]), list(meta["targets"])  # checked by store.meta
            _check_targets(slot, targets, spec.from_path or "", "from_path")
        else:
            if not (spec.train_mlp or spec.train_attn or spec.train_unembed):
                raise InvalidInputError("nothing to train", field="train_mlp/train_attn/train_unembed", fix="set at least one to True")
            if not 1 <= spec.rank <= MAX_LORA_RANK:
                raise InvalidInputError(f"rank {spec.rank} is out of range", field="rank", fix=f"use 1..{MAX_LORA_RANK}")
            if slot.vllm is not None and spec.rank > slot.vllm.options.max_lora_rank:
                raise InvalidInputError(
                    f"rank {spec.rank} exceeds the vLLM sampler's max_lora_rank ({slot.vllm.options.max_lora_rank})",
                    field="rank",
                    fix="use a lower rank, or start the backend with a larger vllm_max_lora_rank",
                )
            rank = spec.rank
            alpha = float(spec.alpha) if spec.alpha is not None else 2.0 * rank
            targets = target_modules(
                slot.host.groups, train_mlp=spec.train_mlp, train_attn=spec.train_attn, train_unembed=spec.train_unembed
            )
        if not _vllm_takes(slot, targets) and slot.vllm is not None and slot.vllm.options.unembed == "refuse":
            raise InvalidInputError(
                f"vLLM cannot load an LM-head LoRA on {slot.name!r} (its vLLM model class declares no embedding modules)",
                field="train_unembed",
                fix="pass train_unembed=False, or start the backend with vllm_unembed=torch (such sessions then sample with torch)",
            )
        model_id = f"lora-{uuid.uuid4().hex[:12]}"
        adapter = f"t{next(self._names)}"
        params = slot.host.add(adapter, rank=rank, alpha=alpha, targets=targets, seed=spec.seed)
        sess = trainer.TrainSession(
            model_id=model_id,
            base_model=slot.name,
            adapter=adapter,
            rank=rank,
            alpha=alpha,
            targets=targets,
            seed=spec.seed,
            params=params,
            optimizer=trainer.new_optimizer(params, fused=self.options.device.type == "cuda"),
        )
        try:
            if ckpt is not None:
                self.store.load_state(slot.host, sess, ckpt, with_optimizer=spec.with_optimizer, field="from_path")
        except BaseException:
            slot.host.remove(adapter)
            raise
        self.sessions[model_id] = sess
        return GetInfoResponse(
            model_id=model_id,
            base_model=base_name,
            lora_rank=rank,
            lora_alpha=alpha,
            seed=spec.seed,
            step=sess.step,
            user_metadata=dict(spec.user_metadata),
            session_options=dict(spec.session_options),
        )

    def stop_session(self, session_id: str) -> None:
        """Stop a training session or a sampler (unknown ids are ignored)."""
        sess = self.sessions.pop(session_id, None)
        if sess is not None:
            self.slots[sess.base_model].host.remove(sess.adapter)
            self._latest.pop(session_id, None)
            self._drop_unused(session_id)
        self._retired.pop(session_id, None)
        ref = self.samplers.pop(session_id, None)
        if ref is not None and ref.path is not None and ref.path in self._snapshots:
            snap = self._snapshots[ref.path]
            snap.refs -= 1
            self._drop_unused(snap.owner, only=ref.path)

    def snapshot(self, sess: trainer.TrainSession, op: SaveWeightsOp) -> CheckpointResponse:
        """An ephemeral ``save_weights``: copy the session's adapter into an in-memory snapshot for samplers."""
        slot = self.slots[sess.base_model]
        path = f"{EPHEMERAL}{sess.model_id}/{op.seq}"
        adapter = f"{sess.model_id}-v{sess.step}-{next(self._names)}"  # versioned: never reused for other weights
        slot.host.copy(sess.adapter, adapter)
        self._snapshots[path] = _Snapshot(slot, adapter, owner=sess.model_id, step=sess.step, lineage=sess.model_id)
        self._latest[sess.model_id] = path
        self._drop_unused(sess.model_id)  # older snapshots no sampler uses any more
        self._retain(sess.model_id)
        return CheckpointResponse(path=path, kind="sampler", step=sess.step)

    def snapshot_adapters(self, owner: str) -> list[str]:
        """The adapter names of ``owner``'s live ephemeral snapshots, oldest first."""
        return [snap.adapter for snap in self._snapshots.values() if snap.owner == owner]

    def _retain(self, owner: str) -> None:
        """Drop ``owner``'s oldest snapshots beyond ``retain_snapshots``; their samplers are retired."""
        keep = self.options.retain_snapshots
        paths = [path for path, snap in self._snapshots.items() if snap.owner == owner]
        for path in paths[: max(0, len(paths) - keep)] if keep else []:
            for sampler_id, ref in list(self.samplers.items()):
                if ref.path == path:
                    del self.samplers[sampler_id]
                    self._retired[sampler_id] = f"its weights ({path}) were dropped: retain_snapshots={keep} newer snapshots exist"
            self._drop_snapshot(path)

    def _drop_unused(self, owner: str | None, only: str | None = None) -> None:
        """Drop ``owner``'s snapshots that no sampler uses, except the newest one of a live session."""
        for path, snap in list(self._snapshots.items()):
            if snap.owner == owner and snap.refs == 0 and (only is None or path == only):
                if owner is None or self._latest.get(owner) != path:
                    self._drop_snapshot(path)

    def _drop_snapshot(self, path: str) -> None:
        snap = self._snapshots.pop(path)
        snap.slot.host.remove(snap.adapter)
        if snap.in_vllm and snap.slot.vllm is not None:
            snap.slot.vllm.remove_adapter(snap.adapter)

    # ------------------------------------------------------------------------------- samplers

    def create_sampler(self, spec: SamplerSpec) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        if spec.model_path is None:
            self.samplers[sampler_id] = SamplerRef(self.slot(spec.base_model or ""), BASE, None)
            return sampler_id
        path = spec.model_path
        if not path.startswith(EPHEMERAL):
            path = str(self.store.resolve(path))  # one snapshot per checkpoint directory, however its path is spelled
        snap = self._snapshots.get(path)
        if snap is None:
            if path.startswith(EPHEMERAL):
                raise InvalidInputError(f"{path} is no longer available", field="model_path", fix="save the weights again")
            d = Path(path)
            meta = self.store.meta(d, "model_path")
            slot = self.slot(meta["base_model"])
            adapter = f"s{next(self._names)}"
            peft_dir = None if meta["kind"] == "state" else d / "adapter" if meta["kind"] == "merged" else d
            uri = self.store.uri(d)
            if peft_dir is None:
                _check_targets(slot, meta["targets"], uri, "model_path")
                slot.host.add(adapter, rank=meta["rank"], alpha=float(meta["alpha"]), targets=list(meta["targets"]), seed=None)
                try:
                    shapes = {k: tuple(p.shape) for k, p in slot.host.params(adapter).items()}
                    slot.host.load_state_dict(adapter, read_tensors(uri, d / "adapter.safetensors", shapes, field="model_path"))
                except BaseException:
                    slot.host.remove(adapter)
                    raise
            else:
                slot.host.import_peft(adapter, peft_dir, uri)
            step = meta.get("step")
            snap = self._snapshots[path] = _Snapshot(
                slot, adapter, owner=None, step=step if type(step) is int else 0, lineage=meta.get("model_id", "ckpt"), peft_dir=peft_dir
            )
        if spec.base_model and spec.base_model != snap.slot.name and self.slots.get(spec.base_model) is not snap.slot:
            if snap.refs == 0 and snap.owner is None:
                self._drop_snapshot(path)
            raise InvalidInputError(
                f"{spec.model_path} holds weights for {snap.slot.name!r}, not {spec.base_model!r}",
                field="base_model",
                fix="leave base_model out: a sampler on a saved path samples that path's base model",
            )
        vllm = snap.slot.vllm
        if vllm is not None and not snap.in_vllm and _vllm_takes(snap.slot, snap.slot.host.info[snap.adapter].targets):
            host, adapter = snap.slot.host, snap.adapter
            dtype = self.options.dtype
            staged = dtype if dtype in (torch.bfloat16, torch.float16) else None  # what vLLM computes in
            try:
                vllm.add_adapter(
                    adapter,
                    snap.lineage,
                    peft_dir=snap.peft_dir,
                    export=lambda d: host.export_peft(adapter, d, dtype=staged),
                    nbytes=host.nbytes(adapter, staged),
                )
            except BaseException:
                if snap.refs == 0 and snap.owner is None:
                    self._drop_snapshot(path)
                raise
            snap.in_vllm = True
        snap.refs += 1
        self.samplers[sampler_id] = SamplerRef(snap.slot, snap.adapter, path, snap.step)
        return sampler_id

    def forget_checkpoint(self, directory: Path) -> None:
        """``directory`` was written over or is being deleted: a sampler opened on its path from now on loads what
        is there; open ones keep the weights they sample (their snapshot is kept under a private key)."""
        key = str(directory)
        snap = self._snapshots.pop(key, None)
        if snap is None:
            return
        hidden = f"{key}#replaced-{next(self._names)}"
        self._snapshots[hidden] = snap
        for ref in self.samplers.values():
            if ref.path == key:
                ref.path = hidden
        if snap.refs == 0:
            self._drop_snapshot(hidden)

    def sampler(self, sampler_id: str) -> SamplerRef:
        """What the sampler ``sampler_id`` samples from; :class:`SessionGoneError` when it is stopped or unknown."""
        ref = self.samplers.get(sampler_id)
        if ref is None:
            if sampler_id in self._retired:
                raise SessionGoneError(f"sampler {sampler_id} is gone: {self._retired[sampler_id]}")
            raise SessionGoneError(f"sampler {sampler_id} is stopped or unknown")
        return ref


def _vllm_takes(slot: Slot, targets: list[str]) -> bool:
    """Whether the slot's vLLM can load an adapter on ``targets`` (an LM-head LoRA only on some models)."""
    if slot.vllm is None:
        return False
    return slot.vllm.unembed_lora or not set(targets) & set(slot.host.groups["unembed"])


def _check_targets(slot: Slot, targets: list[str], uri: str, field: str) -> None:
    """Refuse a checkpoint whose LoRA targets modules this base model lacks (before an adapter is added)."""
    if unknown := sorted(set(targets) - slot.host.known_targets()):
        raise InvalidInputError(
            f"{uri}: its LoRA targets modules {slot.name!r} lacks: {unknown[:3]}", field=field, fix="pass a checkpoint of this base model"
        )
