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
  then fails with :class:`ResourceExhaustedError`; the session stays usable and the lowered budget stays;
  except an ``optim_step`` skipped for a NaN/inf gradient (:class:`NonFiniteGradientError`); and except a save
  or load refused when it runs (a name that a save queued before it took; a load path gone) and a save the disk
  failed (:class:`InsufficientStorageError`): void, nothing written under its name.

State (base models, sessions, sampler snapshots: :class:`~.sessions.Sessions`) is touched only on this
thread; checkpoints are written and read by :class:`~.checkpoints.CheckpointStore`.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from typing_extensions import assert_never

from asyncsess.backends import (
    ForwardBackwardOp,
    ForwardOp,
    LoadStateOp,
    OptimStepOp,
    PassOp,
    SaveStateOp,
    SaveWeightsOp,
    TrainingOp,
    unknown_op,
)
from asyncsess.errors import (
    AsyncSessError,
    InsufficientStorageError,
    InvalidInputError,
    NonFiniteGradientError,
    PoisonedError,
    ResourceExhaustedError,
    ServerError,
    SessionGoneError,
)
from asyncsess.types import CheckpointResponse, LoadWeightsResponse, SampleResponse

from . import trainer
from .adapters import BASE
from .checkpoints import CheckpointStore
from .completion import Completion
from .logprobs import packed_logprobs
from .models import ATTENTION, pick_device, pick_dtype
from .sampler import SampleJob
from .sessions import SamplerRef, Sessions, Slot, SlotOptions
from .vllm_sampler import VllmOptions, choose_sampler

__all__ = ["Engine", "EngineConfig", "CallWork", "TrainWork", "SampleWork", "LogprobsWork", "Work"]

log = logging.getLogger("asyncsess.local")


@dataclass
class EngineConfig:
    device: str | None = None
    dtype: str | None = None
    checkpoint_dir: str | None = None
    models: dict[str, str] = field(default_factory=dict)  # name -> directory overrides
    token_budget: int = 8192  # tokens per packed training micro-batch (halved after running out of memory)
    checkpoint_layers: str = "auto"  # recompute decoder layers in backward: on, off, auto (CUDA and >= 1B parameters)
    attention: str = "auto"  # auto (grouped on the CPU, else sdpa), grouped or sdpa: see attention.py
    logprob_chunk: int = 1024  # positions per LM-head chunk
    shared_prefix: int = 16  # datums of a pass sharing >= this many leading tokens run that prefix once (0: off)
    max_sample_rows: int = 256  # rows decoded together
    sampler: str = "auto"  # torch, vllm, or auto (vllm when installed and on CUDA)
    vllm: VllmOptions = field(default_factory=VllmOptions)
    retain_snapshots: int = 0  # ephemeral sampler snapshots kept per session (0: while samplers use them); see sessions.py


# ------------------------------------------------------------------------------- the queue's items


@dataclass
class CallWork:
    """Run ``fn()`` on the engine thread (in queue order: a barrier for the samples queued before it)."""

    fn: Callable[[], Any]
    done: Completion = field(default_factory=Completion)


@dataclass
class TrainWork:
    """One ordered op of a training session."""

    model_id: str
    op: TrainingOp
    done: Completion = field(default_factory=Completion)


@dataclass
class SampleWork:
    """A generation request on a slot (batched with the others queued)."""

    slot: Slot
    job: SampleJob
    done: Completion = field(default_factory=Completion)


@dataclass
class LogprobsWork:
    """Score ``tokens`` with ``adapter`` on a slot (batched with the others on the same adapter)."""

    slot: Slot
    tokens: list[int]
    adapter: str = BASE
    done: Completion = field(default_factory=Completion)


Work = CallWork | TrainWork | SampleWork | LogprobsWork
_W = TypeVar("_W", SampleWork, LogprobsWork)


def _as_api_error(err: BaseException) -> BaseException:
    if isinstance(err, AsyncSessError):
        return err
    if trainer.is_oom(err):
        return ResourceExhaustedError(f"out of device memory: {err}")
    if isinstance(err, (ValueError, KeyError)):
        return InvalidInputError(str(err))
    return ServerError(f"{type(err).__name__}: {err}")


def _poisoned(cause: BaseException) -> PoisonedError:
    return PoisonedError(f"an earlier op failed on this session: {cause}", cause=cause)


class Engine:
    """The device thread: a queue of :data:`Work`, batched as the module docstring says. ``state`` holds
    what lives on the device (its ``slots``, ``sessions`` and ``samplers`` are also properties here)."""

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
        if self.config.attention not in ATTENTION:
            raise InvalidInputError(f"unknown attention {self.config.attention!r}", field="attention", fix=f"use {', '.join(ATTENTION)}")
        options = SlotOptions(
            device=self.device,
            dtype=self.dtype,
            sampler_kind=self.sampler_kind,
            sampler_choice=self.config.sampler,
            checkpoint_layers=self.config.checkpoint_layers,
            attention=self.config.attention,
            models=self.config.models,
            vllm=self.config.vllm,
            retain_snapshots=self.config.retain_snapshots,
        )
        self.state = Sessions(options, self.store)
        self.stats = {"passes": 0, "pass_ops": 0, "sample_batches": 0, "sample_rows": 0, "oom": 0}
        self._queue: list[Work] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="asyncsess-engine", daemon=True)
        self._thread.start()

    @property
    def slots(self) -> dict[str, Slot]:
        return self.state.slots

    @property
    def sessions(self) -> dict[str, trainer.TrainSession]:
        return self.state.sessions

    @property
    def samplers(self) -> dict[str, SamplerRef]:
        return self.state.samplers

    def slot(self, name: str) -> Slot:
        """The base model ``name``, loaded on first use (call it on the engine thread: ``await call(slot, name)``)."""
        return self.state.slot(name)

    # --------------------------------------------------------------------------- queue side

    def submit(self, work: Work) -> Completion:
        with self._cv:
            if self._closed:
                raise SessionGoneError("the local engine is closed")
            self._queue.append(work)
            self._cv.notify()
        return work.done

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> Completion:
        """Queue ``fn(*args)`` to run on the engine thread, in queue order."""
        return self.submit(CallWork(lambda: fn(*args)))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.call_soon(fn, *args).wait()

    def submit_training(self, model_id: str, op: TrainingOp) -> Completion:
        return self.submit(TrainWork(model_id, op))

    async def sample(self, sampler_id: str, job: SampleJob) -> SampleResponse:
        ref = self.state.sampler(sampler_id)
        job.adapter = ref.adapter
        if ref.slot.vllm is not None and (ref.adapter == BASE or ref.slot.vllm.has(ref.adapter)):
            return await ref.slot.vllm.submit(job).wait()
        return await self.submit(SampleWork(ref.slot, job)).wait()

    async def logprobs(self, sampler_id: str, tokens: list[int]) -> list[float | None]:
        ref = self.state.sampler(sampler_id)
        return await self.submit(LogprobsWork(ref.slot, tokens, ref.adapter)).wait()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        for slot in self.state.distinct_slots():
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

    def _process(self, batch: list[Work]) -> None:
        used = [False] * len(batch)
        samples: list[SampleWork | LogprobsWork] = []
        for i, w in enumerate(batch):
            if used[i]:
                continue
            used[i] = True
            match w:
                case SampleWork() | LogprobsWork():
                    samples.append(w)
                case CallWork(fn=fn):
                    self._flush_samples(samples)
                    samples = []
                    self._run(w, fn)
                case TrainWork():
                    self._run_training(self._pass_group(batch, used, i, w))
                case _:
                    assert_never(w)
        self._flush_samples(samples)

    @staticmethod
    def _pass_group(batch: list[Work], used: list[bool], i: int, w: TrainWork) -> list[TrainWork]:
        """``w`` and, for a pass, the same session's passes of the same kind queued after it before a barrier
        (marked used)."""
        group = [w]
        if not isinstance(w.op, PassOp):
            return group
        for j in range(i + 1, len(batch)):
            x = batch[j]
            if isinstance(x, CallWork):
                break
            if used[j] or not isinstance(x, TrainWork) or x.model_id != w.model_id:
                continue
            if type(x.op) is not type(w.op):
                break  # a barrier (or the other pass kind) for this session
            group.append(x)
            used[j] = True
        return group

    def _api_error(self, err: BaseException) -> BaseException:
        out = _as_api_error(err)
        self._oom = self._oom or isinstance(out, ResourceExhaustedError)
        return out

    def _run(self, w: Work, fn: Callable[[], Any]) -> None:
        try:
            w.done.set_result(fn())
        except BaseException as err:
            w.done.set_error(self._api_error(err))

    def _run_training(self, group: list[TrainWork]) -> None:
        model_id = group[0].model_id
        sess = self.sessions.get(model_id)
        if sess is None:
            for w in group:
                w.done.set_error(SessionGoneError(f"training session {model_id} is stopped"))
            return
        if sess.failed is not None:
            for w in group:
                w.done.set_error(_poisoned(sess.failed))
            return
        try:
            results = self._training_op(sess, [w.op for w in group])
        except InsufficientStorageError as err:  # a save the disk failed: its scratch copy removed, nothing under its name
            err.void, err.operation, err.seq = True, group[0].op.kind, group[0].op.seq
            group[0].done.set_error(err)  # a barrier runs alone
            return
        except ResourceExhaustedError as err:  # a pass that did not fit: nothing was applied, the session lives on
            self._oom = True
            for w in group:
                w.done.set_error(ResourceExhaustedError(err.message, budget=err.budget, operation=w.op.kind, seq=w.op.seq))
            return
        except NonFiniteGradientError as err:  # a skipped optim_step (a barrier, alone): nothing applied, the session lives on
            err.operation, err.seq = group[0].op.kind, group[0].op.seq
            group[0].done.set_error(err)
            return
        except BaseException as err:
            if isinstance(err, InvalidInputError) and isinstance(group[0].op, (SaveStateOp, SaveWeightsOp, LoadStateOp)):
                # checked when it was queued, refused now (a save's name taken by an op queued before it, a load's path
                # gone): saves and loads check before they write or load anything, so the op is void, nothing poisoned
                err.void = True
                group[0].done.set_error(err)  # a barrier runs alone
                return
            sess.failed = self._api_error(err)
            group[0].done.set_error(sess.failed)
            for w in group[1:]:
                w.done.set_error(_poisoned(sess.failed))
            return
        for w, r in zip(group, results):
            w.done.set_result(r)

    def _flush_samples(self, works: list[SampleWork | LogprobsWork]) -> None:
        if not works:
            return
        gens = [w for w in works if isinstance(w, SampleWork)]
        for slot in {id(w.slot): w.slot for w in gens}.values():
            mine = [w for w in gens if w.slot is slot]
            parts: list[list[SampleWork]] = [[]]
            rows = 0
            for w in mine:  # at most max_sample_rows decoding rows per batch (one request is never split)
                n = w.job.num_samples
                if parts[-1] and rows + n > self.config.max_sample_rows:
                    parts.append([])
                    rows = 0
                parts[-1].append(w)
                rows += n
            for part in parts:
                self.stats["sample_batches"] += 1
                self.stats["sample_rows"] += sum(w.job.num_samples for w in part)
                self._isolated(part, self._generate)
        lps = [w for w in works if isinstance(w, LogprobsWork)]
        for key in {(id(w.slot), w.adapter) for w in lps}:
            same = [w for w in lps if (id(w.slot), w.adapter) == key]
            self._isolated(same, lambda ws: self._score(ws[0].slot, ws[0].adapter, [w.tokens for w in ws]))

    @staticmethod
    def _generate(works: list[SampleWork]) -> list[SampleResponse]:
        """One generation for sample requests on one slot."""
        return works[0].slot.sampler.run([w.job for w in works])

    def _isolated(self, works: list[_W], run: Callable[[list[_W]], list[Any]]) -> None:
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

    def _saved(self, resp: CheckpointResponse) -> CheckpointResponse:
        """A save may have written over a checkpoint that samplers were opened on: later ones load the new one."""
        self.state.forget_checkpoint(self.store.resolve(resp.path))
        return resp

    def delete_checkpoint(self, path: str) -> None:
        """Remove a saved checkpoint directory (only under the checkpoint root); open samplers keep their weights."""
        directory = self.store.resolve(path)
        self.state.forget_checkpoint(directory)
        shutil.rmtree(directory)

    def _training_op(self, sess: trainer.TrainSession, ops: list[TrainingOp]) -> list[Any]:
        """Run ``ops`` (one barrier op, or a group of passes of one kind) on ``sess``."""
        slot = self.slots[sess.base_model]
        match ops[0]:
            case ForwardOp() | ForwardBackwardOp() as first:
                passes = [op for op in ops if isinstance(op, PassOp)]
                self.stats["passes"] += 1
                self.stats["pass_ops"] += len(passes)
                return self._fitting_pass(slot, sess, passes, backward=isinstance(first, ForwardBackwardOp))
            case OptimStepOp(adam_params=adam):
                return [trainer.optim_step(sess, adam)]
            case SaveStateOp() as op:
                return [self._saved(self.store.save_state(slot.host, sess, op))]
            case SaveWeightsOp() as op:
                if op.ephemeral:  # for samplers only: in memory, never on disk (a merged model would not be used)
                    return [self.state.snapshot(sess, op)]
                return [self._saved(self.store.save_weights(slot, sess, op, self.dtype))]
            case LoadStateOp() as op:
                self.store.load_state_op(slot.host, sess, op)
                return [LoadWeightsResponse(path=op.path, step=sess.step)]
            case _ as never:
                unknown_op(never)

    def _fitting_pass(self, slot: Slot, sess: trainer.TrainSession, ops: list[PassOp], *, backward: bool) -> list[Any]:
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
                    shared_prefix=self.config.shared_prefix,
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
