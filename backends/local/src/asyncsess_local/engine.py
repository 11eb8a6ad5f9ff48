"""The engine: one thread that owns the device and runs every model's work.

Callers (the embedded backend, the HTTP worker) put work on a queue and await a :class:`Completion`;
the event loop never blocks on torch. Each time the thread wakes it takes everything queued and:

- runs a session's ops in arrival order (the backend's sequencers already put them in ``seq`` order);
- merges each run of consecutive ``forward_backward`` (or ``forward``) ops of one session queued
  before a barrier (``optim_step``, save, load) into one packed pass;
- batches every pending sampling request, across sessions and adapters, into one generation
  (unless vLLM samples: then requests go straight to it and never wait for training);
- after a session's op fails, fails that session's later ops with :class:`PoisonedError` -- except
  running out of device memory in a (forward-)backward pass: the pass is retried with half the token
  budget (gradients put back, cache emptied) until every datum is alone in its micro-batch, and only
  then fails with :class:`ResourceExhaustedError`; the session stays usable and the lowered budget stays.

State (base models, sessions, sampler snapshots) is touched only on this thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from asyncsess.backends import SamplerSpec, TrainingOp, TrainingSessionSpec
from asyncsess.errors import (
    AsyncSessError,
    InvalidInputError,
    PoisonedError,
    ResourceExhaustedError,
    ServerError,
    SessionGoneError,
)
from asyncsess.types import CheckpointResponse, GetInfoResponse, LoadWeightsResponse, SampleResponse, SupportedModel

from . import trainer
from .adapters import BASE, LoraHost, target_modules
from .checkpoints import EPHEMERAL, CheckpointStore
from .completion import Completion
from .logprobs import head_is_plain, packed_logprobs
from .models import ModelSource, load_model, load_tokenizer, pick_device, pick_dtype, resolve_model
from .sampler import SampleJob, TorchSampler
from .vllm_sampler import VllmOptions, VllmSampler, choose_sampler

__all__ = ["Engine", "EngineConfig", "Slot", "SamplerRef"]

log = logging.getLogger("asyncsess.local")
MAX_LORA_RANK = 256
CHECKPOINT_LAYERS_ABOVE = 10**9  # parameters: checkpoint_layers=auto turns it on for models this big (on CUDA)


@dataclass
class EngineConfig:
    device: str | None = None
    dtype: str | None = None
    checkpoint_dir: str | None = None
    models: dict[str, str] = field(default_factory=dict)  # name -> directory overrides
    token_budget: int = 8192  # tokens per packed training micro-batch (halved after running out of memory)
    checkpoint_layers: str = "auto"  # recompute decoder layers in backward: on, off, auto (CUDA and >= 1B parameters)
    logprob_chunk: int = 1024  # positions per LM-head chunk
    max_sample_rows: int = 256  # rows decoded together
    sampler: str = "auto"  # torch, vllm, or auto (vllm when installed and on CUDA)
    vllm: VllmOptions = field(default_factory=VllmOptions)


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
    slot: Slot
    adapter: str
    path: str | None


@dataclass
class _Snapshot:
    slot: Slot
    adapter: str
    owner: str | None  # the training session it was taken from (ephemeral snapshots)
    refs: int = 0
    lineage: str = ""  # the training session its weights come from (names its vLLM versions)
    peft_dir: Path | None = None  # a PEFT directory on disk holding these weights, if any
    in_vllm: bool = False


@dataclass
class _Work:
    kind: Literal["call", "train", "sample", "logprobs"]
    done: Completion = field(default_factory=Completion)
    fn: Callable[[], Any] | None = None
    model_id: str | None = None
    op: TrainingOp | None = None
    slot: Slot | None = None
    job: SampleJob | None = None
    tokens: list[int] | None = None
    adapter: str = BASE


def _save_meta(op: TrainingOp) -> dict[str, Any]:
    """What the caller asked to keep with a checkpoint (description, user metadata, lifetime)."""
    return {k: v for k, v in (("description", op.description), ("user_metadata", op.user_metadata), ("ttl_seconds", op.ttl_seconds)) if v}


def _as_api_error(err: BaseException) -> BaseException:
    if isinstance(err, AsyncSessError):
        return err
    if trainer.is_oom(err):
        return ResourceExhaustedError(f"out of device memory: {err}")
    if isinstance(err, (ValueError, KeyError)):
        return InvalidInputError(str(err))
    return ServerError(f"{type(err).__name__}: {err}")


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.device = pick_device(self.config.device)
        self.dtype = pick_dtype(self.config.dtype, self.device)
        self.sampler_kind = choose_sampler(self.config.sampler, self.device)
        self.store = CheckpointStore(self.config.checkpoint_dir)
        self._oom = False
        self.token_budget = self.config.token_budget  # lowered after running out of memory
        if self.config.checkpoint_layers not in ("auto", "on", "off"):
            raise InvalidInputError(
                f"unknown checkpoint_layers {self.config.checkpoint_layers!r}", field="checkpoint_layers", fix="use auto, on or off"
            )
        self.slots: dict[str, Slot] = {}
        self.sessions: dict[str, trainer.TrainSession] = {}
        self.samplers: dict[str, SamplerRef] = {}
        self._snapshots: dict[str, _Snapshot] = {}  # path -> snapshot adapter
        self._latest: dict[str, str] = {}  # training session -> path of its newest ephemeral snapshot
        self._names = itertools.count(1)
        self.stats = {"passes": 0, "pass_ops": 0, "sample_batches": 0, "sample_rows": 0, "oom": 0}
        self._queue: list[_Work] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="asyncsess-engine", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------------------- queue side

    def submit(self, work: _Work) -> Completion:
        with self._cv:
            if self._closed:
                raise SessionGoneError("the local engine is closed")
            self._queue.append(work)
            self._cv.notify()
        return work.done

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> Completion:
        """Queue ``fn(*args)`` to run on the engine thread, in queue order."""
        return self.submit(_Work("call", fn=lambda: fn(*args)))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.call_soon(fn, *args).wait()

    def submit_training(self, model_id: str, op: TrainingOp) -> Completion:
        return self.submit(_Work("train", model_id=model_id, op=op))

    async def sample(self, sampler_id: str, job: SampleJob) -> SampleResponse:
        ref = self._sampler(sampler_id)
        job.adapter = ref.adapter
        if ref.slot.vllm is not None and (ref.adapter == BASE or ref.slot.vllm.has(ref.adapter)):
            return await ref.slot.vllm.submit(job).wait()
        return await self.submit(_Work("sample", slot=ref.slot, job=job)).wait()

    async def logprobs(self, sampler_id: str, tokens: list[int]) -> list[float | None]:
        ref = self._sampler(sampler_id)
        return await self.submit(_Work("logprobs", slot=ref.slot, tokens=tokens, adapter=ref.adapter)).wait()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        for slot in {id(s): s for s in self.slots.values()}.values():
            if slot.vllm is not None:
                slot.vllm.close()

    # ---------------------------------------------------------------------------- the thread

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                batch, self._queue = self._queue, []
                closed = self._closed
            try:
                self._process(batch)
            except BaseException as err:  # never let the device owner die silently
                log.exception("engine batch failed")
                for w in batch:
                    w.done.set_error(self._api_error(err))
            if self._oom:  # the failed op's tensors are released by now: hand the cached blocks back
                self._oom = False
                trainer.free_memory(self.device)
            if closed and not batch:
                for w in self._queue:
                    w.done.set_error(SessionGoneError("the local engine is closed"))
                return

    def _process(self, batch: list[_Work]) -> None:
        used = [False] * len(batch)
        samples: list[_Work] = []
        for i, w in enumerate(batch):
            if used[i]:
                continue
            used[i] = True
            if w.kind in ("sample", "logprobs"):
                samples.append(w)
            elif w.kind == "call":
                self._flush_samples(samples)
                samples = []
                self._run(w, w.fn)  # type: ignore[arg-type]
            else:
                group = [w]
                if w.op.kind in ("forward", "forward_backward"):  # type: ignore[union-attr]
                    for j in range(i + 1, len(batch)):
                        x = batch[j]
                        if x.kind == "call":
                            break
                        if used[j] or x.kind != "train" or x.model_id != w.model_id:
                            continue
                        if x.op.kind != w.op.kind:  # type: ignore[union-attr]
                            break  # a barrier (or the other pass kind) for this session
                        group.append(x)
                        used[j] = True
                self._run_training(group)
        self._flush_samples(samples)

    def _api_error(self, err: BaseException) -> BaseException:
        out = _as_api_error(err)
        self._oom = self._oom or isinstance(out, ResourceExhaustedError)
        return out

    def _run(self, w: _Work, fn: Callable[[], Any]) -> None:
        try:
            w.done.set_result(fn())
        except BaseException as err:
            w.done.set_error(self._api_error(err))

    def _run_training(self, group: list[_Work]) -> None:
        model_id = group[0].model_id
        sess = self.sessions.get(model_id)  # type: ignore[arg-type]
        if sess is None:
            for w in group:
                w.done.set_error(SessionGoneError(f"training session {model_id} is stopped"))
            return
        if sess.failed is not None:
            for w in group:
                w.done.set_error(PoisonedError(f"an earlier op failed on this session: {sess.failed}", cause=sess.failed))
            return
        ops = [w.op for w in group]
        try:
            results = self._training_op(sess, ops)  # type: ignore[arg-type]
        except ResourceExhaustedError as err:  # a pass that did not fit: nothing was applied, the session lives on
            self._oom = True
            for w in group:
                w.done.set_error(ResourceExhaustedError(err.message, budget=err.budget, operation=w.op.kind, seq=w.op.seq))  # type: ignore[union-attr]
            return
        except BaseException as err:
            sess.failed = self._api_error(err)
            group[0].done.set_error(sess.failed)
            for w in group[1:]:
                w.done.set_error(PoisonedError(f"an earlier op failed on this session: {sess.failed}", cause=sess.failed))
            return
        for w, r in zip(group, results):
            w.done.set_result(r)

    def _flush_samples(self, works: list[_Work]) -> None:
        if not works:
            return
        gens = [w for w in works if w.kind == "sample"]
        for slot in {id(w.slot): w.slot for w in gens}.values():
            mine = [w for w in gens if w.slot is slot]
            parts: list[list[_Work]] = [[]]
            rows = 0
            for w in mine:  # at most max_sample_rows decoding rows per batch (one request is never split)
                n = w.job.num_samples  # type: ignore[union-attr]
                if parts[-1] and rows + n > self.config.max_sample_rows:
                    parts.append([])
                    rows = 0
                parts[-1].append(w)
                rows += n
            for part in parts:
                self.stats["sample_batches"] += 1
                self.stats["sample_rows"] += sum(w.job.num_samples for w in part)  # type: ignore[union-attr]
                self._isolated(part, lambda ws, s=slot: s.sampler.run([w.job for w in ws]))  # type: ignore[misc]
        lps = [w for w in works if w.kind == "logprobs"]
        for key in {(id(w.slot), w.adapter) for w in lps}:
            mine = [w for w in lps if (id(w.slot), w.adapter) == key]
            self._isolated(mine, lambda ws: self._score(ws[0].slot, ws[0].adapter, [w.tokens for w in ws]))  # type: ignore[arg-type,misc]

    def _isolated(self, works: list[_Work], run: Callable[[list[_Work]], list[Any]]) -> None:
        """Run ``works`` as one batch; if the batch fails, run each alone, so one bad request fails only itself."""
        try:
            outs = run(works)
        except BaseException as err:
            if len(works) == 1:
                works[0].done.set_error(self._api_error(err))
                return
            log.warning("a batch of %d requests failed (%s); running them one by one", len(works), err)
            for w in works:
                self._isolated([w], run)
            return
        for w, out in zip(works, outs):
            w.done.set_result(out)

    # ------------------------------------------------------------------- work on the thread

    def slot(self, name: str) -> Slot:
        """The loaded base model called ``name``, loading it on first use."""
        if name in self.slots:
            return self.slots[name]
        source = resolve_model(name, self.config.models)
        for s in self.slots.values():
            if s.source.path == source.path and s.source.kwargs == source.kwargs:
                self.slots[name] = s
                return s
        model = load_model(source, self.device, self.dtype)
        tokenizer = load_tokenizer(source)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else []), tokenizer.eos_token_id} - {None})
        plain = head_is_plain(model, self.device)
        layers = self._checkpointed(model)
        host = LoraHost(model, source)
        max_context = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        slot = Slot(
            name=name,
            source=source,
            host=host,
            tokenizer=tokenizer,
            sampler=TorchSampler(host, tokenizer, self.device, eos_ids),
            vocab_size=int(model.config.vocab_size),
            max_context=max_context,
            plain_head=plain,
            checkpointed_layers=layers,
        )
        if self.sampler_kind == "vllm":
            slot.vllm = self._start_vllm(source, eos_ids, max_context)
        self.slots[name] = slot
        log.info("loaded %s from %s on %s (%s, %d layers checkpointed)", name, source.path, self.device, self.dtype, layers)
        return slot

    def _checkpointed(self, model: Any) -> int:
        """Turn on activation checkpointing of the decoder layers if configured (auto: CUDA and >= 1B parameters)."""
        choice = self.config.checkpoint_layers
        if choice == "auto":
            big = sum(p.numel() for p in model.parameters()) >= CHECKPOINT_LAYERS_ABOVE
            choice = "on" if self.device.type == "cuda" and big else "off"
        return trainer.checkpoint_layers(model) if choice == "on" else 0

    def _start_vllm(self, source: ModelSource, eos_ids: list[int], max_context: int) -> VllmSampler | None:
        if source.kwargs:  # e.g. a GGUF file: vLLM gets plain model directories only
            if self.config.sampler == "vllm":
                raise InvalidInputError(f"vLLM cannot serve {source.name!r}", field="sampler", fix="use a model directory or sampler=torch")
            log.warning("sampling %s with torch: vLLM gets plain model directories only", source.name)
            return None
        return VllmSampler(
            source.path,
            dtype=self.dtype,
            max_context=max_context,
            eos_ids=eos_ids,
            options=self.config.vllm,
            device=self.device,
            fallback_staging=self.store.root,
        )

    def create_session(self, spec: TrainingSessionSpec) -> GetInfoResponse:
        meta: dict[str, Any] = {}
        ckpt: Path | None = None
        if spec.from_path:
            ckpt = self.store.resolve(spec.from_path)
            meta = self.store.meta(ckpt)
            if meta.get("kind") != "state":
                raise InvalidInputError(f"{spec.from_path} is a {meta.get('kind')} checkpoint", field="path", fix="pass a save_state path")
        base_name = spec.base_model or meta.get("base_model", "")
        slot = self.slot(base_name)
        if meta:
            rank, alpha, targets = int(meta["rank"]), float(meta["alpha"]), list(meta["targets"])
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
        if not self._vllm_takes(slot, targets) and slot.vllm is not None and slot.vllm.options.unembed == "refuse":
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
            optimizer=trainer.new_optimizer(params, fused=self.device.type == "cuda"),
        )
        try:
            if ckpt is not None:
                self._load_state(sess, ckpt, with_optimizer=spec.with_optimizer)
        except BaseException:
            slot.host.remove(adapter)
            raise
        self.sessions[model_id] = sess
        return GetInfoResponse(model_id=model_id, base_model=base_name, lora_rank=rank, lora_alpha=alpha, seed=spec.seed, step=sess.step)

    def stop_session(self, session_id: str) -> None:
        sess = self.sessions.pop(session_id, None)
        if sess is not None:
            self.slots[sess.base_model].host.remove(sess.adapter)
            self._latest.pop(session_id, None)
            self._drop_unused(session_id)
        ref = self.samplers.pop(session_id, None)
        if ref is not None and ref.path is not None and ref.path in self._snapshots:
            snap = self._snapshots[ref.path]
            snap.refs -= 1
            self._drop_unused(snap.owner, only=ref.path)

    def _drop_unused(self, owner: str | None, only: str | None = None) -> None:
        """Drop ``owner``'s snapshots that no sampler uses, except the newest one of a live session."""
        for path, snap in list(self._snapshots.items()):
            if snap.owner == owner and snap.refs == 0 and (only is None or path == only):
                if owner is None or self._latest.get(owner) != path:
                    self._drop_snapshot(path)

    def _drop_snapshot(self, path: str) -> None:
        snap = self._snapshots.pop(path)
        snap.slot.host.remove(snap.adapter)
        if snap.in_vllm:
            snap.slot.vllm.remove_adapter(snap.adapter)  # type: ignore[union-attr]

    def create_sampler(self, spec: SamplerSpec) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        if spec.model_path is None:
            self.samplers[sampler_id] = SamplerRef(self.slot(spec.base_model or ""), BASE, None)
            return sampler_id
        path = spec.model_path
        snap = self._snapshots.get(path)
        if snap is None:
            if path.startswith(EPHEMERAL):
                raise InvalidInputError(f"{path} is no longer available", field="model_path", fix="save the weights again")
            d = self.store.resolve(path)
            meta = self.store.meta(d)
            slot = self.slot(meta["base_model"])
            adapter = f"s{next(self._names)}"
            peft_dir = None if meta["kind"] == "state" else d / "adapter" if meta["kind"] == "merged" else d
            if peft_dir is None:
                from safetensors.torch import load_file

                slot.host.add(adapter, rank=int(meta["rank"]), alpha=float(meta["alpha"]), targets=list(meta["targets"]), seed=None)
                slot.host.load_state_dict(adapter, load_file(str(d / "adapter.safetensors")))
            else:
                slot.host.import_peft(adapter, peft_dir)
            snap = self._snapshots[path] = _Snapshot(slot, adapter, owner=None, lineage=meta.get("model_id", "ckpt"), peft_dir=peft_dir)
        if snap.slot.vllm is not None and not snap.in_vllm and self._vllm_takes(snap.slot, snap.slot.host.info[snap.adapter].targets):
            host, adapter = snap.slot.host, snap.adapter
            staged = self.dtype if self.dtype in (torch.bfloat16, torch.float16) else None  # what vLLM computes in
            try:
                snap.slot.vllm.add_adapter(
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
        self.samplers[sampler_id] = SamplerRef(snap.slot, snap.adapter, path)
        return sampler_id

    @staticmethod
    def _vllm_takes(slot: Slot, targets: list[str]) -> bool:
        """Whether the slot's vLLM can load an adapter on ``targets`` (an LM-head LoRA only on some models)."""
        if slot.vllm is None:
            return False
        return slot.vllm.unembed_lora or not set(targets) & set(slot.host.groups["unembed"])

    def _sampler(self, sampler_id: str) -> SamplerRef:
        ref = self.samplers.get(sampler_id)
        if ref is None:
            raise SessionGoneError(f"sampler {sampler_id} is stopped or unknown")
        return ref

    @torch.no_grad()
    def _score(self, slot: Slot, adapter: str, prompts: list[list[int]]) -> list[list[float | None]]:
        host = slot.host
        model = host.peft.get_base_model()
        seqs = [(torch.tensor(p[:-1], device=self.device), torch.tensor(p[1:], device=self.device)) for p in prompts if len(p) > 1]
        if adapter == BASE:
            host.activate_base()
        else:
            host.activate(adapter, trainable=False)
        lps = packed_logprobs(model, seqs, chunk=self.config.logprob_chunk, plain_head=slot.plain_head) if seqs else []
        it = iter(lps)
        return [[None, *next(it).tolist()] if len(p) > 1 else [None] for p in prompts]

    # ------------------------------------------------------------------------ training ops

    def _training_op(self, sess: trainer.TrainSession, ops: list[TrainingOp]) -> list[Any]:
        slot = self.slots[sess.base_model]
        kind = ops[0].kind
        if kind in ("forward", "forward_backward"):
            self.stats["passes"] += 1
            self.stats["pass_ops"] += len(ops)
            return self._fitting_pass(slot, sess, ops, backward=kind == "forward_backward")
        (op,) = ops
        if kind == "optim_step":
            return [trainer.optim_step(sess, op.adam_params)]  # type: ignore[arg-type]
        if kind == "save_state":
            return [self._save_state(sess, op)]
        if kind == "save_weights":
            return [self._save_weights(sess, op)]
        if kind == "load_state":
            self._load_state(sess, self.store.resolve(op.path or ""), with_optimizer=op.with_optimizer)
            return [LoadWeightsResponse(path=op.path or "", step=sess.step)]
        raise InvalidInputError(f"unknown op {kind!r}", field="kind")

    def _fitting_pass(self, slot: Slot, sess: trainer.TrainSession, ops: list[TrainingOp], *, backward: bool) -> list[Any]:
        """Run the pass; on running out of memory put the gradients back, halve the budget and retry."""
        lengths = [d.model_input.length for op in ops for d in op.data]
        while True:
            budget = self.token_budget
            saved = trainer.save_grads(sess) if backward else None
            try:
                return trainer.run_ops(
                    slot.host,
                    sess,
                    ops,
                    backward=backward,
                    device=self.device,
                    token_budget=budget,
                    chunk=self.config.logprob_chunk,
                    plain_head=slot.plain_head,
                )
            except BaseException as err:
                if not trainer.is_oom(err):
                    raise
                detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
            # out of the except block: the failed pass's tensors are unreachable now
            if saved is not None:
                trainer.restore_grads(sess, saved)
            del saved
            trainer.free_memory(self.device)
            self.stats["oom"] += 1
            if trainer.single_datum_batches(lengths, budget):
                raise ResourceExhaustedError(
                    f"out of device memory in {ops[0].kind} with one datum per micro-batch (token budget {budget}, "
                    f"longest datum {max(lengths)} tokens): send shorter datums, or give the trainer more memory "
                    f"(a smaller vllm_memory share, checkpoint_layers=on) [{detail}]",
                    budget=budget,
                )
            self.token_budget = max(1, budget // 2)
            log.warning("out of device memory at token budget %d: retrying at %d (%s)", budget, self.token_budget, detail)

    def _meta(self, sess: trainer.TrainSession, kind: str) -> dict[str, Any]:
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

    def _save_state(self, sess: trainer.TrainSession, op: TrainingOp) -> CheckpointResponse:
        from safetensors.torch import save_file

        host = self.slots[sess.base_model].host
        scratch, final = self.store.begin(sess.model_id, "state", op.name or f"step-{sess.step:06d}-{op.seq}")
        save_file({k: v.cpu() for k, v in host.state_dict(sess.adapter).items()}, str(scratch / "adapter.safetensors"))
        save_file(trainer.optimizer_tensors(sess), str(scratch / "optimizer.safetensors"))
        uri = self.store.commit(scratch, final, {**self._meta(sess, "state"), **_save_meta(op)})
        return CheckpointResponse(path=uri, kind="state", step=sess.step)

    def _load_state(self, sess: trainer.TrainSession, path: Path, *, with_optimizer: bool) -> None:
        from safetensors.torch import load_file

        meta = self.store.meta(path)
        if meta.get("kind") != "state":
            raise InvalidInputError(
                f"{self.store.uri(path)} is a {meta.get('kind')} checkpoint", field="path", fix="pass a save_state path"
            )
        if (int(meta["rank"]), list(meta["targets"])) != (sess.rank, sess.targets):
            raise InvalidInputError("the checkpoint's LoRA rank or targets differ from this session's", field="path")
        host = self.slots[sess.base_model].host
        host.load_state_dict(sess.adapter, load_file(str(path / "adapter.safetensors")))
        for p in sess.params.values():
            p.grad = None
        sess.step = int(meta.get("step", 0))
        if with_optimizer:
            trainer.load_optimizer_tensors(sess, load_file(str(path / "optimizer.safetensors")))
        else:
            sess.optimizer.state.clear()

    def _save_weights(self, sess: trainer.TrainSession, op: TrainingOp) -> CheckpointResponse:
        slot = self.slots[sess.base_model]
        if op.ephemeral and not op.merge_weights:
            path = f"{EPHEMERAL}{sess.model_id}/{op.seq}"
            adapter = f"s{next(self._names)}"
            slot.host.copy(sess.adapter, adapter)
            self._snapshots[path] = _Snapshot(slot, adapter, owner=sess.model_id, lineage=sess.model_id)
            self._latest[sess.model_id] = path
            self._drop_unused(sess.model_id)  # older snapshots no sampler uses any more
            return CheckpointResponse(path=path, kind="sampler", step=sess.step)
        kind = "merged" if op.merge_weights else "sampler"
        scratch, final = self.store.begin(sess.model_id, kind, op.name or f"step-{sess.step:06d}-{op.seq}")
        if op.merge_weights:
            slot.host.export_peft(sess.adapter, scratch / "adapter")
            self._write_merged(slot, scratch / "adapter", scratch)
        else:
            slot.host.export_peft(sess.adapter, scratch)
        uri = self.store.commit(scratch, final, {**self._meta(sess, kind), **_save_meta(op)})
        return CheckpointResponse(path=uri, kind=kind, step=sess.step)  # type: ignore[arg-type]

    def _write_merged(self, slot: Slot, adapter_dir: Path, out: Path) -> None:
        """A full model with the adapter merged in: a fresh copy of the base, so the live one stays untouched."""
        from peft import PeftModel

        base = load_model(slot.source, torch.device("cpu"), self.dtype)
        head = base.get_output_embeddings()
        if getattr(base.config, "tie_word_embeddings", False) and head is not None:
            # merging a LoRA on a tied LM head would also change the input embeddings: untie first
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
            base.config.tie_word_embeddings = False
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        merged.save_pretrained(str(out), safe_serialization=True)
        slot.tokenizer.save_pretrained(str(out))
