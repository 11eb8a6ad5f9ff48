"""The async clients: ServiceClient → TrainingClient → SamplingClient.

Every GPU-bound method returns an :class:`APIFuture` at call time. Training ops get their sequence
number synchronously, so call order is execution order however the futures are awaited; sampling
requests run concurrently through a bounded pool. Creating clients, refreshing samplers and stopping
are ``async def``.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import os
import pickle
import time
import uuid
import warnings
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import sniffio

from .backends import (
    Backend,
    ForwardBackwardOp,
    ForwardOp,
    LoadStateOp,
    OptimStepOp,
    SampleRequest,
    SamplerSpec,
    SaveStateOp,
    SaveWeightsOp,
    Tokenizer,
    TrainingOp,
    TrainingSessionSpec,
    load_backend,
)
from .batching import chunk_datums, merge_outputs
from .custom_loss import CustomLossFn, ce_view, linearize, with_weights
from .errors import (
    APIResponseValidationError,
    AsyncSessError,
    ClientClosedError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
    OperationCancelledError,
    OperationError,
    PoisonedError,
    ResultMismatchError,
    SessionGoneError,
    UnsupportedError,
    WrongEventLoopError,
    poisons,
)
from .futures import APIFuture, loop_token
from .retry import RetryBudget, RetryEvent, RetryPolicy, call_with_retry
from .sampling import QueueState, SamplingLimiter, SamplingStats
from .types import (
    AdamParams,
    Checkpoint,
    CheckpointResponse,
    CheckpointsListResponse,
    Cursor,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    ModelInput,
    ModelPackageDeletion,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    ServerCapabilities,
    SessionSummary,
    TensorData,
    TrainingRun,
    TrainingRunsResponse,
)
from .validation import (
    MAX_SAMPLES,
    MAX_TOPK,
    check_base_model,
    check_bound,
    check_checkpoint_path,
    check_count,
    check_datums,
    check_description,
    check_lora_rank,
    check_loss_fn,
    check_loss_fn_config,
    check_overwrite,
    check_record_stability_info,
    check_seed,
    check_session_options,
    check_target_prompt_logprobs,
    check_timeout,
    check_ttl_seconds,
    check_user_metadata,
    coerce_adam_params,
    coerce_datums,
    coerce_prompt,
    coerce_sampling_params,
    split_name_and_description,
)

__all__ = ["ServiceClient", "TrainingClient", "SamplingClient", "SamplerHandle", "RestClient"]

log = logging.getLogger("asyncsess")
QUEUE_STATE_LOG_INTERVAL = 60  # seconds between two "sampling is paused" warnings of one SamplingClient (Tinker's)
DEFAULT_URL = "local://"
MIN_HEARTBEAT_INTERVAL = 0.01  # seconds; tests beat every 0.02 s
T = TypeVar("T")
Op = TypeVar("Op", bound=TrainingOp)
Spec = TypeVar("Spec", TrainingSessionSpec, SamplerSpec)


class ServiceClient:
    """Entry point: picks a backend by URL and creates training and sampling clients.

    Use as ``async with ServiceClient("mock://") as svc: ...``; leaving the block (normally, by an
    exception or by cancellation) stops every session this client opened. Without a URL it uses
    ``$ASYNCSESS_URL``, else ``local://`` (the embedded torch worker).

    Keyword options: ``retry`` (a :class:`RetryPolicy`), ``on_retry`` (called with a
    :class:`RetryEvent` before each backoff), ``max_samples_in_flight`` / ``max_sample_bytes`` (the
    sampling pool's bounds), ``heartbeat_interval`` (seconds; 0 disables), ``max_chunk_datums`` /
    ``max_chunk_bytes`` (larger ``forward``/``forward_backward`` batches are split into consecutive ops
    and merged back; the four bounds are whole numbers >= 1, checked here), ``backend`` (an already-open
    :class:`Backend` to use instead of loading one from the URL: a server hosting several doors shares one;
    its owner opens and closes it); everything else goes to the backend (e.g. ``role_arn`` for SageMaker).
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
        backend: Backend | None = None,
        **options: Any,
    ) -> None:
        self.url = url or os.environ.get("ASYNCSESS_URL") or DEFAULT_URL
        self._given = backend  # an open backend its owner keeps (a server's): neither opened nor closed here
        self.retry_policy = retry or RetryPolicy()
        self.retry_budget = RetryBudget()  # shared by this client's calls: when a first retry may skip its backoff
        self.retries = 0
        self._on_retry = on_retry
        self._options = options
        self._limiter = SamplingLimiter(
            check_bound(max_samples_in_flight, "max_samples_in_flight"), check_bound(max_sample_bytes, "max_sample_bytes")
        )
        fix = f"give seconds >= {MIN_HEARTBEAT_INTERVAL}, or 0 for no heartbeat"
        every = check_timeout(heartbeat_interval, "heartbeat_interval", fix=fix)
        if every is not None and 0 < every < MIN_HEARTBEAT_INTERVAL:  # the loop would never sleep, touching every session
            raise InvalidInputError(f"{every!r:.40} s is too short a heartbeat", field="heartbeat_interval", fix=fix)
        self._heartbeat_interval = 0.0 if every is None else every  # None or inf: never
        self.max_chunk_datums = check_bound(max_chunk_datums, "max_chunk_datums")
        self.max_chunk_bytes = check_bound(max_chunk_bytes, "max_chunk_bytes")
        self._backend: Backend | None = None
        self._opened = False
        self._opening: anyio.Event | None = None  # set while a first call opens the client (Tinker's style, no `async with`)
        self._loop: asyncio.AbstractEventLoop | None = None  # set on asyncio: op tasks are plain tasks there
        self._owner: object = None  # the event loop (asyncio) or run (trio's token) that opened this client
        self._pid = 0  # the process that opened it
        self._tasks: set[asyncio.Task[Any]] = set()
        self._scopes: set[anyio.CancelScope] = set()  # trio: one per running task of this client
        self._idle: anyio.Event | None = None  # trio: set when the last of them ends, once close waits for that
        self._closed = False
        self._training: weakref.WeakValueDictionary[str, TrainingClient] = weakref.WeakValueDictionary()
        self._samplers: set[str] = set()
        self._orphans: list[str] = []  # sessions whose client was garbage-collected; stopped on the next call
        self._known: dict[str, SessionSummary] = {}  # every session this client opened, for list_sessions
        self._caps: ServerCapabilities | None = None
        self.close_status: str | None = None  # set by close(status, detail): why the run ended
        self.close_detail: str | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> ServiceClient:
        if self._opened or self._closed:
            state = "is already open" if not self._closed else "was closed"
            raise ClientClosedError(f"this ServiceClient {state}: a ServiceClient opens once; make a new one for another block")
        backend = self._given
        if backend is None:
            backend = load_backend(self.url, **self._options)
            await backend.open()
        self._backend, self._opened = backend, True
        self._owner, self._pid = loop_token(), os.getpid()
        if sniffio.current_async_library() == "asyncio":
            self._loop = asyncio.get_running_loop()
        if self._heartbeat_interval > 0:
            self._start(self._heartbeat_loop)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        await self.aclose()
        return None

    async def _ensure_open(self) -> None:
        """Open on the first call when no ``async with`` did (Tinker's ``svc = ServiceClient()`` then awaited factories);
        concurrent first calls open it once. Such a client stops its sessions at ``close()`` / ``aclose()``."""
        while not (self._opened or self._closed):
            if self._opening is not None:
                await self._opening.wait()
                continue
            self._opening = anyio.Event()
            try:
                await self.__aenter__()
            finally:
                self._opening.set()
                self._opening = None

    async def aclose(self) -> None:
        """Stop every session this client opened, end its tasks (their futures fail with
        :class:`OperationCancelledError`), then release the backend. Idempotent; callable from any task of the loop
        that opened the client (the client holds no task group of its caller's)."""
        if not self._closed and self._opened:
            self._check_loop("aclose")
        if self._closed or not self._opened:
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
                await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._scopes:
                self._idle = anyio.Event()
                for scope in list(self._scopes):
                    scope.cancel()
                await self._idle.wait()
            assert self._backend is not None
            if self._given is None:
                await self._backend.aclose()

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise ClientClosedError(self._not_open())
        return self._backend

    # ------------------------------------------------------------------ factories

    def get_telemetry(self) -> None:
        """Tinker's telemetry handle: always ``None`` (what Tinker returns with telemetry off); asyncsess collects none."""
        return None

    async def get_server_capabilities(self) -> ServerCapabilities:
        await self._ensure_open()
        return await self._call("capabilities", self.backend.capabilities)

    async def list_base_models(self) -> list[str]:
        caps = await self.get_server_capabilities()
        return [m.model_name for m in caps.supported_models]

    async def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool | None = True,
        train_attn: bool | None = True,
        train_unembed: bool | None = None,
        user_metadata: Mapping[str, str] | None = None,
        optimizer: Any = None,
        *,
        alpha: float | None = None,
        training_session_name: str | None = None,
        model_package_group_arn: str | None = None,
        s3_output_path: str | None = None,
        kms_key_arn: str | None = None,
        vpc_config: Mapping[str, Any] | None = None,
    ) -> TrainingClient:
        """Open a LoRA training session on ``base_model``. ``alpha=None`` lets the backend choose.

        Takes both anchors' parameters: Tinker's (positional order as in ``tinker``) and SageMaker's
        per-call session options, which ``sagemaker://`` sends and other backends record in
        ``get_info().session_options``.
        """
        check_lora_rank(rank)
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf")):
            raise InvalidInputError(f"{alpha!r} must be > 0", field="alpha", fix="e.g. alpha=2*rank, or None for the backend default")
        check_seed(seed)
        mlp, attn, unembed = (  # SageMaker: None = default; "false" was truthy (the worker over http:// refused it)
            True if f is None else _check_bool(f, name)
            for f, name in ((train_mlp, "train_mlp"), (train_attn, "train_attn"), (train_unembed, "train_unembed"))
        )
        if not (mlp or attn or unembed):
            raise InvalidInputError("nothing to train", field="train_mlp/train_attn/train_unembed", fix="leave at least one True")
        check_base_model(base_model)
        options = check_session_options(
            {
                "training_session_name": training_session_name,
                "model_package_group_arn": model_package_group_arn,
                "s3_output_path": s3_output_path,
                "kms_key_arn": kms_key_arn,
                "vpc_config": vpc_config,
                "optimizer": optimizer,
            }
        )
        spec = TrainingSessionSpec(
            base_model,
            rank,
            alpha,
            seed,
            train_mlp=mlp,
            train_attn=attn,
            train_unembed=unembed,
            user_metadata=check_user_metadata(user_metadata),
            session_options=options,
        )
        return await self._open_training(spec)

    async def create_lora_training_client_async(self, base_model: str, **kwargs: Any) -> TrainingClient:
        """SageMaker's spelling of :meth:`create_lora_training_client` (already async here)."""
        return await self.create_lora_training_client(base_model, **kwargs)

    async def create_training_client_from_state(
        self,
        path: str | None = None,
        base_model: str | None = None,
        user_metadata: Mapping[str, str] | None = None,
        weights_access_token: str | None = None,
        optimizer: Any = None,
        *,
        model_package_arn: str | None = None,
        **session_options: Any,
    ) -> TrainingClient:
        """A new session with the weights saved at ``path`` and a fresh optimizer.

        ``model_package_arn`` is SageMaker's name for ``path``; ``session_options`` are the ones
        :meth:`create_lora_training_client` takes (``rank``, ``alpha``, ``training_session_name``, ...).
        """
        spec = self._from_state_spec(path, model_package_arn, base_model, user_metadata, optimizer, session_options, False)
        return await self._open_training(spec)

    async def create_training_client_from_state_with_optimizer(
        self,
        path: str | None = None,
        base_model: str | None = None,
        user_metadata: Mapping[str, str] | None = None,
        weights_access_token: str | None = None,
        *,
        model_package_arn: str | None = None,
        **session_options: Any,
    ) -> TrainingClient:
        """A new session resuming exactly: the weights and the optimizer state saved at ``path``."""
        spec = self._from_state_spec(path, model_package_arn, base_model, user_metadata, None, session_options, True)
        return await self._open_training(spec)

    async def create_sampling_client_async(self, model_path: str | None = None, *args: Any, **kwargs: Any) -> SamplingClient:
        """The anchors' spelling of :meth:`create_sampling_client`."""
        return await self.create_sampling_client(model_path, *args, **kwargs)

    async def get_server_capabilities_async(self) -> ServerCapabilities:
        return await self.get_server_capabilities()

    async def create_training_client_from_state_async(self, path: str | None = None, **kwargs: Any) -> TrainingClient:
        """SageMaker's spelling of :meth:`create_training_client_from_state`."""
        return await self.create_training_client_from_state(path, **kwargs)

    async def create_training_client_from_state_with_optimizer_async(self, path: str | None = None, **kwargs: Any) -> TrainingClient:
        """SageMaker's spelling of :meth:`create_training_client_from_state_with_optimizer`."""
        return await self.create_training_client_from_state_with_optimizer(path, **kwargs)

    async def create_sampling_client(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
        *,
        model_package_arn: str | None = None,
    ) -> SamplingClient:
        """A sampler on saved weights (``model_path``, SageMaker: ``model_package_arn``) or on the plain ``base_model``.

        ``retry_config`` (Tinker) is accepted and ignored: retries follow this ServiceClient's ``retry`` policy.
        ``record_stability_info=True`` (Tinker's records for ``stable_reinforce``, which is not public) is refused
        with :class:`UnsupportedError` naming it.
        """
        check_record_stability_info(record_stability_info)
        if model_path is not None and model_package_arn is not None:
            raise InvalidInputError("give model_path or model_package_arn, not both", field="model_package_arn")
        model_path = model_path if model_path is not None else model_package_arn
        if (model_path is None) == (base_model is None):
            raise InvalidInputError("give exactly one of model_path and base_model", field="model_path/base_model")
        if model_path is not None:
            model_path = check_checkpoint_path(model_path, "model_path")
        else:
            check_base_model(base_model)
        return await self._open_sampler(SamplerSpec(base_model=base_model, model_path=model_path), base_model or "")

    async def list_checkpoints(self, model_id: str | None = None) -> list[Checkpoint]:
        """Saved checkpoints, of one training session or of all (newest first)."""
        await self._ensure_open()
        found = await self._call("list_checkpoints", functools.partial(self.backend.list_checkpoints, model_id))
        return sorted(found, key=lambda c: c.time, reverse=True)

    # ------------------------------------------------------------------ sessions and checkpoints (admin)

    async def close(self, status: str = "success", detail: str | None = None) -> None:
        """Tinker's ``close(status, detail)``: record why the run ended, then stop every session. First reason wins."""
        if status not in ("success", "errored", "interrupted"):
            raise InvalidInputError(f"{status!r} is not a status", field="status", fix="success, errored or interrupted")
        if detail is not None:
            check_description(detail, field="detail")
        if self.close_status is None:
            self.close_status, self.close_detail = status, detail
        await self.aclose()

    async def list_sessions(
        self, *, name_contains: str | None = None, status_equals: str | None = None, max_results: int | None = None
    ) -> list[SessionSummary]:
        """Sessions this ServiceClient opened (training and sampling), newest first."""
        rows = sorted(self._known.values(), key=lambda r: r.creation_time, reverse=True)
        rows = [r for r in rows if (name_contains is None or name_contains in r.session_id) and status_equals in (None, r.status)]
        return rows[: check_count(max_results, "max_results", low=1, high=10**6)] if max_results is not None else rows

    async def describe_session(self, training_session: str) -> SessionSummary:
        """The summary of one session this ServiceClient opened (by id, name or ARN)."""
        row = self._known.get(training_session) if isinstance(training_session, str) else None
        if row is None:
            raise NotFoundError(
                f"no session {training_session!r} was opened by this client", field="training_session", fix="see list_sessions()"
            )
        return row

    async def stop_session(self, training_session: str) -> None:
        """Stop a session. Idempotent."""
        row = await self.describe_session(training_session)
        tc = self._training.get(row.session_id)
        if tc is not None:
            await tc.stop()
        else:
            await self._stop_quietly(row.session_id)
        self._mark(row.session_id, "Stopped")

    async def delete_session(self, training_session: str, *, stop_if_active: bool = False) -> None:
        """Forget a stopped session (``stop_if_active=True`` stops a running one first)."""
        row = await self.describe_session(training_session)
        if row.status == "Running":
            if not _check_bool(stop_if_active, "stop_if_active"):
                raise ConflictError(
                    f"session {training_session} is running", field="training_session", fix="stop it first, or pass stop_if_active=True"
                )
            await self.stop_session(training_session)
        self._mark(row.session_id, "Deleted")

    async def list_model_packages(
        self, *, kind: str | None = None, model_package_group_arn: str | None = None, max_results: int = 10
    ) -> list[Checkpoint]:
        """SageMaker's name for the checkpoint list: newest first, ``kind`` ``CHECKPOINT`` or ``MODEL``."""
        if kind is not None and kind not in ("CHECKPOINT", "MODEL"):
            raise InvalidInputError(f"{kind!r} is not a kind", field="kind", fix="CHECKPOINT (resumable state) or MODEL")
        rows = [c for c in await self.list_checkpoints() if kind in (None, c.kind)]
        return rows[: check_count(max_results, "max_results", low=1, high=10**6)]

    async def get_latest_model_package(
        self, kind: str, *, model_package_group_arn: str | None = None, scan_limit: int = 20
    ) -> Checkpoint | None:
        """The newest checkpoint of ``kind`` (``CHECKPOINT`` or ``MODEL``), or None."""
        rows = await self.list_model_packages(kind=kind, max_results=scan_limit)
        return rows[0] if rows else None

    async def delete_model_package(self, model_package_arn: str, *, delete_artifacts: bool = False) -> ModelPackageDeletion:
        """SageMaker's delete: the checkpoint's record and, on backends that store files, its files. A package already
        gone is not an error (``model_package_deleted=False``). ``delete_artifacts=True`` where the backend keeps them
        (``sagemaker://``: the S3 objects) is refused before anything is deleted."""
        path = check_checkpoint_path(model_package_arn, "model_package_arn")
        await self._ensure_open()
        keeps = self.backend.keeps_artifacts
        if _check_bool(delete_artifacts, "delete_artifacts") and keeps:
            raise UnsupportedError(
                "this backend deletes the package's record only; its artifacts stay where the service wrote them",
                field="delete_artifacts",
                fix="leave delete_artifacts=False and delete the S3 objects yourself (e.g. aws s3 rm --recursive)",
            )
        try:
            await self.delete_checkpoint(path)
            deleted = True
        except NotFoundError:
            deleted = False
        reason = "the backend keeps a deleted package's artifacts" if keeps else None
        return ModelPackageDeletion(model_package_arn=path, model_package_deleted=deleted, artifacts_retained=keeps, retained_reason=reason)

    async def delete_checkpoint(self, path: str) -> None:
        """Delete a saved checkpoint by its path."""
        path = check_checkpoint_path(path)
        await self._ensure_open()
        await self._call("delete_checkpoint", functools.partial(self.backend.delete_checkpoint, path))

    def create_rest_client(self) -> RestClient:
        """Tinker's REST-style client for runs and checkpoints, over this ServiceClient's backend."""
        return RestClient(self)

    # ------------------------------------------------------------------ internals

    def _from_state_spec(
        self,
        path: str | None,
        arn: str | None,
        base_model: str | None,
        user_metadata: Mapping[str, str] | None,
        optimizer: Any,
        options: dict[str, Any],
        with_optimizer: bool,
    ) -> TrainingSessionSpec:
        if (path is None) == (arn is None):
            raise InvalidInputError("give exactly one of path and model_package_arn", field="path")
        path = check_checkpoint_path(path if path is not None else arn)
        if base_model is not None:
            check_base_model(base_model)
        rank, alpha = options.pop("rank", 32), options.pop("alpha", None)
        check_lora_rank(rank)
        for ignored in ("seed", "train_mlp", "train_attn", "train_unembed"):
            options.pop(ignored, None)
        known = {"training_session_name", "model_package_group_arn", "s3_output_path", "kms_key_arn", "vpc_config"}
        unknown = set(options) - known
        if unknown:
            raise InvalidInputError(
                f"unexpected option(s) {', '.join(sorted(unknown))}", field="session_options", fix=f"use {sorted(known)}"
            )
        opts = check_session_options({**options, "optimizer": optimizer})
        return TrainingSessionSpec(
            base_model or "",
            rank,
            alpha,
            from_path=path,
            with_optimizer=with_optimizer,
            user_metadata=check_user_metadata(user_metadata),
            session_options=opts,
        )

    def _mark(self, session_id: str, status: str) -> None:
        row = self._known.get(session_id)
        if row is not None and row.status != "Deleted":
            self._known[session_id] = row.model_copy(update={"status": status})

    # ------------------------------------------------------------------ internals

    async def _open_training(self, spec: TrainingSessionSpec) -> TrainingClient:
        await self._ensure_open()
        self._require_open()
        info = await self._create("create_training_session", self.backend.create_training_session, _keyed(spec))
        update: dict[str, Any] = {}
        if spec.user_metadata and not info.user_metadata:
            update["user_metadata"] = dict(spec.user_metadata)
        if spec.session_options and not info.session_options:
            update["session_options"] = dict(spec.session_options)
        if update:  # the backend had no use for them: keep them with the session's info
            info = info.model_copy(update=update)
        try:
            limits = await self._model_limits(info.base_model)
        except BaseException:  # cancelled (a timeout around the call): the session exists but nobody holds it
            with anyio.CancelScope(shield=True):
                await self._stop_quietly(info.model_id)
            raise
        tc = TrainingClient(self, info)
        tc._limits = limits
        tc._multi_target = frozenset(self._caps.multi_target_losses) if self._caps is not None else frozenset()
        self._training[info.model_id] = tc
        self._known[info.model_id] = SessionSummary(
            session_id=info.model_id,
            kind="training",
            status="Running",
            base_model=info.base_model,
            creation_time=time.time(),
            user_metadata=dict(info.user_metadata),
        )
        return tc

    async def _open_sampler(self, spec: SamplerSpec, base_model: str) -> SamplingClient:
        await self._ensure_open()
        self._require_open()
        sampler_id = await self._create("create_sampler", self.backend.create_sampler, _keyed(spec))
        self._samplers.add(sampler_id)
        self._known[sampler_id] = SessionSummary(
            session_id=sampler_id, kind="sampler", status="Running", base_model=base_model, creation_time=time.time()
        )
        return SamplingClient(self, sampler_id, base_model, spec)

    async def _create(self, operation: str, create: Callable[[Spec], Awaitable[T]], spec: Spec) -> T:
        """``create(spec)`` with retries; once it fails for good (or is cancelled) the backend is told in the background
        (``abandon_create``), so it can stop a session that create may have made without an answer."""
        sent = False

        async def attempt() -> T:
            nonlocal sent
            sent = True
            return await create(spec)

        try:
            return await self._call(operation, attempt)
        except BaseException:
            if sent and not self._closed:
                self._start(self.backend.abandon_create, spec.idempotency_key)
            raise

    async def _model_limits(self, base_model: str) -> tuple[int | None, int | None]:
        """(vocab size, context length) of ``base_model`` when the backend reports them, for checks before numbering."""
        for refresh in (self._caps is None, True):  # a model first used just now may be missing from a cached list
            if refresh:
                try:
                    self._caps = await self.get_server_capabilities()
                except Exception as err:  # limits are an extra check; a backend without them still works
                    log.debug("no capabilities: %r", err)
                    return None, None
            assert self._caps is not None
            for m in self._caps.supported_models:
                if m.model_name == base_model:
                    return m.vocab_size, m.max_context_length
        return None, None

    def _vocab_size(self, base_model: str) -> int | None:
        """The vocabulary size the cached capabilities give ``base_model`` (no call to the backend)."""
        models = self._caps.supported_models if self._caps is not None else []
        return next((m.vocab_size for m in models if m.model_name == base_model), None)

    def _require_open(self) -> None:
        if not self._opened or self._closed:
            raise ClientClosedError(self._not_open())
        self._check_loop()
        while self._orphans:
            self._start(self._stop_quietly, self._orphans.pop())

    def _not_open(self) -> str:
        if self._closed:
            return "this ServiceClient was closed: open a new one (`async with ServiceClient(url) as svc:`)"
        return "ServiceClient is not open: use `async with ServiceClient(url) as svc:`"

    def _check_loop(self, operation: str | None = None) -> None:
        """Refuse a call made on another event loop (or thread, or forked process) than the one that opened this
        client: its tasks would never run there, or its results never wake the caller."""
        if self._owner is None or loop_token() is self._owner:
            return
        if self._pid != os.getpid():
            where, fix = f"process {self._pid}, before os.fork()", "open a new ServiceClient in this process"
        else:
            where, fix = "another event loop (or thread)", "call it from the loop that opened it, or open a ServiceClient on this one"
        raise WrongEventLoopError(f"this ServiceClient was opened in {where}: {fix}", operation=operation)

    async def _call(self, operation: str, fn: Callable[[], Awaitable[T]], seq: int | None = None) -> T:
        if not self._opened or self._closed:
            raise ClientClosedError(self._not_open(), operation=operation, seq=seq)
        self._check_loop(operation)
        return await call_with_retry(
            self.retry_policy, fn, operation=operation, seq=seq, on_retry=self._record_retry, budget=self.retry_budget
        )

    def _record_retry(self, event: RetryEvent) -> None:
        self.retries += 1
        if self._on_retry is not None:
            self._on_retry(event)

    def _spawn(self, fut: APIFuture[T], fn: Callable[..., Awaitable[T]], *args: Any) -> APIFuture[T]:
        self._require_open()
        self._start(self._drive, fut, fn, args)
        return fut

    def _start(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Start a background task owned by this client (cancelled at close).

        Not in a task group of the caller's: ``aclose()`` may then come from any task, nested anywhere. On asyncio
        a plain task (~5 µs; anyio's start_soon ~30 µs); on trio a system task in its own cancel scope."""
        if self._loop is not None:
            task: asyncio.Task[Any] = self._loop.create_task(fn(*args))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            import trio

            trio.lowlevel.spawn_system_task(self._scoped, fn, args, context=contextvars.copy_context())

    async def _scoped(self, fn: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...]) -> None:
        """Run a trio task of this client in a cancel scope that ``aclose()`` cancels (and waits for)."""
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                await fn(*args)
            except Exception:  # a system task's error would end the whole run
                log.exception("a background task of the ServiceClient failed")
            finally:
                self._scopes.discard(scope)
                if not self._scopes and self._idle is not None:
                    self._idle.set()

    async def _drive(self, fut: APIFuture[T], fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> None:
        try:
            with anyio.CancelScope() as scope:
                fut._cancel_scope = scope
                if fut._cancel_requested:  # cancelled before this task started: never sent (an fn that does not
                    scope.cancel()  # yield would otherwise run to the end, and cancel() would have said True for nothing)
                else:
                    value = await fn(*args)
                    if not scope.cancel_called:  # cancel() said True after the answer came: it stays cancelled
                        fut._set_result(value)
        except Exception as err:
            if isinstance(err, AsyncSessError) and err.operation is None:
                err.operation = fut.operation  # say which call failed (SageMaker's operation_type)
            fut._set_exception(err)
        finally:
            if not fut.done():
                why = "the ServiceClient was closed" if self._closed else "cancelled"
                fut._set_exception(OperationCancelledError(f"{why} before it finished", operation=fut.operation, seq=fut.seq))

    async def _stop_quietly(self, session_id: str) -> None:
        self._samplers.discard(session_id)
        self._mark(session_id, "Stopped")
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
            for sampler_id in list(self._samplers):  # a sampling-only client keeps its server session alive too
                try:
                    await self.backend.heartbeat(sampler_id)
                except Exception as err:  # the sampler's next call reports a lost session, typed
                    log.debug("heartbeat for sampler %s failed: %r", sampler_id, err)


def _check_sequences(request: SampleRequest, response: SampleResponse, vocab_size: int | None) -> None:
    """A backend's sequences must answer the request: ``num_samples`` of them, one log-prob (not NaN) per token, token
    ids in the vocabulary (``[0, vocab_size)``, or int32 when the size is unknown); anything else is not a result."""
    if len(response.sequences) != request.num_samples:
        raise APIResponseValidationError(f"the backend returned {len(response.sequences)} sequences for num_samples={request.num_samples}")
    for s in response.sequences:
        if s.logprobs is not None and len(s.logprobs) != len(s.tokens):
            raise ResultMismatchError("sample.logprobs", len(s.tokens), len(s.logprobs))
        if s.logprobs is not None and any(lp != lp for lp in s.logprobs):
            raise APIResponseValidationError("the backend returned a NaN log-prob for a sampled token")
        top = vocab_size if vocab_size is not None else 2**31
        bad = next((t for t in s.tokens if not 0 <= t < top), None)
        if bad is not None:
            raise APIResponseValidationError(f"the backend sampled token id {str(bad)[:30]}, outside the vocabulary [0, {top})")


def _keyed(spec: Spec) -> Spec:
    """``spec`` with the idempotency key of one create: its retries send the same spec, a later create (a pickled
    sampler reopened included: the key is not kept in the client's spec) gets a new key."""
    return dataclasses.replace(spec, idempotency_key=spec.idempotency_key or uuid.uuid4().hex)


def _on_collect(obj: object, fn: Callable[..., None], *args: Any) -> weakref.finalize:
    """``fn(*args)`` once ``obj`` is garbage-collected, but not at interpreter exit: a client still referenced then
    was not dropped, and its ServiceClient's own close (the sync facade's at exit) stops its session."""
    finalizer = weakref.finalize(obj, fn, *args)
    finalizer.atexit = False
    return finalizer


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
        self._limits: tuple[int | None, int | None] = (None, None)  # (vocab size, context) for checks before numbering
        self._multi_target: frozenset[str] = frozenset()  # losses for which the backend takes (N, K) target_tokens
        self._saved_names: set[tuple[str, str]] = set()
        self._finalizer = _on_collect(self, _warn_unclosed, weakref.ref(service), info.model_id, "TrainingClient")

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

    @property
    def training_session_name(self) -> str:
        """SageMaker's name for :attr:`model_id`: the backing session (on ``sagemaker://``, its TrainingSession name)."""
        return self.model_id

    # ------------------------------------------------------------------ ordered ops

    def forward(
        self,
        data: Any = None,
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, Any] | None = None,
        loss_fn_inputs: Mapping[str, Any] | None = None,
        *,
        batch: Any = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Log-probs and loss without gradients. Argument forms: see :meth:`forward_backward`."""
        datums, config = self._check(_data_or_batch(data, batch), loss_fn, loss_fn_config, loss_fn_inputs)
        return self._submit_batch(ForwardOp, datums, loss_fn, config)

    def forward_backward(
        self,
        data: Any = None,
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, Any] | None = None,
        loss_fn_inputs: Mapping[str, Any] | None = None,
        *,
        batch: Any = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Log-probs, loss, and gradients accumulated until the next ``optim_step``.

        The third positional argument is Tinker's ``loss_fn_config`` or SageMaker's ``loss_fn_inputs``
        (told apart by content: per-token arrays are inputs, scalars are config); ``loss_fn_inputs``
        are attached to each datum that has none of its own. ``batch=`` is SageMaker's name for ``data``.
        """
        datums, config = self._check(_data_or_batch(data, batch), loss_fn, loss_fn_config, loss_fn_inputs)
        return self._submit_batch(ForwardBackwardOp, datums, loss_fn, config)

    def forward_backward_custom(self, data: Any, loss_fn: CustomLossFn, *, loss_type_input: Any = None) -> APIFuture[ForwardBackwardOutput]:
        """Any differentiable loss of the log-probs, lowered to ``cross_entropy`` (needs torch).

        ``loss_fn(data, logprobs) -> (loss, metrics)`` receives copies of the datums and one torch tensor of log-probs
        per datum. The forward and the backward pass are numbered now (one op each per chunk), so later ops stay
        behind both. A ``loss_fn`` that raises or returns no finite scalar loss with finite gradients fails this
        future with an :class:`InvalidInputError` naming ``loss_fn``: the backward's numbers then run a forward
        (nothing is applied) and the client stays usable.
        """
        if not callable(loss_fn):
            raise InvalidInputError("must be callable (data, logprobs) -> (loss, metrics)", field="loss_fn")
        original = self._coerce_rl_datums(data)
        vocab, context = self._limits
        multi = "cross_entropy" in self._multi_target
        forward_data = check_datums(ce_view(original), "cross_entropy", vocab_size=vocab, max_length=context, multi_target=multi)
        self._raise_if_unusable("forward_backward_custom")
        chunks = chunk_datums(forward_data, self._svc.max_chunk_datums, self._svc.max_chunk_bytes)
        first = self._next_seq
        try:  # the backend judges both passes before they take their numbers, as for forward_backward
            fwds = [self._number(functools.partial(ForwardOp, data=c, loss_fn="cross_entropy")) for c in chunks]
            bwds = [self._number(functools.partial(ForwardBackwardOp, data=c, loss_fn="cross_entropy")) for c in chunks]
        except BaseException:
            self._next_seq = first  # refused before they took their places: the numbers are free again
            raise
        fut: APIFuture[ForwardBackwardOutput] = APIFuture("forward_backward_custom", fwds[0].seq)
        fut._withdrawable = False
        return self._track(fut, self._run_custom, original, fwds, bwds, loss_fn)

    def optim_step(
        self, optim_params: AdamParams | Mapping[str, float] | None = None, *, adam_params: AdamParams | Mapping[str, float] | None = None
    ) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradients with AdamW. ``adam_params=`` is the keyword both anchors also take."""
        if optim_params is not None and adam_params is not None:
            raise InvalidInputError("give optim_params or adam_params, not both", field="adam_params")
        params = coerce_adam_params(adam_params if adam_params is not None else optim_params)
        return self._submit("optim_step", functools.partial(OptimStepOp, adam_params=params))

    def save_state(
        self,
        name: str | None = None,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: Mapping[str, str] | None = None,
        *,
        description: str | None = None,
    ) -> APIFuture[CheckpointResponse]:
        """Save weights + optimizer state (resumable).

        ``name`` becomes the last path component (1-128 of ``A-Za-z0-9._-``); a first argument that is
        not a valid name is SageMaker's free-text ``description`` and the backend picks the name.
        ``overwrite=True`` replaces a checkpoint of the same name.
        """
        fields = self._save_fields(name, description, ttl_seconds, overwrite, user_metadata, "save_state")
        return self._remember("save_state", fields, self._submit("save_state", functools.partial(SaveStateOp, **fields)))

    def save_weights_for_sampler(
        self,
        name: str | None = None,
        merge_weights: bool = False,
        user_metadata: Mapping[str, str] | None = None,
        *,
        ttl_seconds: int | None = None,
        description: str | None = None,
        overwrite: bool = False,
    ) -> APIFuture[CheckpointResponse]:
        """Save weights for sampling/export; ``merge_weights=True`` also writes a merged full model. Names: see :meth:`save_state`."""
        fields = self._save_fields(name, description, ttl_seconds, overwrite, user_metadata, "save_weights")
        merge = _check_bool(merge_weights, "merge_weights")
        return self._remember(
            "save_weights", fields, self._submit("save_weights", functools.partial(SaveWeightsOp, merge_weights=merge, **fields))
        )

    def load_state(
        self, path: str | None = None, weights_access_token: str | None = None, *, model_package_arn: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        """Load weights from ``path`` (SageMaker: ``model_package_arn``) and reset the optimizer."""
        return self._submit("load_state", functools.partial(LoadStateOp, path=_path_or_arn(path, model_package_arn), with_optimizer=False))

    def load_state_with_optimizer(
        self, path: str | None = None, weights_access_token: str | None = None, *, model_package_arn: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        """Load weights and optimizer state from ``path`` (SageMaker: ``model_package_arn``)."""
        return self._submit("load_state", functools.partial(LoadStateOp, path=_path_or_arn(path, model_package_arn), with_optimizer=True))

    def save_weights_external(
        self, name: str | None = None, ttl_seconds: int | None = None, age_encryption_recipients: Any = None
    ) -> APIFuture[CheckpointResponse]:
        """Tinker's export: here the same as :meth:`save_weights_for_sampler` (a PEFT adapter where the backend stores files)."""
        if age_encryption_recipients:
            raise UnsupportedError("age encryption is not offered", field="age_encryption_recipients", fix="leave it None")
        return self.save_weights_for_sampler(name, ttl_seconds=ttl_seconds)

    # The anchors' *_async spellings: coroutines that return the op's future (await the future for the value).

    async def forward_async(self, data: Any = None, *args: Any, **kwargs: Any) -> APIFuture[ForwardBackwardOutput]:
        """``fut = await tc.forward_async(...)``; then ``await fut``."""
        return self.forward(data, *args, **kwargs)

    async def forward_backward_async(self, data: Any = None, *args: Any, **kwargs: Any) -> APIFuture[ForwardBackwardOutput]:
        """``fut = await tc.forward_backward_async(...)``; then ``await fut``."""
        return self.forward_backward(data, *args, **kwargs)

    async def forward_backward_custom_async(self, data: Any, loss_fn: CustomLossFn, **kwargs: Any) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward_custom(data, loss_fn, **kwargs)

    async def optim_step_async(self, optim_params: Any = None, *, adam_params: Any = None) -> APIFuture[OptimStepResponse]:
        """``fut = await tc.optim_step_async(...)``; then ``await fut``."""
        return self.optim_step(optim_params, adam_params=adam_params)

    async def save_state_async(self, name: str | None = None, *args: Any, **kwargs: Any) -> APIFuture[CheckpointResponse]:
        """``fut = await tc.save_state_async(...)``; then ``await fut``."""
        return self.save_state(name, *args, **kwargs)

    async def save_weights_for_sampler_async(self, name: str | None = None, *args: Any, **kwargs: Any) -> APIFuture[CheckpointResponse]:
        """``fut = await tc.save_weights_for_sampler_async(...)``; then ``await fut``."""
        return self.save_weights_for_sampler(name, *args, **kwargs)

    async def save_weights_external_async(self, name: str | None = None, *args: Any, **kwargs: Any) -> APIFuture[CheckpointResponse]:
        return self.save_weights_external(name, *args, **kwargs)

    async def load_state_async(self, path: str | None = None, *args: Any, **kwargs: Any) -> APIFuture[LoadWeightsResponse]:
        return self.load_state(path, *args, **kwargs)

    async def load_state_with_optimizer_async(self, path: str | None = None, *args: Any, **kwargs: Any) -> APIFuture[LoadWeightsResponse]:
        return self.load_state_with_optimizer(path, *args, **kwargs)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None, *args: Any, **kwargs: Any) -> SamplingClient:
        return await self.save_weights_and_get_sampling_client(name, *args, **kwargs)

    async def create_sampling_client_async(self, model_path: str | None = None, *args: Any, **kwargs: Any) -> SamplingClient:
        return await self.create_sampling_client(model_path, *args, **kwargs)

    async def get_info_async(self) -> GetInfoResponse:
        return self.get_info()

    # ------------------------------------------------------------------ samplers and info

    async def save_weights_and_get_sampling_client(
        self,
        name: str | None = None,
        merge_weights: bool = False,
        record_stability_info: bool = False,
        kind: str = "snapshot",
        *,
        description: str | None = None,
        retry_config: Any = None,
    ) -> SamplingClient:
        """Snapshot the current weights (an ordered op) and return a sampler on them.

        Without a name the snapshot is ephemeral (not listed). ``kind="snapshot"`` only: every
        sampler here pins the weights it was made from. ``record_stability_info=True`` is refused, as in
        :meth:`ServiceClient.create_sampling_client`, before anything is saved.
        """
        check_record_stability_info(record_stability_info)
        if kind != "snapshot":
            raise UnsupportedError(f"kind={kind!r}", field="kind", fix='use kind="snapshot" (samplers pin their weights)')
        fields = self._save_fields(name, description, None, False, None, "save_weights")
        merge = _check_bool(merge_weights, "merge_weights")
        saved = await self._remember(
            "save_weights",
            fields,
            self._submit("save_weights", functools.partial(SaveWeightsOp, merge_weights=merge, ephemeral=fields["name"] is None, **fields)),
        )
        return await self._svc._open_sampler(SamplerSpec(model_path=saved.path), self.base_model)

    async def create_sampling_client(
        self,
        model_path: str | None = "",
        retry_config: Any = None,
        record_stability_info: bool = False,
        *,
        model_package_arn: str = "",
    ) -> SamplingClient:
        """A sampler on ``model_path`` (SageMaker: ``model_package_arn``), or on the current weights when none is given.
        ``record_stability_info=True`` is refused, as in :meth:`ServiceClient.create_sampling_client`."""
        check_record_stability_info(record_stability_info)
        if model_path not in (None, "") and model_package_arn not in (None, ""):  # the ARN was silently ignored
            raise InvalidInputError("give model_path or model_package_arn, not both", field="model_package_arn")
        path = model_path if model_path not in (None, "") else model_package_arn
        if path in (None, ""):
            return await self.save_weights_and_get_sampling_client()
        return await self._svc._open_sampler(SamplerSpec(model_path=check_checkpoint_path(path, "model_path")), self.base_model)

    async def list_model_packages(self, *, kind: str | None = None, max_results: int | None = None) -> list[Checkpoint]:
        """This session's checkpoints, newest first (SageMaker's per-client listing; ``max_results=None``: all)."""
        rows = [c for c in await self._svc.list_checkpoints(self.model_id) if kind in (None, c.kind)]
        return rows if max_results is None else rows[: check_count(max_results, "max_results", low=1, high=10**6)]

    async def get_latest_model_package(self, kind: str = "CHECKPOINT") -> Checkpoint | None:
        rows = await self.list_model_packages(kind=kind, max_results=1)
        return rows[0] if rows else None

    def get_telemetry(self) -> None:
        """Tinker's telemetry handle: always ``None`` (what Tinker returns with telemetry off); asyncsess collects none."""
        return None

    def get_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = self._svc.backend.get_tokenizer(self.base_model)
        return self._tokenizer

    def get_info(self) -> GetInfoResponse:
        return self._info

    async def stop(self) -> None:
        """Stop the session. Idempotent; ops still queued fail with ``SessionGoneError``."""
        await self._stop_quietly()

    async def delete(self, *, stop_if_active: bool = False) -> None:
        """SageMaker's ``delete``: forget this session (``stop_if_active=True`` stops it first)."""
        await self._svc.delete_session(self.model_id, stop_if_active=stop_if_active)

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

    def _check(self, data: Any, loss_fn: str, config: Any, shared: Any) -> tuple[tuple[Datum, ...], dict[str, float] | None]:
        if _looks_like_inputs(config) and (shared is None or not _looks_like_inputs(shared)):
            config, shared = shared, config  # SageMaker's order: (batch, loss_fn, loss_fn_inputs, loss_fn_config)
        if config is not None and not isinstance(config, Mapping):
            raise InvalidInputError(f"got {type(config).__name__}", field="loss_fn_config", fix="a dict of str to float, or None")
        if shared is not None and not isinstance(shared, Mapping):
            raise InvalidInputError(f"got {type(shared).__name__}", field="loss_fn_inputs", fix="a dict of per-token lists, or None")
        check_loss_fn(loss_fn)
        cfg = check_loss_fn_config(loss_fn, config)
        vocab, context = self._limits
        try:
            return check_datums(
                data,
                loss_fn,
                shared_inputs=shared,
                encode=self._encode_or_none(),
                vocab_size=vocab,
                max_length=context,
                multi_target=loss_fn in self._multi_target,
            ), cfg
        except (TypeError, ValueError, OverflowError) as err:
            if isinstance(err, InvalidInputError):
                raise
            raise InvalidInputError(str(err).splitlines()[0], field="data", fix="pass list[Datum] with per-token loss_fn_inputs") from None

    def _save_fields(self, name: Any, description: Any, ttl: Any, overwrite: Any, meta: Any, kind: str) -> dict[str, Any]:
        name, desc = split_name_and_description(name, description)
        fields = {
            "name": name,
            "description": desc,
            "ttl_seconds": check_ttl_seconds(ttl),
            "overwrite": _check_bool(overwrite, "overwrite"),
            "user_metadata": check_user_metadata(meta) or None,
        }
        if name is not None:  # a remote backend would refuse it only after numbering
            check_overwrite(name, (kind, name) in self._saved_names, fields["overwrite"])
        return fields

    def _remember(self, kind: str, fields: dict[str, Any], fut: APIFuture[T]) -> APIFuture[T]:
        """Note a name once its save is numbered, so a second save of it is refused before numbering; a save that
        fails void (refused at its turn, over a quota, its write failed for the disk) wrote nothing: the name is free
        again, unless an earlier save holds it."""
        if fields["name"] is None:
            return fut
        name = (kind, fields["name"])
        added = name not in self._saved_names
        self._saved_names.add(name)

        def settled(f: APIFuture[T]) -> None:
            error = None if f.cancelled() else f.exception()
            if error is None:
                self._saved_names.add(name)
            elif added and not poisons(error):
                self._saved_names.discard(name)

        fut.add_done_callback(settled)
        return fut

    def _coerce_rl_datums(self, data: Any) -> tuple[Datum, ...]:
        """Datums for a custom loss: anything with ``target_tokens`` (other keys are passed to the loss fn)."""
        out = coerce_datums(data, encode=self._encode_or_none())
        for i, d in enumerate(out):
            if "target_tokens" not in d.loss_fn_inputs:
                raise InvalidInputError("needs target_tokens", field=f"data[{i}].loss_fn_inputs", fix="add target_tokens")
        return tuple(out)

    def _raise_if_unusable(self, operation: str) -> None:
        self._svc._check_loop(operation)
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

    def _number(self, make: Callable[..., Op]) -> Op:
        """``make(seq=, idempotency_key=)`` (a ``partial`` of a record) with the next number, once the backend's
        :meth:`~Backend.precheck` accepts it; a refusal frees the number again."""
        seq, key = self._reserve()
        op = make(seq=seq, idempotency_key=key)
        try:
            self._svc.backend.precheck(self.model_id, op)
        except BaseException:
            self._next_seq -= 1
            raise
        return op

    def _submit(self, operation: str, make: Callable[..., TrainingOp]) -> APIFuture[Any]:
        """Number an op and run it in order; ``make(seq=, idempotency_key=)`` builds its record (a ``partial`` of one)."""
        self._raise_if_unusable(operation)
        op = self._number(make)
        fut: APIFuture[Any] = APIFuture(operation, op.seq)
        fut._withdrawable = False  # an ordered op keeps its place once numbered
        return self._track(fut, self._run_op, op)

    def _submit_batch(
        self, record: type[ForwardOp | ForwardBackwardOp], datums: tuple[Datum, ...], loss_fn: str, config: dict[str, float] | None
    ) -> APIFuture[ForwardBackwardOutput]:
        """One op, or consecutive ops for a batch over the chunk limits, merged into one future."""
        kind = "forward" if record is ForwardOp else "forward_backward"
        chunks = chunk_datums(datums, self._svc.max_chunk_datums, self._svc.max_chunk_bytes)
        parts = [self._submit(kind, functools.partial(record, data=c, loss_fn=loss_fn, loss_fn_config=config)) for c in chunks]
        if len(parts) == 1:
            return parts[0]
        fut: APIFuture[ForwardBackwardOutput] = APIFuture(kind, parts[0].seq)
        fut._withdrawable = False
        return self._svc._spawn(fut, self._merge_parts, parts)

    async def _merge_parts(self, parts: list[APIFuture[ForwardBackwardOutput]]) -> ForwardBackwardOutput:
        """The parts' outputs merged. A part refused void while the others ran leaves the batch half-applied: that
        poisons the ops after it, as any failure of an op that changed the session does."""
        try:
            return merge_outputs([await p for p in parts])
        except AsyncSessError as err:
            if not poisons(err):
                seq = err.seq if err.seq is not None else parts[0].seq or 0  # _run_op names the part's seq
                self._poison_after(seq, OperationError(f"a batch sent as {len(parts)} ops was half-applied: {err}", seq=seq))
            raise

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
            if isinstance(err, AsyncSessError):
                err.request_id = err.request_id or op.idempotency_key
                err.seq = op.seq if err.seq is None else err.seq
            if poisons(err):  # a void op (refused before anything ran, a skipped step) left the session as it was
                self._poison_after(op.seq, err)
            raise

    async def _run_custom(
        self, original: tuple[Datum, ...], fwds: list[ForwardOp], bwds: list[ForwardBackwardOp], loss_fn: CustomLossFn
    ) -> ForwardBackwardOutput:
        outs: list[ForwardBackwardOutput] = []
        refused: Exception | None = None
        for fwd in fwds:  # every number is sent, in order: a gap would stall the ops after it
            try:
                outs.append(await self._run_op(fwd))
            except Exception as err:
                if poisons(err):  # _run_op poisoned the ops after it, the backward's numbers with them
                    raise
                refused = refused or err  # refused void: nothing ran
        if refused is not None:
            await self._fill(bwds, refused)
            raise refused
        forward = merge_outputs(outs)
        try:
            loss, metrics, weights = linearize(original, forward, loss_fn)
        except InvalidInputError as err:  # the user's loss_fn
            await self._fill(bwds, err)
            raise
        except Exception as err:  # anything else: the reserved numbers are never filled
            self._poison_after(fwds[-1].seq, err)
            raise
        done = 0
        parts = []
        for bwd in bwds:
            chunk = bwd.data
            part = dataclasses.replace(bwd, data=with_weights(chunk, weights[done : done + len(chunk)]))
            done += len(chunk)
            try:
                parts.append(await self._run_op(part))
            except AsyncSessError as err:
                if not poisons(err) and len(bwds) > 1:  # other parts ran, or are never sent: as _merge_parts
                    msg = f"a custom loss's backward sent as {len(bwds)} ops did not run in full: {err}"
                    self._poison_after(bwd.seq, OperationError(msg, seq=bwd.seq))
                raise
        out = merge_outputs(parts)
        return ForwardBackwardOutput.model_construct(
            loss_fn_output_type=out.loss_fn_output_type,
            loss_fn_outputs=forward.loss_fn_outputs,
            metrics={**out.metrics, **metrics, "loss:sum": loss, "surrogate_loss:sum": out.metrics.get("loss:sum", 0.0)},
            usage=forward.usage + out.usage,
        )

    async def _fill(self, bwds: list[ForwardBackwardOp], err: Exception) -> None:
        """Run the reserved backward numbers as forwards of their first datum (they read, apply nothing), so the ops
        after them keep their order and run; ``err`` is void then. A filler that fails for good poisons, as any op."""
        void = True
        for op in bwds:
            try:
                await self._run_op(ForwardOp(seq=op.seq, idempotency_key=op.idempotency_key, data=op.data[:1], loss_fn="cross_entropy"))
            except Exception as filler:  # a void refusal still took its turn; any other failure poisoned (in _run_op)
                void = void and not poisons(filler)
        if isinstance(err, AsyncSessError):
            err.void = void

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


def _data_or_batch(data: Any, batch: Any) -> Any:
    if batch is not None and data is not None:
        raise InvalidInputError("give data or batch, not both", field="batch", fix="batch= is SageMaker's name for data")
    return data if batch is None else batch


def _path_or_arn(path: Any, arn: Any) -> str:
    if path is not None and arn is not None:
        raise InvalidInputError("give path or model_package_arn, not both", field="model_package_arn")
    return check_checkpoint_path(path if arn is None else arn)


def _check_bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        hint = " (a Tinker positional ttl_seconds or retry_config? pass it by keyword)" if field == "merge_weights" else ""
        raise InvalidInputError(f"got {value!r}{hint}", field=field, fix="True or False")
    return value


def _looks_like_inputs(value: Any) -> bool:
    """A mapping of per-token arrays (SageMaker's ``loss_fn_inputs``), not of scalars (``loss_fn_config``)."""
    if not isinstance(value, Mapping) or not value:
        return False
    return any(isinstance(v, (list, tuple, TensorData)) or hasattr(v, "__array__") and getattr(v, "ndim", 0) > 0 for v in value.values())


@dataclass(frozen=True)
class SamplerHandle:
    """What another process needs to reopen a sampler: the backend URL and options, the weights, and
    whatever the backend exported (``mock://`` puts the weights themselves here)."""

    url: str
    options: dict[str, Any]
    spec: SamplerSpec
    base_model: str


class SamplingClient:
    """Samples from one set of weights. Requests are concurrent, bounded by the client's pool.

    Picklable: a copy in another process reopens the same weights through its own ServiceClient (same
    URL and options). There, ``async with sc:`` opens and closes that ServiceClient around its use;
    the copy of an ``asyncsess.sync.SamplingClient`` opens it on first use.
    """

    def __init__(self, service: ServiceClient | None, sampler_id: str, base_model: str, spec: SamplerSpec | None = None) -> None:
        self._svc = service  # type: ignore[assignment]
        self.sampler_id = sampler_id
        self.base_model = base_model
        self._spec = spec or SamplerSpec(base_model=base_model)
        self._handle: SamplerHandle | None = None  # set on an unpickled copy until it is attached
        self._owned: ServiceClient | None = None
        self._last_queue_log = -float(QUEUE_STATE_LOG_INTERVAL)
        self._session = ""  # the session it runs on (Backend.sampler_session), kept after a stop
        if service is not None:
            self._session = service.backend.sampler_session(sampler_id)
            self._limiter = service._limiter
            self._finalizer = _on_collect(self, _release_sampler, weakref.ref(service), sampler_id)

    _svc: ServiceClient

    def __repr__(self) -> str:
        return f"<SamplingClient {self.sampler_id}>"

    @property
    def training_session_name(self) -> str:
        """The session this sampler runs on (SageMaker: a training client's session, or one the sampler owns); on a
        backend whose samplers are sessions of their own, :attr:`sampler_id`."""
        self._require_attached("training_session_name")
        return self._session

    @property
    def model_package_arn(self) -> str | None:
        """SageMaker's name for the checkpoint path this sampler samples (``None``: the base model's weights)."""
        return self._spec.model_path

    async def __aenter__(self) -> SamplingClient:
        if self._handle is not None and self._owned is None:
            await self._attach(self._handle)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.stop()
        if self._owned is not None:
            owned, self._owned = self._owned, None
            await owned.aclose()

    # ------------------------------------------------------------------ pickling

    def get_sampler_handle(self) -> SamplerHandle:
        """A picklable handle; :meth:`from_sampler_handle` reopens it (in any process)."""
        if self._handle is not None:
            return self._handle
        svc = self._svc
        payload = svc.backend.export_sampler(self.sampler_id)
        spec = SamplerSpec(base_model=self._spec.base_model, model_path=self._spec.model_path, payload=payload)
        return SamplerHandle(svc.url, _picklable_options(svc), spec, self.base_model)

    @classmethod
    def from_sampler_handle(cls, handle: SamplerHandle, *, api_key: str | None = None) -> SamplingClient:
        """A detached client for ``handle``: use it as ``async with client:`` (or pass it to ``attach``)."""
        if api_key is not None:
            handle = SamplerHandle(handle.url, {**handle.options, "api_key": api_key}, handle.spec, handle.base_model)
        sc = cls(None, "", handle.base_model, handle.spec)
        sc._handle = handle
        return sc

    def __reduce__(self) -> tuple[Any, ...]:
        return (SamplingClient.from_sampler_handle, (self.get_sampler_handle(),))

    async def attach(self, service: ServiceClient) -> SamplingClient:
        """Reopen an unpickled client's sampler on an open ``service`` (same backend URL)."""
        if self._handle is None:
            raise InvalidInputError("this SamplingClient is already open", field="self")
        opened = await service._open_sampler(self._handle.spec, self.base_model)
        self.__dict__.update({k: v for k, v in opened.__dict__.items() if k != "_finalizer"})
        opened._finalizer.detach()
        self._finalizer = _on_collect(self, _release_sampler, weakref.ref(service), self.sampler_id)
        self._handle = None
        return self

    async def _attach(self, handle: SamplerHandle) -> None:
        svc = ServiceClient(handle.url, heartbeat_interval=0, **handle.options)
        await svc.__aenter__()
        try:
            await self.attach(svc)
        except BaseException:
            await svc.aclose()
            raise
        self._owned = svc

    # ------------------------------------------------------------------ sampling

    def sample(
        self,
        prompt: ModelInput | list[int] | str,
        num_samples: int = 1,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int | None = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: Any = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[SampleResponse]:
        """Draw ``num_samples`` continuations of ``prompt``.

        ``topk_prompt_logprobs=k`` / ``topk_sample_logprobs=k`` return the k most likely tokens and their
        log-probs at each prompt / sampled position; ``target_prompt_logprobs`` (ids ``[len(prompt)-1, K]``,
        ``-1`` = skip) scores chosen ids; ``prompt_logprobs_last_n=n`` keeps only the last n prompt
        positions (earlier entries are ``None``). ``prompt_alt_tokens_k`` is not offered.
        """
        self._require_attached("sample")
        tokens = coerce_prompt(prompt, self._encode)
        num_samples = check_count(num_samples, "num_samples", low=1, high=MAX_SAMPLES)  # numpy's int as a plain int
        params = coerce_sampling_params(sampling_params)
        _check_bool(include_prompt_logprobs, "include_prompt_logprobs")
        k_prompt = check_count(topk_prompt_logprobs, "topk_prompt_logprobs", high=MAX_TOPK, none_ok=True) or 0  # Tinker's None: 0
        k_sample = check_count(topk_sample_logprobs, "topk_sample_logprobs", high=MAX_TOPK)
        if check_count(prompt_alt_tokens_k, "prompt_alt_tokens_k"):
            raise UnsupportedError("prompt_alt_tokens_k is not offered", field="prompt_alt_tokens_k", fix="leave it 0")
        last_n = _check_last_n(prompt_logprobs_last_n, len(tokens), include_prompt_logprobs or k_prompt > 0)
        target = check_target_prompt_logprobs(target_prompt_logprobs, len(tokens))
        request = SampleRequest(tuple(tokens), num_samples, params, include_prompt_logprobs, uuid.uuid4().hex, k_prompt, k_sample, target)
        fut: APIFuture[SampleResponse] = APIFuture("sample")
        call = functools.partial(self._sample_checked, request, last_n)
        return self._svc._spawn(fut, self._run, "sample", len(tokens), call)

    def compute_logprobs(
        self, prompt: ModelInput | list[int] | str, prompt_logprobs_last_n: int | None = None
    ) -> APIFuture[list[float | None]]:
        """Log-prob of each prompt token given the ones before it; the first is ``None`` (and the ones
        before the last ``prompt_logprobs_last_n``)."""
        self._require_attached("compute_logprobs")
        tokens = coerce_prompt(prompt, self._encode)
        last_n = _check_last_n(prompt_logprobs_last_n, len(tokens), True)
        fut: APIFuture[list[float | None]] = APIFuture("compute_logprobs")
        call = functools.partial(self._logprobs_checked, tokens, last_n)
        return self._svc._spawn(fut, self._run, "compute_logprobs", len(tokens), call)

    async def sample_async(self, prompt: Any, num_samples: int = 1, sampling_params: Any = None, **kwargs: Any) -> SampleResponse:
        """The anchors' ``sample_async``: the response itself."""
        return await self.sample(prompt, num_samples, sampling_params, **kwargs)

    async def compute_logprobs_async(self, prompt: Any, prompt_logprobs_last_n: int | None = None) -> list[float | None]:
        """The anchors' ``compute_logprobs_async``: the log-probs themselves."""
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n)

    def stats(self) -> SamplingStats:
        """Backpressure figures of the pool this client shares with its ServiceClient."""
        self._require_attached("stats")
        return self._limiter.stats()

    def get_tokenizer(self) -> Tokenizer:
        self._require_attached("get_tokenizer")
        return self._svc.backend.get_tokenizer(self.base_model)

    def get_base_model(self) -> str:
        return self.base_model

    async def get_base_model_async(self) -> str:
        return self.base_model

    async def stop(self) -> None:
        """Release the sampler. Idempotent."""
        if self._handle is not None:
            return
        self._finalizer.detach()
        await self._svc._stop_quietly(self.sampler_id)

    def _require_attached(self, operation: str) -> None:
        if self._handle is not None:
            raise SessionGoneError(
                "this SamplingClient was unpickled and is not open here: use `async with sc:` (or `await sc.attach(svc)`)",
                operation=operation,
            )

    def _encode(self, text: str) -> list[int]:
        return self.get_tokenizer().encode(text)

    async def _sample_checked(self, request: SampleRequest, last_n: int | None) -> SampleResponse:
        response = await self._svc.backend.sample(self.sampler_id, request)
        n = len(request.prompt)
        if request.include_prompt_logprobs and response.prompt_logprobs is not None and len(response.prompt_logprobs) != n:
            raise ResultMismatchError("sample.prompt_logprobs", n, len(response.prompt_logprobs))
        _check_sequences(request, response, self._svc._vocab_size(self.base_model))
        request.check_extras(response)
        if last_n is not None:
            update: dict[str, Any] = {}
            if response.prompt_logprobs is not None:
                update["prompt_logprobs"] = _keep_tail(response.prompt_logprobs, last_n)
            if response.topk_prompt_logprobs is not None:
                update["topk_prompt_logprobs"] = _keep_tail(response.topk_prompt_logprobs, last_n)
            response = response.model_copy(update=update)
        return response

    async def _logprobs_checked(self, tokens: list[int], last_n: int | None) -> list[float | None]:
        out = await self._svc.backend.compute_logprobs(self.sampler_id, tokens)
        if len(out) != len(tokens):
            raise ResultMismatchError("compute_logprobs", len(tokens), len(out))
        return _keep_tail(out, last_n) if last_n is not None else out

    def get_telemetry(self) -> None:
        """Tinker's telemetry handle: always ``None`` (what Tinker returns with telemetry off); asyncsess collects none."""
        return None

    def on_queue_state_change(self, queue_state: QueueState, queue_state_reason: str | None) -> None:
        """Tinker's observer hook, called when a request of this client waits for the sampling pool and when it proceeds.

        A request that must wait because the pool is full gets ``QueueState.PAUSED_CAPACITY`` with a reason naming
        the bound (``max_samples_in_flight`` or ``max_sample_bytes``); ``QueueState.ACTIVE`` (reason ``None``)
        follows when it is admitted. This default logs a paused state as a warning at most once a minute, like
        Tinker's; override it in a subclass to observe backpressure. An exception it raises is logged, not raised.
        """
        if queue_state == QueueState.ACTIVE:
            return
        now = time.monotonic()
        if now - self._last_queue_log < QUEUE_STATE_LOG_INTERVAL:
            return
        self._last_queue_log = now
        log.warning("Sampling is paused for sampler %s. Reason: %s", self.sampler_id, queue_state_reason or "unknown")

    def _notify_queue_state(self, queue_state: QueueState, reason: str | None) -> None:
        try:
            self.on_queue_state_change(queue_state, reason)
        except Exception:  # an observer must not fail the request
            log.exception("on_queue_state_change raised")

    async def _run(self, operation: str, ntokens: int, call: Callable[[], Awaitable[T]]) -> T:
        nbytes = 8 * ntokens
        reason = self._limiter.wait_reason(nbytes)
        if reason is not None:
            self._notify_queue_state(QueueState.PAUSED_CAPACITY, reason)
        await self._limiter.acquire(nbytes)
        if reason is not None:
            self._notify_queue_state(QueueState.ACTIVE, None)
        try:
            return await self._svc._call(operation, call)
        finally:
            self._limiter.release(nbytes)


def _check_last_n(last_n: Any, prompt_len: int, scoring: bool) -> int | None:
    if last_n is None:
        return None
    if not scoring:
        raise InvalidInputError("applies to prompt log-probs", field="prompt_logprobs_last_n", fix="set include_prompt_logprobs=True")
    return check_count(last_n, "prompt_logprobs_last_n", low=1, high=max(1, prompt_len - 1))  # type: ignore[no-any-return]


def _keep_tail(values: list[Any], last_n: int) -> list[Any]:
    cut = len(values) - last_n
    return [None] * cut + list(values[cut:])


def _picklable_options(svc: ServiceClient) -> dict[str, Any]:
    """The ServiceClient's backend options that survive pickling (callables and live objects do not)."""
    out: dict[str, Any] = {}
    for key, value in svc._options.items():
        try:
            pickle.dumps(value)
        except Exception:
            log.debug("option %s is not picklable; a SamplingClient copy reopens without it", key)
        else:
            out[key] = value
    return out


class RestClient:
    """Tinker's ``RestClient``: runs and checkpoints, over a ServiceClient's backend. Every method returns an APIFuture."""

    def __init__(self, service: ServiceClient) -> None:
        self._svc = service

    def __repr__(self) -> str:
        return f"<RestClient {self._svc.url}>"

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> APIFuture[TrainingRunsResponse]:
        """Training sessions this ServiceClient opened, newest first (Tinker's ``.training_runs`` and ``.cursor``)."""
        limit, offset = check_count(limit, "limit", low=1, high=10**6), check_count(offset, "offset", high=10**9)
        return self._spawn("list_training_runs", self._runs, limit, offset)

    def get_training_run(self, training_run_id: str) -> APIFuture[TrainingRun]:
        return self._spawn("get_training_run", self._run, training_run_id)

    def list_checkpoints(self, training_run_id: str) -> APIFuture[CheckpointsListResponse]:
        """Checkpoints of one training run, newest first (Tinker's ``.checkpoints``)."""
        return self._spawn("list_checkpoints", self._run_checkpoints, _check_id(training_run_id))

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[CheckpointsListResponse]:
        """Every checkpoint on the backend, newest first (Tinker's ``.checkpoints`` and ``.cursor``)."""
        limit, offset = check_count(limit, "limit", low=1, high=10**6), check_count(offset, "offset", high=10**9)
        return self._spawn("list_user_checkpoints", self._all_checkpoints, limit, offset)

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        return self._spawn("delete_checkpoint", self._delete_by_id, _check_id(training_run_id), _check_id(checkpoint_id, "checkpoint_id"))

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self._spawn("delete_checkpoint", self._svc.delete_checkpoint, check_checkpoint_path(tinker_path, "tinker_path"))

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: int | None) -> APIFuture[None]:
        """Refused with :class:`UnsupportedError`: a checkpoint's TTL is set when it is saved, not changed later."""
        raise UnsupportedError(
            "changing a saved checkpoint's TTL is not offered",
            field="ttl_seconds",
            fix="pass ttl_seconds= to save_state / save_weights_for_sampler, or delete the checkpoint (delete_checkpoint_from_tinker_path)",
        )

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Refused with :class:`UnsupportedError`: asyncsess backends have no other users to publish to."""
        raise UnsupportedError(
            _NO_PUBLISHING, field="tinker_path", fix="open the checkpoint by its path (create_sampling_client(model_path=...))"
        )

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Refused with :class:`UnsupportedError`, as :meth:`publish_checkpoint_from_tinker_path`."""
        raise UnsupportedError(_NO_PUBLISHING, field="tinker_path", fix="nothing is published: the checkpoint is its owner's only")

    def _spawn(self, operation: str, fn: Callable[..., Awaitable[T]], *args: Any) -> APIFuture[T]:
        return self._svc._spawn(APIFuture(operation), fn, *args)

    async def _runs(self, limit: int, offset: int) -> TrainingRunsResponse:
        rows = [r for r in await self._svc.list_sessions() if r.kind == "training"]
        runs = [await self._run(r.session_id) for r in rows[offset : offset + limit]]
        return TrainingRunsResponse(training_runs=runs, cursor=Cursor(offset=offset, limit=limit, total_count=len(rows)))

    async def _run(self, run_id: str) -> TrainingRun:
        row = await self._svc.describe_session(_check_id(run_id))
        if row.kind != "training":
            raise NotFoundError(f"{run_id} is a sampler, not a training run", field="training_run_id")
        ckpts = await self._svc.list_checkpoints(run_id)
        tc = self._svc._training.get(run_id)
        return TrainingRun(
            training_run_id=run_id,
            base_model=row.base_model,
            lora_rank=tc.get_info().lora_rank if tc is not None else None,
            last_checkpoint=next((c for c in ckpts if c.checkpoint_type == "training"), None),
            last_sampler_checkpoint=next((c for c in ckpts if c.checkpoint_type != "training"), None),
            user_metadata=row.user_metadata or None,
        )

    async def _run_checkpoints(self, run_id: str) -> CheckpointsListResponse:
        return CheckpointsListResponse(checkpoints=await self._svc.list_checkpoints(run_id))

    async def _all_checkpoints(self, limit: int, offset: int) -> CheckpointsListResponse:
        rows = await self._svc.list_checkpoints()
        return CheckpointsListResponse(
            checkpoints=rows[offset : offset + limit], cursor=Cursor(offset=offset, limit=limit, total_count=len(rows))
        )

    async def _delete_by_id(self, run_id: str, checkpoint_id: str) -> None:
        for c in await self._svc.list_checkpoints(run_id):
            if c.checkpoint_id == checkpoint_id:
                return await self._svc.delete_checkpoint(c.path)
        raise NotFoundError(f"run {run_id} has no checkpoint {checkpoint_id!r}", field="checkpoint_id", fix="see list_checkpoints(run_id)")


_NO_PUBLISHING = "publishing a checkpoint is not offered: asyncsess backends have no other users to publish to"


def _check_id(value: Any, field: str = "training_run_id") -> str:
    if not isinstance(value, str) or not value or len(value) > 512 or "\x00" in value:
        raise InvalidInputError(f"{value!r} is not an id", field=field, fix="use an id from a list_* call")
    return value


def _release_sampler(svc_ref: weakref.ref[ServiceClient], sampler_id: str) -> None:
    svc = svc_ref()
    if svc is not None and not svc._closed and sampler_id in svc._samplers:
        svc._samplers.discard(sampler_id)
        svc._orphaned(sampler_id)
