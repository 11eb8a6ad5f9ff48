"""``mock://``: the Backend driver around the numpy trainer, with seeded latency and fault injection.

Training ops of a session run through :class:`asyncsess.backends.sequencer.Sequencer` (ordered, exactly once,
poisoned after a failure). Checkpoints live in a process-wide store, so another ``ServiceClient`` in the
same process can resume from them. The introspection members (``applied_log``, ``calls``,
``weights``, ``optimizer_state``, ``open_sessions``) exist for tests.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import anyio
import numpy as np

from asyncsess.backends import (
    Backend,
    ForwardBackwardOp,
    ForwardOp,
    LoadStateOp,
    OptimStepOp,
    ParsedURL,
    SampleRequest,
    SamplerSpec,
    SaveStateOp,
    SaveWeightsOp,
    TrainingOp,
    TrainingSessionSpec,
    require_op,
    unknown_op,
)
from asyncsess.backends.sample_store import SampleStore
from asyncsess.backends.sequencer import Sequencer
from asyncsess.errors import AsyncSessError, ConflictError, InvalidInputError, NotFoundError, SessionGoneError
from asyncsess.types import (
    LOSS_FUNCTIONS,
    Checkpoint,
    CheckpointKind,
    GetInfoResponse,
    LoadWeightsResponse,
    SampleResponse,
    ServerCapabilities,
    SupportedModel,
    TrainingResult,
)
from asyncsess.validation import check_overwrite, free_name

from .checkpoints import DiskStore, StoredCheckpoint, check_name, checkpoint_path
from .faults import Faults, MockConfig
from .losses import MULTI_TARGET_LOSSES
from .model import base_table, log_softmax_table
from .sampler import MockSampler
from .tokenizer import CharTokenizer
from .trainer import MockTrainer

__all__ = ["MockBackend"]

DEFAULT_MODEL = "mock/bigram-tiny"
KEEP_CREATES = 4096  # creates remembered by idempotency key (the oldest forgotten)
_TOKENIZER = CharTokenizer()


@dataclass
class _TrainingSession:
    id: str
    seed: int | None
    trainer: MockTrainer
    faults: Faults
    sequencer: Sequencer[TrainingResult]
    rank: int = 32
    alpha: float = 32.0
    stopped: str | None = None
    ops_applied: int = 0
    before_step: np.ndarray | None = None  # D before the last optim_step (kept only for refresh faults)


@dataclass
class _Sampler:
    id: str
    sampler: MockSampler
    faults: Faults
    requests: int = 0
    base_model: str = ""
    seed: int | None = None
    delta: np.ndarray | None = None
    answers: SampleStore = field(default_factory=SampleStore)  # for retries after a lost answer, by request_id
    path: str | None = None  # the checkpoint it was made from


class MockBackend(Backend):
    """A tiny real model: bigram logits ``W[prev] + D[prev]`` over a char-level vocabulary, trained by AdamW."""

    scheme: ClassVar[str] = "mock"
    _checkpoints: ClassVar[dict[str, StoredCheckpoint]] = {}
    _open: ClassVar[dict[str, str]] = {}  # id -> "training" | "sampler", for every session not yet stopped
    _ids: ClassVar[itertools.count] = itertools.count(1)

    def __init__(self, config: MockConfig | None = None) -> None:
        self.config = config or MockConfig()
        self.tokenizer = _TOKENIZER
        self.applied_log: list[tuple[str, int, str]] = []  # (session_id, seq, kind) of every op actually applied
        self.calls: Counter[str] = Counter()  # backend method name -> number of calls
        self._sessions: dict[str, _TrainingSession] = {}
        self._samplers: dict[str, _Sampler] = {}
        self._stopped_samplers: set[str] = set()  # ids only: a stopped sampler's tables are freed
        self._models_used: dict[str, None] = {}
        self._ordinal = itertools.count()
        self._store = DiskStore(self.config.checkpoint_dir, self.tokenizer.vocab_size) if self.config.checkpoint_dir else None
        # with a store shared by processes, session ids (and so checkpoint paths) must not repeat across them
        self._id_prefix = f"{uuid.uuid4().hex[:8]}-" if self._store else ""
        self._refresh_faults: dict[str, np.ndarray] = {}  # sampler checkpoint path -> the (wrong) D its first sampler serves
        self._creates: dict[tuple[str, str], tuple[Any, Any]] = {}  # (create, idempotency_key) -> (its spec, what it made)

    @classmethod
    def from_url(cls, url: ParsedURL, **options: Any) -> MockBackend:
        return cls(MockConfig.from_url(url, options))

    # ------------------------------------------------------------------------------ introspection

    @classmethod
    def open_sessions(cls, kind: Literal["training", "sampler"] | None = None) -> list[str]:
        """Ids of sessions (and samplers) in this process that nobody stopped."""
        return [sid for sid, k in cls._open.items() if kind is None or k == kind]

    def weights(self, session_id: str) -> np.ndarray:
        """A copy of the trainable delta table ``D``."""
        return self._session(session_id).trainer.delta.copy()

    def optimizer_state(self, session_id: str) -> tuple[np.ndarray, np.ndarray, int]:
        """Copies of the AdamW moments and the step count."""
        adam = self._session(session_id).trainer.adam
        return adam.m.copy(), adam.v.copy(), adam.step

    def trainer(self, session_id: str) -> MockTrainer:
        """The live trainer behind a session (for benchmarks and white-box tests)."""
        return self._session(session_id).trainer

    # ---------------------------------------------------------------------------------- sessions

    async def capabilities(self) -> ServerCapabilities:
        self.calls["capabilities"] += 1
        v = self.tokenizer.vocab_size
        names = dict.fromkeys([DEFAULT_MODEL, *self._models_used])
        return ServerCapabilities.model_construct(
            supported_models=[
                SupportedModel.model_construct(
                    model_name=n, max_context_length=self.config.max_context, trainable=True, sampleable=True, vocab_size=v
                )
                for n in names
            ],
            loss_functions=list(LOSS_FUNCTIONS),
            max_lora_rank=256,
            max_batch_datums=1024,
            multi_target_losses=sorted(MULTI_TARGET_LOSSES),
        )

    async def create_training_session(self, spec: TrainingSessionSpec) -> GetInfoResponse:
        self.calls["create_training_session"] += 1
        return await self._once("create_training_session", spec, self._create_training_session)

    async def _once(self, kind: str, spec: Any, create: Any) -> Any:
        """``create(spec)``, or what it made for an earlier create with this ``idempotency_key`` (a retry after a lost
        reply makes no second session); the same key with another spec is a :class:`ConflictError`."""
        key = (kind, spec.idempotency_key)
        if spec.idempotency_key and key in self._creates:
            first, made = self._creates[key]
            try:
                same = bool(first == spec)
            except (ValueError, TypeError):  # another payload's arrays: not the same create
                same = False
            if not same:
                raise ConflictError(
                    f"idempotency_key {spec.idempotency_key!r} was used for another {kind}",
                    field="idempotency_key",
                    fix="use a new key for a new create, the same key only to retry the same one",
                )
            return made
        made = await create(spec)
        if spec.idempotency_key:
            self._creates[key] = (spec, made)
            while len(self._creates) > KEEP_CREATES:
                del self._creates[next(iter(self._creates))]
        return made

    async def _create_training_session(self, spec: TrainingSessionSpec) -> GetInfoResponse:
        if spec.rank < 1:
            raise InvalidInputError(f"rank={spec.rank}", field="rank", fix="use a rank >= 1")
        ckpt = None
        base_model = spec.base_model
        if spec.from_path is not None:
            ckpt = self._checkpoint(spec.from_path, "from_path", state_only=True)
            if base_model and base_model != ckpt.base_model:
                raise InvalidInputError(
                    f"{spec.from_path} was trained from {ckpt.base_model!r}, not {base_model!r}",
                    field="base_model",
                    fix="omit base_model or match it",
                )
            base_model = ckpt.base_model
        if not base_model:
            raise InvalidInputError("empty base model name", field="base_model", fix=f"e.g. {DEFAULT_MODEL!r} (any name works)")
        ordinal = next(self._ordinal)
        trainer = MockTrainer(base_model, self.tokenizer.vocab_size, self.config.max_context)
        if ckpt is not None:
            trainer.load(ckpt.delta, ckpt.adam if spec.with_optimizer else None)
        sid = f"mock-train-{self._id_prefix}{next(self._ids)}"
        # a session resumed from a checkpoint has the LoRA settings it was saved with, as on local://
        rank, alpha = (ckpt.rank, ckpt.alpha) if ckpt else (spec.rank, spec.alpha if spec.alpha is not None else 32.0)
        sess = _TrainingSession(
            id=sid,
            seed=spec.seed,
            trainer=trainer,
            faults=Faults(self.config, f"train-{ordinal}"),
            sequencer=Sequencer(functools.partial(self._apply, sid), gap_timeout=self.config.gap_timeout_s),
            rank=rank,
            alpha=float(alpha),
        )
        self._sessions[sess.id] = sess
        self._open[sess.id] = "training"
        self._models_used[base_model] = None
        return GetInfoResponse.model_construct(
            model_id=sess.id,
            base_model=base_model,
            lora_rank=sess.rank,
            lora_alpha=sess.alpha,
            seed=spec.seed,
            step=trainer.adam.step,
            user_metadata=dict(spec.user_metadata),
            session_options=dict(spec.session_options),
        )

    async def stop_session(self, session_id: str) -> None:
        self.calls["stop_session"] += 1
        if session_id in self._sessions:
            self._stop(self._sessions[session_id], "stopped by the client")
        elif session_id in self._samplers:
            handle = self._samplers.pop(session_id)
            self._stopped_samplers.add(session_id)
            self._open.pop(session_id, None)
            if handle.path is not None:
                self._drop_unused_snapshots(handle.path)
        elif session_id not in self._stopped_samplers:
            raise InvalidInputError(f"no session {session_id!r} on this backend", field="session_id")

    async def heartbeat(self, session_id: str) -> None:
        self.calls["heartbeat"] += 1
        if session_id in self._samplers or session_id in self._stopped_samplers:
            self._sampler(session_id)
        else:
            self._live_session(session_id)

    def _stop(self, sess: _TrainingSession, reason: str) -> None:
        if sess.stopped is None:
            sess.stopped = reason
            sess.sequencer.stop(reason)
        self._open.pop(sess.id, None)

    def _session(self, session_id: str) -> _TrainingSession:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise InvalidInputError(
                f"no training session {session_id!r}", field="session_id", fix="use the model_id from create_training_session"
            ) from None

    def _live_session(self, session_id: str) -> _TrainingSession:
        sess = self._session(session_id)
        if sess.stopped is not None:
            raise SessionGoneError(f"session {session_id} was {sess.stopped}")
        return sess

    # ---------------------------------------------------------------------------------- training

    async def execute_training(self, session_id: str, op: TrainingOp) -> TrainingResult:
        self.calls["execute_training"] += 1
        op = require_op(op)
        sess = self._live_session(session_id)
        await sess.faults.before(op.kind, fetch=sess.sequencer.stored(op))
        if sess.faults.duplicate():
            result = await _deliver_twice(sess.sequencer, op)
        else:
            result = await sess.sequencer.execute(op)
        sess.faults.drop_response(op.kind)
        return result

    def precheck(self, session_id: str, op: TrainingOp) -> None:
        if isinstance(op, LoadStateOp) and (sess := self._sessions.get(session_id)) is not None:
            self._loadable(sess, op.path)
        if isinstance(op, (SaveStateOp, SaveWeightsOp)) and op.name and session_id in self._sessions:
            self._save_path(session_id, op.checkpoint_kind, op.name, op)  # a free name, or overwrite=True

    def _loadable(self, sess: _TrainingSession, path: str) -> StoredCheckpoint:
        ckpt = self._checkpoint(path, "path", state_only=True)
        if ckpt.base_model != sess.trainer.base_model:
            raise InvalidInputError(
                f"{path} holds {ckpt.base_model!r}, this session trains {sess.trainer.base_model!r}",
                field="path",
                fix="load it into a training client of that base model",
            )
        return ckpt

    async def _apply(self, session_id: str, op: TrainingOp) -> TrainingResult:
        """The sequencer's executor: runs one op on the trainer, in order, once."""
        sess = self._sessions[session_id]
        try:  # again at its turn: a save whose name an op queued before it took, a load whose checkpoint was deleted
            self.precheck(session_id, op)
        except AsyncSessError as err:
            err.void = True  # refused before anything ran: the ops numbered after it run
            raise
        trainer = sess.trainer
        result: TrainingResult
        match op:
            case ForwardOp(data=data, loss_fn=loss_fn, loss_fn_config=config):
                result = trainer.forward(data, loss_fn, config)
            case ForwardBackwardOp(data=data, loss_fn=loss_fn, loss_fn_config=config):
                result = trainer.forward_backward(data, loss_fn, config)
            case OptimStepOp(adam_params=params):
                if trainer.adam.step + 1 in (self.config.drop_refresh_at, self.config.repeat_refresh_at):
                    sess.before_step = trainer.delta.copy()
                result = trainer.optim_step(params)
            case SaveStateOp() | SaveWeightsOp():
                name = op.name or self._free_name(
                    sess.id, op.checkpoint_kind, f"ephemeral-{op.seq:06d}" if op.ephemeral else f"{op.seq:06d}"
                )
                result = self._save(sess, op.checkpoint_kind, name, op).response()
            case LoadStateOp(path=path):
                ckpt = self._loadable(sess, path)
                trainer.load(ckpt.delta, ckpt.adam if op.with_optimizer else None)
                result = LoadWeightsResponse.model_construct(path=ckpt.path, step=trainer.adam.step)
            case _:
                unknown_op(op)
        self.applied_log.append((sess.id, op.seq, op.kind))
        sess.ops_applied += 1
        if self.config.stop_after_ops and sess.ops_applied >= self.config.stop_after_ops:
            self._stop(sess, f"stopped by the server after {sess.ops_applied} ops (stop_after_ops)")
        return result

    def _save(self, sess: _TrainingSession, kind: CheckpointKind, name: str, op: SaveStateOp | SaveWeightsOp) -> StoredCheckpoint:
        path = self._save_path(sess.id, kind, name, op)
        trainer = sess.trainer
        ckpt = StoredCheckpoint(
            path=path,
            session_id=sess.id,
            name=name,
            kind=kind,
            base_model=trainer.base_model,
            seed=sess.seed,
            delta=trainer.delta.copy(),
            adam=trainer.adam.copy() if kind == "state" else None,
            step=trainer.adam.step,
            time=time.time(),
            ephemeral=op.ephemeral,
            description=op.description,
            user_metadata=dict(op.user_metadata) if op.user_metadata else None,
            ttl_seconds=op.ttl_seconds,
            rank=sess.rank,
            alpha=sess.alpha,
        )
        self._checkpoints[path] = ckpt
        if self._store is not None:
            self._store.save(ckpt)
        if ckpt.ephemeral:
            self._drop_unused_snapshots(path)
        if kind == "sampler" and sess.before_step is not None and ckpt.step in (self.config.drop_refresh_at, self.config.repeat_refresh_at):
            # the injected refresh fault: the first sampler on these weights serves the wrong ones
            served = sess.before_step if ckpt.step == self.config.drop_refresh_at else 2 * ckpt.delta - sess.before_step
            self._refresh_faults[path] = served.copy()
            sess.before_step = None
        return ckpt

    def _free_name(self, session_id: str, kind: CheckpointKind, base: str) -> str:
        return free_name(base, lambda name: checkpoint_path(session_id, kind, name) in self._checkpoints)

    def _drop_unused_snapshots(self, path: str) -> None:
        """Drop the in-memory snapshots of ``path``'s session that no open sampler of this backend was made from,
        except its newest (a refresh every step would otherwise keep every step's weights for good). A sampler
        made elsewhere from a dropped path keeps its weights (``export_sampler``); the path answers "no checkpoint"."""
        owner = self._checkpoints[path].session_id if path in self._checkpoints else None
        snapshots = [p for p, c in self._checkpoints.items() if c.ephemeral and c.session_id == owner]
        used = {h.path for h in self._samplers.values()}
        for p in snapshots[:-1]:
            if p not in used:
                del self._checkpoints[p]
                self._refresh_faults.pop(p, None)
                if self._store is not None:
                    self._store.delete(p)

    def _save_path(self, session_id: str, kind: CheckpointKind, name: str, op: SaveStateOp | SaveWeightsOp) -> str:
        """Where a save of ``name`` goes; a ConflictError naming ``overwrite`` when a checkpoint is there (unless ``op.overwrite``)."""
        path = checkpoint_path(session_id, kind, check_name(name))
        check_overwrite(name, path in self._checkpoints, op.overwrite)
        return path

    def _checkpoint(self, path: str, field: str, *, state_only: bool = False) -> StoredCheckpoint:
        ckpt = self._checkpoints.get(path)
        if ckpt is None and self._store is not None:
            ckpt = self._store.load(path, field)
        if ckpt is None:
            raise NotFoundError(
                f"no checkpoint at {path!r}",
                field=field,
                fix="use a path returned by save_state / save_weights in this process (or in one with the same ?checkpoint_dir=)",
            )
        if state_only and ckpt.kind != "state":
            raise InvalidInputError(
                f"{path} holds sampler weights, not training state", field=field, fix="use a path from save_state (…/weights/…)"
            )
        return ckpt

    async def list_checkpoints(self, session_id: str | None = None) -> list[Checkpoint]:
        self.calls["list_checkpoints"] += 1
        stored = dict(self._checkpoints)
        if self._store is not None:
            for path in self._store.paths():
                if path in stored:
                    continue
                try:
                    ckpt = self._store.load(path)
                except InvalidInputError:  # a damaged file is refused when opened, not a failed listing
                    continue
                if ckpt is not None:
                    stored[path] = ckpt
        return [c.record() for c in stored.values() if not c.ephemeral and session_id in (None, c.session_id)]

    async def delete_checkpoint(self, path: str) -> None:
        self.calls["delete_checkpoint"] += 1
        on_disk = self._store is not None and self._store.delete(path)
        if self._checkpoints.pop(path, None) is None and not on_disk:
            raise NotFoundError(f"no checkpoint at {path!r}", field="path", fix="see list_checkpoints()")

    def export_sampler(self, sampler_id: str) -> dict[str, Any]:
        """The weights themselves: the process-wide store does not reach another process."""
        handle = self._sampler(sampler_id)
        return {"base_model": handle.base_model, "seed": handle.seed, "delta": handle.delta}

    # ---------------------------------------------------------------------------------- sampling

    async def create_sampler(self, spec: SamplerSpec) -> str:
        self.calls["create_sampler"] += 1
        return await self._once("create_sampler", spec, self._create_sampler)  # type: ignore[no-any-return]

    async def _create_sampler(self, spec: SamplerSpec) -> str:
        v = self.tokenizer.vocab_size
        if spec.payload is not None and (not spec.model_path or spec.model_path not in self._checkpoints):
            base_model, seed, delta = spec.payload["base_model"], spec.payload["seed"], spec.payload["delta"]
            logp = log_softmax_table(base_table(base_model, v) + (delta if delta is not None else 0.0))
        elif spec.model_path:
            ckpt = self._checkpoint(spec.model_path, "model_path")
            base_model, seed = ckpt.base_model, ckpt.seed
            delta = self._refresh_faults.pop(spec.model_path, ckpt.delta)
            logp = log_softmax_table(base_table(base_model, v) + delta)
        elif spec.base_model:
            base_model, seed, delta = spec.base_model, None, None
            logp = log_softmax_table(base_table(base_model, v))
        else:
            raise InvalidInputError("neither model_path nor base_model", field="model_path", fix="pass a saved path or a base model name")
        ordinal = next(self._ordinal)
        rng = np.random.default_rng([self.config.seed % 2**64, (seed or 0) % 2**64, ordinal])
        sampler = MockSampler(
            logp,
            self.tokenizer.pieces,
            self.tokenizer.eos_token_id,
            rng=rng,
            max_context=self.config.max_context,
            default_max_tokens=self.config.default_max_tokens,
        )
        handle = _Sampler(
            id=f"mock-sampler-{next(self._ids)}",
            sampler=sampler,
            faults=Faults(self.config, f"sampler-{ordinal}"),
            base_model=base_model,
            seed=seed,
            delta=delta,
            answers=SampleStore(self.config.keep_samples),
            path=spec.model_path,
        )
        self._samplers[handle.id] = handle
        self._open[handle.id] = "sampler"
        self._models_used[base_model] = None
        return handle.id

    def _sampler(self, sampler_id: str) -> _Sampler:
        handle = self._samplers.get(sampler_id)
        if sampler_id in self._stopped_samplers:
            raise SessionGoneError(f"sampler {sampler_id} was stopped")
        if handle is None:
            raise InvalidInputError(f"no sampler {sampler_id!r}", field="sampler_id", fix="use an id from create_sampler")
        return handle

    async def sample(self, sampler_id: str, request: SampleRequest) -> SampleResponse:
        """Sample, or answer a request_id this sampler already answered from its store (a retry after a lost answer)."""
        self.calls["sample"] += 1
        handle = self._sampler(sampler_id)
        stored = handle.answers.lookup(request)  # a reused id with another request: ConflictError, before any fault draw
        await handle.faults.before("sample", fetch=stored is not None)
        response = stored
        if response is None:
            response = handle.sampler.sample(request, handle.requests, handle.id)
            handle.requests += 1
            handle.answers.add(request, response)
        handle.faults.drop_response("sample")
        return response

    async def compute_logprobs(self, sampler_id: str, tokens: list[int]) -> list[float | None]:
        self.calls["compute_logprobs"] += 1
        handle = self._sampler(sampler_id)
        await handle.faults.before("compute_logprobs")
        result = handle.sampler.compute_logprobs(tokens)
        handle.faults.drop_response("compute_logprobs")
        return result

    def get_tokenizer(self, base_model: str) -> CharTokenizer:
        return self.tokenizer


async def _deliver_twice(sequencer: Sequencer[TrainingResult], op: TrainingOp) -> TrainingResult:
    """Hand the same op to the sequencer twice at once, as a duplicated network delivery would."""

    async def duplicate() -> None:
        with contextlib.suppress(Exception):
            await sequencer.execute(op)

    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(duplicate)
        try:
            result = await sequencer.execute(op)
        except Exception as err:
            error = err
    if error is not None:
        raise error
    return result
