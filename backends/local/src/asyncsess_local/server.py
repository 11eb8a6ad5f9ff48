"""The worker: the local engine behind HTTP (FastAPI on uvicorn), plus the OpenAI-compatible API with token
capture (the core front per tenant: :mod:`.openai_api`).

Every request needs an API key (``Authorization: Bearer <key>`` or ``X-API-Key``); a session, sampler or
checkpoint belongs to the key that created it and is invisible to other keys. Bad input gets a 4xx
naming the field, never a 5xx. Run it with ``asyncsess-worker --model tiny-llama --port 8765``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncsess.backends import ForwardBackwardOp, ForwardOp, LoadStateOp, SaveStateOp, SaveWeightsOp, TrainingOp
from asyncsess.backends import http_wire as wire
from asyncsess.errors import AsyncSessError, InsufficientStorageError, InvalidInputError, RateLimitError, ServerError
from asyncsess.serve import body_limit, json_body
from asyncsess.serve.body_limit import BodyLimit
from asyncsess.serve.capture import MAX_CAPTURE_TOKENS
from asyncsess.serve.defaults import SESSION_TIMEOUT
from asyncsess.types import CheckpointResponse

from . import bodies, openai_api
from .checkpoints import EPHEMERAL, KINDS, MAX_PATH_CHARS, save_bytes, tree_bytes
from .embedded import LocalBackend
from .idempotency import IDEMPOTENCY_HEADER, Creates, check_key
from .idle import IdleClock
from .tenants import Owners, tenant_of
from .vllm_sampler import VllmOptions

__all__ = ["create_app", "serve_in_thread", "tenant_of", "main"]

log = logging.getLogger("asyncsess.worker")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "added_tokens.json")


def create_app(
    backend: LocalBackend,
    api_keys: Iterable[str],
    *,
    models: Iterable[str] = (),
    max_body_bytes: int = bodies.MAX_BODY_BYTES,
    max_body_seconds: float = body_limit.MAX_BODY_SECONDS,
    max_live_per_key: int = bodies.MAX_LIVE_PER_KEY,
    max_inflight_per_key: int = bodies.MAX_INFLIGHT_PER_KEY,
    max_body_bytes_in_flight_per_key: int = bodies.MAX_BODY_BYTES_IN_FLIGHT_PER_KEY,
    max_capture_tokens: int = MAX_CAPTURE_TOKENS,
    max_checkpoints_per_key: int = bodies.MAX_CHECKPOINTS_PER_KEY,
    max_checkpoint_bytes_per_key: int = bodies.MAX_CHECKPOINT_BYTES_PER_KEY,
    session_timeout: float | None = SESSION_TIMEOUT,
) -> FastAPI:
    """The worker's routes over ``backend``. ``models``: base models clients may name besides the backend's
    default (loaded on first use); a client never names a directory. ``max_live_per_key``: sessions plus
    samplers one key may hold open at once; ``max_body_seconds``: how long a request's body may take to arrive
    (past it, a 408: a slow-loris client holds a connection and one of its key's in-flight requests); ``max_inflight_per_key``: requests one key may have in flight
    (more get a 429 with ``Retry-After``); ``max_body_bytes_in_flight_per_key``: the bytes of the bodies of one key's requests in
    flight (a request whose body would pass it gets a 429 with ``Retry-After``: 1,024 requests of 256 MB each, an op waiting
    for an earlier one say, held their bodies, decoded, at once); ``max_capture_tokens``: the OpenAI captures one key's store keeps
    (oldest rollouts dropped past it); ``max_checkpoints_per_key``: durable checkpoints one key may hold on disk
    (a save past it is refused, void); ``max_checkpoint_bytes_per_key``: the bytes they may take (a save whose estimated
    size would pass it is refused, void); ``session_timeout``: seconds without a request (a heartbeat included) after
    which a session or sampler is stopped (its client is gone; ``None`` or 0: never). ``/healthz`` (alive) and
    ``/readyz`` (serving) need no key."""
    keys = [k.encode("utf-8") for k in api_keys]
    if not keys:
        raise ValueError("the worker needs at least one API key")
    store = backend.engine.store
    owners = Owners(store.root / ".owners.jsonl")
    creates = Creates()  # the replies of creates sent with an Idempotency-Key
    ready = threading.Event()
    allowed_extra = set(models)

    def base_models() -> set[str]:
        """The base models a client may name: the backend's default, the configured ones, those loaded."""
        names = {s.name for s in backend.engine.slots.values()} | allowed_extra
        return names | {backend.default_model} if backend.default_model else names

    fronts = openai_api.WorkerFronts(backend, owners, base_models, max_capture_tokens=max_capture_tokens)
    idle = IdleClock(session_timeout)

    disk_bytes: dict[str, int] = {}  # object id -> bytes its checkpoints take on disk (dropped when they change)
    disk_counts: dict[str, int] = {}  # object id -> durable checkpoints it holds on disk (dropped when they change)

    def checkpoints_of(object_id: str) -> int:
        """The durable checkpoints ``object_id`` holds on disk (directories counted, never read)."""
        held = 0
        for kind in KINDS:
            with contextlib.suppress(OSError):
                held += sum(1 for e in os.scandir(store.root / object_id / kind) if not e.name.startswith("."))
        return held

    def release(object_id: str) -> None:
        """Forget ``object_id``'s owner once it is stopped and holds nothing its tenant may still name: no checkpoint on
        disk and no snapshot a sampler uses (the owner table held every id ever made)."""
        engine = backend.engine
        if object_id in engine.sessions or object_id in engine.samplers or engine.state.snapshot_adapters(object_id):
            return
        if object_id not in owners.durable or checkpoints_of(object_id) == 0:
            owners.forget(object_id)
            measure_again(object_id)

    def measure_again(object_id: str) -> None:
        """``object_id``'s checkpoints changed: count and measure them again at the next check."""
        disk_bytes.pop(object_id, None)
        disk_counts.pop(object_id, None)

    for journaled in list(owners.durable):  # what a restarted worker keeps: the sessions that left checkpoints
        release(journaled)
    owners.compact()

    async def stop(object_id: str) -> None:
        """Stop a session or sampler; forget its owner (and that of the stopped session whose snapshot it sampled)."""
        ref = backend.engine.samplers.get(object_id)
        await backend.stop_session(object_id)
        idle.forget(object_id)
        release(object_id)
        if ref is not None and ref.path is not None and ref.path.startswith(EPHEMERAL):
            with contextlib.suppress(InvalidInputError):
                release(store.ephemeral_owner(ref.path))

    async def reap_idle() -> list[str]:
        """Stop the sessions and samplers no request touched for ``session_timeout`` seconds; the ids stopped.
        The samplers a newer snapshot retired (``retain_snapshots``) and their clients never stopped are among them."""
        engine = backend.engine
        samplers = (i for i in owners.by_id if i not in owners.durable)  # retired ones too (live ones: the dict drops repeats)
        gone = idle.expired(dict.fromkeys([*engine.sessions, *engine.samplers, *samplers]))
        for object_id in gone:
            log.warning("stopping %s: no request for %gs (its client stopped its heartbeat)", object_id, idle.ttl)
            with contextlib.suppress(AsyncSessError):
                await stop(object_id)
        return gone

    async def reap_forever(ttl: float) -> None:
        while True:
            await anyio.sleep(min(ttl / 4, 30.0))
            try:
                await reap_idle()
            except Exception:  # never let the reaper take the worker down
                log.exception("stopping idle sessions failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.open()
        try:
            async with fronts.running(), anyio.create_task_group() as tg:
                if idle.ttl is not None:
                    tg.start_soon(reap_forever, idle.ttl)
                ready.set()
                yield
                tg.cancel_scope.cancel()
        finally:
            ready.clear()
            await backend.aclose()

    app = FastAPI(
        title="asyncsess worker",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",  # behind the key, like every route (see _Guard)
        default_response_class=_JSON,
    )
    app.router.route_class = bodies.BodyRoute  # large bodies are decoded off the event loop
    app.state.inflight = Counter()  # requests being served, per tenant (see tenant_of)
    app.state.idle, app.state.reap_idle, app.state.owners, app.state.creates = idle, reap_idle, owners, creates
    app.add_middleware(
        _Guard,
        keys=keys,
        max_body_bytes=max_body_bytes,
        max_body_seconds=max_body_seconds,
        max_inflight_per_key=max_inflight_per_key,
        max_body_bytes_in_flight=max_body_bytes_in_flight_per_key,
        inflight=app.state.inflight,
        ready=lambda: ready.is_set(),
    )

    @app.exception_handler(AsyncSessError)
    async def _typed(request: Request, err: AsyncSessError) -> Response:
        status = wire.status_for(err)  # a ConflictError is a 409 (a taken name, a reused seq, request_id or Idempotency-Key)
        if status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, err)
        elif isinstance(err, InvalidInputError):  # every refusal names a field and a fix
            err.field = err.field or "body"
            err.fix = err.fix or "see GET /openapi.json and docs/backend-local.md (Security and limits)"
        return _JSON(wire.encode_error(err), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> Response:
        return _JSON(wire.encode_error(bodies.invalid_input(err.errors())), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> Response:
        where, fix = _HTTP_FIELDS.get(err.status_code, ("body", bodies.NOT_JSON_FIX))
        cause = err.__cause__  # FastAPI's "There was an error parsing the body" says what failed no further
        detail = f"{err.detail} ({type(cause).__name__}: {str(cause)[:200]})" if cause is not None else str(err.detail)
        body = wire.encode_error(InvalidInputError(detail, field=where, fix=fix))
        return _JSON(body, status_code=err.status_code if 400 <= err.status_code < 500 else 400, headers=err.headers)

    def api_key(request: Request) -> str:
        return request.scope["asyncsess.key"]  # set by _Guard, which refused the request otherwise

    def check_base_model(name: str | None, field: str) -> str:
        if not name or name not in base_models():
            raise InvalidInputError(f"unknown base model {_show(name)}", field=field, fix="use a name from GET /v1/models")
        return name

    opening: Counter[str] = Counter()  # sessions and samplers being created, per tenant (they count as open)

    @contextmanager
    def room(key: str, what: str) -> Iterator[None]:
        """Hold one of ``key``'s ``max_live_per_key`` places while a session or sampler is created: counted and
        taken with no await between, so requests sent at once cannot all pass the check."""
        engine = backend.engine
        live = sum(1 for i, k in owners.by_id.items() if k == key and (i in engine.sessions or i in engine.samplers))
        live += opening[key]
        if live >= max_live_per_key:
            raise InvalidInputError(
                f"this API key holds {live} open sessions and samplers, the most allowed",
                field=what,
                fix="stop the ones you no longer need (DELETE /v1/sessions/{id})",
            )
        opening[key] += 1
        try:
            yield
        finally:
            opening[key] -= 1

    saving: Counter[str] = Counter()  # durable saves checked and not yet answered, per tenant (they count as held)
    saving_bytes: Counter[str] = Counter()  # their estimated sizes

    def held_checkpoints(key: str) -> int:
        """The durable checkpoints ``key``'s sessions, stopped ones included, hold on disk (directories counted, never
        read; once per session, again after it saves or one of its checkpoints is deleted: counting every session's on
        each save held the event loop ~0.1 s per save for a key of 4,096 sessions), plus its saves under way."""
        for i, k in owners.by_id.items():
            if k == key and i not in disk_counts:
                disk_counts[i] = checkpoints_of(i)
        return saving[key] + sum(disk_counts[i] for i, k in owners.by_id.items() if k == key)

    def held_bytes(key: str) -> int:
        """The bytes ``key``'s checkpoints take on disk (measured once per session, again after it saves or one of its
        checkpoints is deleted), plus the estimated sizes of its saves under way."""
        for i, k in owners.by_id.items():
            if k == key and i not in disk_bytes:
                disk_bytes[i] = sum(tree_bytes(store.root / i / kind) for kind in KINDS)
        return saving_bytes[key] + sum(disk_bytes[i] for i, k in owners.by_id.items() if k == key)

    @contextmanager
    def checkpoint_room(key: str, session_id: str, op: TrainingOp) -> Iterator[None]:
        """Hold a place among ``key``'s ``max_checkpoints_per_key``, and the save's estimated bytes among its
        ``max_checkpoint_bytes_per_key``, while ``op`` (a durable save) runs; an InvalidInputError when there is no
        room (a save over one of its names adds no checkpoint, and frees the bytes of the one it replaces)."""
        sess = backend.engine.sessions.get(session_id)
        if not isinstance(op, (SaveStateOp, SaveWeightsOp)) or op.ephemeral or sess is None:
            yield
            return
        existing = store.root / session_id / op.checkpoint_kind / op.name if op.name and op.overwrite else None
        replaces = existing is not None and existing.exists()
        held = held_checkpoints(key)
        if not replaces and held >= max_checkpoints_per_key:
            raise InvalidInputError(
                f"this API key holds {held} checkpoints, the most allowed",
                field="name",
                fix="delete one you no longer need (DELETE /v1/checkpoints?path=...), or save over one (overwrite=true)",
            )
        size = save_bytes(backend.engine.slots[sess.base_model], sess, op, backend.engine.dtype)
        after = held_bytes(key) - (tree_bytes(existing) if existing is not None and replaces else 0) + size
        if after > max_checkpoint_bytes_per_key:
            smaller = ", or save the adapter alone (merge_weights=false)" if isinstance(op, SaveWeightsOp) and op.merge_weights else ""
            raise InvalidInputError(
                f"this save (about {size:,} bytes) would take this API key's checkpoints to {after:,} bytes on disk, over "
                f"its quota of {max_checkpoint_bytes_per_key:,} (max_checkpoint_bytes_per_key)",
                field="name",
                fix=f"delete checkpoints you no longer need (DELETE /v1/checkpoints?path=...){smaller}",
            )
        saving[key] += 0 if replaces else 1
        saving_bytes[key] += size
        try:
            yield
        finally:
            saving[key] -= 0 if replaces else 1
            saving_bytes[key] -= size
            measure_again(session_id)

    def seq_is_new(session_id: str, seq: int) -> bool:
        """Whether ``seq`` is not yet taken (a re-delivery is answered by the sequencer, checked or not)."""
        next_seq = backend.next_seq(session_id)
        return next_seq is not None and seq >= next_seq

    def owned_path(key: str, path: str | None, field: str) -> None:
        """A checkpoint path must name one of this key's sessions; whose it is is read from the text alone,
        so another tenant's path and a missing one get the same answer."""
        if path is None:
            return
        store = backend.engine.store
        owner = store.ephemeral_owner(path, field) if path.startswith(EPHEMERAL) else store.owner(path, field)
        if owners.by_id.get(owner) != key:
            raise InvalidInputError(
                f"no checkpoint at {_show(path)} for this API key", field=field, fix="pass a path saved with this API key"
            )
        if not path.startswith(EPHEMERAL):
            store.resolve(path, field)  # the key's own: now it may learn that it is missing

    # ---------------------------------------------------------------- the backend protocol

    @app.get("/v1/capabilities")
    async def capabilities(key: str = Depends(api_key)) -> Any:
        return (await backend.capabilities()).model_dump(mode="json")

    def idempotency_key(request: Request) -> str | None:
        """A create's ``Idempotency-Key`` (a 400 naming it when it is garbage); see :mod:`.idempotency`."""
        return check_key(request.headers.getlist(IDEMPOTENCY_HEADER))

    @app.post("/v1/sessions")
    async def create_session(body: bodies.SessionBody, key: str = Depends(api_key), once_key: str | None = Depends(idempotency_key)) -> Any:
        async with creates.once(key, once_key, "/v1/sessions", body.model_dump(mode="json")) as once:
            if once.reply is None:  # not a retry of a create already made
                spec = body.spec()
                owned_path(key, spec.from_path, "from_path")
                if spec.from_path is None or spec.base_model:
                    check_base_model(spec.base_model, "base_model")
                with room(key, "base_model"):
                    info = await backend.create_training_session(spec)
                    try:
                        owners.own(info.model_id, key, durable=True)
                    except OSError as err:  # the journal cannot grow (a full disk): the session is stopped, not leaked
                        await backend.stop_session(info.model_id)
                        raise InsufficientStorageError(
                            f"the worker could not record the new session ({err.strerror or err})",
                            fix="the worker's disk is full: delete checkpoints (delete_checkpoint) or ask the operator to free space, then create again",
                        ) from None
                    idle.touch(info.model_id)
                once.reply = info.model_dump(mode="json")
        return once.reply

    @app.delete("/v1/creates/{once_key}", status_code=204)
    async def abandon_create(once_key: str, key: str = Depends(api_key)) -> Response:
        """The client gave up on the create it sent with this ``Idempotency-Key``: stop what it made, refuse the key."""
        check_key([once_key])
        made = await creates.abandon(key, once_key)
        if isinstance(made, dict):
            made_id = made.get("model_id") or made.get("sampler_id")
            if isinstance(made_id, str) and owners.by_id.get(made_id) == key:
                await stop(made_id)
        return Response(status_code=204)

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def stop_session(session_id: IdPath, key: str = Depends(api_key)) -> Response:
        if owners.by_id.get(session_id) == key:
            await stop(session_id)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/heartbeat", status_code=204)
    async def heartbeat(session_id: IdPath, key: str = Depends(api_key)) -> Response:
        owners.check(key, session_id)
        await backend.heartbeat(session_id)
        idle.touch(session_id)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/ops")
    async def execute(session_id: IdPath, body: bodies.OpBody, key: str = Depends(api_key)) -> Any:
        owners.check(key, session_id)
        op = body.op()
        next_seq = backend.next_seq(session_id)
        if next_seq is not None and op.seq > next_seq + bodies.MAX_SEQ_AHEAD:
            raise InvalidInputError(
                f"seq {op.seq} is too far ahead of the next op ({next_seq})",
                field="seq",
                fix=f"number ops 1, 2, 3, ... per session; at most {bodies.MAX_SEQ_AHEAD} may wait for earlier ones",
            )
        with contextlib.ExitStack() as held:
            if seq_is_new(session_id, op.seq):  # a re-delivery is answered from the sequencer's store
                try:
                    if isinstance(op, LoadStateOp):
                        owned_path(key, op.path, "path")
                    op = await backend.checked(session_id, op)  # a large pass is checked off the event loop
                    held.enter_context(checkpoint_room(key, session_id, op))
                except InvalidInputError as err:  # refused before anything ran: the op's seq is void, the later ops run
                    backend.refuse(session_id, op, err)  # raises, unless the seq is taken: then the sequencer answers
            held.enter_context(idle.using(session_id))
            result = await backend.execute_training(session_id, op)
        if isinstance(op, SaveWeightsOp) and isinstance(result, CheckpointResponse):
            owners.saved_weights(session_id, result.path)
        if isinstance(op, (ForwardOp, ForwardBackwardOp)):  # per-token outputs: megabytes of JSON, off the loop
            return await _off_loop_json(lambda: wire.encode_result(result))
        return wire.encode_result(result)

    @app.post("/v1/samplers")
    async def create_sampler(body: bodies.SamplerBody, key: str = Depends(api_key), once_key: str | None = Depends(idempotency_key)) -> Any:
        async with creates.once(key, once_key, "/v1/samplers", body.model_dump(mode="json")) as once:
            if once.reply is None:
                spec = body.spec()
                owned_path(key, spec.model_path, "model_path")
                if spec.model_path is None:
                    check_base_model(spec.base_model, "base_model")
                with room(key, "model_path" if spec.model_path else "base_model"):
                    sampler_id = await backend.create_sampler(spec)
                    owners.own(sampler_id, key)
                    idle.touch(sampler_id)
                once.reply = {"sampler_id": sampler_id}
        return once.reply

    @app.post("/v1/samplers/{sampler_id}/sample")
    async def sample(sampler_id: IdPath, body: bodies.SampleBody, key: str = Depends(api_key)) -> Any:
        owners.check(key, sampler_id)
        with idle.using(sampler_id):
            out = await backend.sample(sampler_id, body.request())
        return await _off_loop_json(lambda: out.model_dump(mode="json"))

    @app.post("/v1/samplers/{sampler_id}/logprobs")
    async def logprobs(sampler_id: IdPath, body: bodies.LogprobsBody, key: str = Depends(api_key)) -> Any:
        owners.check(key, sampler_id)
        with idle.using(sampler_id):
            out = await backend.compute_logprobs(sampler_id, body.tokens, field="tokens")
        return await _off_loop_json(lambda: {"logprobs": out})

    @app.get("/v1/checkpoints")
    async def checkpoints(session_id: IdQuery = None, key: str = Depends(api_key)) -> Any:
        """The key's own checkpoints (of one session): only its sessions are read, so another tenant's many
        checkpoints never slow its listing (it read and filtered every tenant's). The answer is rendered off the event
        loop: 4,096 checkpoints with 64 KB of user_metadata each are 300 MB of JSON (2-3 s of every tenant's calls)."""
        if session_id is not None:
            owners.check(key, session_id)
        ids = [session_id] if session_id is not None else [i for i, k in owners.by_id.items() if k == key]
        listed = [c for i in ids for c in await backend.list_checkpoints(i)]
        return await _off_loop_json(lambda: [c.model_dump(mode="json") for c in sorted(listed, key=lambda c: c.time)])

    @app.delete("/v1/checkpoints", status_code=204)
    async def delete_checkpoint(path: PathQuery, key: str = Depends(api_key)) -> Response:
        """Delete one of the key's durable checkpoints (samplers open on it keep their weights)."""
        if path.startswith(EPHEMERAL):
            raise InvalidInputError("a snapshot is not stored", field="path", fix="stop the samplers on it: it goes with them")
        owned_path(key, path, "path")
        await backend.delete_checkpoint(path)
        measure_again(store.owner(path, "path"))
        release(store.owner(path, "path"))  # its session's last checkpoint, the session stopped: nothing left to name
        return Response(status_code=204)

    tokenizers: dict[str, bytes] = {}  # base model -> the answer of GET /v1/tokenizer, rendered

    @app.get("/v1/tokenizer")
    async def tokenizer(base_model: NameQuery, key: str = Depends(api_key)) -> Any:
        """The tokenizer's files, written out once per base model in a worker thread (each call wrote and read
        megabytes on the event loop)."""
        name = check_base_model(base_model, "base_model")
        if name not in tokenizers:
            tokenizers[name] = await anyio.to_thread.run_sync(_tokenizer_answer, backend, name)
        return Response(tokenizers[name], media_type="application/json")

    app.state.openai_fronts = fronts
    app.include_router(openai_api.router(fronts, idle))
    return app


_HTTP_FIELDS = {  # what a refusal by status names, and its fix
    404: ("path", "see GET /openapi.json for the routes"),
    405: ("method", "see GET /openapi.json for the routes"),
    413: ("body", f"send at most {json_body.MAX_CONTAINERS:,} arrays and objects (split the request)"),
    415: ("Content-Type", "send Content-Type: application/json"),
}
IdPath = Annotated[str, PathParam(max_length=bodies.MAX_ID_CHARS)]
IdQuery = Annotated[str | None, Query(max_length=bodies.MAX_ID_CHARS)]
NameQuery = Annotated[str, Query(max_length=256)]
PathQuery = Annotated[str, Query(min_length=1, max_length=MAX_PATH_CHARS)]


def _dumps(content: Any) -> bytes:
    """JSON with every non-ASCII character escaped (a lone surrogate echoed in an error cannot break the
    encoder); non-finite floats are written as Python's json writes them rather than failing the response."""
    return _text(content).encode("ascii")


def _text(content: Any) -> str:
    return json.dumps(content, ensure_ascii=True, allow_nan=True, separators=(",", ":"))


RENDER_SLICE = 16_384
"""Numbers one ``json.dumps`` call renders in a large answer (see :func:`_render`)."""


def _render(content: Any) -> bytes:
    """:func:`_dumps`'s bytes, a slice of each long list of numbers at a time. ``json.dumps`` is one C call that holds
    the GIL: a forward's (512, 8192) log-probs held it 2 s, every tenant's event loop stalled behind a thread."""
    out: list[str] = []
    todo: list[Any] = [content]  # values to render, and text already rendered (a str in a _Raw)
    while todo:
        value = todo.pop()
        if isinstance(value, _Raw):
            out.append(value.text)
        elif isinstance(value, dict) and all(isinstance(k, str) for k in value):
            parts: list[Any] = [_Raw("{")]
            for i, (k, v) in enumerate(value.items()):
                parts += [_Raw(("," if i else "") + _text(k) + ":"), v]
            todo += reversed([*parts, _Raw("}")])
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], (dict, list, tuple)):
            parts = [_Raw("[")]
            for i, v in enumerate(value):
                parts += [_Raw(","), v] if i else [v]
            todo += reversed([*parts, _Raw("]")])
        elif isinstance(value, (list, tuple)) and len(value) > RENDER_SLICE:
            rows = [_text(list(value[i : i + RENDER_SLICE]))[1:-1] for i in range(0, len(value), RENDER_SLICE)]
            out.append("[" + ",".join(rows) + "]")
        else:
            out.append(_text(value))
    return "".join(out).encode("ascii")


@dataclass(frozen=True)
class _Raw:
    """Rendered JSON text on :func:`_render`'s stack."""

    text: str


class _JSON(JSONResponse):
    """A JSON response rendered by :func:`_dumps`."""

    def render(self, content: Any) -> bytes:
        return _dumps(content)


async def _off_loop_json(make: Callable[[], Any]) -> Response:
    """``make()`` as a JSON response, built and rendered in a worker thread: an answer of per-token log-probs
    can be tens of MB of text, seconds of every tenant's event loop (FastAPI also walked it with its encoder),
    and it is rendered in slices (:func:`_render`) so that the thread hands the GIL back to the loop between them."""
    return Response(await anyio.to_thread.run_sync(lambda: _render(make())), media_type="application/json")


def _tokenizer_answer(backend: LocalBackend, base_model: str) -> bytes:
    """``{"files": {name: text}}`` of ``base_model``'s tokenizer, as JSON."""
    import tempfile

    tok: Any = backend.get_tokenizer(base_model)  # a transformers tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        return _dumps({"files": {n: (Path(tmp) / n).read_text() for n in _TOKENIZER_FILES if (Path(tmp) / n).exists()}})


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


class _Guard:
    """ASGI middleware in front of every route: the API key (401), a compressed body (415), the body size (413), a key's requests
    and body bytes in flight (429), and a last resort for unexpected exceptions (a logged 500 with a JSON body; the connection
    stays open)."""

    def __init__(
        self,
        app: Any,
        keys: list[bytes],
        max_body_bytes: int,
        max_body_seconds: float,
        max_inflight_per_key: int,
        max_body_bytes_in_flight: int,
        inflight: Counter[str],
        ready: Callable[[], bool],
    ) -> None:
        self.app, self.keys, self.max_body, self.max_seconds, self.ready = app, keys, max_body_bytes, max_body_seconds, ready
        self.max_inflight, self.inflight = max_inflight_per_key, inflight
        self.max_body_in_flight, self.body_bytes = max_body_bytes_in_flight, Counter[str]()

    def _body_bytes(self, scope: Any) -> int:
        """The bytes a request's body holds, as far as its headers tell: its ``Content-Length``, the largest body for one
        sent in chunks, 0 for one without a body or over the limit (which :class:`BodyLimit` refuses before reading it)."""
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None:
            return int(length) if length.isdigit() and int(length) <= self.max_body else 0
        return self.max_body if b"transfer-encoding" in headers else 0

    def _key(self, scope: Any) -> bytes | None:
        headers = dict(scope.get("headers") or ())
        auth = headers.get(b"authorization", b"")
        key = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        ok = False
        for k in self.keys:  # compare with every key, so timing says nothing about which matched
            ok |= secrets.compare_digest(key, k)
        return key if ok else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("path") in ("/healthz", "/readyz"):  # for supervisors and load balancers; they tell nothing
            ok = scope["path"] == "/healthz" or self.ready()
            return await _JSON({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)(scope, receive, send)
        started = False

        async def reply(status: int, err: AsyncSessError, headers: dict[str, str] | None = None) -> None:
            if not started:
                await _JSON(wire.encode_error(err), status_code=status, headers=headers)(scope, receive, send)

        key = self._key(scope)
        if key is None:
            fix = "send 'Authorization: Bearer <key>'"
            return await reply(
                401, InvalidInputError("missing or wrong API key", field="Authorization", fix=fix), {"WWW-Authenticate": "Bearer"}
            )
        encoding = dict(scope.get("headers") or ()).get(b"content-encoding", b"").strip().lower()
        if encoding not in (b"", b"identity"):  # a compressed body was read as if it were plain JSON
            compressed = InvalidInputError(
                f"Content-Encoding {_show(encoding.decode('latin-1'))} is not accepted",
                field="Content-Encoding",
                fix="send the body uncompressed, without Content-Encoding",
            )
            return await reply(415, compressed)
        tenant = tenant_of(key)  # what the routes know of the key (and may store)
        scope["asyncsess.key"] = tenant
        if self.inflight[tenant] >= self.max_inflight:
            err = RateLimitError(
                f"this API key has {self.inflight[tenant]} requests in flight, the most allowed: retry after 1 s",
                retry_after=1.0,
            )
            return await reply(429, err, {"Retry-After": "1"})
        size = self._body_bytes(scope)
        if size and self.body_bytes[tenant] and self.body_bytes[tenant] + size > self.max_body_in_flight:  # (one alone goes)
            err = RateLimitError(
                f"this API key has {self.body_bytes[tenant]:,} bytes of request bodies in flight; this one's {size:,} would pass "
                f"the {self.max_body_in_flight:,} allowed: retry after 1 s",
                retry_after=1.0,
            )
            return await reply(429, err, {"Retry-After": "1"})
        self.inflight[tenant] += 1
        self.body_bytes[tenant] += size
        try:
            too_large = InvalidInputError("the body is too large", field="body", fix=f"send at most {self.max_body} bytes")

            async def tracked(message: Any) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            try:
                too_slow = InvalidInputError(
                    "the body did not arrive in time", field="body", fix=f"send the whole body within {self.max_seconds:g} s"
                )
                await BodyLimit(
                    self.app,
                    self.max_body,
                    lambda _: _JSON(wire.encode_error(too_large), status_code=413),
                    max_seconds=self.max_seconds,
                    too_slow=lambda _: _JSON(wire.encode_error(too_slow), status_code=408),
                )(scope, receive, tracked)
            except Exception as err:
                incident = uuid.uuid4().hex[:12]
                log.exception("worker error %s on %s %s", incident, scope.get("method"), scope.get("path"))
                await reply(500, ServerError(f"internal error {incident} ({type(err).__name__}); the worker logged it"))
        finally:
            self.inflight[tenant] -= 1
            self.body_bytes[tenant] -= size


# ------------------------------------------------------------------------------------- running

MAX_HEADER_BYTES = 64 * 1024  # a request's line and headers (uvicorn's default parser buffered 96 MB of them)
# h11: its buffer of a request's head is bounded (past it: a 400 and the connection closed, before any route, the
# key's check included), and it passes any method on to the routes (a 405 naming it, not the parser's plain 400)
HTTP_OPTIONS: dict[str, Any] = {"http": "h11", "h11_max_incomplete_event_size": MAX_HEADER_BYTES}


class _Thread:
    """A uvicorn server on a background thread (for tests, benchmarks and ``local://``-style embedding)."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **HTTP_OPTIONS))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> _Thread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the worker failed to start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def serve_in_thread(backend: LocalBackend, api_keys: Iterable[str], host: str = "127.0.0.1", port: int = 0, **app_options: Any) -> _Thread:
    """Start a worker on ``host:port`` (port 0: a free one) in this process; ``.url``, ``.stop()``.
    ``app_options`` go to :func:`create_app` (``models``, ``max_body_bytes``, ``max_live_per_key``, ...)."""
    return _Thread(create_app(backend, api_keys, **app_options), host, port).start()


def _timeout_seconds(text: str) -> float:
    """A finite number of seconds >= 0 (argparse's type for ``--session-timeout``; 0: never)."""
    return 0.0 if text.strip() in ("0", "0.0") else _seconds(text)


def _byte_count(text: str) -> int:
    """A positive number of bytes, with an optional binary suffix K, M, G or T (argparse's type for
    ``--max-checkpoint-bytes-per-key``)."""
    digits, unit = (text[:-1], text[-1].upper()) if text[-1:].upper() in ("K", "M", "G", "T") else (text, "")
    scale = 1 << 10 * "_KMGT".index(unit or "_")
    if not (digits.isascii() and digits.isdigit()) or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of bytes (e.g. 68719476736 or 64G)")
    return int(digits) * scale


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse's type for ``--max-body-seconds``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive, finite number of seconds")
    return value


def main(argv: list[str] | None = None) -> None:
    """``asyncsess-worker [--model M] [--allow-model M2] [--host 127.0.0.1] [--port 8765] [--api-key K] [--dir D] [--device D] [--dtype T]``."""
    import uvicorn

    p = argparse.ArgumentParser(prog="asyncsess-worker", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="base model to load at start (directory, alias or hub id)")
    p.add_argument("--allow-model", action="append", default=[], help="another base model clients may name (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--api-key", action="append", default=None, help="accepted key (repeatable; default $ASYNCSESS_API_KEY or a new one)")
    p.add_argument("--dir", default="./runs/checkpoints", help="checkpoint root")
    p.add_argument("--supervise", action="store_true", help="run the worker as a child and restart it when it crashes")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--sampler", default="auto", choices=["auto", "torch", "vllm"], help="auto: vLLM when installed and on CUDA")
    p.add_argument("--vllm-memory", type=float, default=0.4, help="vLLM's share of the GPU (the trainer keeps the rest)")
    p.add_argument("--vllm-max-model-len", type=int, default=32768, help="cap on vLLM's context (its KV cache must hold one)")
    p.add_argument("--vllm-max-loras", type=int, default=4, help="adapters in one vLLM batch")
    p.add_argument("--vllm-max-cpu-loras", type=int, default=None, help="adapters vLLM keeps loaded (default max(16, max-loras))")
    p.add_argument("--vllm-max-lora-rank", type=int, default=64)
    p.add_argument("--vllm-unembed", default="torch", choices=["torch", "refuse"], help="LM-head LoRAs vLLM cannot load")
    p.add_argument("--token-budget", type=int, default=8192, help="tokens per training micro-batch (halved after an OOM)")
    p.add_argument("--checkpoint-layers", default="auto", choices=["auto", "on", "off"], help="recompute decoder layers in backward")
    p.add_argument("--attention", default="auto", choices=["auto", "grouped", "sdpa"], help="auto: grouped float32 attention on the CPU")
    p.add_argument(
        "--max-body-seconds",
        type=_seconds,
        default=body_limit.MAX_BODY_SECONDS,
        help="seconds a request body has to arrive; a slower one (a slow-loris client) gets a 408",
    )
    p.add_argument(
        "--max-checkpoint-bytes-per-key",
        type=_byte_count,
        default=bodies.MAX_CHECKPOINT_BYTES_PER_KEY,
        help="bytes one API key's checkpoints may take on disk (a number, or with K, M, G or T: 64G); a save past it is refused",
    )
    p.add_argument(
        "--session-timeout",
        type=_timeout_seconds,
        default=SESSION_TIMEOUT,
        help="seconds without a request (heartbeats count) before a session or sampler is stopped; 0: never",
    )
    args = p.parse_args(argv)
    keys = args.api_key or ([os.environ["ASYNCSESS_API_KEY"]] if os.environ.get("ASYNCSESS_API_KEY") else [])
    if not keys:
        keys = [secrets.token_urlsafe(24)]
        print(f"API key (set ASYNCSESS_API_KEY to reuse): {keys[0]}", flush=True)
    if args.supervise:  # the same keys for every restart of the child; one not given as --api-key goes in its env
        from .supervise import supervise

        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--supervise"]
        raise SystemExit(supervise(rest, api_key=None if args.api_key else keys[0]))
    backend = LocalBackend(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        checkpoint_dir=args.dir,
        sampler=args.sampler,
        token_budget=args.token_budget,
        checkpoint_layers=args.checkpoint_layers,
        attention=args.attention,
        vllm=VllmOptions(
            memory=args.vllm_memory,
            max_model_len=args.vllm_max_model_len,
            max_loras=args.vllm_max_loras,
            max_cpu_loras=args.vllm_max_cpu_loras,
            max_lora_rank=args.vllm_max_lora_rank,
            unembed=args.vllm_unembed,
        ),
    )
    logging.basicConfig(level=logging.INFO)
    app = create_app(
        backend,
        keys,
        models=args.allow_model,
        max_body_seconds=args.max_body_seconds,
        max_checkpoint_bytes_per_key=args.max_checkpoint_bytes_per_key,
        session_timeout=args.session_timeout,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", **HTTP_OPTIONS)


if __name__ == "__main__":
    main()
