"""``local://``: the engine in this process, behind the :class:`asyncsess.backends.base.Backend` protocol.

URL query (keyword options of the same names win): ``model`` (a base model to load at start: a
directory, an alias such as ``tiny-llama`` or a hub id), ``device`` (``auto``/``cpu``/``cuda``),
``dtype`` (``auto``/``float32``/``bfloat16``), ``dir`` (checkpoint root; default a fresh temp dir),
``token_budget`` (tokens per training micro-batch; halved after running out of memory),
``checkpoint_layers`` (``auto``/``on``/``off``: recompute decoder layers in backward; auto = CUDA and
>= 1B parameters), ``attention`` (``auto``: :mod:`.attention`'s grouped float32 attention on the CPU, SDPA
elsewhere; ``grouped``; ``sdpa``), ``shared_prefix`` (datums of one pass sharing at least this many leading tokens run
that prefix once; 0 = off), ``sampler`` (``auto``: vLLM when it is installed and the device is CUDA, else
torch; ``torch``; ``vllm``) and the vLLM engine's ``vllm_memory``, ``vllm_kv_cache_mb``,
``vllm_max_loras``, ``vllm_max_cpu_loras``, ``vllm_max_lora_rank``, ``vllm_max_model_len``,
``vllm_unembed`` (see :class:`VllmOptions`; the keyword option ``vllm=VllmOptions(...)`` also takes
any other engine argument), ``retain_snapshots`` (ephemeral sampler snapshots kept per training session,
0 = while samplers use them; see :mod:`.sessions`).
E.g. ``local://?model=/models/qwen3-0.6b&dir=./runs&sampler=vllm&vllm_memory=0.35``.

Every request is checked here (shapes, vocabulary, context length, loss options, paths) so bad input
fails with :class:`InvalidInputError` before it reaches the device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import anyio

from asyncsess.backends import (
    Backend,
    ForwardBackwardOp,
    ForwardOp,
    LoadStateOp,
    OptimStepOp,
    ParsedURL,
    PassOp,
    SampleRequest,
    SamplerSpec,
    SaveStateOp,
    SaveWeightsOp,
    Tokenizer,
    TrainingOp,
    TrainingSessionSpec,
    unknown_op,
)
from asyncsess.backends.sample_store import SampleStore
from asyncsess.backends.sequencer import Sequencer
from asyncsess.errors import InvalidInputError, SessionGoneError
from asyncsess.types import MAX_SEED, Checkpoint, GetInfoResponse, SampleResponse, ServerCapabilities, TrainingResult
from asyncsess.validation import check_datums, check_loss_fn, check_loss_fn_config, check_target_prompt_logprobs

from .adapters import BASE
from .completion import Completion
from .engine import Engine, EngineConfig
from .losses import MULTI_TARGET_LOSSES
from .sampler import SampleJob
from .sessions import MAX_LORA_RANK, SamplerRef, Slot
from .vllm_sampler import VllmOptions

__all__ = ["LocalBackend", "MAX_NUM_SAMPLES", "MAX_LORA_ALPHA"]

MAX_NUM_SAMPLES = 128  # samples per request
MAX_LORA_ALPHA = 1e4

KEEP_ANSWERS = 256  # answered samples each sampler keeps by request_id, for retries to fetch
INLINE_VALUES = 65_536  # an op carrying more token ids and loss inputs is checked in a worker thread


class LocalBackend(Backend):
    scheme = "local"

    def __init__(
        self,
        *,
        model: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        checkpoint_dir: str | None = None,
        token_budget: int = 8192,
        checkpoint_layers: str = "auto",
        attention: str = "auto",
        shared_prefix: int = EngineConfig.shared_prefix,
        gap_timeout: float = 60.0,
        sampler: str | None = None,
        vllm: VllmOptions | None = None,
        retain_snapshots: int = 0,
    ) -> None:
        if token_budget < 1:
            raise InvalidInputError(f"token_budget={token_budget} is out of range", field="token_budget", fix="use at least 1")
        if not 0 <= retain_snapshots < 2**31:
            raise InvalidInputError(
                f"retain_snapshots={retain_snapshots} is out of range", field="retain_snapshots", fix="use 0 (no bound) or a count >= 1"
            )
        if not 0 <= shared_prefix <= 2**31:
            raise InvalidInputError(
                f"shared_prefix={shared_prefix} is out of range", field="shared_prefix", fix="use 0 (off) or a token count"
            )
        self.default_model = model
        self._config = EngineConfig(
            device=device,
            dtype=dtype,
            checkpoint_dir=checkpoint_dir,
            token_budget=token_budget,
            checkpoint_layers=checkpoint_layers,
            attention=attention,
            shared_prefix=shared_prefix,
            sampler=sampler or "auto",
            vllm=vllm or VllmOptions(),
            retain_snapshots=retain_snapshots,
        )
        self._gap_timeout = gap_timeout
        self._engine: Engine | None = None
        self._sequencers: dict[str, Sequencer[Completion]] = {}
        self._answers: dict[str, SampleStore] = {}  # sampler -> its recent answers by request_id, for retries
        # (a retry comes at once after a lost answer, so a short memory suffices and bounds a tenant's answers)
        self._tokenizers: dict[str, Any] = {}

    @classmethod
    def from_url(cls, url: ParsedURL, **options: Any) -> LocalBackend:
        q = url.query
        return cls(
            model=options.pop("model", q.get("model") or None),
            device=options.pop("device", q.get("device") or None),
            dtype=options.pop("dtype", q.get("dtype") or None),
            checkpoint_dir=options.pop("checkpoint_dir", q.get("dir") or None),
            token_budget=options.pop("token_budget", url.get_int("token_budget", 8192)),
            checkpoint_layers=options.pop("checkpoint_layers", q.get("checkpoint_layers") or "auto"),
            attention=options.pop("attention", q.get("attention") or "auto"),
            shared_prefix=options.pop("shared_prefix", url.get_int("shared_prefix", EngineConfig.shared_prefix)),
            sampler=options.pop("sampler", q.get("sampler") or None),
            vllm=options.pop("vllm", None) or _vllm_options(url),
            retain_snapshots=options.pop("retain_snapshots", url.get_int("retain_snapshots", 0)),
        )

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(self._config)
        return self._engine

    async def open(self) -> None:
        if self.default_model:
            await self.engine.call(self.engine.state.slot, self.default_model)

    async def aclose(self) -> None:
        import anyio

        for seq in self._sequencers.values():
            seq.stop("closed")
        self._sequencers.clear()
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await anyio.to_thread.run_sync(engine.close)

    # ----------------------------------------------------------------------------- sessions

    async def capabilities(self) -> ServerCapabilities:
        if self.default_model:
            await self.engine.call(self.engine.state.slot, self.default_model)
        slots = self.engine.state.distinct_slots()
        return ServerCapabilities(
            supported_models=[s.describe() for s in slots], max_lora_rank=MAX_LORA_RANK, multi_target_losses=sorted(MULTI_TARGET_LOSSES)
        )

    async def create_training_session(self, spec: TrainingSessionSpec) -> GetInfoResponse:
        _check_session_spec(spec)
        info = await self.engine.call(self.engine.state.create_session, spec)
        self._sequencers[info.model_id] = Sequencer(
            functools.partial(self._enqueue, info.model_id), first_seq=1, gap_timeout=self._gap_timeout
        )
        return info

    async def stop_session(self, session_id: str) -> None:
        seq = self._sequencers.pop(session_id, None)
        if seq is not None:
            seq.stop("stopped")
        self._answers.pop(session_id, None)
        await self.engine.call(self.engine.state.stop_session, session_id)

    def next_seq(self, session_id: str) -> int | None:
        """The seq the session's next op must carry (None: no such session)."""
        seq = self._sequencers.get(session_id)
        return None if seq is None else seq.next_seq

    async def heartbeat(self, session_id: str) -> None:
        if session_id not in self._sequencers and session_id not in self.engine.samplers:
            raise SessionGoneError(f"session {session_id} is stopped or unknown")

    async def execute_training(self, session_id: str, op: TrainingOp) -> TrainingResult:
        seq = self._sequencers.get(session_id)
        if seq is None:
            raise SessionGoneError(f"training session {session_id} is stopped or unknown", operation=op.kind, seq=op.seq)
        done = await seq.execute(op)
        return await done.wait()

    def refuse(self, session_id: str, op: TrainingOp, error: InvalidInputError) -> None:
        """Raise ``error``, marked void: ``op``'s ``seq`` is used up without running anything, and the later ops run
        (see :meth:`Sequencer.refuse`; it returns when the seq is no longer free: then the sequencer answers ``op``)."""
        seq = self._sequencers.get(session_id)
        if seq is None:
            raise SessionGoneError(f"training session {session_id} is stopped or unknown", operation=op.kind, seq=op.seq)
        seq.refuse(op, error)

    async def _enqueue(self, session_id: str, op: TrainingOp) -> Completion:
        """Check ``op`` and queue it on the engine (the sequencer calls this in ``seq`` order); a refusal here is
        void: nothing ran."""
        try:
            checked = await self.checked(session_id, op)
        except InvalidInputError as err:
            err.void = True
            raise
        return self.engine.submit_training(session_id, checked)

    def precheck(self, session_id: str, op: TrainingOp) -> None:
        if isinstance(op, (LoadStateOp, SaveStateOp, SaveWeightsOp)) and session_id in self.engine.sessions:
            self.check_op(session_id, op)  # a load path this session can load; a save name that is free (or overwrite)

    async def checked(self, session_id: str, op: TrainingOp) -> TrainingOp:
        """:meth:`check_op`, in a worker thread for an op of more than :data:`INLINE_VALUES` values: a pass of (512, 8192)
        targets took 1.4 s to check, every tenant's event loop stalled (the worker checks an op on arrival and at its turn)."""
        if _values(op) <= INLINE_VALUES:
            return self.check_op(session_id, op)
        return await anyio.to_thread.run_sync(self.check_op, session_id, op)

    def check_op(self, session_id: str, op: TrainingOp) -> TrainingOp:
        """``op`` checked against its session (shapes, vocabulary, context, loss options, names, paths) and
        coerced; the worker calls this when the op arrives, and :meth:`refuse` takes the seq of one it refuses."""
        sess = self.engine.sessions.get(session_id)
        if sess is None:
            raise SessionGoneError(f"training session {session_id} is stopped")
        match op:
            case ForwardOp() | ForwardBackwardOp():
                return _checked_pass(op, self.engine.slots[sess.base_model])
            case OptimStepOp(adam_params=None):
                raise InvalidInputError("optim_step needs adam_params", field="adam_params", fix="pass AdamParams(learning_rate=...)")
            case OptimStepOp():
                return op
            case SaveStateOp(ephemeral=True):
                raise InvalidInputError(
                    "a save_state is durable", field="ephemeral", fix="drop ephemeral (an ephemeral save_weights snapshots for samplers)"
                )
            case SaveStateOp(name=name) | SaveWeightsOp(name=name):
                if name:
                    self.engine.store.check_name(name)
                if name and not op.ephemeral:
                    self.engine.store.target(session_id, op.checkpoint_kind, name, op.overwrite)  # free, or overwrite=True
                return op
            case LoadStateOp(path=path):
                self.engine.store.check_state(self.engine.store.resolve(path), sess)  # a resumable state this session fits
                return op
            case _:
                unknown_op(op)

    # ------------------------------------------------------------------------------ sampling

    async def create_sampler(self, spec: SamplerSpec) -> str:
        if spec.model_path is None and not spec.base_model:
            raise InvalidInputError(
                "give a model_path or a base_model", field="model_path", fix="pass the .path of a save result, or base_model"
            )
        return await self.engine.call(self.engine.state.create_sampler, spec)

    async def sample(self, sampler_id: str, request: SampleRequest) -> SampleResponse:
        ref = self.engine.state.sampler(sampler_id)
        prompt = _checked_tokens(list(request.prompt), ref.slot, "prompt")
        if not 1 <= request.num_samples <= MAX_NUM_SAMPLES:
            raise InvalidInputError(f"{request.num_samples} is out of range", field="num_samples", fix=f"use 1..{MAX_NUM_SAMPLES}")
        context = ref.slot.sample_context(ref.adapter)
        room = context - len(prompt)
        if room < 1:
            raise InvalidInputError(f"the prompt ({len(prompt)} tokens) fills the context ({context})", field="prompt", fix="shorten it")
        params = request.sampling_params
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidInputError(
                f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the context length ({context})",
                field="sampling_params.max_tokens",
                fix=f"use at most {room}",
            )
        for t in params.stop_token_ids():
            if not 0 <= t < ref.slot.vocab_size:
                raise InvalidInputError(
                    f"stop {_show_int(t)} is outside the vocabulary",
                    field="sampling_params.stop",
                    fix=f"use token ids 0..{ref.slot.vocab_size - 1}",
                )
        job = SampleJob(prompt=prompt, num_samples=request.num_samples, params=params, max_tokens=max_tokens)
        targets = check_target_prompt_logprobs(request.target_prompt_logprobs, len(prompt))  # a request built past the client
        if targets is not None and max(max(r) for r in targets) >= ref.slot.vocab_size:
            raise InvalidInputError(f"an id is outside the vocabulary [0, {ref.slot.vocab_size})", field="target_prompt_logprobs")
        answers = self._answers.get(sampler_id)
        if answers is None:  # a new sampler: forget the stores of samplers stopped another way (expiry, session end)
            self._answers = {k: v for k, v in self._answers.items() if k in self.engine.samplers}
            answers = self._answers[sampler_id] = SampleStore(KEEP_ANSWERS)
        kept = answers.lookup(request)  # a retry after a lost answer: not sampled again
        if kept is not None:
            return kept
        out = await self.engine.sample(sampler_id, job)
        if request.include_prompt_logprobs:
            out.prompt_logprobs = await self.engine.logprobs(sampler_id, prompt)
        if request.topk_prompt_logprobs or request.topk_sample_logprobs or request.target_prompt_logprobs is not None:
            await self.engine.call(self._logprob_extras, ref, prompt, request, out)
        for i, s in enumerate(out.sequences):
            s.sequence_id = f"{request.request_id or sampler_id}:{i}"
        answers.add(request, out)
        return out

    def _logprob_extras(self, ref: SamplerRef, prompt: list[int], request: SampleRequest, out: SampleResponse) -> None:
        """Top-k prompt / sample log-probs and target log-probs from full fp32 passes (on the engine thread)."""
        import numpy as np
        import torch

        from asyncsess.types import TensorData

        from .logprobs import next_token_logprobs, topk_rows

        host = ref.slot.host
        if ref.adapter == BASE:
            host.activate_base()
        else:
            host.activate(ref.adapter, trainable=False)
        model, dev = host.peft.get_base_model(), self.engine.device
        if request.topk_prompt_logprobs or request.target_prompt_logprobs is not None:
            dist = next_token_logprobs(model, prompt, dev)[:-1]  # row i-1 predicts prompt[i]
            if request.topk_prompt_logprobs:
                out.topk_prompt_logprobs = [None, *topk_rows(dist, request.topk_prompt_logprobs)]
            if request.target_prompt_logprobs is not None:
                ids = torch.tensor(request.target_prompt_logprobs, device=dev)
                picked = torch.where(ids >= 0, dist.gather(1, ids.clamp(min=0)), torch.zeros((), device=dev))
                out.target_prompt_logprobs = TensorData.from_numpy(picked.cpu().numpy().astype(np.float32), "float32")
        if request.topk_sample_logprobs:
            for seq in out.sequences:
                if not seq.tokens:
                    seq.topk_logprobs = []
                    continue
                dist = next_token_logprobs(model, prompt + seq.tokens[:-1], dev)[len(prompt) - 1 :]
                seq.topk_logprobs = topk_rows(dist, request.topk_sample_logprobs)

    async def compute_logprobs(self, sampler_id: str, tokens: list[int], *, field: str = "prompt") -> list[float | None]:
        """The log-prob of each token given those before it; a refusal names ``field`` (the worker's route: ``tokens``)."""
        ref = self.engine.state.sampler(sampler_id)
        tokens = _checked_tokens(list(tokens), ref.slot, field)
        if len(tokens) > ref.slot.max_context:
            raise InvalidInputError(
                f"{len(tokens)} tokens exceed the context length ({ref.slot.max_context})", field=field, fix="shorten it"
            )
        return await self.engine.logprobs(sampler_id, tokens)

    def get_tokenizer(self, base_model: str) -> Tokenizer:
        if base_model not in self._tokenizers:
            from .models import load_tokenizer, resolve_model

            slot = self.engine.slots.get(base_model)
            self._tokenizers[base_model] = slot.tokenizer if slot else load_tokenizer(resolve_model(base_model, self._config.models))
        return self._tokenizers[base_model]

    async def list_checkpoints(self, session_id: str | None = None) -> list[Checkpoint]:
        """Read in a worker thread: each checkpoint's metadata and file sizes (a key's 4,096 took 0.7 s of the loop)."""
        return await anyio.to_thread.run_sync(self.engine.store.list, session_id)

    async def delete_checkpoint(self, path: str) -> None:
        await self.engine.call(self.engine.delete_checkpoint, path)


def _vllm_options(url: ParsedURL) -> VllmOptions:
    kv = url.get_int("vllm_kv_cache_mb", 0)
    cpu = url.get_int("vllm_max_cpu_loras", 0)
    return VllmOptions(
        memory=url.get_float("vllm_memory", VllmOptions.memory),
        kv_cache_mb=kv or None,
        max_loras=url.get_int("vllm_max_loras", VllmOptions.max_loras),
        max_cpu_loras=cpu or None,
        max_lora_rank=url.get_int("vllm_max_lora_rank", VllmOptions.max_lora_rank),
        max_model_len=url.get_int("vllm_max_model_len", VllmOptions.max_model_len),
        unembed=url.get_str("vllm_unembed", VllmOptions.unembed),
    )


def _values(op: TrainingOp) -> int:
    """The token ids and loss inputs ``op`` carries (what checking it walks)."""
    if not isinstance(op, (ForwardOp, ForwardBackwardOp)):
        return 0
    return sum(d.model_input.length + sum(len(t.data) for t in d.loss_fn_inputs.values()) for d in op.data)


def _check_session_spec(spec: TrainingSessionSpec) -> None:
    a = spec.alpha
    if a is not None and not (isinstance(a, (int, float)) and math.isfinite(a) and 0 < a <= MAX_LORA_ALPHA):
        raise InvalidInputError(
            f"alpha {a!r} is out of range", field="alpha", fix=f"use a finite number in (0, {MAX_LORA_ALPHA:g}], or None for 2*rank"
        )
    if spec.seed is not None and not 0 <= spec.seed <= MAX_SEED:
        raise InvalidInputError(f"seed {spec.seed} is out of range", field="seed", fix=f"use 0..{MAX_SEED}")


def _show_int(t: object) -> str:
    text = f"token id {t}"
    return text if len(text) <= 40 else text[:37] + "..."


def _checked_tokens(tokens: list[int], slot: Slot, field: str) -> list[int]:
    if not tokens:
        raise InvalidInputError("is empty", field=field, fix="give at least one token")
    bad = next((t for t in tokens if not isinstance(t, int) or not 0 <= t < slot.vocab_size), None)
    if bad is not None:
        raise InvalidInputError(
            _show_int(bad) + f" is outside the vocabulary [0, {slot.vocab_size})",
            field=field,
            fix=f"use token ids 0..{slot.vocab_size - 1}",
        )
    return tokens


def _checked_pass(op: PassOp, slot: Slot) -> PassOp:
    loss_fn = check_loss_fn(op.loss_fn or "cross_entropy")
    config = check_loss_fn_config(loss_fn, op.loss_fn_config)
    data = check_datums(list(op.data), loss_fn, vocab_size=slot.vocab_size, multi_target=loss_fn in MULTI_TARGET_LOSSES)
    for i, d in enumerate(data):
        if d.model_input.length > slot.max_context:
            raise InvalidInputError(
                f"{d.model_input.length} tokens exceed the context length ({slot.max_context})",
                field=f"data[{i}].model_input",
                fix="truncate it",
            )
    return dataclasses.replace(op, data=data, loss_fn=loss_fn, loss_fn_config=config)
