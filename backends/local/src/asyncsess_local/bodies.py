"""The worker's request bodies: one pydantic model per route, with explicit limits.

This is the worker's validation layer. FastAPI checks every body against these models before a route
runs (so a rejection consumes no sequence number), publishes them in ``/openapi.json``, and answers a
failure with a 400 naming the field. Limits, all documented in docs/backend-local.md:

- numbers are finite (NaN and ±inf are refused), with the ranges below, and of their JSON type (strict: a
  bool, a string or ``2.0`` where an int goes is refused, as is ``1`` or ``"true"`` where a bool goes);
- free text holds no NUL and no lone surrogate, and has a length cap;
- checkpoint names match a full-string pattern; checkpoint paths are at most 1024 characters;
- counts are capped: datums per op, tokens per prompt, samples per request, stop strings.

What needs the server's state (a base model from its list, a path inside the key's own storage, token
ids inside the vocabulary, a prompt inside the context) is checked by the routes and the backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, JsonValue, ValidationError
from starlette.exceptions import HTTPException

from asyncsess.backends import OP_TYPES, SampleRequest, SamplerSpec, TrainingOp, TrainingOpKind, TrainingSessionSpec
from asyncsess.errors import InvalidInputError
from asyncsess.serve import body_limit, json_body
from asyncsess.types import MAX_SEED, AdamParams, Datum, SamplingParams
from asyncsess.validation import MAX_TOPK, check_description, check_session_options, check_target_prompt_logprobs, check_ttl_seconds

from .checkpoints import MAX_PATH_CHARS, CheckpointStore
from .embedded import MAX_LORA_ALPHA, MAX_NUM_SAMPLES
from .sessions import MAX_LORA_RANK

__all__ = [
    "BodyRoute",
    "LogprobsBody",
    "OpBody",
    "ForwardBody",
    "ForwardBackwardBody",
    "OptimStepBody",
    "SaveStateBody",
    "SaveWeightsBody",
    "LoadStateBody",
    "SampleBody",
    "SamplerBody",
    "SessionBody",
    "Text",
    "MAX_BODY_BYTES",
    "MAX_DATUMS",
    "MAX_PROMPT_TOKENS",
    "MAX_ID_CHARS",
    "invalid_input",
]

MAX_BODY_BYTES = body_limit.MAX_BODY_BYTES  # a request body larger than this gets a 413
MAX_DATUMS = 1024  # datums per forward / forward_backward (ServerCapabilities.max_batch_datums)
MAX_PROMPT_TOKENS = 1 << 20  # tokens per prompt or logprobs request (the context length is checked after)
MAX_ID_CHARS = 64  # session, sampler and model ids
MAX_NAME_CHARS = 256  # base model names
MAX_TEXT_CHARS = 1024  # keys, request ids, metadata values
MAX_SEQ = 2**62
MAX_LIVE_PER_KEY = 256  # open sessions plus samplers per API key
MAX_CHECKPOINTS_PER_KEY = 4096  # durable checkpoints one API key may hold on disk
MAX_CHECKPOINT_BYTES_PER_KEY = 64 << 30  # bytes they may take: thousands of LoRA adapters, a few merged models
MAX_INFLIGHT_PER_KEY = 1024  # requests one API key may have in flight (more get a 429)
MAX_BODY_BYTES_IN_FLIGHT_PER_KEY = 4 * MAX_BODY_BYTES  # the bytes of their bodies (past it a request gets a 429)
NOT_JSON_FIX = "send one JSON object, UTF-8 encoded"
MAX_SEQ_AHEAD = 1024  # an op may arrive at most this far ahead of the next expected seq (it waits for the gap)


def _clean(text: str) -> str:
    """Refuse text no file system, tokenizer or JSON encoder downstream should have to handle."""
    if "\x00" in text:
        raise ValueError("must not contain a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return text


_CLEAN = AfterValidator(_clean)
MAX_OPTIONS_CHARS = 16_384  # session_options, as JSON


def _clean_json(value: Any) -> Any:
    """A free-form JSON value (``session_options``): its text clean (see :func:`_clean`), its size capped
    (walked with a stack, not recursion: any depth the JSON parser took is fine)."""
    size, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            size += len(_clean(v)) + 2
        elif isinstance(v, dict):
            todo += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            todo += v
        size += 1
        if size > MAX_OPTIONS_CHARS:
            raise ValueError(f"is larger than {MAX_OPTIONS_CHARS} characters as JSON")
    return value


def Text(max_length: int, min_length: int = 0) -> Any:
    """A ``str`` of bounded length, without NUL or lone surrogates (the aliases below spell it out for mypy)."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length), _CLEAN]


ModelName = Annotated[str, Field(max_length=MAX_NAME_CHARS), _CLEAN]
Short = Annotated[str, Field(max_length=64), _CLEAN]
Label = Annotated[str, Field(max_length=128), _CLEAN]
Long = Annotated[str, Field(max_length=MAX_TEXT_CHARS), _CLEAN]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
CheckpointPath = Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS), _CLEAN]
CheckpointName = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", max_length=128), AfterValidator(CheckpointStore.check_name)
]


def _datum(value: Any) -> Any:
    """A datum from its JSON form (its coercion may raise TypeError or AttributeError on wrong shapes, which
    pydantic would not turn into a validation error: make every failure a ValueError)."""
    if isinstance(value, Datum):
        return value
    try:
        return Datum.model_validate(value)
    except ValidationError as err:  # the first error, with where in the datum it is
        first = err.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')}"[:300]) from None
    except Exception as err:
        raise ValueError(str(err).splitlines()[0][:200]) from None


DatumIn = Annotated[Datum, BeforeValidator(_datum)]
# the SDK's own checks (they raise InvalidInputError, a ValueError: pydantic reports them by field)
Description = Annotated[str | None, AfterValidator(check_description)]
TTLSeconds = Annotated[int | None, AfterValidator(check_ttl_seconds)]
SessionOptions = Annotated[dict[Label, JsonValue], Field(max_length=16), AfterValidator(_clean_json), AfterValidator(check_session_options)]
TopK = Annotated[int, Field(ge=0, le=MAX_TOPK)]
TargetIds = Annotated[list[Annotated[int, Field(ge=-1, lt=2**31)]], Field(max_length=MAX_TOPK)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StrictSamplingParams(SamplingParams):
    """:class:`SamplingParams` of their JSON types (a body's strictness does not reach a nested model:
    ``"max_tokens": "2"``, ``2.0`` or ``"temperature": "0.5"`` were taken as numbers)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StrictAdamParams(AdamParams):
    """:class:`AdamParams` of their JSON types (``"learning_rate": "0.001"`` was taken as a number)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class SessionBody(_Body):
    """``POST /v1/sessions``: a LoRA training session on a base model from ``GET /v1/models``."""

    base_model: ModelName = ""
    rank: int = Field(default=32, ge=1, le=MAX_LORA_RANK)
    alpha: float | None = Field(default=None, gt=0.0, le=MAX_LORA_ALPHA)
    seed: Seed | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    from_path: CheckpointPath | None = None
    with_optimizer: bool = False
    user_metadata: dict[Label, Long] = Field(default_factory=dict, max_length=64)
    session_options: SessionOptions = Field(default_factory=dict)

    def spec(self) -> TrainingSessionSpec:
        return TrainingSessionSpec(**self.model_dump())


class _OpFields(_Body):
    """What every op body carries: its place and its delivery key."""

    kind: TrainingOpKind
    seq: int = Field(ge=1, le=MAX_SEQ)
    idempotency_key: Long

    def op(self) -> TrainingOp:
        """The typed record for this body's ``kind``, from its fields (unset optional ones take the record's default)."""
        cls = OP_TYPES[self.kind]
        fields = {k: getattr(self, k) for k in type(self).model_fields if getattr(self, k) is not None}
        if "data" in fields:
            fields["data"] = tuple(fields["data"])
        if "adam_params" in fields:  # the shared type, checked strictly here
            fields["adam_params"] = AdamParams.model_validate(fields["adam_params"].model_dump())
        return cls(**fields)


class _PassFields(_OpFields):
    data: list[DatumIn] = Field(default_factory=list, max_length=MAX_DATUMS)
    loss_fn: Short | None = None
    loss_fn_config: dict[Short, float] | None = Field(default=None, max_length=16)


class ForwardBody(_PassFields):
    """``forward``: loss and per-token log-probs, no gradient."""

    kind: Literal["forward"]


class ForwardBackwardBody(_PassFields):
    """``forward_backward``: like ``forward``, and accumulate the gradient."""

    kind: Literal["forward_backward"]


class OptimStepBody(_OpFields):
    """``optim_step``: apply the accumulated gradient."""

    kind: Literal["optim_step"]
    adam_params: StrictAdamParams | None = None


class _SaveFields(_OpFields):
    name: CheckpointName | None = None
    ephemeral: bool = False
    description: Description = None
    overwrite: bool = False
    ttl_seconds: TTLSeconds = None
    user_metadata: dict[Label, Long] | None = Field(default=None, max_length=64)


class SaveStateBody(_SaveFields):
    """``save_state``: weights and optimizer state (resumable)."""

    kind: Literal["save_state"]


class SaveWeightsBody(_SaveFields):
    """``save_weights``: weights for sampling (``merge_weights``: also a merged full model)."""

    kind: Literal["save_weights"]
    merge_weights: bool = False


class LoadStateBody(_OpFields):
    """``load_state``: load a ``save_state`` path of this key."""

    kind: Literal["load_state"]
    path: CheckpointPath
    with_optimizer: bool = True


OpBody = Annotated[
    ForwardBody | ForwardBackwardBody | OptimStepBody | SaveStateBody | SaveWeightsBody | LoadStateBody,
    Field(discriminator="kind"),
]
"""``POST /v1/sessions/{id}/ops``: one ordered training op, a body per ``kind`` (a field the kind does not
have is refused by name)."""


class SamplerBody(_Body):
    """``POST /v1/samplers``: sample from a saved path of this key, or from a base model."""

    base_model: ModelName | None = None
    model_path: CheckpointPath | None = None
    payload: None = None  # another process's in-memory sampler cannot cross HTTP

    def spec(self) -> SamplerSpec:
        return SamplerSpec(base_model=self.base_model, model_path=self.model_path)


class SampleBody(_Body):
    """``POST /v1/samplers/{id}/sample``."""

    prompt: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    num_samples: int = Field(default=1, ge=1, le=MAX_NUM_SAMPLES)
    sampling_params: StrictSamplingParams = Field(default_factory=StrictSamplingParams)
    include_prompt_logprobs: bool = False
    request_id: Long = ""
    topk_prompt_logprobs: TopK = 0
    topk_sample_logprobs: TopK = 0
    target_prompt_logprobs: list[TargetIds] | None = Field(default=None, max_length=MAX_PROMPT_TOKENS)

    def request(self) -> SampleRequest:
        """The backend's request; ``target_prompt_logprobs`` must be ``[len(prompt) - 1][K]`` ids (InvalidInputError)."""
        targets = check_target_prompt_logprobs(self.target_prompt_logprobs, len(self.prompt))
        return SampleRequest(
            tuple(self.prompt),
            self.num_samples,
            SamplingParams.model_validate(self.sampling_params.model_dump()),
            self.include_prompt_logprobs,
            self.request_id,
            self.topk_prompt_logprobs,
            self.topk_sample_logprobs,
            targets,
        )


class LogprobsBody(_Body):
    """``POST /v1/samplers/{id}/logprobs``."""

    tokens: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)


_FIXES = {
    "missing": "add it",
    "union_tag_invalid": "use forward, forward_backward, optim_step, save_state, save_weights or load_state",
    "union_tag_not_found": "add it: forward, forward_backward, optim_step, save_state, save_weights or load_state",
    "extra_forbidden": "remove it (see GET /openapi.json)",
    "finite_number": "give a finite number",
}


def invalid_input(errors: Any) -> InvalidInputError:
    """The first pydantic error as an InvalidInputError naming the field (``a.b[2].c``) and a fix."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":  # its loc is ("body", offset): not a field (it was named "[1]")
        ctx, at = first.get("ctx"), list(first.get("loc") or ())[-1:]
        reason = ctx.get("error", "decode error") if isinstance(ctx, dict) else "decode error"
        where = f" (at character {at[0]})" if at and isinstance(at[0], int) else ""
        return InvalidInputError(f"the body is not JSON: {reason}{where}", field="body", fix=NOT_JSON_FIX)
    where = ""
    loc = list(first.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header"):  # where in the request, not a field
        loc = loc[1:]
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        loc = [*loc, "kind"]  # the op body's discriminator
    elif loc and loc[0] in OP_TYPES:  # the op body's kind, not a field
        loc = loc[1:]
    for part in loc:
        if isinstance(part, int):
            where += f"[{part}]"
        elif not any(c in str(part) for c in "[(,"):  # not a union branch's tag
            where += f".{part}" if where else str(part)
    if len(where) > 200:  # a path down a deeply nested value
        where = f"{where[:197]}..."
    ctx = first.get("ctx")
    cause = ctx.get("error") if isinstance(ctx, dict) else None
    if isinstance(cause, InvalidInputError) and cause.fix:  # an SDK check (ttl_seconds, description, ...): its own fix
        text = cause.message.removesuffix(f" (fix: {cause.fix})")
        return InvalidInputError(text.removeprefix(f"{cause.field}: ") if cause.field else text, field=where or "body", fix=cause.fix)
    fix = _FIXES.get(str(first.get("type", "")), "see the request schema in GET /openapi.json")
    return InvalidInputError(str(first.get("msg", "invalid")).removeprefix("Value error, "), field=where or "body", fix=fix)


class BodyRoute(APIRoute):
    """A worker route. Its JSON body, over :data:`json_body.INLINE_BYTES`, is decoded and validated in a worker
    thread (FastAPI does both on the event loop, where a 256 MB body stalls every tenant for seconds); a small one is
    left to FastAPI, and the answers are FastAPI's either way. A body that is not declared JSON is a 415 naming
    ``Content-Type`` (it was a 400 saying that the body should be an object), and a query parameter the route does
    not take is a 400 naming it (``POST /v1/sessions?rank=8`` made a rank-32 session)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        field = self.body_field
        takes, todo = set(), [self.dependant]  # the query parameters of the route and of its dependencies
        while todo:
            dependant = todo.pop()
            takes |= {p.alias for p in dependant.query_params}
            todo += dependant.dependencies

        async def route(request: Request) -> Response:
            unknown = [name for name in request.query_params if name not in takes]
            if unknown:
                fix = "send it in the JSON body" if field is not None else "drop it"
                raise InvalidInputError(f"{self.path} takes no query parameter {unknown[0]!r:.80}", field=unknown[0][:80], fix=fix)
            if field is None:
                return await handle(request)
            raw = await request.body()
            content_type = request.headers.get("content-type")
            if raw and not json_body.is_json(content_type):
                declared = f"Content-Type {content_type!r:.80}" if content_type else "no Content-Type"
                raise HTTPException(415, f"the body is not declared as JSON (it has {declared})")
            if len(raw) <= json_body.INLINE_BYTES:
                return await handle(request)
            value, errors = await json_body.off_loop(len(raw), _decode, field, raw)
            if errors:
                raise RequestValidationError(errors, body=value)
            return await handle(_Decoded(request, raw, value))

        return route


def _decode(field: Any, raw: bytes) -> tuple[Any, list[Any]]:
    """``raw`` decoded and validated as FastAPI would (its errors, its exceptions): (value, errors)."""
    try:
        value = json_body.loads(raw)
    except json.JSONDecodeError as err:
        error = {"type": "json_invalid", "loc": ("body", err.pos), "msg": "JSON decode error", "input": {}, "ctx": {"error": err.msg}}
        return None, [error]
    except json_body.TooManyContainers as err:
        raise HTTPException(413, str(err)) from None
    except Exception as err:  # FastAPI's answer to a body json.loads fails on (bad UTF-8, a 5000-digit number, ...)
        raise HTTPException(400, "There was an error parsing the body") from err
    checked, errors = field.validate(value, {}, loc=("body",))
    return (value, errors) if errors else (checked, [])


class _Decoded(Request):
    """The request, its body already decoded and validated (FastAPI takes a validated model as it is)."""

    def __init__(self, request: Request, raw: bytes, value: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._raw, self._value = raw, value

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._value
