"""What crosses HTTP between the worker and :class:`~asyncsess.backends.http.HttpBackend`.

Request bodies are the backend protocol's own records (validated by pydantic on the server); results
are the shared wire types; errors travel as ``{"error": {"type": <asyncsess.errors class>, ...}}`` and
are rebuilt as the same typed exception on the client. ``"void": true`` in an op's error says the worker
refused it before anything ran and used up its ``seq``: the client's later ops run (nothing is poisoned).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from .. import errors
from ..retry import retry_after_seconds
from ..types import CheckpointResponse, ForwardBackwardOutput, LoadWeightsResponse, OptimStepResponse, TrainingResult
from .base import OP_TYPES, SampleRequest, SamplerSpec, TrainingOp, TrainingSessionSpec

__all__ = [
    "OP",
    "encode_op",
    "decode_op",
    "SESSION_SPEC",
    "SAMPLER_SPEC",
    "SAMPLE_REQUEST",
    "IDEMPOTENCY_HEADER",
    "create_request",
    "STATUS",
    "encode_result",
    "decode_result",
    "encode_error",
    "decode_error",
]

OP: TypeAdapter[TrainingOp] = TypeAdapter(Annotated[TrainingOp, Field(discriminator="kind")])
"""A training op on the wire: the record's fields plus its ``kind`` tag; a field its kind lacks is refused."""
SESSION_SPEC = TypeAdapter(TrainingSessionSpec)
SAMPLER_SPEC = TypeAdapter(SamplerSpec)
SAMPLE_REQUEST = TypeAdapter(SampleRequest)
IDEMPOTENCY_HEADER = "Idempotency-Key"
"""The header of a create (``POST /v1/sessions``, ``POST /v1/samplers``): one key per logical create, the same on
its retries; the worker answers a repeated key with what the first create made."""


def create_request(adapter: TypeAdapter[Any], spec: TrainingSessionSpec | SamplerSpec) -> tuple[dict[str, Any], dict[str, str]]:
    """The JSON body and headers of a create: the spec's fields, its ``idempotency_key`` as :data:`IDEMPOTENCY_HEADER`."""
    body: dict[str, Any] = adapter.dump_python(spec, mode="json", exclude={"idempotency_key"})
    return body, {IDEMPOTENCY_HEADER: spec.idempotency_key} if spec.idempotency_key else {}


_RESULTS: dict[str, type] = {
    "forward_backward": ForwardBackwardOutput,
    "optim_step": OptimStepResponse,
    "checkpoint": CheckpointResponse,
    "load": LoadWeightsResponse,
}
RESULT_OF_OP: dict[str, str] = {
    "forward": "forward_backward",
    "forward_backward": "forward_backward",
    "optim_step": "optim_step",
    "save_state": "checkpoint",
    "save_weights": "checkpoint",
    "load_state": "load",
}
"""The result ``type`` that answers each op ``kind``: any other is the answer to another request."""

# error class -> HTTP status (the most specific class wins); bad input is always a 4xx, never a 5xx. A conflict
# with the server's state (a taken checkpoint name, a reused seq, request_id or Idempotency-Key) is a 409, its
# typed body a ConflictError that no client retries; malformed input stays a 400
STATUS: dict[type[errors.AsyncSessError], int] = {
    errors.InvalidInputError: 400,
    errors.ConflictError: 409,
    errors.SessionGoneError: 404,
    errors.PoisonedError: 424,
    errors.TransientError: 503,
    errors.RateLimitError: 429,
    errors.DeadlineExceededError: 504,
    errors.ServerError: 500,
    errors.InsufficientStorageError: 507,
}
_FIELDS = ("message", "operation", "seq", "request_id", "field", "fix", "retry_after")


def status_for(err: errors.AsyncSessError) -> int:
    for cls in type(err).__mro__:
        if cls in STATUS:
            return STATUS[cls]  # type: ignore[index]
    return 500


def encode_op(op: TrainingOp) -> dict[str, Any]:
    """The JSON body of an op; text that UTF-8 cannot carry (a lone surrogate) is refused, naming its field."""
    _check_utf8(OP.dump_python(op), "")
    return OP.dump_python(op, mode="json")  # type: ignore[no-any-return]


def decode_op(body: Any) -> TrainingOp:
    """The record a JSON body holds, or an :class:`~asyncsess.errors.InvalidInputError` naming the bad field."""
    _check_utf8(body, "")
    try:
        return OP.validate_python(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        loc = [str(p) for p in first["loc"]]
        kinds = ", ".join(OP_TYPES)
        if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
            got = body.get("kind") if isinstance(body, dict) else None
            raise errors.InvalidInputError(f"unknown op kind {got!r}", field="kind", fix=f"one of {kinds}") from None
        if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            raise errors.InvalidInputError(
                f"a {loc[0]} op has no field {loc[-1]!r}", field=".".join(loc[1:]), fix=f"drop it (see {OP_TYPES[loc[0]].__name__})"
            ) from None
        where = ".".join(loc[1:]) or "op"
        raise errors.InvalidInputError(first["msg"], field=where, fix=f"see {OP_TYPES[loc[0]].__name__}" if loc else None) from None


def _check_utf8(value: Any, where: str) -> None:
    """Refuse a string (or dict key) that is not UTF-8 text: JSON over HTTP cannot carry it, and pydantic
    would silently replace it in a dict key."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise errors.InvalidInputError(
                f"{value[:40]!r} is not UTF-8 text (it holds a lone surrogate)", field=where or "op", fix="send valid Unicode text"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(k, where)
            _check_utf8(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)) and value and not isinstance(value[0], (int, float)):  # number lists: no text
        for i, v in enumerate(value):
            _check_utf8(v, f"{where}[{i}]")


def encode_result(result: TrainingResult) -> dict[str, Any]:
    kind = next(k for k, cls in _RESULTS.items() if isinstance(result, cls))
    return {"type": kind, "result": result.model_dump(mode="json")}


def decode_result(body: Any, op_kind: str | None = None) -> TrainingResult:
    """The result a worker's answer holds; one of another shape, or (given ``op_kind``) one that does not answer
    that kind of op, is an :class:`~asyncsess.errors.APIResponseValidationError`, never a wrong result."""
    kind = body.get("type") if isinstance(body, dict) else None
    if not isinstance(kind, str) or kind not in _RESULTS or not isinstance(body.get("result"), dict):
        raise errors.APIResponseValidationError(f"the worker's answer is not an op result: {str(body)[:200]!r}")
    want = RESULT_OF_OP.get(op_kind or "", kind)
    if kind != want:
        raise errors.APIResponseValidationError(f"the worker answered a {op_kind} op with a {kind} result (another request's answer?)")
    try:
        return _RESULTS[kind].model_validate(body["result"])  # type: ignore[attr-defined,no-any-return]
    except ValidationError as err:
        raise invalid_answer(f"a {kind} result", err) from None


def invalid_answer(what: str, err: ValidationError) -> errors.APIResponseValidationError:
    """A server's answer that does not fit its type, naming the first bad field (pydantic's error stays the cause)."""
    first = err.errors(include_url=False)[0] if err.error_count() else None
    where = ".".join(map(str, first["loc"])) if first else "?"
    return errors.APIResponseValidationError(f"the server's answer is not {what}: {where}: {first['msg'] if first else err}")


def encode_error(err: errors.AsyncSessError) -> dict[str, Any]:
    """``{"error": {"type", "message", "field", "fix", ..., "void"}}`` (``void`` only when true), with OpenAI's ``param`` (the field) and ``code``
    (the type in snake case) too: the worker's key, size and route checks answer its OpenAI routes in this shape,
    and the openai client reads an error's ``param`` and ``code`` from there."""
    state = {k: getattr(err, k) for k in _FIELDS if getattr(err, k, None) is not None}
    if isinstance(err, errors.PoisonedError) and err.cause is not None:
        state["cause"] = str(err.cause)
    if err.void:
        state["void"] = True
    code = re.sub(r"(?<!^)(?=[A-Z])", "_", type(err).__name__).lower()  # InvalidInputError -> invalid_input_error
    return {"error": {"type": type(err).__name__, **state, "param": getattr(err, "field", None), "code": code}}


def decode_error(body: Any, status: int, retry_after: Any = None) -> errors.AsyncSessError:
    """Rebuild the server's typed error. An unknown shape (a proxy's page, another server's JSON) becomes a
    TransientError (408, 409, 429, 5xx), an InvalidInputError (another 4xx) or an APIResponseValidationError (an
    error body under a 2xx or 3xx). Each field must have its type or is dropped; ``retry_after`` (the HTTP
    header) is the hint when the body has none, read by :func:`~asyncsess.retry.retry_after_seconds`."""
    info = body.get("error") if isinstance(body, dict) else None
    name = info.get("type") if isinstance(info, dict) else None
    cls = getattr(errors, name, None) if isinstance(name, str) and name.isidentifier() else None
    if cls is errors.InputValidationError:  # pydantic's half needs its line errors: the typed half is what travels
        cls = errors.InvalidInputError
    if not (isinstance(info, dict) and isinstance(cls, type) and issubclass(cls, errors.AsyncSessError)):
        text = str(body)[:500]
        if status in (408, 409, 429) or status >= 500:
            return errors.TransientError(f"worker answered {status}: {text}", retry_after=retry_after_seconds(retry_after))
        if status >= 400:
            return errors.InvalidInputError(f"worker answered {status}: {text}")
        return errors.APIResponseValidationError(f"worker answered {status} with an error: {text}")
    err = cls.__new__(cls)
    message = info.get("message")
    message = message if isinstance(message, str) else f"worker answered {status} with a {name} and no message"
    Exception.__init__(err, message)
    state: dict[str, Any] = {k: v for k in _FIELDS if isinstance(v := info.get(k), str)}
    state["message"] = message
    seq = info.get("seq")
    state["seq"] = seq if isinstance(seq, int) and not isinstance(seq, bool) else None
    state["retry_after"] = retry_after_seconds(info.get("retry_after"))
    if state["retry_after"] is None:
        state["retry_after"] = retry_after_seconds(retry_after)
    for k in _FIELDS:
        state.setdefault(k, None)
    if issubclass(cls, errors.PoisonedError):
        state["cause"] = errors.ServerError(str(info["cause"])[:2000]) if info.get("cause") else None
    if issubclass(cls, errors.TransientError):
        state["lost_response"] = False
    if info.get("void") is True:
        state["void"] = True
    err.__dict__.update(state)
    return err
