"""The async clients: ServiceClient → TrainingClient → SamplingClient.

Every GPU-bound method returns an :class:`APIFuture` at call time. Training ops get their sequence
number synchronously, so call order is execution order however the futures are awaited; sampling
requests run concurrently through a bounded pool. Creating clients, refreshing samplers and stopping
are ``async def``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import uuid
import warnings
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

import anyio
import sniffio
from anyio.abc import TaskGroup

from .backend import Backend, SampleRequest, SamplerSpec, Tokenizer, TrainingOp, TrainingSessionSpec, load_backend
from .batching import chunk_datums, merge_outputs
from .custom_loss import CustomLossFn, ce_view, linearize, with_weights
from .errors import AsyncSessError, InvalidInputError, OperationCancelledError, PoisonedError, SessionGoneError
from .futures import APIFuture
from .retry import RetryEvent, RetryPolicy, call_with_retry
from .sampling import SamplingLimiter, SamplingStats
from .types import (
    AdamParams,
    Checkpoint,
    CheckpointResponse,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    ServerCapabilities,
)
from .validation import check_datums, check_loss_fn, check_loss_fn_config, coerce_adam_params, coerce_prompt, coerce_sampling_params

__all__ = ["ServiceClient", "TrainingClient", "SamplingClient"]

log = logging.getLogger("asyncsess")
DEFAULT_URL = "local://"
T = TypeVar("T")


class ServiceClient:
    """Entry point: picks a backend by URL and creates training and sampling clients.

    Use as ``async with ServiceClient("mock://") as svc: ...``; leaving the block (normally, by an
    exception or by cancellation) stops every session this client opened. Without a URL it uses
    ``$ASYNCSESS_URL``, else ``local://`` (the embedded torch worker).

    Keyword options: ``retry`` (a :class:`RetryPolicy`), ``on_retry`` (called with a
    :class:`RetryEvent` before each backoff), ``max_samples_in_flight`` / ``max_sample_bytes`` (the
    sampling pool's bounds), ``heartbeat_interval`` (seconds; 0 disables), ``max_chunk_datums`` /
    ``max_chunk_bytes`` (larger ``forward``/``forward_backward`` batches are split into consecutive ops
    and merged back); everything else goes to the backend (e.g. ``role_arn`` for SageMaker).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        retry: RetryPolicy | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        max_samples_in_flight: int = 256,
        max_sample_bytes: int = 64 * 2**20,
        heartbeat_interval: float = 10.0,
        max_chunk_datums: int = 1024,
        max_chunk_bytes: int = 5_000_000,
        **options: Any,
    ) -> None:
        self.url = url or os.environ.get("ASYNCSESS_URL") or DEFAULT_URL
        self.retry_policy = retry or RetryPolicy()
        self.retries = 0
        self._on_retry = on_retry
        self._options = options
        self._limiter = SamplingLimiter(max_samples_in_flight, max_sample_bytes)
        self._heartbeat_interval = heartbeat_interval
        self.max_chunk_datums = max_chunk_datums
        self.max_chunk_bytes = max_chunk_bytes
        self._backend: Backend | None = None
        self._tg: TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set on asyncio: op tasks are plain tasks there
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._training: weakref.WeakValueDictionary[str, TrainingClient] = weakref.WeakValueDictionary()
        self._samplers: set[str] = set()
        self._orphans: list[str] = []  # sessions whose client was garbage-collected; stopped on the next call

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> ServiceClient:
        backend = load_backend(self.url, **self._options)
        await backend.open()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._backend, self._tg = backend, tg
        if sniffio.current_async_library() == "asyncio":
            self._loop = asyncio.get_running_loop()
        if self._heartbeat_interval > 0:
            tg.start_soon(self._heartbeat_loop)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        await self.aclose()
        return None

    async def aclose(self) -> None:
        """Stop every session this client opened, then release the backend. Idempotent."""
        if self._closed or self._tg is None:
            self._closed = True
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for tc in list(self._training.values()):
                await tc._stop_quietly()
            for sid in [*self._samplers, *self._orphans]:
                await self._stop_quietly(sid)
            self._samplers.clear()
            self._orphans.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*self._tasks, return_exceptions=True)
        tg, self._tg = self._tg, None
        tg.cancel_scope.cancel()
        await tg.__aexit__(None, None, None)
        assert self._backend is not None
        with anyio.CancelScope(shield=True):
            await self._backend.aclose()

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("ServiceClient is not open: use `async with ServiceClient(url) as svc:`")
        return self._backend

    # ------------------------------------------------------------------ factories

    async def get_server_capabilities(self) -> ServerCapabilities:
        return await self._call("capabilities", self.backend.capabilities)

    async def list_base_models(self) -> list[str]:
        caps = await self.get_server_capabilities()
        return [m.model_name for m in caps.supported_models]

    async def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        alpha: float | None = None,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        """Open a LoRA training session on ``base_model``. ``alpha=None`` lets the backend choose."""
        if not isinstance(rank, int) or rank < 1:
            raise InvalidInputError(f"{rank!r} is not a positive integer", field="rank", fix="e.g. rank=32")
        if alpha is not None and alpha <= 0:
            raise InvalidInputError(f"{alpha!r} must be > 0", field="alpha", fix="e.g. alpha=2*rank, or None for the backend default")
        if not (train_mlp or train_attn or train_unembed):
            raise InvalidInputError("nothing to train", field="train_mlp/train_attn/train_unembed", fix="leave at least one True")
        spec = TrainingSessionSpec(
            base_model, rank, alpha, seed, train_mlp, train_attn, train_unembed, user_metadata=dict(user_metadata or {})
        )
        return await self._open_training(spec)

    async def create_training_client_from_state(self, path: str, base_model: str | None = None) -> TrainingClient:
        """A new session with the weights saved at ``path`` and a fresh optimizer."""
        return await self._open_training(TrainingSessionSpec(base_model or "", from_path=path, with_optimizer=False))

    async def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None) -> TrainingClient:
        """A new session resuming exactly: the weights and the optimizer state saved at ``path``."""
        return await self._open_training(TrainingSessionSpec(base_model or "", from_path=path, with_optimizer=True))

    async def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> SamplingClient:
        """A sampler on saved weights (``model_path``) or on the plain ``base_model``."""
        if (model_path is None) == (base_model is None):
            raise InvalidInputError("give exactly one of model_path and base_model", field="model_path/base_model")
        return await self._open_sampler(SamplerSpec(base_model=base_model, model_path=model_path), base_model or "")

    async def list_checkpoints(self, model_id: str | None = None) -> list[Checkpoint]:
        return await self._call("list_checkpoints", functools.partial(self.backend.list_checkpoints, model_id))

    # ------------------------------------------------------------------ internals

    async def _open_training(self, spec: TrainingSessionSpec) -> TrainingClient:
        self._require_open()
        info = await self._call("create_training_session", functools.partial(self.backend.create_training_session, spec))
        tc = TrainingClient(self, info)
        self._training[info.model_id] = tc
        return tc

    async def _open_sampler(self, spec: SamplerSpec, base_model: str) -> SamplingClient:
        self._require_open()
        sampler_id = await self._call("create_sampler", functools.partial(self.backend.create_sampler, spec))
        self._samplers.add(sampler_id)
        return SamplingClient(self, sampler_id, base_model)

    def _require_open(self) -> None:
        if self._tg is None or self._closed:
            raise RuntimeError("ServiceClient is not open: use `async with ServiceClient(url) as svc:`")
        while self._orphans:
            self._start(self._stop_quietly, self._orphans.pop())

    async def _call(self, operation: str, fn: Callable[[], Awaitable[T]], seq: int | None = None) -> T:
        return await call_with_retry(self.retry_policy, fn, operation=operation, seq=seq, on_retry=self._record_retry)

    def _record_retry(self, event: RetryEvent) -> None:
        self.retries += 1
        if self._on_retry is not None:
            self._on_retry(event)

    def _spawn(self, fut: APIFuture[T], fn: Callable[..., Awaitable[T]], *args: Any) -> APIFuture[T]:
        self._require_open()
        self._start(self._drive, fut, fn, args)
        return fut

    def _start(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Start a background task owned by this client (cancelled at close)."""
        if self._loop is not None:  # asyncio: a plain task costs ~5 µs, anyio's start_soon ~30 µs
            task: asyncio.Task[Any] = self._loop.create_task(fn(*args))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            assert self._tg is not None
            self._tg.start_soon(fn, *args)

    @staticmethod
    async def _drive(fut: APIFuture[T], fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> None:
        try:
            with anyio.CancelScope() as scope:
                fut._cancel_scope = scope
                fut._set_result(await fn(*args))
        except Exception as err:
            fut._set_exception(err)
        finally:
            if not fut.done():
                fut._set_exception(OperationCancelledError("cancelled before it finished", operation=fut.operation, seq=fut.seq))

    async def _stop_quietly(self, session_id: str) -> None:
        self._samplers.discard(session_id)
        try:
            with anyio.fail_after(30):
                await self.backend.stop_session(session_id)
        except Exception as err:  # a failed stop must not mask the caller's own error
            log.warning("could not stop session %s: %r", session_id, err)

    def _orphaned(self, session_id: str) -> None:
        """Called by a finalizer when a client is garbage-collected while its session is open."""
        self._orphans.append(session_id)

    async def _heartbeat_loop(self) -> None:
        while True:
            await anyio.sleep(self._heartbeat_interval)
            while self._orphans:  # sessions of garbage-collected clients stop within one interval
                await self._stop_quietly(self._orphans.pop())
            for tc in list(self._training.values()):
                if tc._stopped or tc._gone is not None:
                    continue
                try:
                    await self.backend.heartbeat(tc.model_id)
                except SessionGoneError as err:
                    tc._gone = err
                except Exception as err:
                    log.debug("heartbeat for %s failed: %r", tc.model_id, err)


def _warn_unclosed(svc_ref: weakref.ref[ServiceClient], session_id: str, kind: str) -> None:
    svc = svc_ref()
    if svc is None or svc._closed:
        return
    warnings.warn(f"{kind} {session_id} was garbage-collected while open; stopping its session", ResourceWarning, stacklevel=2)
    svc._orphaned(session_id)


class TrainingClient:
    """One training session (a LoRA model). Ops run in the order their methods are called."""

    def __init__(self, service: ServiceClient, info: GetInfoResponse) -> None:
        self._svc = service
        self._info = info
        self.model_id = info.model_id
        self.base_model = info.base_model
        self._next_seq = 1
        self._key_prefix = uuid.uuid4().hex  # idempotency key of op n: "<prefix>-<n>", reused on every retry
        self._inflight: dict[int, APIFuture[Any]] = {}
        self._poison: AsyncSessError | None = None
        self._gone: SessionGoneError | None = None
        self._stopped = False
        self._tokenizer: Tokenizer | None = None
        self._finalizer = weakref.finalize(self, _warn_unclosed, weakref.ref(service), info.model_id, "TrainingClient")

    def __repr__(self) -> str:
        return f"<TrainingClient {self.model_id} base={self.base_model} seq={self._next_seq - 1}>"

    async def __aenter__(self) -> TrainingClient:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.stop()

    @property
    def current_sequence_number(self) -> int:
        """The last sequence number assigned (0 before the first op)."""
        return self._next_seq - 1

    # ------------------------------------------------------------------ ordered ops

    def forward(
        self,
        data: Any,
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        loss_fn_inputs: Mapping[str, Any] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Log-probs and loss without gradients."""
        datums, config = self._check(data, loss_fn, loss_fn_config, loss_fn_inputs)
        return self._submit_batch("forward", datums, loss_fn, config)

    def forward_backward(
        self,
        data: Any,
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        loss_fn_inputs: Mapping[str, Any] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Log-probs, loss, and gradients accumulated until the next ``optim_step``."""
        datums, config = self._check(data, loss_fn, loss_fn_config, loss_fn_inputs)
        return self._submit_batch("forward_backward", datums, loss_fn, config)

    def forward_backward_custom(self, data: Any, loss_fn: CustomLossFn) -> APIFuture[ForwardBackwardOutput]:
        """Any differentiable loss of the log-probs, lowered to ``cross_entropy`` (needs torch).

        ``loss_fn(data, logprobs) -> (loss, metrics)`` receives one torch tensor of log-probs per datum.
        Two sequence numbers are reserved now, so later ops stay behind both passes.
        """
        if not callable(loss_fn):
            raise InvalidInputError("must be callable (data, logprobs) -> (loss, metrics)", field="loss_fn")
        original = self._coerce_rl_datums(data)
        forward_data = check_datums(ce_view(original), "cross_entropy")
        self._raise_if_unusable("forward_backward_custom")
        fwd = self._make_op("forward", data=forward_data, loss_fn="cross_entropy")
        bwd_seq, bwd_key = self._reserve()
        fut: APIFuture[ForwardBackwardOutput] = APIFuture("forward_backward_custom", fwd.seq)
        fut._withdrawable = False
        return self._track(fut, self._run_custom, original, fwd, bwd_seq, bwd_key, loss_fn)

    def optim_step(self, adam_params: AdamParams | Mapping[str, float] | None = None) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradients with AdamW."""
        return self._submit("optim_step", adam_params=coerce_adam_params(adam_params))

    def save_state(
        self, name: str | None = None, *, description: str | None = None, ttl_seconds: int | None = None
    ) -> APIFuture[CheckpointResponse]:
        """Save weights + optimizer state (resumable). ``description`` is SageMaker's spelling."""
        return self._submit("save_state", name=name or description)

    def save_weights_for_sampler(
        self, name: str | None = None, merge_weights: bool = False, *, description: str | None = None, ttl_seconds: int | None = None
    ) -> APIFuture[CheckpointResponse]:
        """Save weights for sampling/export; ``merge_weights=True`` also writes a merged full model."""
        return self._submit("save_weights", name=name or description, merge_weights=merge_weights)

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Load weights from ``path`` and reset the optimizer."""
        return self._submit("load_state", path=_check_path(path), with_optimizer=False)

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Load weights and optimizer state from ``path``."""
        return self._submit("load_state", path=_check_path(path), with_optimizer=True)

    # ------------------------------------------------------------------ samplers and info

    async def save_weights_and_get_sampling_client(self, name: str | None = None, merge_weights: bool = False) -> SamplingClient:
        """Snapshot the current weights (an ordered op) and return a sampler on them."""
        saved = await self._submit("save_weights", name=name, merge_weights=merge_weights, ephemeral=name is None)
        return await self._svc._open_sampler(SamplerSpec(model_path=saved.path), self.base_model)

    async def create_sampling_client(self, model_path: str | None = None) -> SamplingClient:
        """A sampler on ``model_path``, or on the current weights when no path is given."""
        if model_path is None:
            return await self.save_weights_and_get_sampling_client()
        return await self._svc._open_sampler(SamplerSpec(model_path=_check_path(model_path)), self.base_model)

    def get_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = self._svc.backend.get_tokenizer(self.base_model)
        return self._tokenizer

    def get_info(self) -> GetInfoResponse:
        return self._info

    async def stop(self) -> None:
        """Stop the session. Idempotent; ops still queued fail with ``SessionGoneError``."""
        await self._stop_quietly()

    async def _stop_quietly(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._finalizer.detach()
        self._svc._training.pop(self.model_id, None)
        await self._svc._stop_quietly(self.model_id)

    # ------------------------------------------------------------------ internals

    def _encode_or_none(self) -> Callable[[str], list[int]] | None:
        return lambda text: self.get_tokenizer().encode(text)

    def _check(
        self, data: Any, loss_fn: str, config: Mapping[str, float] | None, shared: Mapping[str, Any] | None
    ) -> tuple[tuple[Datum, ...], dict[str, float] | None]:
        check_loss_fn(loss_fn)
        cfg = check_loss_fn_config(loss_fn, config)
        return check_datums(data, loss_fn, shared_inputs=shared, encode=self._encode_or_none()), cfg

    def _coerce_rl_datums(self, data: Any) -> tuple[Datum, ...]:
        """Datums for a custom loss: anything with ``target_tokens`` (other keys are passed to the loss fn)."""
        if isinstance(data, Datum):
            data = [data]
        out = []
        for i, d in enumerate(data):
            d = d if isinstance(d, Datum) else Datum.model_validate(d)
            if "target_tokens" not in d.loss_fn_inputs:
                raise InvalidInputError("needs target_tokens", field=f"data[{i}].loss_fn_inputs", fix="add target_tokens")
            out.append(d)
        if not out:
            raise InvalidInputError("expected a non-empty list of datums", field="data")
        return tuple(out)

    def _raise_if_unusable(self, operation: str) -> None:
        if self._stopped:
            raise SessionGoneError("this TrainingClient was stopped", operation=operation)
        if self._gone is not None:
            raise self._gone
        if self._svc._closed:
            raise SessionGoneError("the ServiceClient is closed", operation=operation)

    def _reserve(self) -> tuple[int, str]:
        seq = self._next_seq
        self._next_seq += 1
        return seq, f"{self._key_prefix}-{seq}"

    def _make_op(self, kind: Any, **fields: Any) -> TrainingOp:
        seq, key = self._reserve()
        return TrainingOp(kind=kind, seq=seq, idempotency_key=key, **fields)

    def _submit(self, kind: Any, **fields: Any) -> APIFuture[Any]:
        self._raise_if_unusable(kind)
        op = self._make_op(kind, **fields)
        fut: APIFuture[Any] = APIFuture(kind, op.seq)
        fut._withdrawable = False  # an ordered op keeps its place once numbered
        return self._track(fut, self._run_op, op)

    def _submit_batch(
        self, kind: Any, datums: tuple[Datum, ...], loss_fn: str, config: dict[str, float] | None
    ) -> APIFuture[ForwardBackwardOutput]:
        """One op, or consecutive ops for a batch over the chunk limits, merged into one future."""
        chunks = chunk_datums(datums, self._svc.max_chunk_datums, self._svc.max_chunk_bytes)
        if len(chunks) == 1:
            return self._submit(kind, data=datums, loss_fn=loss_fn, loss_fn_config=config)
        parts = [self._submit(kind, data=c, loss_fn=loss_fn, loss_fn_config=config) for c in chunks]
        fut: APIFuture[ForwardBackwardOutput] = APIFuture(kind, parts[0].seq)
        fut._withdrawable = False
        return self._svc._spawn(fut, _merge_parts, parts)

    def _track(self, fut: APIFuture[T], fn: Callable[..., Awaitable[T]], *args: Any) -> APIFuture[T]:
        assert fut.seq is not None
        if self._poison is not None:
            fut._set_exception(
                PoisonedError(f"an earlier op failed: {self._poison}", cause=self._poison, operation=fut.operation, seq=fut.seq)
            )
            return fut
        self._inflight[fut.seq] = fut
        fut.add_done_callback(lambda f: self._inflight.pop(f.seq, None))  # type: ignore[arg-type]
        return self._svc._spawn(fut, fn, *args)

    async def _run_op(self, op: TrainingOp) -> Any:
        try:
            return await self._svc._call(op.kind, functools.partial(self._svc.backend.execute_training, self.model_id, op), seq=op.seq)
        except PoisonedError:
            raise
        except Exception as err:
            if isinstance(err, AsyncSessError) and err.request_id is None:
                err.request_id = op.idempotency_key
            self._poison_after(op.seq, err)
            raise

    async def _run_custom(
        self, original: tuple[Datum, ...], fwd: TrainingOp, bwd_seq: int, bwd_key: str, loss_fn: CustomLossFn
    ) -> ForwardBackwardOutput:
        try:
            forward = await self._run_op(fwd)
            loss, metrics, weights = linearize(original, forward, loss_fn)
        except Exception as err:  # the reserved backward number can never be filled: poison
            self._poison_after(fwd.seq, err)
            raise
        bwd = TrainingOp(
            kind="forward_backward", seq=bwd_seq, idempotency_key=bwd_key, data=with_weights(fwd.data, weights), loss_fn="cross_entropy"
        )
        out: ForwardBackwardOutput = await self._run_op(bwd)
        return ForwardBackwardOutput.model_construct(
            loss_fn_output_type=out.loss_fn_output_type,
            loss_fn_outputs=forward.loss_fn_outputs,
            metrics={**out.metrics, **metrics, "loss:sum": loss, "surrogate_loss:sum": out.metrics.get("loss:sum", 0.0)},
            usage=forward.usage + out.usage,
        )

    def _poison_after(self, seq: int, err: Exception) -> None:
        """Op ``seq`` failed for good: fail every later op of this client with the cause."""
        if isinstance(err, SessionGoneError):
            self._gone = err
        if self._poison is None:
            self._poison = err if isinstance(err, AsyncSessError) else AsyncSessError(repr(err), seq=seq)
        for later_seq, fut in sorted(self._inflight.items()):
            if later_seq > seq and not fut.done():
                fut._set_exception(PoisonedError(f"op {seq} failed earlier: {err}", cause=err, operation=fut.operation, seq=later_seq))
                if fut._cancel_scope is not None:
                    fut._cancel_scope.cancel()


async def _merge_parts(parts: list[APIFuture[ForwardBackwardOutput]]) -> ForwardBackwardOutput:
    return merge_outputs([await p for p in parts])


def _check_path(path: Any) -> str:
    if not isinstance(path, str) or "://" not in path and not path.startswith("arn:"):
        raise InvalidInputError(
            f"{path!r} is not a checkpoint path", field="path", fix="pass the .path of a save_state/save_weights result"
        )
    return path


class SamplingClient:
    """Samples from one set of weights. Requests are concurrent, bounded by the client's pool."""

    def __init__(self, service: ServiceClient, sampler_id: str, base_model: str) -> None:
        self._svc = service
        self.sampler_id = sampler_id
        self.base_model = base_model
        self._limiter = service._limiter
        self._finalizer = weakref.finalize(self, _release_sampler, weakref.ref(service), sampler_id)

    def __repr__(self) -> str:
        return f"<SamplingClient {self.sampler_id}>"

    async def __aenter__(self) -> SamplingClient:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.stop()

    def sample(
        self,
        prompt: ModelInput | list[int] | str,
        num_samples: int = 1,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> APIFuture[SampleResponse]:
        """Draw ``num_samples`` continuations of ``prompt``."""
        tokens = coerce_prompt(prompt, self._encode)
        if not isinstance(num_samples, int) or not 1 <= num_samples <= 1000:
            raise InvalidInputError(f"{num_samples!r} is out of range", field="num_samples", fix="an int in 1..1000")
        if topk_prompt_logprobs:
            raise InvalidInputError("top-k prompt log-probs are not supported", field="topk_prompt_logprobs", fix="leave it 0")
        request = SampleRequest(
            tuple(tokens), num_samples, coerce_sampling_params(sampling_params), include_prompt_logprobs, uuid.uuid4().hex
        )
        fut: APIFuture[SampleResponse] = APIFuture("sample")
        return self._svc._spawn(
            fut, self._run, "sample", len(tokens), functools.partial(self._svc.backend.sample, self.sampler_id, request)
        )

    def compute_logprobs(self, prompt: ModelInput | list[int] | str) -> APIFuture[list[float | None]]:
        """Log-prob of each prompt token given the ones before it; the first is ``None``."""
        tokens = coerce_prompt(prompt, self._encode)
        fut: APIFuture[list[float | None]] = APIFuture("compute_logprobs")
        return self._svc._spawn(
            fut, self._run, "compute_logprobs", len(tokens), functools.partial(self._svc.backend.compute_logprobs, self.sampler_id, tokens)
        )

    def stats(self) -> SamplingStats:
        """Backpressure figures of the pool this client shares with its ServiceClient."""
        return self._limiter.stats()

    def get_tokenizer(self) -> Tokenizer:
        return self._svc.backend.get_tokenizer(self.base_model)

    def get_base_model(self) -> str:
        return self.base_model

    async def stop(self) -> None:
        """Release the sampler. Idempotent."""
        self._finalizer.detach()
        await self._svc._stop_quietly(self.sampler_id)

    def _encode(self, text: str) -> list[int]:
        return self.get_tokenizer().encode(text)

    async def _run(self, operation: str, ntokens: int, call: Callable[[], Awaitable[T]]) -> T:
        nbytes = 8 * ntokens
        await self._limiter.acquire(nbytes)
        try:
            return await self._svc._call(operation, call)
        finally:
            self._limiter.release(nbytes)


_request_ids = itertools.count(1)
_request_prefix = uuid.uuid4().hex[:12]


def _request_id() -> str:
    return f"{_request_prefix}-{next(_request_ids)}"


def _release_sampler(svc_ref: weakref.ref[ServiceClient], sampler_id: str) -> None:
    svc = svc_ref()
    if svc is not None and not svc._closed and sampler_id in svc._samplers:
        svc._samplers.discard(sampler_id)
        svc._orphaned(sampler_id)
