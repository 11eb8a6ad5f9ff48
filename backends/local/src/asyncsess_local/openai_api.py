"""The worker's OpenAI-compatible routes: the core front (:mod:`asyncsess.serve.openai_front`) per tenant.

``POST /v1/chat/completions`` (tools and tool calls, ``n``, log-probs, stop, seed, streaming with usage),
``POST /v1/completions``, ``POST /v1/responses``, ``GET /v1/models`` and ``GET``/``DELETE /v1/asyncsess/rollouts/{id}`` (the captured
tokens of a rollout) are :func:`asyncsess.serve.openai_door.openai_router` over :class:`WorkerFronts`.

A ``model`` is, for the tenant (API key) that names it: one of its samplers, one of its training sessions
(the session's latest ``save_weights``, else its base weights), or a base model the worker serves. Anything
else, another tenant's ids included, is a 404 ``model_not_found`` that does not say whether it exists. Each
(tenant, model) has one :class:`~asyncsess.serve.openai_front.OpenAIFront`; a tenant's fronts share one
capture store, bounded at ``max_capture_tokens`` (oldest rollouts dropped first), so a tenant reads only its
own captures. Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import APIRouter, Request

from asyncsess.backends import SamplerSpec
from asyncsess.client import SamplingClient, ServiceClient
from asyncsess.errors import InvalidInputError
from asyncsess.serve.capture import CaptureStore
from asyncsess.serve.openai_door import openai_router
from asyncsess.serve.openai_front import OpenAIFront
from asyncsess.serve.openai_wire import FrontError, model_not_found

from .embedded import MAX_NUM_SAMPLES, LocalBackend
from .idle import IdleClock
from .tenants import Owners

__all__ = ["WorkerFronts", "router"]

MAX_COMPLETION_TOKENS = 256  # the completion budget of a request that sets none


class WorkerFronts:
    """The OpenAI fronts of a worker: one per (tenant, model), over the tenant's own samplers and sessions."""

    def __init__(self, backend: LocalBackend, owners: Owners, base_models: Callable[[], set[str]], *, max_capture_tokens: int) -> None:
        self.backend, self.owners, self.base_models = backend, owners, base_models
        self.max_capture_tokens = max_capture_tokens
        self._svc: ServiceClient | None = None
        self._fronts: dict[tuple[str | None, str], OpenAIFront] = {}
        self._served: dict[tuple[str | None, str], str] = {}  # (tenant, model) -> the sampler its front serves from
        self._captures: dict[str | None, CaptureStore] = {}
        self._base: dict[str, str] = {}  # base model -> the sampler on its base weights (shared by tenants)
        self._session_samplers: dict[str, tuple[tuple[str, int], str]] = {}  # training session -> (its latest_weights, sampler id)
        self._retired: dict[str, str] = {}  # training session -> the sampler on its weights before the latest
        self._opening: dict[tuple[str, str], anyio.Lock] = {}  # (kind, name) a sampler is being opened for: one at a time

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[WorkerFronts]:
        """Enter once the backend is open; on exit stop the samplers opened here."""
        async with ServiceClient("hub://", backend=self.backend, heartbeat_interval=0) as svc:
            self._svc = svc
            try:
                yield self
            finally:
                self._svc = None
                with anyio.CancelScope(shield=True):
                    for sampler_id in [*self._base.values(), *(s for _, s in self._session_samplers.values()), *self._retired.values()]:
                        await self._stop(sampler_id)

    def captures(self, key: str | None) -> CaptureStore:
        return self._captures.setdefault(key, CaptureStore(self.max_capture_tokens))

    def _own(self, key: str | None, model: str) -> str | None:
        """``"sampler"`` / ``"session"`` when ``model`` is a live one of ``key``'s, else None."""
        engine = self.backend.engine
        if key is None or self.owners.by_id.get(model) != key:
            return None
        return "sampler" if model in engine.samplers else "session" if model in engine.sessions else None

    async def _forget_stopped(self) -> None:
        """Drop the fronts of stopped samplers and sessions, and the samplers opened for those sessions."""
        for key, model in [k for k in self._fronts if k[1] not in self._base and self._own(*k) is None]:
            self._fronts.pop((key, model), None)
            self._served.pop((key, model), None)
        for sid in [s for s in self._session_samplers if s not in self.backend.engine.sessions]:
            await self._stop(self._session_samplers.pop(sid, (None, None))[1])
            await self._stop(self._retired.pop(sid, None))
        free = [w for w, lock in self._opening.items() if not (lock.locked() or lock.statistics().tasks_waiting)]
        for what in [w for w in free if w[0] == "session" and w[1] not in self.backend.engine.sessions]:
            del self._opening[what]  # (a stopped session's)

    def _opening_for(self, what: tuple[str, str]) -> anyio.Lock:
        """Held while ``what``'s sampler (a base model's, a session's weights) is opened: once however many calls ask
        at once, while a call on anything else never waits for it (an engine call, queued behind whatever it runs)."""
        return self._opening.setdefault(what, anyio.Lock())

    async def _stop(self, sampler_id: str | None) -> None:
        if sampler_id is not None:
            with contextlib.suppress(Exception):
                await self.backend.stop_session(sampler_id)

    async def _session_sampler(self, session_id: str) -> tuple[str, int]:
        """The sampler on a session's latest ``save_weights`` (made when they change) and their step."""
        latest = self.owners.latest_weights.get(session_id)
        if latest is None:
            return await self._base_sampler(self.backend.engine.sessions[session_id].base_model), 0
        current = self._session_samplers.get(session_id)
        if current is None or current[0] != latest:
            try:
                self._session_samplers[session_id] = (latest, await self.backend.create_sampler(SamplerSpec(model_path=latest[0])))
            except InvalidInputError as err:  # its tenant deleted that checkpoint: the error named no field of the call
                raise FrontError(
                    f"{session_id}'s latest save_weights cannot be opened ({err.message}); save its weights again",
                    "model",
                    code="model_not_sampleable",
                ) from None
            if current is not None:
                # the previous weights stay open until the next change, for the calls still running on them
                await self._stop(self._retired.pop(session_id, None))
                self._retired[session_id] = current[1]
        sampler_id = self._session_samplers[session_id][1]
        return sampler_id, self.backend.engine.samplers[sampler_id].step

    async def _base_sampler(self, base_model: str) -> str:
        if base_model not in self._base:
            self._base[base_model] = await self.backend.create_sampler(SamplerSpec(base_model=base_model))
        return self._base[base_model]

    async def front(self, key: str | None, model: str) -> OpenAIFront:
        """The front that serves ``model`` to ``key``; a 404 FrontError if the key may not use it."""
        engine = self.backend.engine
        await self._forget_stopped()
        kind = self._own(key, model)
        if kind == "sampler":
            ref = engine.samplers[model]
            sampler_id, base, version = model, ref.slot.name, ref.step
        elif kind == "session":
            async with self._opening_for(("session", model)):
                if self._own(key, model) != "session":  # stopped while another call opened its weights
                    raise model_not_found(model)
                base = engine.sessions[model].base_model
                sampler_id, version = await self._session_sampler(model)
        elif model in self.base_models():
            async with self._opening_for(("base", model)):
                sampler_id, base, version = await self._base_sampler(model), model, 0
        else:
            raise model_not_found(model)
        # from here on nothing awaits: no other call changes the fronts meanwhile
        ref = engine.samplers[sampler_id]
        context = ref.slot.sample_context(ref.adapter)
        front = self._fronts.get((key, model))
        if front is None or self._served.get((key, model)) != sampler_id:
            assert self._svc is not None, "WorkerFronts.running() is not active"
            sampler = SamplingClient(self._svc, sampler_id, base)
            if front is None:
                front = self._fronts[(key, model)] = OpenAIFront(
                    sampler,
                    version=version,
                    model_name=model,
                    captures=self.captures(key),
                    max_n=MAX_NUM_SAMPLES,
                    max_tokens=MAX_COMPLETION_TOKENS,
                    context_window=context,
                    sampler_name=model,
                )
            else:  # new weights of the session: the same front and captures
                front.publish(sampler, version, sampler_name=model)
                front.context_window = context
            self._served[(key, model)] = sampler_id
        return front

    async def models(self, key: str | None) -> list[str]:
        """What ``key`` may name: the base models, then its live sessions and samplers."""
        engine = self.backend.engine
        own = sorted(i for i, k in self.owners.by_id.items() if k == key and (i in engine.sessions or i in engine.samplers))
        return [*sorted(self.base_models()), *own]


def router(fronts: WorkerFronts, idle: IdleClock) -> APIRouter:
    """The OpenAI routes over ``fronts``; the tenant is the one the worker's key check set on the request. A call on
    one of the tenant's sessions or samplers keeps it alive in ``idle`` while it runs, as any request on it does."""

    def key_of(request: Request) -> str:
        return str(request.scope["asyncsess.key"])

    def hold(key: str | None, model: str) -> contextlib.AbstractContextManager[object]:
        return idle.using(model) if key is not None and fronts.owners.by_id.get(model) == key else contextlib.nullcontext()

    return openai_router(fronts, key_of=key_of, hold=hold)
