"""The Tinker-wire door: the official ``tinker`` SDK (and tinker-cookbook) in front of any asyncsess backend.

:class:`TinkerDoor` holds the state (sessions, models, samplers, checkpoints, promises) and talks to the
backend only through the :class:`~asyncsess.backends.base.Backend` seam. :func:`tinker_router` puts its routes on
an ``APIRouter`` (``/api/v1/...``); :func:`create_app` wraps them in an app with the door's lifespan.

Ordering: each model's requests run in the client's ``seq_id`` order through a
:class:`~asyncsess.backends.sequencer.Sequencer` keyed by ``(model_id, seq_id)``; a re-sent request with the same
body gets the same promise, a changed body under a used ``seq_id`` gets 409. Bad input is refused with a
4xx naming the field before it takes its ``seq_id``'s turn; that turn is then skipped so later requests
still run. Failures while running become ``{"error", "category"}`` results, which the SDK raises as
``RequestFailedError``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import heapq
import itertools
import json
import logging
import math
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..backends.base import (
    Backend,
    ForwardBackwardOp,
    ForwardOp,
    LoadStateOp,
    OptimStepOp,
    SampleRequest,
    SamplerSpec,
    SaveStateOp,
    SaveWeightsOp,
    TrainingOp,
    TrainingSessionSpec,
)
from ..backends.sequencer import Sequencer
from ..errors import AsyncSessError, ConflictError, InvalidInputError, NotFoundError, SessionGoneError
from ..types import CheckpointResponse, ForwardBackwardOutput, LoadWeightsResponse, OptimStepResponse, SampleResponse
from ..validation import (
    MAX_SAMPLES,
    MAX_TOPK,
    check_base_model,
    check_checkpoint_path,
    check_count,
    check_datums,
    check_lora_rank,
    check_loss_fn,
    check_loss_fn_config,
    check_record_stability_info,
    check_seed,
    check_target_prompt_logprobs,
    check_ttl_seconds,
    check_user_metadata,
    coerce_adam_params,
    coerce_prompt,
    coerce_sampling_params,
    is_checkpoint_name,
)
from . import json_body, tinker_proto
from .body_limit import MAX_BODY_BYTES, MAX_BODY_SECONDS, BodyLimit
from .defaults import (
    MAX_DELETED_PATHS_PER_KEY,
    MAX_FINISHED_PER_KEY,
    MAX_FORGOTTEN_PATHS_PER_KEY,
    MAX_LIVE_PER_KEY,
    MAX_PENDING,
    MAX_SAMPLERS,
    MAX_SESSIONS_PER_KEY,
    POLL_TIMEOUT,
    SESSION_TIMEOUT,
)
from .gone_paths import GonePaths
from .json_body import INLINE_BYTES  # forward_backward bodies up to this size (decompressed) are handled on the event loop
from .promises import Promise, PromiseTable

__all__ = ["TinkerDoor", "tinker_router", "create_app", "ApiError", "api_key_of"]

log = logging.getLogger("asyncsess.serve.tinker")
T = TypeVar("T")
PROTO = "application/x-protobuf"
DEFAULT_LORA_ALPHA = 32.0  # the SDK cannot send alpha; SkyRL uses 32 too
MAX_TEXT = 1024  # characters of a display_name or project_id
MAX_SEARCH_TERMS = 1024  # project ids, status queries or reasons one sessions/search may list
MAX_DETAIL = 65536  # characters of a finish detail (the SDK sends an error's text)
FINISH_REASONS = ("success", "errored", "interrupted")  # Tinker's ClientSessionFinishReason
KEEP_SEQS = 1024  # per model / sampler: how far back a re-sent seq_id is still recognised
MAX_PROMPT_TOKENS = 2**20  # tokens of a prompt when the backend does not say its model's context (the worker's bound)
SEQ_WINDOW = KEEP_SEQS  # how far past a model's first missing seq_id a request may be (the SDK's: a few chunks at most)
KEEP_RELEASED = 4096  # ids of released ephemeral samplers remembered per API key, to answer their use with why (older: 404)
EXPIRED = {"type": "expired"}  # the finish reason of a session the server expired
RELEASED_FIX = (
    "sample from a newer save_weights_and_get_sampling_client() (a session keeps its {} most recently used samplers "
    "open); for weights that stay, save_weights_for_sampler(name) and create_sampling_client(model_path)"
)
MAX_DEPTH = 64  # levels of arrays and objects in a JSON body (the SDK's nest 6): deeper, its hash or repr on the loop overflowed
INLINE_SPARSE = 1 << 18  # cells the sparse tensors of a body decoded on the event loop may expand to (else: in a thread)
# The API key of the request being served (set by the routes' auth; None on a server without keys). Sessions
# belong to the key that created them: another key's session, model, sampler, checkpoint (unless published) or
# request id is "not found", exactly as an id that never existed.
caller: contextvars.ContextVar[str | None] = contextvars.ContextVar("asyncsess_serve_caller", default=None)


class ApiError(Exception):
    """An HTTP error with a JSON body naming the field: ``{"error", "field", "fix"}``."""

    def __init__(
        self, status: int, message: str, field: str | None = None, fix: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.fix, self.headers = status, message, field, fix, headers

    @classmethod
    def from_error(cls, err: AsyncSessError) -> ApiError:
        kinds = ((ConflictError, 409), (SessionGoneError, 410), (NotFoundError, 404))
        status = next((code for kind, code in kinds if isinstance(err, kind)), 400)
        return cls(status, str(err), getattr(err, "field", None), getattr(err, "fix", None))

    def response(self) -> JSONResponse:
        body = {"error": self.message, "detail": self.message, "field": self.field, "fix": self.fix}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _not_found(what: str, value: str, fix: str) -> ApiError:
    return ApiError(404, f"no {what} {value!r:.200}", field=what, fix=fix)  # not echoing 100k characters back


def _key_at_limit(message: str, fix: str, retry_after_s: int) -> ApiError:
    """A 429 for a key at one of its per-key limits, before anything is taken (the SDK retries it after the wait)."""
    return ApiError(429, message, field="X-API-Key", fix=fix, headers={"Retry-After": str(retry_after_s)})


# ------------------------------------------------------------------------------------------ state


@dataclass
class _Session:
    id: str
    tags: list[str]
    user_metadata: dict[str, Any]
    created: float
    last_heartbeat: float
    finished: dict[str, Any] | None = None
    project_id: str | None = None
    display_name: str | None = None
    owner: str | None = None  # the API key that created it (None: a server without keys)
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    creating: dict[str, tuple[str, Promise]] = field(default_factory=dict)  # model id -> (body hash, its create's promise)
    # its sampling session ids taken (by create_sampling_session or an ephemeral save) -> what took them: one id names
    # one sampler (a second one under it replaced the first in the registry and left it open on the backend); they go
    # with the session (one door-wide table kept every refresh's id after its session was forgotten)
    sampler_ids: dict[str, str] = field(default_factory=dict)
    seen: float = field(default_factory=time.monotonic)  # the last heartbeat or request naming this session

    @property
    def expired(self) -> bool:
        return self.finished is not None and self.finished["reason"] == EXPIRED


_TRAIN_FLAGS = ("train_mlp", "train_attn", "train_unembed")


@dataclass
class _Model:
    id: str
    session_id: str
    backend_id: str
    base_model: str
    rank: int
    created: float
    user_metadata: dict[str, Any]
    sequencer: Sequencer[Any] = field(init=False)
    thunks: dict[int, Callable[[], Awaitable[Any]]] = field(default_factory=dict)
    submitted: dict[int, tuple[str, Promise]] = field(default_factory=dict)
    backend_seq: int = 1
    last_request: float = 0.0
    checkpoints: list[str] = field(default_factory=list)
    snapshots: set[str] = field(default_factory=set)  # backend paths of its ephemeral snapshots still in _backend_paths
    names: set[str] = field(default_factory=set)  # checkpoint ids ("weights/<name>") of its accepted saves, not deleted
    trains: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(_TRAIN_FLAGS, True))  # its LoRA's train_* flags
    unloaded: bool = False  # unload_model stopped it: its ops are 410s
    frontier: int = 1  # its first seq_id not received yet: every one before it arrived (or ran, or was skipped)

    def arrived(self) -> int:
        """Move :attr:`frontier` past the seq_ids received; returns it."""
        self.frontier = max(self.frontier, self.sequencer.next_seq)
        while self.frontier in self.thunks or self.frontier in self.submitted:
            self.frontier += 1
        return self.frontier


@dataclass
class _Sampler:
    """A sampling session. ``backend_id`` None: closed on the backend to bound the session's open samplers; one with
    a ``spec`` (base weights or a saved path) reopens on its next sample, an ephemeral one (no ``spec``) is released."""

    id: str
    backend_id: str | None
    base_model: str
    model_path: str | None
    session_id: str = ""
    version: int = 0  # the optimizer step of the weights it samples (0: base weights)
    ids: dict[int, tuple[str, Promise]] = field(default_factory=dict)
    spec: SamplerSpec | None = None  # how to reopen it; None: an ephemeral snapshot's sampler, which cannot be
    backend_path: str | None = None  # an ephemeral one's snapshot path on the backend
    used: int = 0  # when it was last opened or sampled (a tick of the door's clock): the least recent is closed first
    busy: int = 0  # samples accepted and not finished: a busy sampler is never closed
    lock: anyio.Lock = field(default_factory=anyio.Lock)  # one reopen at a time


@dataclass(frozen=True)
class _Limits:
    vocab: int | None
    context: int | None
    multi_target: frozenset[str]  # losses the backend takes (N, K) target_tokens for


@dataclass
class _Checkpoint:
    tinker_path: str
    backend_path: str
    model_id: str
    checkpoint_id: str  # "weights/<name>" or "sampler_weights/<name>"
    kind: str  # "training" | "sampler"
    base_model: str
    rank: int
    time: float
    step: int = 0
    public: bool = False
    expires_at: float | None = None
    user_metadata: dict[str, str] | None = None
    order: int = 0  # when the door first recorded its path (a tick of its clock): listings keep this order
    schedule: Callable[[_Checkpoint], None] | None = field(default=None, repr=False, compare=False)  # told each new expires_at

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        schedule = getattr(self, "schedule", None)
        if name == "expires_at" and value is not None and schedule is not None:
            schedule(self)

    def rest(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_type": self.kind,
            "time": _iso(self.time),
            "tinker_path": self.tinker_path,
            "size_bytes": None,
            "public": self.public,
            "expires_at": _iso(self.expires_at) if self.expires_at else None,
            "user_metadata": self.user_metadata,
        }


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _us(t: float) -> int:
    """Seconds as whole microseconds: what an ISO time in a search cursor carries exactly."""
    return round(t * 1_000_000)


def _iso_us(t: float) -> str:
    return (_EPOCH + timedelta(microseconds=_us(t))).isoformat().replace("+00:00", "Z")


def _cursor(cursor: Any) -> tuple[int, str] | None:
    """A search cursor (``{"last_created_at", "last_session_id"}``) as the (created, id) key it points after; a 400
    naming ``cursor`` and the key that is wrong otherwise."""
    if cursor is None:
        return None
    fix = "pass the previous page's next_cursor back unchanged (or none for the first page)"
    if not isinstance(cursor, dict):
        raise ApiError(
            400, f"expected an object with last_created_at and last_session_id, got {_json_type(cursor)}", field="cursor", fix=fix
        )
    when, sid = cursor.get("last_created_at"), cursor.get("last_session_id")
    if not isinstance(sid, str):
        raise ApiError(400, f"cursor.last_session_id: expected a session id, got {_json_type(sid)}", field="cursor", fix=fix)
    parsed = None
    if isinstance(when, str) and len(when) <= 64:
        with contextlib.suppress(ValueError):
            parsed = datetime.fromisoformat(when.replace("Z", "+00:00"))
    if parsed is None or parsed.tzinfo is None:
        shown = f"{when!r:.80}" if isinstance(when, str) else _json_type(when)
        raise ApiError(400, f"cursor.last_created_at: expected an ISO 8601 time with a time zone, got {shown}", field="cursor", fix=fix)
    return (parsed - _EPOCH) // timedelta(microseconds=1), sid


def _json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, for a message (``null``, ``a number``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = ((str, "a string"), ((int, float), "a number"), (list, "an array"), (dict, "an object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _status(s: _Session) -> dict[str, Any] | None:
    if s.finished is None:
        return {"type": "active"}
    reason = s.finished.get("reason")
    if isinstance(reason, dict) and reason.get("type") in ("success", "errored", "interrupted"):
        return {"type": "client_finished", "reason": {"type": reason["type"]}}
    return None  # expired, or finished without a reason Tinker names


def _status_filter(statuses: Any) -> set[tuple[str, str | None]] | None:
    """A search's ``statuses`` as the (type, reason) pairs they match (reason None: any), so each session costs one
    lookup; a 400 naming ``statuses`` unless a list of 1 to :data:`MAX_SEARCH_TERMS` queries with text types and
    reasons (a million queries, or reasons, were each compared with every session on the event loop)."""
    if statuses is None:
        return None
    fix = 'e.g. [{"type": "active"}, {"type": "client_finished", "reasons": ["success"]}]'
    if not isinstance(statuses, list) or not 0 < len(statuses) <= MAX_SEARCH_TERMS:
        raise ApiError(400, f"must be a list of 1 to {MAX_SEARCH_TERMS} status queries", field="statuses", fix=fix)
    keys: set[tuple[str, str | None]] = set()
    for q in statuses:
        kind, reasons = (q.get("type"), q.get("reasons")) if isinstance(q, dict) else (None, None)
        if not isinstance(kind, str) or not (reasons is None or isinstance(reasons, list) and len(reasons) <= MAX_SEARCH_TERMS):
            raise ApiError(400, f"must be status queries with at most {MAX_SEARCH_TERMS} reasons", field="statuses", fix=fix)
        if not all(isinstance(r, str) for r in reasons or ()):
            raise ApiError(400, "reasons must be text", field="statuses", fix=fix)
        keys |= {(kind, None)} if kind != "client_finished" or reasons is None else {(kind, r) for r in reasons}
    return keys


def _status_in(keys: set[tuple[str, str | None]], status: dict[str, Any] | None) -> bool:
    """Whether ``status`` is one :func:`_status_filter` keeps."""
    reason = status.get("reason", {}).get("type") if status is not None else None
    return status is not None and ((status["type"], None) in keys or (status["type"], reason) in keys)


def _hash(body: Any) -> str:
    raw = body if isinstance(body, bytes) else json.dumps(body, sort_keys=True, default=str).encode()
    return hashlib.sha256(raw).hexdigest()


class TinkerDoor:
    """Tinker's sessions, models, samplers, checkpoints and promises over one asyncsess backend."""

    def __init__(
        self,
        backend: Backend,
        *,
        poll_timeout: float = POLL_TIMEOUT,
        gap_timeout: float = 300.0,
        session_timeout: float = SESSION_TIMEOUT,
        max_samplers: int = MAX_SAMPLERS,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_pending: int = MAX_PENDING,
        max_live_per_key: int = MAX_LIVE_PER_KEY,
    ) -> None:
        self.backend = backend
        self.max_pending = max_pending  # unfinished requests one key may hold (see _room)
        self.max_live_per_key = max_live_per_key  # models plus open samplers one key may hold (see _live_room)
        self.max_sessions_per_key = MAX_SESSIONS_PER_KEY  # unfinished sessions one key may hold (see create_session)
        self.max_finished_per_key = MAX_FINISHED_PER_KEY  # finished ones kept for its listings (see _forget_finished)
        self.max_deleted_paths_per_key = MAX_DELETED_PATHS_PER_KEY  # its deleted checkpoints' backend paths kept as 404s
        self.max_forgotten_paths_per_key = MAX_FORGOTTEN_PATHS_PER_KEY  # its forgotten sessions' snapshot paths kept as 404s
        self._opening: dict[str | None, int] = {}  # samplers being opened by create_sampling_session, per key
        self.max_body_bytes = max_body_bytes  # what a zstd forward_backward body may inflate to (as an uncompressed one may be)
        self.max_samplers = max_samplers  # samplers a session keeps open on the backend (see _bound)
        self.poll_timeout = poll_timeout
        self.gap_timeout = gap_timeout
        # the SDK never re-sends a seq_id it gave up on (its turn counter moves on): after gap_timeout a model's
        # queue goes on without it, rather than failing every later request (False: fail them, for tests of the turns)
        self.skip_gaps = True
        self.seq_window = SEQ_WINDOW
        self.keep_seqs = KEEP_SEQS  # a sampler's re-send records: the last this many seq_ids received (the SDK re-sends recent ones)
        self.session_timeout = session_timeout  # 0: sessions never expire
        self.inline_bytes = INLINE_BYTES
        self.promises = PromiseTable()
        self.sessions: dict[str, _Session] = {}
        self._owned: dict[str | None, dict[str, _Session]] = {}  # API key -> its sessions, oldest first (a call walks its own)
        self._live: OrderedDict[str, _Session] = OrderedDict()  # unfinished sessions, least recently heard from first (reap)
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, _Sampler] = {}
        self.checkpoints: dict[str, _Checkpoint] = {}
        self._runs: dict[str | None, dict[str, None]] = {}  # API key -> its model ids, oldest first (a listing walks its own)
        self._ttl: list[tuple[float, int, _Checkpoint]] = []  # a heap of (expires_at, tick, checkpoint): what may expire next
        # whose the backend's own ids and paths are (-> door model id), so a raw backend path is checked like a tinker:// one
        self._backend_models: dict[str, str] = {}
        self._backend_paths: dict[str, str] = {}
        self._dropped = GonePaths()  # backend paths of checkpoints deleted or expired: 404s, as never-issued paths
        self._forgotten = GonePaths()  # backend paths of snapshots of forgotten sessions (_forget_finished): 404s too
        self._deleting: dict[str, anyio.Event] = {}  # tinker path -> set once its old checkpoint's backend delete is done
        self._tg: TaskGroup | None = None
        self._limits: dict[str, _Limits] = {}
        self._clock = itertools.count(1)
        self._released: dict[str | None, OrderedDict[str, str]] = {}  # API key -> its released ephemeral sampler ids -> why

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[TinkerDoor]:
        """Open the backend and the task group that runs requests; on exit stop every model and sampler."""
        await self.backend.open()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self.session_timeout > 0:
                    tg.start_soon(self._reap_forever)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                for m in list(self.models.values()):
                    with contextlib.suppress(Exception):
                        await self.backend.stop_session(m.backend_id)
                for s in list(self.samplers.values()):
                    if s.backend_id is not None:
                        with contextlib.suppress(Exception):
                            await self.backend.stop_session(s.backend_id)
                await self.backend.aclose()

    # ------------------------------------------------------------------------------- plumbing

    def _spawn(self, promise: Promise, work: Callable[[], Awaitable[Callable[[Promise], None]]]) -> None:
        """Run ``work`` in the background; it returns how to resolve the promise."""

        async def run() -> None:
            try:
                resolve = await work()
            except Exception as err:  # every failure becomes the promise's error
                log.debug("request %s failed: %r", promise.request_id, err)
                promise.fail(err)
            else:
                resolve(promise)

        if self._tg is None:
            raise RuntimeError("TinkerDoor.running() is not active (use create_app or enter it yourself)")
        self._tg.start_soon(run)

    async def _reap_forever(self) -> None:
        while True:
            await anyio.sleep(min(self.session_timeout / 4, 5.0))
            try:
                await self.reap()
            except Exception:  # a reaper failure must not take the server down; the next round retries
                log.exception("expiring sessions failed")

    async def reap(self) -> list[str]:
        """Expire every session not heard from for ``session_timeout`` seconds (none when it is 0); returns their ids."""
        if self.session_timeout <= 0:
            return []
        now = time.monotonic()
        stale = []
        for s in self._live.values():  # least recently heard from first: it stops at the first one still heard from
            if s.finished is None and now - s.seen <= self.session_timeout:
                break
            stale.append(s)
        for s in stale:
            del self._live[s.id]
        stale = [s for s in stale if s.finished is None]
        for s in stale:
            await self._expire(s)
        return [s.id for s in stale]

    async def _expire(self, s: _Session) -> None:
        """A client that stopped heartbeating (killed, cut off): release its models and samplers on the backend
        and drop its futures; later calls naming the session get 410, as for a finished session."""
        log.info("session %s expired after %g s without a heartbeat", s.id, self.session_timeout)
        s.finished = {"reason": EXPIRED, "detail": f"no heartbeat for {self.session_timeout:g} s", "time": time.time()}
        self._live.pop(s.id, None)
        await self._release(s, "session expired")
        self.promises.forget(s.id, SessionGoneError(f"session {s.id} expired"))
        s.creating.clear()
        for mid in s.models:
            self.models[mid].thunks.clear()
            self.models[mid].submitted.clear()
        for sid in s.samplers:
            self.samplers[sid].ids.clear()

    async def _release(self, s: _Session, reason: str) -> None:
        """Stop the session's models (their queues first) and samplers on the backend."""
        for mid in s.models:
            self.models[mid].sequencer.stop(reason)
            with contextlib.suppress(Exception):
                await self.backend.stop_session(self.models[mid].backend_id)
        for sid in s.samplers:
            backend_id = self.samplers[sid].backend_id
            if backend_id is not None:
                with contextlib.suppress(Exception):
                    await self.backend.stop_session(backend_id)

    def _gone(self, s: _Session) -> ApiError:
        """410 for a request naming a finished or expired session (the SDK's heartbeat loop stops on 410)."""
        if s.expired:
            why = f"expired: no heartbeat for {self.session_timeout:g} s, so its models, samplers and futures were released"
        else:
            why = "finished"
        return ApiError(410, f"session {s.id} is {why}", field="session_id", fix="create a new session")

    async def _adopt(self, session: _Session, backend_id: str) -> None:
        """Refuse a backend session created for a session that finished or expired meanwhile (stop it, no leak)."""
        if session.finished is not None:
            with contextlib.suppress(Exception):
                await self.backend.stop_session(backend_id)
            raise SessionGoneError(self._gone(session).message)

    def _room(self, session_id: str) -> None:
        """A 429 (before anything is taken: the SDK retries the same request) when the session's key already holds
        ``max_pending`` unfinished requests: a client firing requests without end held a promise and a task for each,
        and queued every other key's requests behind them."""
        owner = self.sessions[session_id].owner
        if self.promises.pending(owner) >= self.max_pending:
            raise _key_at_limit(
                f"this key has {self.max_pending} requests unfinished, the most one key may have",
                "retrieve results before sending more (retry after 1 s)",
                retry_after_s=1,
            )

    def _live_room(self, session_id: str, field: str) -> None:
        """A 400 naming ``field`` when the session's key already holds ``max_live_per_key`` models and open samplers
        (in sessions not finished or expired; those being created count): each holds backend memory, and one key
        could take all of it from the others. Checked and counted with no await between, so a burst cannot pass it."""
        owner = self.sessions[session_id].owner
        mine = [s for s in self.owned(owner) if s.finished is None]
        held = sum(1 for s in mine for m in s.models if not self.models[m].unloaded)
        held += sum(1 for s in mine for x in s.samplers if self.samplers[x].backend_id is not None)
        held += sum(1 for s in mine for _, p in s.creating.values() if not p.done.is_set())
        held += self._opening.get(owner, 0)
        if held >= self.max_live_per_key:
            raise ApiError(
                400,
                f"this API key holds {held} models and open samplers, the most allowed",
                field=field,
                fix="finish sessions you no longer need (ServiceClient.close() does), or unload_model",
            )

    def _promise(self, kind: str, prefix: str) -> Promise:
        """A new promise of the session ``prefix`` starts with, counted against its key's share of kept results."""
        return self.promises.new(kind, prefix, owner=self.sessions[prefix.split(":", 1)[0]].owner)

    def owned(self, owner: str | None) -> list[_Session]:
        """``owner``'s sessions, oldest first: what a per-key call walks (never every key's)."""
        return list(self._owned.get(owner, {}).values())

    def owns(self, session_id: str) -> bool:
        """Whether the calling key created session ``session_id``."""
        s = self.sessions.get(session_id)
        return s is not None and s.owner == caller.get()

    def _session(self, session_id: str) -> _Session:
        s = self.sessions.get(session_id) if self.owns(session_id) else None
        if s is None:
            raise _not_found("session_id", session_id, "call create_session first")
        if s.finished is not None:
            raise self._gone(s)
        self._heard(s)
        return s

    def _heard(self, s: _Session) -> None:
        """A heartbeat or request named unfinished session ``s``: it is the last one :meth:`reap` looks at."""
        s.seen = time.monotonic()
        if s.id in self._live:
            self._live.move_to_end(s.id)

    def model(self, model_id: str, *, live: bool = False) -> _Model:
        """The caller's model; ``live`` (an op): its session must be open (else 410), and the call keeps it alive."""
        m = self.models.get(model_id)
        if m is None or not self.owns(m.session_id):
            raise _not_found("model_id", model_id, "use the model_id that create_model returned")
        if live:
            self._session(m.session_id)
            if m.unloaded:  # before its turn: nothing is queued behind a model that is gone
                raise ApiError(410, f"model {m.id} was unloaded", field="model_id", fix="create a model, or load its checkpoint into one")
        return m

    def sampler(self, sampling_session_id: str, *, live: bool = False) -> _Sampler:
        s = self.samplers.get(sampling_session_id)
        if s is None and self.released(sampling_session_id) is not None:
            raise ApiError(
                410, self.released(sampling_session_id) or "", field="sampling_session_id", fix=RELEASED_FIX.format(self.max_samplers)
            )
        if s is None or not self.owns(s.session_id):
            raise _not_found("sampling_session_id", sampling_session_id, "create_sampling_session first")
        if live:
            self._session(s.session_id)
        return s

    async def _model_limits(self, base_model: str) -> _Limits:
        """What the backend reports of ``base_model`` (vocabulary, context, (N, K) losses), so datums are checked as
        asyncsess's client checks them: before they take their turn."""
        if base_model not in self._limits:
            caps = await self.backend.capabilities()
            m = next((m for m in caps.supported_models if m.model_name == base_model), None)
            self._limits[base_model] = _Limits(
                m.vocab_size if m else None, m.max_context_length if m else None, frozenset(caps.multi_target_losses)
            )
        return self._limits[base_model]

    # ------------------------------------------------------------------------------- sessions

    def create_session(self, body: dict[str, Any], owner: str | None = None) -> dict[str, Any]:
        """A new session of ``owner``'s. Each key holds at most ``max_sessions_per_key`` unfinished ones (a 429: one
        abandoned expires after ``session_timeout``); past ``max_finished_per_key`` finished ones, its oldest that
        left no checkpoint are forgotten (404s from then on, no longer listed), so a key creating and finishing
        sessions without end no longer grows the door's memory for every key."""
        tags, meta, name, project = _tags(body), _metadata(body), _opt_text(body, "display_name"), _opt_text(body, "project_id")
        mine = self.owned(owner)
        live = sum(1 for s in mine if s.finished is None)
        if live >= self.max_sessions_per_key:
            raise _key_at_limit(
                f"this API key holds {live} unfinished sessions, the most one key may hold",
                "finish the sessions you no longer use (one no longer heartbeating expires after the session timeout)",
                retry_after_s=10,
            )
        self._forget_finished(mine)
        now = time.time()
        s = _Session(str(uuid.uuid4()), tags, meta, now, now, owner=owner, display_name=name, project_id=project)
        self.add_session(s)
        return {"type": "create_session", "session_id": s.id}

    def add_session(self, s: _Session) -> None:
        """Register new session ``s`` (its owner's, unfinished)."""
        self.sessions[s.id] = self._owned.setdefault(s.owner, {})[s.id] = self._live[s.id] = s

    def _forget_finished(self, mine: list[_Session]) -> None:
        """Forget one key's oldest finished sessions that left no checkpoint, past ``max_finished_per_key - 1`` (room
        for one more): the session, its models, samplers and futures."""
        done = [s for s in mine if s.finished is not None and not any(self.models[m].checkpoints for m in s.models)]
        done.sort(key=lambda s: s.finished["time"] if s.finished else 0.0)
        for s in done[: max(0, len(done) - self.max_finished_per_key + 1)]:
            self.promises.forget(s.id, SessionGoneError(f"session {s.id} is finished"))
            for mid in s.models:
                m = self.models.pop(mid)
                self._backend_models.pop(m.backend_id, None)
                del self._runs[s.owner][mid]
                # nobody's now: its backend id (a part of its paths on mock:// and local://) and any snapshot path that
                # does not name it are 404s while remembered; its snapshots are deleted on the backend
                self._forgotten.add(m.backend_id, s.owner, self.max_forgotten_paths_per_key)
                for path in m.snapshots:
                    self._backend_paths.pop(path, None)
                    if m.backend_id not in _parts(path):
                        self._forgotten.add(path, s.owner, self.max_forgotten_paths_per_key)
                    if self._tg is not None:
                        self._tg.start_soon(_quietly, self.backend.delete_checkpoint(path))
            for smp in s.samplers:
                self.samplers.pop(smp, None)
            del self.sessions[s.id], self._owned[s.owner][s.id]

    def search_sessions(self, body: dict[str, Any]) -> dict[str, Any]:
        """``sessions/search``: the caller's sessions, newest first, a page at a time. Without user accounts every
        ``owner`` query means the calling key's own sessions. Status: ``active``, ``client_finished`` (with the
        client's reason), or none for a session the server expired (as Tinker: neither finished nor running)."""
        limit = _int(body, "limit", 50)
        if not 1 <= limit <= 200:
            raise ApiError(400, f"limit={limit}", field="limit", fix="ask for 1 to 200 sessions a page")
        meta, projects = body.get("user_metadata"), body.get("project_ids")
        meta = {} if meta is None else meta
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise ApiError(400, "must be an object of strings", field="user_metadata")
        _metadata(body)  # at most 64 pairs of clean text, as a session's own
        self.forget_expired()  # each summary counts its checkpoints
        statuses = _status_filter(body.get("statuses"))
        if projects is not None:
            if not (isinstance(projects, list) and len(projects) <= MAX_SEARCH_TERMS and all(isinstance(p, str) for p in projects)):
                raise ApiError(400, f"must be a list of at most {MAX_SEARCH_TERMS} project ids", field="project_ids")
            projects = set(projects)
        want_id = _str(body, "session_id") if body.get("session_id") is not None else None
        name = _str(body, "display_name") if body.get("display_name") is not None else None
        if name is not None and len(name) > MAX_TEXT:  # a session's display_name is at most that: a longer one never matches
            raise ApiError(400, f"{len(name)} characters", field="display_name", fix=f"keep it to {MAX_TEXT}")
        words = set(name.lower().split()) if name is not None else None
        after = _cursor(body.get("cursor"))

        def matches(s: _Session) -> bool:
            by_id = want_id is not None and s.id == want_id
            by_name = words is not None and all(w in (s.display_name or "").lower() for w in words)
            if (want_id is not None or words is not None) and not (by_id or by_name):
                return False
            if any(str(s.user_metadata.get(k)) != str(v) for k, v in meta.items()):
                return False
            if projects is not None and s.project_id not in projects:
                return False
            return statuses is None or _status_in(statuses, _status(s))

        rows = sorted(self.owned(caller.get()), key=lambda s: (_us(s.created), s.id), reverse=True)
        if after is not None:
            rows = [s for s in rows if (_us(s.created), s.id) < after]
        rows = [s for s in rows if matches(s)]
        page = rows[:limit]
        more = len(rows) > limit
        return {
            "sessions": [self._summary(s) for s in page],
            "next_cursor": {"last_created_at": _iso_us(page[-1].created), "last_session_id": page[-1].id} if more else None,
        }

    def _summary(self, s: _Session) -> dict[str, Any]:
        return {
            "session_id": s.id,
            "created_at": _iso_us(s.created),
            "owner": "local",
            "project_id": s.project_id or "",
            "status": _status(s),
            "checkpoints_count": sum(len(self.models[m].checkpoints) for m in s.models),
            "display_name": s.display_name,
            "user_metadata": {str(k): str(v) for k, v in s.user_metadata.items()} or None,
        }

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        s = self._session(_str(body, "session_id"))
        s.last_heartbeat = time.time()
        return {"type": "session_heartbeat"}

    async def finish_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        s = self.sessions.get(session_id) if self.owns(session_id) else None
        if s is None:
            raise _not_found("session_id", session_id, "use an id from create_session")
        reason, detail = body.get("reason"), body.get("detail")
        if reason is not None and not (isinstance(reason, dict) and set(reason) == {"type"} and reason["type"] in FINISH_REASONS):
            raise ApiError(400, f"got {reason!r:.60}", field="reason", fix='send {"type": "success"}, "errored" or "interrupted"')
        if detail is not None and (not isinstance(detail, str) or len(detail) > MAX_DETAIL):
            raise ApiError(400, f"expected text of at most {MAX_DETAIL} characters", field="detail")
        if detail:
            _str(body, "detail")  # no NUL, no lone surrogate
        if s.finished is None:
            s.finished = {"reason": reason, "detail": detail, "time": time.time()}
            self._live.pop(s.id, None)
            await self._release(s, "finished")
        return {"session_id": session_id, "status": "finished"}

    # --------------------------------------------------------------------------------- models

    def _register(self, model_id: str, session: _Session, backend_id: str, base_model: str, rank: int, meta: dict[str, Any]) -> _Model:
        m = _Model(model_id, session.id, backend_id, base_model, rank, time.time(), meta)

        async def run(turn: _Turn) -> Any:
            return await m.thunks.pop(turn.seq)()

        m.sequencer = Sequencer(run, first_seq=1, gap_timeout=self.gap_timeout, skip_gaps=self.skip_gaps)
        self.models[model_id] = m
        self._backend_models[backend_id] = model_id
        self._runs.setdefault(session.owner, {})[model_id] = None
        session.models.append(model_id)
        return m

    def _once(self, key: str, body: Any, kind: str, prefix: str) -> tuple[Promise, bool]:
        """The promise for a create request (created now, or the earlier one for a re-sent body)."""
        digest = _hash(body)
        creating = self.sessions[prefix].creating
        earlier = creating.get(key)
        if earlier is not None:
            if earlier[0] != digest:
                raise ApiError(409, f"{key} was already created with another request", field="model_seq_id", fix="use a fresh id")
            return earlier[1], False
        self._room(prefix)
        self._live_room(prefix, "model_seq_id")
        p = self._promise(kind, prefix)
        creating[key] = (digest, p)
        return p, True

    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        session = self._session(_str(body, "session_id"))
        seq = _int(body, "model_seq_id")
        base_model = _base_model(body) or _str(body, "base_model")
        _adam_only(body)
        lora = {"rank": 32} if body.get("lora_config") is None else body["lora_config"]
        if not isinstance(lora, dict) or "rank" not in lora:
            raise ApiError(400, "must be an object with a rank", field="lora_config", fix='e.g. {"rank": 32}')
        for key in set(lora) - {"rank", "seed", *_TRAIN_FLAGS}:
            raise ApiError(400, "is not a LoRA setting", field=f"lora_config.{key!s:.40}", fix=f"use rank, seed, {', '.join(_TRAIN_FLAGS)}")
        try:
            rank = check_lora_rank(lora.get("rank", 32), field="lora_config.rank")
            seed = check_seed(lora.get("seed"), field="lora_config.seed")
        except InvalidInputError as err:
            raise ApiError.from_error(err) from None
        trains = {k: lora.get(k, True) for k in _TRAIN_FLAGS}
        for k, v in trains.items():
            if not isinstance(v, bool):
                raise ApiError(400, f"expected true or false, got {v!r:.40}", field=f"lora_config.{k}")
        meta = _metadata(body)
        model_id = f"{session.id}:train:{seq}"
        promise, fresh = self._once(model_id, body, "create_model", session.id)
        if fresh:
            spec = TrainingSessionSpec(
                base_model=base_model,
                rank=rank,
                alpha=DEFAULT_LORA_ALPHA,
                seed=seed,
                user_metadata=meta,
                train_mlp=trains["train_mlp"],
                train_attn=trains["train_attn"],
                train_unembed=trains["train_unembed"],
            )

            async def work() -> Callable[[Promise], None]:
                info = await self.backend.create_training_session(spec)
                await self._adopt(session, info.model_id)
                self._register(model_id, session, info.model_id, info.base_model, info.lora_rank, dict(meta)).trains = trains
                return lambda p: p.resolve(json={"model_id": model_id, "type": "create_model"})

            self._spawn(promise, work)
        return _future(promise, model_id)

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        m = self.model(_str(body, "model_id"))
        tid = self._tokenizer_id(m.base_model)
        return {
            "type": "get_info",
            "model_id": m.id,
            "model_data": {"arch": None, "model_name": m.base_model, "tokenizer_id": tid},
            "is_lora": True,
            "lora_rank": m.rank,
            "model_name": m.base_model,
        }

    def _tokenizer_id(self, base_model: str) -> str:
        """A name the SDK's ``get_tokenizer()`` can load: the backend tokenizer's local directory when it has
        one (loads offline), else the base model name."""
        from pathlib import Path

        try:
            where = getattr(self.backend.get_tokenizer(base_model), "name_or_path", None)
        except Exception:  # a backend that cannot name a tokenizer for this model
            where = None
        return str(where) if where and Path(str(where)).is_dir() else base_model

    async def unload_model(self, body: dict[str, Any]) -> dict[str, Any]:
        m = self.model(_str(body, "model_id"))
        if not m.unloaded:  # once: a re-sent unload answers the same
            m.unloaded = True
            m.sequencer.stop("unloaded")
            try:
                await self.backend.stop_session(m.backend_id)
            except Exception as err:  # stopped already (its session finished), or the backend failed: it is unloaded here
                log.warning("unloading %s: %r", m.id, err)
        p = self._promise("unload_model", m.session_id)
        p.resolve(json={"model_id": m.id, "type": "unload_model"})
        return _future(p, m.id)

    # ------------------------------------------------------------------------ ordered requests

    def submit(self, m: _Model, seq: int, body: Any, kind: str, make: Callable[[], Callable[[], Awaitable[Any]]]) -> Promise:
        """Queue one request of model ``m`` at ``seq``; ``make`` validates (raising ApiError) and returns the op."""
        if seq < 1:
            raise ApiError(400, f"seq_id={seq}", field="seq_id", fix="seq_id starts at 1 for each model")
        if seq >= m.arrived() + self.seq_window:  # it would hold a promise open for requests that never come
            raise ApiError(
                400,
                f"seq_id={seq} is {seq - m.frontier} past the model's first missing one ({m.frontier})",
                field="seq_id",
                fix=f"number a model's requests 1, 2, 3, ...: at most {self.seq_window - 1} past the first not sent yet",
            )
        digest = _hash(body)
        earlier = m.submitted.get(seq)
        if earlier is not None:
            if earlier[0] != digest:
                raise ApiError(
                    409, f"seq_id {seq} of {m.id} was already used for another request", field="seq_id", fix="use a fresh seq_id"
                )
            return earlier[1]
        if seq in m.sequencer.skipped:
            raise ApiError(
                400,
                f"seq_id {seq} of {m.id} came after the model's queue went on without it (its later requests waited "
                f"{self.gap_timeout:g} s for it)",
                field="seq_id",
                fix="send a model's requests in seq_id order, without gaps",
            )
        if seq < m.sequencer.next_seq:
            raise ApiError(409, f"seq_id {seq} is older than the model's queue ({m.sequencer.next_seq})", field="seq_id")
        self._room(m.session_id)  # before make(): a 429 takes nothing, the SDK re-sends this seq_id
        m.last_request = time.time()
        try:
            thunk = make()
        except (ApiError, AsyncSessError):
            self._skip(m, seq, digest)  # the turn is used up, so later requests do not wait for it
            raise
        promise = self._promise(kind, m.id)
        m.submitted[seq] = (digest, promise)
        m.submitted.pop(seq - KEEP_SEQS, None)  # re-deliveries older than this get 409, as in the Sequencer
        m.thunks[seq] = thunk

        async def work() -> Callable[[Promise], None]:
            result = await m.sequencer.execute(_Turn(seq, digest, kind))
            return result

        self._spawn(promise, work)
        return promise

    def _skip(self, m: _Model, seq: int, digest: str) -> None:
        async def nothing() -> None:
            return None

        m.thunks[seq] = nothing
        if self._tg is not None:
            self._tg.start_soon(_quietly, m.sequencer.execute(_Turn(seq, digest, "refused")))

    def _op(self, m: _Model, make: Callable[..., TrainingOp]) -> Callable[[], Awaitable[Any]]:
        """A thunk that numbers the op for the backend when its turn comes (``make`` is a ``partial`` of a record).
        What the backend refuses at once (``precheck``: e.g. a load path that holds no checkpoint) is refused now,
        before the turn, as asyncsess's client does: failing when run, it failed every later op of the model."""
        self.backend.precheck(m.backend_id, make(seq=m.backend_seq, idempotency_key=""))

        async def run() -> Any:
            seq = m.backend_seq
            m.backend_seq += 1
            return await self.backend.execute_training(m.backend_id, make(seq=seq, idempotency_key=f"{m.id}:{seq}"))

        return run

    async def forward_backward(self, raw: bytes, encoding: str | None) -> dict[str, Any]:
        """Decompress, decode, validate and encode the result; in worker threads for bodies over ``inline_bytes``
        (megabytes of tensors stay off the event loop), inline for small ones."""
        if encoding not in (None, "", "identity", "zstd"):
            raise ApiError(400, f"Content-Encoding {encoding!r}", field="Content-Encoding", fix="send zstd or nothing")

        size = tinker_proto.decompressed_size(raw) if encoding == "zstd" else len(raw)
        off_loop = _inline if size is not None and size <= self.inline_bytes else anyio.to_thread.run_sync

        def decode(sparse: int = tinker_proto.MAX_SPARSE_VALUES) -> tuple[bytes, tinker_proto.ForwardBackwardWire]:
            body = tinker_proto.decompress(raw, self.max_body_bytes) if encoding == "zstd" else raw
            return body, tinker_proto.decode_forward_backward(body, sparse)

        try:
            try:
                raw, wire = await off_loop(decode, INLINE_SPARSE if off_loop is _inline else tinker_proto.MAX_SPARSE_VALUES)
            except tinker_proto.SparseTooLarge:  # a small body whose sparse tensors expand to more than the loop should hold
                off_loop = anyio.to_thread.run_sync
                raw, wire = await off_loop(decode)
        except tinker_proto.BodyTooLarge as err:  # inflated past what an uncompressed body may be
            raise ApiError(413, str(err), field=err.field, fix=err.fix) from None
        except InvalidInputError as err:
            raise ApiError.from_error(err) from None
        m = self.model(wire.model_id, live=True)
        limits = await self._model_limits(m.base_model)

        def check() -> Callable[..., TrainingOp] | InvalidInputError:
            if wire.error is not None:
                return wire.error
            try:
                loss_fn = check_loss_fn(wire.loss_fn)
                data = check_datums(
                    wire.data,
                    loss_fn,
                    vocab_size=limits.vocab,
                    max_length=limits.context,
                    multi_target=loss_fn in limits.multi_target,
                )
                config = check_loss_fn_config(loss_fn, wire.loss_fn_config)
            except InvalidInputError as err:
                return err
            record = ForwardOp if wire.forward_only else ForwardBackwardOp
            return functools.partial(record, data=data, loss_fn=loss_fn, loss_fn_config=config)

        checked = await off_loop(check)

        def make() -> Callable[[], Awaitable[Any]]:
            if isinstance(checked, InvalidInputError):
                raise checked
            run = self._op(m, checked)

            async def encoded() -> Callable[[Promise], None]:
                out: ForwardBackwardOutput = await run()
                blob = await off_loop(tinker_proto.encode_forward_backward_output, out)
                return lambda p: p.resolve(proto=blob)

            return encoded

        try:
            promise = self.submit(m, wire.seq_id, raw, "forward_backward", make)
        except InvalidInputError as err:
            raise ApiError.from_error(err) from None
        return _future(promise, m.id)

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        m = self.model(_str(body, "model_id"), live=True)

        def make() -> Callable[[], Awaitable[Any]]:
            if "optimizer_params" in body and "adam_params" not in body:
                raise ApiError(400, "only AdamW is offered", field="optimizer_params", fix="send adam_params")
            params = coerce_adam_params(body["adam_params"] if "adam_params" in body else body.get("optim_params"))
            run = self._op(m, functools.partial(OptimStepOp, adam_params=params))

            async def go() -> Callable[[Promise], None]:
                out: OptimStepResponse = await run()
                return lambda p: p.resolve(json={"metrics": _json_floats(out.metrics or {}), "type": "optim_step"})

            return go

        return self._submit_json(m, body, "optim_step", make)

    def _submit_json(
        self, m: _Model, body: dict[str, Any], kind: str, make: Callable[[], Callable[[], Awaitable[Any]]], same: Any = None
    ) -> dict[str, Any]:
        """Submit a JSON op at its ``seq_id``; ``same``: what a re-sent request must equal (default: the body)."""
        seq = _int(body, "seq_id")
        try:
            promise = self.submit(m, seq, body if same is None else same, kind, make)
        except InvalidInputError as err:
            raise ApiError.from_error(err) from None
        return _future(promise, m.id)

    def _record(self, m: _Model, resp: CheckpointResponse, save: functools.partial[Any], folder: str, kind: str) -> _Checkpoint:
        name, ttl, now = save.keywords["name"], save.keywords["ttl_seconds"], time.time()
        path = f"tinker://{m.id}/{folder}/{name}"
        ck = _Checkpoint(path, resp.path, m.id, f"{folder}/{name}", kind, m.base_model, m.rank, now, resp.step)
        ck.user_metadata = save.keywords["user_metadata"]
        self._backend_paths[resp.path] = m.id
        self._dropped.discard(resp.path)
        old = self.checkpoints.get(path)
        if old is None:  # an overwrite replaces the record, in its place
            m.checkpoints.append(path)
        ck.order = old.order if old is not None else next(self._clock)
        self.checkpoints[path] = ck
        ck.schedule = self._schedule
        ck.expires_at = now + ttl if ttl else None
        return ck

    def _schedule(self, ck: _Checkpoint) -> None:
        """Put ``ck``'s new ``expires_at`` on :attr:`_ttl` (each assignment of it does). Entries left behind by a later
        expiry, a delete or an overwrite are skipped when popped; past twice the checkpoints held, the heap is rebuilt
        from them, so it stays bounded."""
        assert ck.expires_at is not None
        heapq.heappush(self._ttl, (ck.expires_at, next(self._clock), ck))
        if len(self._ttl) > 2 * len(self.checkpoints) + 64:
            self._ttl = [(c.expires_at, next(self._clock), c) for c in self.checkpoints.values() if c.expires_at is not None]
            heapq.heapify(self._ttl)

    def _save_op(
        self, m: _Model, body: dict[str, Any], record: type[SaveStateOp | SaveWeightsOp], folder: str, name: str
    ) -> functools.partial[Any]:
        """The save's record (a ``partial`` awaiting its seq) with its checked ``overwrite``, ``ttl_seconds`` and
        ``user_metadata``; its name is taken from now on. A name the model holds is refused unless ``overwrite``:
        before its turn, so the model goes on (failing when run, it failed every later op of the model)."""
        overwrite = body.get("overwrite", False)
        if not isinstance(overwrite, bool):
            raise ApiError(400, f"expected true or false, got {overwrite!r:.40}", field="overwrite")
        try:
            ttl = check_ttl_seconds(body.get("ttl_seconds"))
        except InvalidInputError as err:
            raise ApiError.from_error(err) from None
        meta = _metadata(body) or None
        cid = f"{folder}/{name}"
        self.forget_expired()  # an expired name is free again
        if cid in m.names and not overwrite:
            raise ApiError(400, f"{m.id} already saved {cid}", field="path", fix="pick another name, or pass overwrite=True")
        m.names.add(cid)
        # the door keeps the names: one it does not hold (never saved, or deleted) may be written over on the backend
        return functools.partial(record, name=name, overwrite=True, ttl_seconds=ttl, user_metadata=meta)

    def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        m = self.model(_str(body, "model_id"), live=True)

        def make() -> Callable[[], Awaitable[Any]]:
            op = self._save_op(m, body, SaveStateOp, "weights", _name(body.get("path"), f"{_int(body, 'seq_id'):06d}"))
            run = self._op(m, op)

            async def go() -> Callable[[Promise], None]:
                await self._deleted(m, f"weights/{op.keywords['name']}")
                ck = self._record(m, await run(), op, "weights", "training")
                return lambda p: p.resolve(json={"path": ck.tinker_path, "type": "save_weights"})

            return go

        return self._submit_json(m, body, "save_weights", make)

    def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        m = self.model(_str(body, "model_id"), live=True)

        def make() -> Callable[[], Awaitable[Any]]:
            if body.get("kind") not in (None, "snapshot"):
                raise ApiError(
                    400,
                    f"kind={body['kind']!r:.40} is not offered: a sampler keeps the weights it was created with",
                    field="kind",
                    fix='use kind="snapshot", and a new save_weights_and_get_sampling_client() for newer weights',
                )
            ephemeral_seq = body.get("sampling_session_seq_id")
            if ephemeral_seq is not None:
                ephemeral_seq = _int(body, "sampling_session_seq_id")
            name = _name(body.get("path"), f"ephemeral-{_int(body, 'seq_id'):06d}")
            if body.get("path") is None and ephemeral_seq is None:
                raise ApiError(400, "give a path or a sampling_session_seq_id", field="path")
            sid = f"{m.session_id}:sample:{ephemeral_seq}"
            taken = self.sessions[m.session_id].sampler_ids
            if body.get("path") is None and sid in taken:
                raise ApiError(
                    409, f"{sid} already names a sampler", field="sampling_session_seq_id", fix="number a session's samplers 0, 1, 2, ..."
                )
            op = functools.partial(self._save_op(m, body, SaveWeightsOp, "sampler_weights", name), ephemeral=body.get("path") is None)
            run = self._op(m, op)
            if body.get("path") is None:
                taken[sid] = f"ephemeral {m.id} {body['seq_id']}"

            async def go() -> Callable[[Promise], None]:
                await self._deleted(m, f"sampler_weights/{name}")
                resp: CheckpointResponse = await run()
                if body.get("path") is not None:
                    ck = self._record(m, resp, op, "sampler_weights", "sampler")
                    return lambda p: p.resolve(json={"path": ck.tinker_path, "type": "save_weights_for_sampler"})
                self._backend_paths[resp.path] = m.id  # ephemeral: no tinker:// path, but still this model's
                m.snapshots.add(resp.path)
                m.names.discard(f"sampler_weights/{name}")  # never listed: its seq_id keeps it unique
                await self._open_sampler(sid, self.sessions[m.session_id], m.base_model, None, resp.path, resp.step, ephemeral=True)
                return lambda p: p.resolve(json={"path": None, "sampling_session_id": sid, "type": "save_weights_for_sampler"})

            return go

        # the SDK numbers an ephemeral save's sampler anew on each retry of the same request (same seq_id): a retry
        # after a lost answer gets the first one's future, not a 409
        same = {k: v for k, v in body.items() if k != "sampling_session_seq_id"}
        return self._submit_json(m, body, "save_weights_for_sampler", make, same)

    def _checkpoint(self, path: str, field: str) -> tuple[str, _Checkpoint | None]:
        """The backend path behind a ``tinker://`` path. Another path passes through to the backend unless it names a
        model of the door's (a path the door saved for it, or its backend id as a part) and is not one of the caller's
        live checkpoints and snapshots, or is gone (:meth:`_path_gone`): those are "not found", as a never-issued
        ``tinker://`` path is. So a deleted checkpoint of a model the door holds needs no record to stay a 404."""
        ck = self.visible_checkpoint(path)
        if ck is not None:
            return ck.backend_path, ck
        owners = self._backend_owners(path)
        if owners:  # a path of the door's models: served while the door holds it, to the key that saved it
            known = path in self._backend_paths and all(m in self.models and self.owns(self.models[m].session_id) for m in owners)
        else:  # the backend's own (made elsewhere), unless the door deleted it or forgot its model
            known = not path.startswith("tinker://") and not self._path_gone(path)
        if not known:
            raise _not_found(field, path, "use a path returned by save_state / save_weights_for_sampler on this server")
        try:
            return check_checkpoint_path(path, field), None  # a backend's path: scheme://... or an ARN, at most 4096 characters
        except InvalidInputError as err:
            raise ApiError.from_error(err) from None

    def _backend_owners(self, path: str) -> set[str]:
        """The door models a backend path belongs to: the one that saved it, and any whose backend id is one of its
        parts (``mock://<id>/…``, ``local://…/<id>/…``, however the path is spelled)."""
        owners = {self._backend_models[part] for part in _parts(path) if part in self._backend_models}
        if path in self._backend_paths:
            owners.add(self._backend_paths[path])
        return owners

    def _path_gone(self, path: str) -> bool:
        """Whether ``path`` is one the door deleted (a checkpoint deleted or expired), or names a model it forgot
        (:meth:`_forget_finished`), while it remembers them (a key's newest ``max_*_paths_per_key``). An older one
        reaches the backend, which deleted it: its not-found is a 404 as well (:meth:`ApiError.from_error`)."""
        return path in self._dropped or path in self._forgotten or any(part in self._forgotten for part in _parts(path))

    def _training_state(self, body: dict[str, Any]) -> tuple[str, str, _Checkpoint | None]:
        """``load_weights``' path, the backend path behind it and its checkpoint record (a training state, not sampler weights)."""
        path = _str(body, "path")
        backend_path, ck = self._checkpoint(path, "path")
        if ck is not None and ck.kind != "training":
            raise ApiError(400, f"{path} holds sampler weights", field="path", fix="load a path from save_state (…/weights/…)")
        return path, backend_path, ck

    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("session_id") is not None and body.get("model_id") is None:  # create via load: the model's first request
            return self._create_from_state(body, _flag(body, "optimizer"))
        m = self.model(_str(body, "model_id"), live=True)

        def make() -> Callable[[], Awaitable[Any]]:
            if body.get("session_id") is not None:
                raise ApiError(400, "give session_id or model_id, not both", field="session_id", fix="model_id loads onto that model")
            with_optimizer = _flag(body, "optimizer")
            path, backend_path, _ = self._training_state(body)
            run = self._op(m, functools.partial(LoadStateOp, path=backend_path, with_optimizer=with_optimizer))

            async def go() -> Callable[[Promise], None]:
                _: LoadWeightsResponse = await run()
                return lambda p: p.resolve(json={"path": path, "model_id": m.id, "type": "load_weights"})

            return go

        return self._submit_json(m, body, "load_weights", make)

    def _create_from_state(self, body: dict[str, Any], with_optimizer: bool) -> dict[str, Any]:
        _adam_only(body)
        path, backend_path, ck = self._training_state(body)
        session = self._session(_str(body, "session_id"))
        model_id = f"{session.id}:train:{_int(body, 'model_seq_id')}"
        meta = _metadata(body)
        base_model = _base_model(body) or (ck.base_model if ck else "")  # 5 or a 100k-character name failed when run
        promise, fresh = self._once(model_id, body, "load_weights", session.id)
        if fresh:
            rank = ck.rank if ck else 32
            trains = dict(self.models[ck.model_id].trains) if ck else dict.fromkeys(_TRAIN_FLAGS, True)
            spec = TrainingSessionSpec(
                base_model=base_model,
                rank=rank,
                alpha=DEFAULT_LORA_ALPHA,
                from_path=backend_path,
                with_optimizer=with_optimizer,
                train_mlp=trains["train_mlp"],
                train_attn=trains["train_attn"],
                train_unembed=trains["train_unembed"],
            )

            async def work() -> Callable[[Promise], None]:
                info = await self.backend.create_training_session(spec)
                await self._adopt(session, info.model_id)
                self._register(model_id, session, info.model_id, info.base_model, info.lora_rank, dict(meta)).trains = trains
                return lambda p: p.resolve(json={"path": path, "model_id": model_id, "type": "load_weights"})

            self._spawn(promise, work)
        return _future(promise, model_id)

    # ------------------------------------------------------------------------------- sampling

    async def _open_sampler(
        self,
        sid: str,
        session: _Session,
        base_model: str | None,
        path: str | None,
        backend_path: str | None,
        version: int = 0,
        *,
        ephemeral: bool = False,
    ) -> _Sampler:
        spec = SamplerSpec(base_model=None if backend_path else base_model, model_path=backend_path)
        backend_id = await self.backend.create_sampler(spec)
        await self._adopt(session, backend_id)
        s = _Sampler(sid, backend_id, base_model or "", path, session.id, version, used=next(self._clock))
        if ephemeral:
            s.backend_path = backend_path
        else:
            s.spec = spec
        self.samplers[sid] = s
        session.samplers.append(sid)
        await self._bound(session)
        return s

    async def _bound(self, session: _Session) -> None:
        """Keep at most ``max_samplers`` of the session's samplers open on the backend: close the least recently used
        idle ones past it. One on base weights or a saved path reopens on its next sample; an ephemeral one
        (``save_weights_and_get_sampling_client``) holds a snapshot nothing else can reopen, so it is released and
        its id answers 410 from then on. An RL loop that refreshes its sampler every step stays bounded; the
        samplers it still uses (rollouts of the last few steps) are the most recently used and stay open."""
        open_now = [self.samplers[sid] for sid in session.samplers if self.samplers[sid].backend_id is not None]
        idle = sorted((s for s in open_now if not s.busy), key=lambda s: s.used)
        closing: list[str] = []
        for s in idle[: max(0, len(open_now) - self.max_samplers)]:  # all state changes first, then the awaits
            assert s.backend_id is not None
            closing.append(s.backend_id)
            s.backend_id = None
            s.ids.clear()  # its re-send records (and their results) go with it
            if s.spec is None:
                del self.samplers[s.id]
                session.samplers.remove(s.id)
                if s.backend_path is not None:
                    mid = self._backend_paths.pop(s.backend_path, None)
                    if mid in self.models:
                        self.models[mid].snapshots.discard(s.backend_path)
                released = self._released.setdefault(session.owner, OrderedDict())
                released[s.id] = (
                    f"sampler {s.id} was released: its session opened {self.max_samplers} samplers used more recently, "
                    "and its snapshot weights (from save_weights_and_get_sampling_client) went with it"
                )
                while len(released) > KEEP_RELEASED:  # the key's own oldest: another key's refreshes never push these out
                    old = released.popitem(last=False)[0]  # its number is free again (the SDK never reuses one)
                    owner = self.sessions.get(old.split(":", 1)[0])
                    if owner is not None:
                        owner.sampler_ids.pop(old, None)
        for backend_id in closing:
            with contextlib.suppress(Exception):
                await self.backend.stop_session(backend_id)

    def released(self, sampling_session_id: str) -> str | None:
        """Why the caller's ephemeral sampler ``sampling_session_id`` was released (None: it was not, or not theirs)."""
        mine = self._released.get(caller.get())
        why = mine.get(sampling_session_id) if mine is not None else None
        return why if why is not None and self.owns(sampling_session_id.split(":", 1)[0]) else None

    def touch(self, s: _Sampler) -> None:
        """``s`` is being used now: it is the last of its session's samplers that :meth:`_bound` closes."""
        s.used = next(self._clock)

    async def live_backend_id(self, s: _Sampler) -> str:
        """``s``'s sampler on the backend, reopened if :meth:`_bound` closed it (the caller holds ``s.busy``)."""
        async with s.lock:
            if s.backend_id is None:
                if s.spec is None:
                    raise SessionGoneError(self.released(s.id) or f"sampler {s.id} was released")
                session = self.sessions[s.session_id]
                backend_id = await self.backend.create_sampler(s.spec)
                await self._adopt(session, backend_id)
                s.backend_id = backend_id
                await self._bound(session)
        assert s.backend_id is not None
        return s.backend_id

    async def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        session = self._session(_str(body, "session_id"))
        sid = f"{session.id}:sample:{_int(body, 'sampling_session_seq_id')}"
        path = _str(body, "model_path") if body.get("model_path") is not None else None
        base_model = _base_model(body)
        digest = _hash({"model_path": path, "base_model": base_model})
        claimed = session.sampler_ids.get(sid)
        if claimed is not None:  # a re-sent request gets its sampler; the id used for another is a 409
            if claimed != digest:
                raise ApiError(
                    409,
                    f"{sid} already names another sampler",
                    field="sampling_session_seq_id",
                    fix="number a session's samplers 0, 1, 2, ...",
                )
            if sid not in self.samplers:
                if self.released(sid) is not None:
                    self.sampler(sid)  # 410 saying why
                raise ApiError(409, f"{sid} is still being created", field="sampling_session_seq_id", fix="retry")  # the SDK retries 409
            return {"sampling_session_id": sid, "type": "create_sampling_session"}
        backend_path, version = None, 0
        if path:
            backend_path, ck = self._checkpoint(path, "model_path")
            base_model, version = (ck.base_model, ck.step) if ck else (base_model, 0)
        elif not base_model:
            raise ApiError(400, "give model_path or base_model", field="base_model", fix="e.g. the model you train")
        self._live_room(session.id, "sampling_session_seq_id")
        session.sampler_ids[sid] = digest
        self._opening[session.owner] = self._opening.get(session.owner, 0) + 1
        try:
            await self._open_sampler(sid, session, base_model, path, backend_path, version)
        except BaseException as err:
            del session.sampler_ids[sid]  # free for a retry
            if isinstance(err, (InvalidInputError, SessionGoneError)):
                raise ApiError.from_error(err) from None
            raise
        finally:
            self._opening[session.owner] -= 1
        return {"sampling_session_id": sid, "type": "create_sampling_session"}

    def get_sampler(self, sid: str) -> dict[str, Any]:
        s = self.sampler(sid)
        return {"sampler_id": s.id, "base_model": s.base_model, "model_path": s.model_path}

    async def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = body.get("sampling_session_id")
        if sid is None:  # the legacy form: sample straight from a path or a base model
            raise ApiError(400, "this server needs a sampling session", field="sampling_session_id", fix="create_sampling_session first")
        s = self.sampler(str(sid), live=True)
        seq = _int(body, "seq_id")
        _check_prompt_size(body.get("prompt"), (await self._model_limits(s.base_model)).context or MAX_PROMPT_TOKENS)
        digest = _hash(body)
        earlier = s.ids.get(seq)
        if earlier is not None:
            if earlier[0] != digest:
                raise ApiError(409, f"seq_id {seq} was already used for another sample", field="seq_id")
            return _future(earlier[1], None, earlier[1].request_id, _int(body, "num_samples", 1))
        try:
            prompt = coerce_prompt(body.get("prompt"), field="prompt")
            params = coerce_sampling_params(body.get("sampling_params"))
            n = check_count(body.get("num_samples", 1), "num_samples", low=1, high=MAX_SAMPLES)
            k_prompt = _count(body, "topk_prompt_logprobs", MAX_TOPK)
            k_sample = _count(body, "topk_sample_logprobs", MAX_TOPK)
            check_record_stability_info(body.get("record_stability_info"))
            if _count(body, "prompt_alt_tokens_k", MAX_TOPK):
                raise ApiError(400, "prompt alternatives are not offered", field="prompt_alt_tokens_k", fix="leave it at 0")
            target = check_target_prompt_logprobs(body.get("target_prompt_logprobs"), len(prompt))
            last_n = body.get("prompt_logprobs_last_n")
            if last_n is not None:
                last_n = check_count(last_n, "prompt_logprobs_last_n", low=1, high=max(1, len(prompt) - 1))
        except InvalidInputError as err:
            raise ApiError.from_error(err) from None
        want_prompt = _flag(body, "prompt_logprobs")
        if s.backend_id is None and s.model_path is not None and s.model_path.startswith("tinker://"):
            if self.visible_checkpoint(s.model_path) is None:  # closed to bound the session's samplers; cannot reopen
                raise ApiError(
                    410,
                    f"sampler {s.id} was closed and its checkpoint {s.model_path!r:.200} is gone (deleted, expired or unpublished)",
                    field="sampling_session_id",
                    fix="create a sampling client on a checkpoint that exists",
                )
        self._room(s.session_id)
        promise = self._promise("sample", s.id)
        s.ids[seq] = (digest, promise)
        s.ids.pop(seq - self.keep_seqs, None)
        while len(s.ids) > self.keep_seqs:  # scattered seq_ids (1, 10**6, ...) too: the one received longest ago goes
            del s.ids[next(iter(s.ids))]
        request = SampleRequest(tuple(prompt), n, params, want_prompt, promise.request_id, k_prompt, k_sample, target)

        s.busy += 1  # not closed while this sample runs
        self.touch(s)

        async def work() -> Callable[[Promise], None]:
            try:
                resp: SampleResponse = await self.backend.sample(await self.live_backend_id(s), request)
            finally:
                s.busy -= 1
            request.check_extras(resp)
            if last_n is not None:  # the prompt rows before the last n are not scored (log-probs and top-k alike)
                resp.prompt_logprobs = _keep_tail(resp.prompt_logprobs, last_n)
                resp.topk_prompt_logprobs = _keep_tail(resp.topk_prompt_logprobs, last_n)
            blob = tinker_proto.encode_sample_response(resp)
            return lambda p: p.resolve(proto=blob)

        self._spawn(promise, work)
        return _future(promise, None, promise.request_id, n)

    # -------------------------------------------------------------------------------- futures

    async def retrieve(self, body: dict[str, Any]) -> Response:
        rid = _str(body, "request_id")
        sid = rid.split(":", 1)[0]
        session = self.sessions[sid] if self.owns(sid) else None
        if session is not None and session.expired:
            raise self._gone(session)  # its futures were dropped
        if session is not None and session.finished is None:
            self._heard(session)
        p = self.promises.get(rid) if session is not None else None
        if p is None:
            raise _not_found("request_id", rid, "use a request_id this server returned (results are kept for a while)")
        if not await self.promises.wait(p, self.poll_timeout):
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"}, status_code=408)
        if p.forgotten:  # its key's newer results pushed it out meanwhile
            raise _not_found("request_id", rid, "retrieve results as they finish (each key's results are kept for a while)")
        if p.error is not None:
            return JSONResponse({"error": p.error, "category": p.category})
        if p.proto is not None:
            return Response(p.proto, media_type=PROTO)
        return JSONResponse(p.json or {})

    # ----------------------------------------------------------------------------------- REST

    def forget_expired(self) -> None:
        """Checkpoints past their TTL are gone, as on Tinker: no longer listed, loaded or sampled, and deleted on the
        backend (in the background)."""
        now = time.time()
        while self._ttl and self._ttl[0][0] <= now:  # only what is due: never every key's checkpoints
            when, _, ck = heapq.heappop(self._ttl)
            if self.checkpoints.get(ck.tinker_path) is ck and ck.expires_at == when:
                delete = self._forget(ck)
                if self._tg is not None:
                    self._tg.start_soon(delete)

    def _forget(self, ck: _Checkpoint) -> Callable[[], Coroutine[Any, Any, None]]:
        """The door no longer knows ``ck``: its ``tinker://`` and backend paths are 404s, its name is free. Returns
        the delete of its backend copy, which a new save under its name waits for (else it could delete the new one)."""
        del self.checkpoints[ck.tinker_path]
        self.models[ck.model_id].checkpoints.remove(ck.tinker_path)
        self.models[ck.model_id].names.discard(ck.checkpoint_id)
        self._backend_paths.pop(ck.backend_path, None)
        m = self.models[ck.model_id]
        if m.backend_id not in _parts(ck.backend_path):  # one naming its model is a 404 while the door holds the model
            self._dropped.add(ck.backend_path, self.sessions[m.session_id].owner, self.max_deleted_paths_per_key)
        done = self._deleting[ck.tinker_path] = anyio.Event()

        async def delete() -> None:
            try:
                await self.backend.delete_checkpoint(ck.backend_path)
            except Exception as err:  # a backend that cannot delete keeps it; the door no longer serves it
                log.warning("checkpoint %s stays on the backend: %s", ck.backend_path, err)
            finally:
                done.set()
                if self._deleting.get(ck.tinker_path) is done:
                    del self._deleting[ck.tinker_path]

        return delete

    async def _deleted(self, m: _Model, checkpoint_id: str) -> None:
        """Wait until the backend delete of the checkpoint ``m`` last saved as ``checkpoint_id`` (if any) is done."""
        done = self._deleting.get(f"tinker://{m.id}/{checkpoint_id}")
        if done is not None:
            await done.wait()

    def visible_checkpoint(self, path: str) -> _Checkpoint | None:
        """The checkpoint at ``path`` if the calling key saved it or it is published."""
        self.forget_expired()
        ck = self.checkpoints.get(path)
        return ck if ck is not None and (ck.public or self.owns(self.models[ck.model_id].session_id)) else None

    def training_run(self, model_id: str) -> dict[str, Any]:
        m = self.model(model_id)
        self.forget_expired()
        last = max((self.checkpoints[c] for c in m.checkpoints), key=lambda c: c.time, default=None)
        last_sampler = max(
            (self.checkpoints[c] for c in m.checkpoints if self.checkpoints[c].kind == "sampler"), key=lambda c: c.time, default=None
        )
        last_state = max(
            (self.checkpoints[c] for c in m.checkpoints if self.checkpoints[c].kind == "training"), key=lambda c: c.time, default=None
        )
        del last
        return {
            "training_run_id": m.id,
            "base_model": m.base_model,
            "model_owner": "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": m.rank,
            "last_request_time": _iso(m.last_request or m.created),
            "last_checkpoint": last_state.rest() if last_state else None,
            "last_sampler_checkpoint": last_sampler.rest() if last_sampler else None,
            "user_metadata": {str(k): str(v) for k, v in m.user_metadata.items()} or None,
        }

    def training_runs(self, limit: int, offset: int, project_id: str | None = None) -> dict[str, Any]:
        """The caller's runs; with ``project_id``, those whose session is in that project."""
        page = _page(limit, offset)
        ids = list(self._runs.get(caller.get(), ()))
        if project_id is not None:
            ids = [i for i in ids if self.sessions[self.models[i].session_id].project_id == project_id]
        return {
            "training_runs": [self.training_run(i) for i in ids[page]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)},
        }

    def list_checkpoints(self, model_id: str) -> dict[str, Any]:
        """One run's checkpoints (all the caller's: :meth:`user_checkpoints`). A session id of the caller's lists its
        runs' checkpoints: Tinker's tutorial 204 passes ``model_id.split(":")[0]`` as the run id."""
        if model_id not in self.models and self.owns(model_id):
            runs = self.sessions[model_id].models
        else:
            runs = [self.model(model_id).id]  # the caller's run, or 404
        self.forget_expired()
        cks = [c.rest() for c in self.checkpoints_of(runs)]
        return {"checkpoints": cks, "cursor": {"offset": 0, "limit": len(cks), "total_count": len(cks)}}

    def checkpoints_of(self, runs: Iterable[str]) -> list[_Checkpoint]:
        """The checkpoints of models ``runs`` (those the door holds), in the order the door first recorded them."""
        held = (self.models[r] for r in runs if r in self.models)
        return sorted((self.checkpoints[p] for m in held for p in m.checkpoints), key=lambda c: c.order)

    def user_checkpoints(self, limit: int, offset: int) -> dict[str, Any]:
        """``list_user_checkpoints``: the caller's checkpoints across its runs, newest first, a page at a time."""
        page = _page(limit, offset)
        self.forget_expired()
        mine = sorted(self.checkpoints_of(self._runs.get(caller.get(), ())), key=lambda c: c.time, reverse=True)
        return {
            "checkpoints": [c.rest() for c in mine[page]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(mine)},
        }

    def checkpoint_by_id(self, model_id: str, checkpoint_id: str) -> _Checkpoint:
        self.model(model_id)  # the caller's run, or 404
        self.forget_expired()
        ck = self.checkpoints.get(f"tinker://{model_id}/{checkpoint_id}")
        if ck is None:
            raise _not_found("checkpoint_id", checkpoint_id, "list the run's checkpoints")
        return ck

    async def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        """Forget the checkpoint (its path is a 404 from now on), then delete it on the backend: the cookbook's
        rolling checkpoints delete the previous one each step to bound storage."""
        await self._forget(self.checkpoint_by_id(model_id, checkpoint_id))()

    def set_ttl(self, model_id: str, checkpoint_id: str, body: dict[str, Any]) -> None:
        ck = self.checkpoint_by_id(model_id, checkpoint_id)
        try:
            ttl = check_ttl_seconds(body.get("ttl_seconds"))
        except InvalidInputError as err:
            raise ApiError.from_error(err) from None
        ck.expires_at = None if ttl is None else time.time() + ttl

    def publish(self, model_id: str, checkpoint_id: str, public: bool) -> None:
        self.checkpoint_by_id(model_id, checkpoint_id).public = public

    def weights_info(self, body: dict[str, Any]) -> dict[str, Any]:
        path = _str(body, "tinker_path")
        ck = self.visible_checkpoint(path)
        if ck is None:
            raise _not_found("tinker_path", path, "use a path returned by a save on this server")
        return {"base_model": ck.base_model, "is_lora": True, "lora_rank": ck.rank, **self.models[ck.model_id].trains}

    def session_info(self, session_id: str) -> dict[str, Any]:
        s = self.sessions.get(session_id) if self.owns(session_id) else None
        if s is None:
            raise _not_found("session_id", session_id, "use an id from create_session")
        return {
            "training_run_ids": list(s.models),
            "sampler_ids": list(s.samplers),
            "user_metadata": {str(k): str(v) for k, v in s.user_metadata.items()} or None,
            "display_name": s.display_name,
        }

    def set_project(self, session_id: str, body: dict[str, Any]) -> None:
        s = self.sessions.get(session_id) if self.owns(session_id) else None
        if s is None:
            raise _not_found("session_id", session_id, "use an id from create_session")
        s.project_id = _opt_text(body, "project_id")

    async def capabilities(self) -> dict[str, Any]:
        caps = await self.backend.capabilities()
        return {
            "supported_models": [
                {
                    "model_name": m.model_name,
                    "max_context_length": m.max_context_length,
                    "trainable": m.trainable,
                    "sampleable": m.sampleable,
                    "vocab_size": m.vocab_size,  # not in Tinker's schema (the SDK ignores it); lets tinker:// check tokens early
                }
                for m in caps.supported_models
            ],
            "multi_target_losses": list(caps.multi_target_losses),  # not in Tinker's schema either: for tinker://
        }


async def _inline(fn: Callable[..., T], *args: Any) -> T:
    """``anyio.to_thread.run_sync``'s shape, run on the event loop (for work smaller than a thread hop)."""
    return fn(*args)


async def _quietly(aw: Awaitable[Any]) -> None:
    with contextlib.suppress(Exception):
        await aw


@dataclass(frozen=True)
class _Turn:
    """One request's place in its model's queue (``seq_id``), keyed by a digest of its body."""

    seq: int
    idempotency_key: str
    kind: str


def _future(p: Promise, model_id: str | None, prefix: str | None = None, n: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"request_id": p.request_id}
    if model_id is not None:
        out["model_id"] = model_id
    if n is not None:
        out["sample_sequence_ids"] = [f"{prefix}:{i}" for i in range(n)]
    return out


def _str(body: dict[str, Any], key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        raise ApiError(400, f"expected a non-empty string, got {type(v).__name__}", field=key)
    if "\x00" in v:
        raise ApiError(400, "contains NUL", field=key)
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "is not valid Unicode (a lone surrogate?)", field=key, fix="send UTF-8-encodable text") from None
    return v


def _json_floats(metrics: dict[str, float]) -> dict[str, float | str]:
    """Metrics for a JSON answer: NaN and infinities (an exploded gradient's grad_norm) as the strings "NaN",
    "Infinity", "-Infinity", which the SDK's pydantic types read back as floats. JSON has no such numbers: the
    answer was a 500 on every poll, which the SDK retried without end."""
    return {
        k: v if not isinstance(v, float) or math.isfinite(v) else str(v).replace("inf", "Infinity").replace("nan", "NaN")
        for k, v in metrics.items()
    }


def _opt_text(body: dict[str, Any], key: str) -> str | None:
    """An optional text field (``display_name``, ``project_id``): absent, or at most 1024 characters of clean text."""
    if body.get(key) in (None, ""):
        return None
    text = _str(body, key)
    if len(text) > MAX_TEXT:
        raise ApiError(400, f"{len(text)} characters", field=key, fix=f"keep it to {MAX_TEXT}")
    return text


def _base_model(body: dict[str, Any]) -> str | None:
    """``base_model``: absent, null or ``""`` (None), else a model name as the client checks it (a 400 naming it)."""
    if body.get("base_model") in (None, ""):
        return None
    try:
        return check_base_model(body["base_model"])
    except InvalidInputError as err:
        raise ApiError.from_error(err) from None


def _flag(body: dict[str, Any], key: str) -> bool:
    """A JSON ``true`` / ``false`` (absent or null: false); anything else is a 400 naming ``key`` ("false" was read as true)."""
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"expected true or false, got {v!r:.40}", field=key)
    return v


def _count(body: dict[str, Any], key: str, high: int) -> int:
    """An optional count in 0..``high`` (absent or null: 0); a string, list or object is a 400 (it was read as 0)."""
    v = body.get(key)
    try:
        return int(check_count(0 if v is None else v, key, high=high))
    except InvalidInputError as err:
        raise ApiError.from_error(err) from None


def _adam_only(body: dict[str, Any]) -> None:
    """``optimizer_config``: absent or AdamW (the one optimizer offered; another was ignored and AdamW trained)."""
    config = body.get("optimizer_config")
    if config is not None and not (isinstance(config, dict) and config.get("type", "adamw") == "adamw" and set(config) <= {"type"}):
        raise ApiError(400, f"{config!r:.60} is not offered", field="optimizer_config", fix='leave it out or send {"type": "adamw"}')


def _int(body: dict[str, Any], key: str, default: int | None = None, *, field: str | None = None) -> int:
    v = body.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"expected an integer, got {v!r:.40}", field=field or key)
    if not -(2**62) < v < 2**62:
        raise ApiError(400, "out of range", field=field or key)
    return v


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    """``user_metadata``: an object (Tinker's ``dict[str, Any]``), kept as text; NUL, lone surrogates refused."""
    meta = body.get("user_metadata")
    if meta is not None and not isinstance(meta, dict):
        raise ApiError(400, f"expected an object, got {type(meta).__name__}", field="user_metadata", fix='e.g. {"run": "a"}')
    try:
        return check_user_metadata({k: v if isinstance(v, str) else str(v) for k, v in (meta or {}).items()})
    except InvalidInputError as err:
        raise ApiError.from_error(err) from None


def _tags(body: dict[str, Any]) -> list[str]:
    """``tags``: a list of strings (checked as metadata values are)."""
    tags = body.get("tags")
    if tags is not None and not isinstance(tags, list):
        raise ApiError(400, f"expected a list of strings, got {type(tags).__name__}", field="tags", fix='e.g. ["rl"]')
    try:
        return list(check_user_metadata({str(i): t for i, t in enumerate(tags or [])}, field="tags").values())
    except InvalidInputError as err:
        raise ApiError.from_error(err) from None


MAX_PAGE = 10_000  # rows one page of a REST listing may ask for


def _parts(path: str) -> list[str]:
    """A backend path's components (``mock://<id>/weights/x`` -> ``mock``, ``""``, ``""``, ``<id>``, ...)."""
    return re.split(r"[/:\\]", path)


def _page(limit: int, offset: int) -> slice:
    """A listing's ``limit`` (1..10,000) and ``offset`` (>= 0) as the slice of its rows; a 400 naming the field
    otherwise (a negative one was a Python slice from the end)."""
    if not 1 <= limit <= MAX_PAGE:
        raise ApiError(400, f"limit={limit}", field="limit", fix=f"ask for 1 to {MAX_PAGE} rows a page")
    if offset < 0:
        raise ApiError(400, f"offset={offset}", field="offset", fix="start at offset 0 or later")
    return slice(offset, offset + limit)


def _check_prompt_size(prompt: Any, limit: int) -> None:
    """A prompt of more tokens (or chunks) than ``limit`` is a 400 naming it, counted from the list lengths alone:
    hashing and checking 40M token ids held the event loop every key shares for 6 s before the backend refused them."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if isinstance(prompt, list):
        count = len(prompt)
    elif isinstance(chunks, list):
        count = (
            len(chunks)
            if len(chunks) > limit
            else sum(len(c["tokens"]) for c in chunks if isinstance(c, dict) and isinstance(c.get("tokens"), list))
        )
    else:
        return  # not a prompt: coerce_prompt names what is wrong with it
    if count > limit:
        raise ApiError(400, f"{count} tokens, more than the context ({limit})", field="prompt", fix=f"send at most {limit} tokens")


def _keep_tail(rows: list[Any] | None, last_n: int) -> list[Any] | None:
    return None if rows is None else [None if i < len(rows) - last_n else v for i, v in enumerate(rows)]


def _name(path: Any, default: str) -> str:
    if path is None:
        return default
    if not is_checkpoint_name(path):  # one rule for every backend ("." and ".." name directories on disk)
        raise ApiError(
            400, f"bad checkpoint name {path!r:.60}", field="path", fix="use 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return path


# ----------------------------------------------------------------------------------------- routes


def _nan(constant: str) -> float:
    return math.nan  # NaN, Infinity and -Infinity alike: each is refused by the field's check, none read as a bound


def _decode(raw: bytes) -> Any:
    """The JSON body (NaN read as a value each field refuses); a RecursionError past :data:`MAX_DEPTH` levels."""
    body = json_body.loads(raw, _nan)
    if json_body.nests_past(body, MAX_DEPTH):
        raise RecursionError(f"more than {MAX_DEPTH} levels")
    return body


async def _json(request: Request) -> dict[str, Any]:
    """The body as a JSON object; a large one is decoded in a worker thread, not on the loop every key shares. One
    declared as another type (a ``Content-Type`` neither JSON nor absent) or compressed is a 415 naming the header."""
    if (coding := json_body.coding(request.headers)) is not None:
        raise ApiError(415, f"Content-Encoding {coding!r:.60}", field="Content-Encoding", fix="send the JSON body uncompressed")
    if (declared := json_body.foreign_type(request.headers)) is not None:
        raise ApiError(415, f"Content-Type {declared!r:.80} is not JSON", field="Content-Type", fix="send Content-Type: application/json")
    raw = await request.body()
    try:
        body = await json_body.off_loop(len(raw), _decode, raw)
    except json_body.TooManyContainers as err:
        raise ApiError(413, str(err), field="body", fix=f"send at most {json_body.MAX_CONTAINERS:,} (split the request)") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"body is not JSON ({err})", field="body") from None
    except RecursionError:
        raise ApiError(400, "body nests too deeply", field="body", fix=f"nest arrays and objects at most {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object", field="body")
    return body


def api_key_of(request: Request, api_keys: set[str] | frozenset[str] | None) -> str | None:
    """The server's key this request carries (``X-API-Key``, else ``Authorization: Bearer``); None if none."""
    if not api_keys:
        return None
    bearer = request.headers.get("authorization", "")
    for key in (request.headers.get("x-api-key"), bearer[7:] if bearer[:7].lower() == "bearer " else None):
        if key in api_keys:
            return key
    return None


def tinker_router(door: TinkerDoor, api_keys: set[str] | frozenset[str] | None = None) -> APIRouter:
    """Tinker's ``/api/v1`` routes over ``door``. With ``api_keys``, every route but healthz needs ``X-API-Key``."""

    async def auth(request: Request) -> None:
        key = api_key_of(request, api_keys)
        if key is None and api_keys:
            raise ApiError(401, "missing or unknown X-API-Key", field="X-API-Key", fix="send one of the server's --api-key values")
        caller.set(key)  # the endpoint runs in this context: the door checks ownership against it

    r = APIRouter(prefix="/api/v1")
    guarded = APIRouter(dependencies=[Depends(auth)])

    @r.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    # the per-step routes first: the router tries routes in order
    @guarded.post("/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        return await door.retrieve(await _json(request))

    @guarded.post("/asample")
    async def asample(request: Request) -> dict[str, Any]:
        return await door.asample(await _json(request))

    @guarded.post("/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        ctype = request.headers.get("content-type", "")
        if json_body.media_type(ctype) != PROTO:  # parsed: "text/plain; x=application/x-protobuf" is not protobuf
            raise ApiError(415, f"content-type {ctype!r:.80}", field="Content-Type", fix=f"send {PROTO} as the tinker SDK does")
        return await door.forward_backward(await request.body(), request.headers.get("content-encoding"))

    @guarded.post("/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        return door.optim_step(await _json(request))

    @guarded.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        return door.save_weights_for_sampler(await _json(request))

    @guarded.post("/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        return door.heartbeat(await _json(request))

    @guarded.post("/client/config")
    async def client_config() -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False}

    @guarded.post("/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 300}

    @guarded.post("/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @guarded.post("/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        return door.create_session(await _json(request), owner=caller.get())

    @guarded.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict[str, Any]:
        return await door.finish_session(session_id, await _json(request))

    @guarded.get("/sessions/{session_id}")
    async def get_session(session_id: str) -> dict[str, Any]:
        return door.session_info(session_id)

    @guarded.post("/sessions/search")
    async def search_sessions(request: Request) -> dict[str, Any]:
        return door.search_sessions(await _json(request))

    @guarded.get("/sessions")
    async def list_sessions(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        page = _page(limit, offset)
        return {"sessions": [s.id for s in door.owned(caller.get())][page]}

    @guarded.api_route("/get_server_capabilities", methods=["GET", "POST"])
    async def capabilities() -> dict[str, Any]:
        return await door.capabilities()

    @guarded.post("/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        return door.create_model(await _json(request))

    @guarded.post("/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return door.get_info(await _json(request))

    @guarded.post("/unload_model")
    async def unload_model(request: Request) -> dict[str, Any]:
        return await door.unload_model(await _json(request))

    @guarded.post("/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return door.save_weights(await _json(request))

    @guarded.post("/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        return door.load_weights(await _json(request))

    @guarded.post("/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        return await door.create_sampling_session(await _json(request))

    @guarded.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        return door.get_sampler(sampler_id)

    @guarded.get("/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0, project_id: str | None = None) -> dict[str, Any]:
        return door.training_runs(limit, offset, project_id)

    @guarded.get("/training_runs/{model_id}")
    async def training_run(model_id: str) -> dict[str, Any]:
        return door.training_run(model_id)

    @guarded.get("/training_runs/{model_id}/checkpoints")
    async def run_checkpoints(model_id: str) -> dict[str, Any]:
        return door.list_checkpoints(model_id)

    @guarded.put("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def checkpoint_ttl(model_id: str, checkpoint_id: str, request: Request) -> Response:
        door.set_ttl(model_id, checkpoint_id, await _json(request))
        return Response(status_code=204)

    @guarded.post("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
    async def publish(model_id: str, checkpoint_id: str) -> Response:
        door.publish(model_id, checkpoint_id, True)
        return Response(status_code=204)

    @guarded.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
    async def unpublish(model_id: str, checkpoint_id: str) -> Response:
        door.publish(model_id, checkpoint_id, False)
        return Response(status_code=204)

    @guarded.put("/sessions/{session_id}/project")
    async def session_project(session_id: str, request: Request) -> Response:
        door.set_project(session_id, await _json(request))
        return Response(status_code=204)

    @guarded.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str) -> Response:
        await door.delete_checkpoint(model_id, checkpoint_id)
        return Response(status_code=204)

    @guarded.get("/checkpoints")
    async def checkpoints(limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return door.user_checkpoints(limit, offset)

    @guarded.post("/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        return door.weights_info(await _json(request))

    r.include_router(guarded)
    return r


def install_error_handlers(app: FastAPI) -> None:
    """4xx with a JSON body naming the field for every refusal; never a 5xx for bad input."""
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return ApiError(400, str(first.get("msg", "invalid request")), field=where or None).response()


def create_app(
    backend: Backend,
    api_keys: set[str] | frozenset[str] | None = None,
    *,
    poll_timeout: float = POLL_TIMEOUT,
    session_timeout: float = SESSION_TIMEOUT,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_samplers: int = MAX_SAMPLERS,
    max_body_seconds: float = MAX_BODY_SECONDS,
    max_pending: int = MAX_PENDING,
    max_live_per_key: int = MAX_LIVE_PER_KEY,
) -> FastAPI:
    """One server with both doors in front of ``backend``: Tinker's HTTP API (``/api/v1``) and the
    OpenAI-compatible front (``/v1``, :mod:`.openai_door`), sharing the session registry and ``api_keys``.
    A request body over ``max_body_bytes`` is a 413 in the door's error shape, before any of it is buffered; one
    still arriving ``max_body_seconds`` after the request began (a slow-loris client) a 408; so are an unknown
    route (404) and a method a route does not take (405)."""
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .openai_door import OpenAIDoor, openai_router
    from .openai_wire import FrontError

    def refusal(path: str, status: int, message: str, field: str, fix: str, code: str) -> JSONResponse:
        """A refusal in the error shape of the door ``path`` belongs to (OpenAI's under ``/v1/``)."""
        if path.startswith("/v1/"):
            return FrontError(f"{message}: {fix}", field, status, code).response()
        return ApiError(status, message, field=field, fix=fix).response()

    def too_large(scope: Any) -> JSONResponse:
        path = str(scope.get("path", ""))
        return refusal(path, 413, "the request body is too large", "body", f"send at most {max_body_bytes} bytes", "body_too_large")

    def too_slow(scope: Any) -> JSONResponse:
        path, fix = str(scope.get("path", "")), f"send the whole body within {max_body_seconds:g} s"
        return refusal(path, 408, "the request body did not arrive in time", "body", fix, "body_timeout")

    door = TinkerDoor(
        backend,
        poll_timeout=poll_timeout,
        session_timeout=session_timeout,
        max_samplers=max_samplers,
        max_body_bytes=max_body_bytes,
        max_pending=max_pending,
        max_live_per_key=max_live_per_key,
    )
    oai = OpenAIDoor(door)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with door.running(), oai.running():
            yield

    app = FastAPI(title="asyncsess serve: Tinker wire + OpenAI front", lifespan=lifespan)
    app.state.tinker_door = door
    app.state.openai_door = oai
    install_error_handlers(app)

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(request: Request, err: StarletteHTTPException) -> JSONResponse:
        field, code = ("method", "method_not_allowed") if err.status_code == 405 else ("path", "not_found")
        message = f"{request.method} {request.url.path[:200]}: {err.detail}"
        response = refusal(request.url.path, err.status_code, message, field, "see the routes in GET /openapi.json", code)
        response.headers.update(err.headers or {})  # a 405's Allow
        return response

    app.include_router(tinker_router(door, api_keys))
    app.include_router(openai_router(oai, api_keys))
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, refuse=too_large, max_seconds=max_body_seconds, too_slow=too_slow)
    return app
