"""The OpenAI door of ``asyncsess serve``: the OpenAI-compatible front over the Tinker door's samplers.

:class:`OpenAIDoor` serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models`` and the capture
routes (``/v1/asyncsess/rollouts/{id}``) behind the server's API keys (``X-API-Key`` or ``Authorization:
Bearer``). ``model`` names what to sample, resolved through the :class:`~.tinker_api.TinkerDoor`'s registry:

- a sampling session id the Tinker API returned (``create_sampling_session``,
  ``save_weights_and_get_sampling_client``) to a session of the same key;
- a ``tinker://.../sampler_weights/...`` path saved by the same key, or published (a sampler is opened on first use,
  and stopped once the checkpoint is deleted, expires or is overwritten, or when more than ``max_open_paths`` are
  open and it is the least recently used);
- a base model the backend offers (one sampler on the base weights, opened once, shared by all keys).

Anything else, another key's sampler included, is a 404 ``model_not_found`` that does not say whether it
exists. Each (key, sampler) pair has one :class:`~.openai_front.OpenAIFront`; a key's fronts share one
:class:`~asyncsess.serve.capture.CaptureStore` (bounded at ``max_capture_tokens``, oldest rollouts dropped first),
so captures are per key. A capture's ``weight_version`` is the
optimizer step of the sampled weights (0 for base weights) and its ``sampler_id`` is the ``model`` it named.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..backends.base import SamplerSpec
from ..client import SamplingClient, ServiceClient
from ..errors import InvalidInputError
from . import json_body
from .capture import MAX_CAPTURE_TOKENS, CaptureStore
from .openai_front import OpenAIFront, Route, rollout_reply
from .openai_wire import ChatRequest, CompletionRequest, FrontError, OpenAIRequest, check_coding, model_card, model_not_found, parse_body
from .responses_wire import ResponsesRequest
from .tinker_api import TinkerDoor, api_key_of, caller

__all__ = ["OpenAIDoor", "FrontSource", "openai_router", "MAX_OPEN_PATHS"]

MAX_OPEN_PATHS = 64  # samplers the door keeps open on checkpoint paths (least recently used closed past it)


class OpenAIDoor:
    """OpenAI fronts over the samplers of ``door``, one per (API key, sampler), with per-key captures."""

    def __init__(
        self,
        door: TinkerDoor,
        *,
        max_n: int = 64,
        max_tokens: int = 256,
        max_capture_tokens: int = MAX_CAPTURE_TOKENS,
        max_open_paths: int = MAX_OPEN_PATHS,
    ) -> None:
        self.door = door
        self.max_open_paths = max_open_paths
        self.max_capture_tokens = max_capture_tokens
        self.max_n, self.max_tokens = max_n, max_tokens
        self._svc: ServiceClient | None = None
        self._fronts: dict[tuple[str | None, str], tuple[str, OpenAIFront]] = {}  # (key, model) -> (backend id, front)
        self._captures: dict[str | None, CaptureStore] = {}
        # base model / tinker path -> (backend id, base model, version), least recently used first
        self._opened: OrderedDict[str, tuple[str, str, int]] = OrderedDict()
        self._opened_for: dict[str, object] = {}  # tinker path -> the door's checkpoint record its sampler loaded
        self._opening: dict[str, anyio.Lock] = {}  # base model / tinker path -> held while its sampler is opened

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[OpenAIDoor]:
        """Enter inside ``door.running()``; on exit stop the samplers this door opened."""
        async with ServiceClient("hub://", backend=self.door.backend, heartbeat_interval=0) as svc:
            self._svc = svc
            try:
                yield self
            finally:
                self._svc = None
                with anyio.CancelScope(shield=True):
                    for backend_id, _, _ in list(self._opened.values()):
                        with contextlib.suppress(Exception):
                            await self.door.backend.stop_session(backend_id)

    def captures(self, key: str | None) -> CaptureStore:
        """The captures of the API key ``key`` (None on a server without keys)."""
        return self._captures.setdefault(key, CaptureStore(self.max_capture_tokens))

    # ------------------------------------------------------------------ resolving ``model``

    async def _base_models(self) -> dict[str, int | None]:
        caps = await self.door.backend.capabilities()
        return {m.model_name: m.max_context_length for m in caps.supported_models if m.sampleable}

    async def _open(self, what: str, spec: SamplerSpec, base_model: str, version: int, record: object = None) -> tuple[str, str, int]:
        """The sampler on ``what`` (a base model or a checkpoint path), opened once however many calls ask at once,
        under a lock of its own: a call on any other sampler never waits for it (one lock for all held every key's
        calls while one key's checkpoint loaded)."""
        lock = self._opening.setdefault(what, anyio.Lock())
        try:
            async with lock:
                await self._close_stale()
                if what not in self._opened:
                    self._opened[what] = (await self.door.backend.create_sampler(spec), base_model, version)
                    if record is not None:
                        self._opened_for[what] = record
                        await self._bound_paths()
                self._opened.move_to_end(what)
                return self._opened[what]
        finally:
            if not (lock.locked() or lock.statistics().tasks_waiting):
                self._opening.pop(what, None)

    async def _bound_paths(self) -> None:
        """Past ``max_open_paths`` samplers on checkpoint paths, stop the least recently used ones that serve no call
        (one reopens on its next call): a key sampling checkpoint after checkpoint kept every one of them loaded."""
        excess = len(self._opened_for) - self.max_open_paths
        for what in [w for w in list(self._opened)[:-1] if w in self._opened_for]:  # never the one just opened
            if excess <= 0:
                break
            if not any(front.active for (_, m), (_, front) in self._fronts.items() if m == what):
                await self._close([what])
                excess -= 1

    async def _close(self, whats: list[str]) -> None:
        """Forget the samplers on ``whats`` (and their fronts) at once, then stop them; one another call closed first
        is skipped."""
        gone = [entry[0] for w in whats if (entry := self._opened.pop(w, None)) is not None]
        for what in whats:
            self._opened_for.pop(what, None)
        for k in [k for k in self._fronts if k[1] in whats]:
            del self._fronts[k]
        for backend_id in gone:
            with contextlib.suppress(Exception):
                await self.door.backend.stop_session(backend_id)

    async def _close_stale(self) -> None:
        """Stop the samplers opened on checkpoints the door no longer holds as they were: deleted, expired or
        overwritten. They stayed open for good (one per checkpoint ever sampled), an overwritten one serving the
        old weights."""
        await self._close([what for what, record in list(self._opened_for.items()) if self.door.checkpoints.get(what) is not record])

    async def front(self, key: str | None, model: str) -> OpenAIFront:
        """The front that serves ``model`` to ``key``; a 404 FrontError if the key may not use it."""
        token = caller.set(key)  # the Tinker door's ownership rules, for this key
        try:
            s = self.door.samplers.get(model)
            s = s if s is not None and self.door.owns(s.session_id) else None
            ck = self.door.visible_checkpoint(model)
            released = self.door.released(model)
        finally:
            caller.reset(token)
        if released is not None:
            self._fronts.pop((key, model), None)
            raise FrontError(released, "model", status=410, code="model_gone")
        if s is not None:
            if self.door.sessions[s.session_id].finished is not None:
                self._fronts.pop((key, model), None)
                raise FrontError(f"{model} was stopped: its session is finished", "model", status=410, code="model_gone")
            self.door.touch(s)  # in use: the last the door closes to bound the session's samplers
            s.busy += 1
            try:
                backend_id = await self.door.live_backend_id(s)  # reopened if the door closed it
            finally:
                s.busy -= 1
            base_model, version = s.base_model, s.version
        elif ck is not None:
            if ck.kind != "sampler":
                raise FrontError(
                    f"{model} holds training state, not sampler weights", "model", code="model_not_sampleable"
                )  # a checkpoint the key may see: saying so reveals nothing
            spec = SamplerSpec(model_path=ck.backend_path)
            try:
                backend_id, base_model, version = await self._open(model, spec, ck.base_model, ck.step, ck)
            except InvalidInputError as err:  # the backend refused the path: a bare error, a 500
                if self.door.checkpoints.get(model) is not ck:  # deleted or overwritten since it was looked up
                    raise model_not_found(model) from None
                raise FrontError(f"{model} cannot be opened: {err.message}", "model", code="model_not_sampleable") from None
        elif model in await self._base_models():
            backend_id, base_model, version = await self._open(model, SamplerSpec(base_model=model), model, 0)
        else:
            await self._close_stale()
            raise model_not_found(model)
        cached = self._fronts.get((key, model))
        front = cached[1] if cached is not None and cached[0] == backend_id else None  # a reopened sampler has a new id
        if front is None:
            assert self._svc is not None, "OpenAIDoor.running() is not active"
            context = (await self._base_models()).get(base_model)
            sampler = SamplingClient(self._svc, backend_id, base_model)
            front = OpenAIFront(
                sampler,
                version=version,
                model_name=model,
                captures=self.captures(key),
                max_n=self.max_n,
                max_tokens=self.max_tokens,
                context_window=context,
                sampler_name=model,
            )
            self._fronts[(key, model)] = (backend_id, front)
        return front

    async def models(self, key: str | None) -> list[str]:
        """What ``key`` may name as ``model``: base models, its sampling sessions, its sampler weights."""
        self.door.forget_expired()
        own = self.door.owned(key)  # the key's own sessions, never every key's
        samplers = [sid for s in own for sid in s.samplers if sid in self.door.samplers]
        models = {m for s in own for m in s.models}
        paths = [c.tinker_path for c in self.door.checkpoints_of(models) if c.kind == "sampler"]  # its own, not every key's
        return [*sorted(await self._base_models()), *samplers, *paths]


class FrontSource(Protocol):
    """What :func:`openai_router` serves from: the front for an (API key, ``model``), the models a key may
    name, and a key's captures. :class:`OpenAIDoor` is one; the local worker's ``WorkerFronts`` another."""

    async def front(self, key: str | None, model: str) -> OpenAIFront: ...

    async def models(self, key: str | None) -> list[str]: ...

    def captures(self, key: str | None) -> CaptureStore: ...


def openai_router(
    oai: FrontSource,
    api_keys: set[str] | frozenset[str] | None = None,
    *,
    key_of: Callable[[Request], str | None] | None = None,
    hold: Callable[[str | None, str], AbstractContextManager[object]] | None = None,
) -> APIRouter:
    """The ``/v1`` routes over ``oai``; with ``api_keys`` every route needs ``X-API-Key`` or a Bearer key.
    ``key_of``: how a request names its key, instead (a server whose middleware already checked it); ``hold(key,
    model)``: entered while a call on a ``model`` the key may use is served (the local worker's idle clock)."""

    def checked_key(request: Request) -> str | None:
        key = api_key_of(request, api_keys)
        if api_keys and key is None:
            raise FrontError(
                "missing or unknown API key: send one of the server's --api-key values as Authorization: Bearer or X-API-Key",
                None,
                status=401,
                code="invalid_api_key",
            )
        return key

    key_of = key_of or checked_key

    async def sample(request: Request, route: Route) -> Response:
        try:
            key = key_of(request)
            check_coding(request.headers)
            raw = await request.body()
            body = await json_body.off_loop(len(raw), parse_body, raw)  # a large body: in a thread
            model = body.get("model") if isinstance(body, dict) else None
            if not isinstance(model, str) or not model:
                raise FrontError("give the model to sample: a name from GET /v1/models", "model")
            front = await oai.front(key, model)
        except FrontError as err:
            return err.response()
        except InvalidInputError as err:  # the backend refused to open model's sampler (a base model that does not load)
            return FrontError(f"{model!r:.120} cannot be opened: {err.message}", "model", code="model_not_sampleable").response()
        with hold(key, model) if hold is not None else contextlib.nullcontext():
            return await front.answer(request, body, route)

    r = APIRouter(prefix="/v1")

    @r.post("/chat/completions", openapi_extra=_body_schema(ChatRequest))
    async def chat(request: Request) -> Response:
        return await sample(request, "chat")

    @r.post("/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await sample(request, "completions")

    @r.post("/responses", openapi_extra=_body_schema(ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await sample(request, "responses")

    @r.get("/models")
    async def models(request: Request) -> Response:
        try:
            key = key_of(request)
        except FrontError as err:
            return err.response()
        return JSONResponse({"object": "list", "data": [model_card(m) for m in await oai.models(key)]})

    @r.get("/models/{model:path}")
    async def model(model: str, request: Request) -> Response:
        """One model of GET /v1/models (``client.models.retrieve``); any other is a 404 ``model_not_found``."""
        try:
            key = key_of(request)
            if model not in await oai.models(key):
                raise model_not_found(model)
        except FrontError as err:
            return err.response()
        return JSONResponse(model_card(model))

    async def rollout_calls(rollout_id: str, request: Request, take: bool) -> Response:
        try:
            store = oai.captures(key_of(request))
        except FrontError as err:
            return err.response()
        return await rollout_reply(rollout_id, store.pop(rollout_id) if take else store.calls(rollout_id))

    @r.get("/asyncsess/rollouts/{rollout_id:path}")
    async def rollout(rollout_id: str, request: Request) -> Response:
        """The calls this key made under ``rollout_id``."""
        return await rollout_calls(rollout_id, request, take=False)

    @r.delete("/asyncsess/rollouts/{rollout_id:path}")
    async def take_rollout(rollout_id: str, request: Request) -> Response:
        """The calls this key made under ``rollout_id``, forgotten by the server."""
        return await rollout_calls(rollout_id, request, take=True)

    return r


def _body_schema(model: type[OpenAIRequest]) -> dict[str, Any]:
    """The request body's JSON schema for ``/openapi.json`` (the front validates the body itself)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
