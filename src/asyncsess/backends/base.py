"""The backend seam: a narrow async protocol and the op records that cross it (the URL registry: registry.py).

A backend is a class with an entry point in group ``asyncsess.backends`` named after its URL scheme.
Everything user-facing (futures, ordering, retries, backpressure, custom-loss lowering, sync facade)
lives above this cut, so a backend only has to execute ops.

Contract for ``execute_training``: ops of one session run strictly in ``seq`` order (a backend must
hold an op whose predecessors have not arrived), each ``seq`` at most once; a repeated delivery with
the same ``idempotency_key`` returns the stored result; once an op fails, later ops of that session fail
with :class:`~asyncsess.errors.PoisonedError`, unless the failure is void (refused before anything ran, its
``seq`` used up: :attr:`~asyncsess.errors.AsyncSessError.void`). :class:`asyncsess.backends.sequencer.Sequencer`
implements this.

Creates (``create_training_session``, ``create_sampler``) carry the spec's ``idempotency_key``, one per logical
create and the same on every retry of it; a backend that can answers a repeated key with what the first create
made (the http:// worker does), so a retry after a lost reply makes no second session. Once the client gives up on
a key it calls ``abandon_create(key)`` in the background, for a backend to stop what that create may have made.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NoReturn, Protocol, runtime_checkable
from urllib.parse import parse_qsl, urlsplit

from pydantic import ConfigDict

from ..errors import InvalidInputError, UnsupportedError
from ..types import (
    AdamParams,
    Checkpoint,
    CheckpointKind,
    Datum,
    GetInfoResponse,
    SampleResponse,
    SamplingParams,
    ServerCapabilities,
    TrainingResult,
)

__all__ = [
    "Backend",
    "Tokenizer",
    "TrainingOp",
    "TrainingOpKind",
    "PassOp",
    "OP_TYPES",
    "require_op",
    "unknown_op",
    "ForwardOp",
    "ForwardBackwardOp",
    "OptimStepOp",
    "SaveStateOp",
    "SaveWeightsOp",
    "LoadStateOp",
    "TrainingSessionSpec",
    "SamplerSpec",
    "SampleRequest",
    "ParsedURL",
    "parse_url",
]

TrainingOpKind = Literal["forward", "forward_backward", "optim_step", "save_state", "save_weights", "load_state"]
"""The ``kind`` tags of the records, for wire formats that name an op by string."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Op:
    """What every ordered op carries: its place (``seq`` starts at 1 per session) and its delivery key."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")  # on the wire: a field its kind lacks is an error

    seq: int
    idempotency_key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardOp(_Op):
    """Loss and per-token log-probs, no gradient."""

    kind: Literal["forward"] = "forward"
    data: tuple[Datum, ...] = ()
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardBackwardOp(_Op):
    """Like :class:`ForwardOp`, and accumulate the gradient."""

    kind: Literal["forward_backward"] = "forward_backward"
    data: tuple[Datum, ...] = ()
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimStepOp(_Op):
    """Apply the accumulated gradient with Adam and clear it."""

    kind: Literal["optim_step"] = "optim_step"
    adam_params: AdamParams = field(default_factory=AdamParams)


@dataclass(frozen=True, slots=True, kw_only=True)
class _SaveOp(_Op):
    name: str | None = None  # None: the backend picks one
    ephemeral: bool = False  # not listed, may be collected (snapshots for samplers)
    description: str | None = None  # free text kept with a checkpoint (SageMaker's model package description)
    overwrite: bool = False  # replace a checkpoint of the same name instead of failing
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveStateOp(_SaveOp):
    """Save weights and optimizer state (resumable)."""

    kind: Literal["save_state"] = "save_state"

    @property
    def checkpoint_kind(self) -> CheckpointKind:
        """What it writes: ``state``."""
        return "state"


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveWeightsOp(_SaveOp):
    """Save weights for sampling; ``merge_weights`` also writes a merged full model."""

    kind: Literal["save_weights"] = "save_weights"
    merge_weights: bool = False

    @property
    def checkpoint_kind(self) -> CheckpointKind:
        """What it writes: ``merged`` with ``merge_weights``, else ``sampler``."""
        return "merged" if self.merge_weights else "sampler"


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadStateOp(_Op):
    """Load saved weights (and the optimizer state when ``with_optimizer``)."""

    kind: Literal["load_state"] = "load_state"
    path: str
    with_optimizer: bool = True


TrainingOp = ForwardOp | ForwardBackwardOp | OptimStepOp | SaveStateOp | SaveWeightsOp | LoadStateOp
"""One ordered op on a training session: a tagged union on ``kind``; backends ``match`` on the class."""

_RECORDS: tuple[type[TrainingOp], ...] = (ForwardOp, ForwardBackwardOp, OptimStepOp, SaveStateOp, SaveWeightsOp, LoadStateOp)

PassOp = ForwardOp | ForwardBackwardOp
"""An op that runs the model over datums (``forward``, ``forward_backward``)."""

OP_TYPES: dict[str, type[TrainingOp]] = {str(t.__dataclass_fields__["kind"].default): t for t in _RECORDS}
"""``kind`` tag -> record class (for wire formats that carry the tag)."""


def require_op(op: object) -> TrainingOp:
    """``op`` itself when it is one of the six records; else a typed error, raised before it takes a sequence number.

    Every ``execute_training`` calls it first, so a stray object never reaches a sequencer or a wire.
    """
    if isinstance(op, _RECORDS):
        return op
    raise InvalidInputError(
        f"{type(op).__name__} is not a training op",
        field="op",
        fix=f"pass one of {', '.join(t.__name__ for t in _RECORDS)} (asyncsess.backends)",
    )


def unknown_op(op: NoReturn) -> NoReturn:
    """The ``case _:`` of a ``match`` over :data:`TrainingOp` (like ``typing.assert_never``).

    mypy reports a call here that is reachable, so a backend that forgot an op kind fails type checking;
    at run time it raises a typed error naming ``kind`` instead of an ``AssertionError``.
    """
    raise UnsupportedError(
        f"unknown op {getattr(op, 'kind', type(op).__name__)!r}",
        field="kind",
        fix=f"use one of {', '.join(OP_TYPES)} (the records in asyncsess.backends)",
    )


@dataclass(frozen=True, slots=True)
class TrainingSessionSpec:
    base_model: str
    rank: int = 32
    alpha: float | None = None
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    from_path: str | None = None
    with_optimizer: bool = False
    user_metadata: dict[str, str] = field(default_factory=dict)
    # SageMaker's per-call options (training_session_name, model_package_group_arn, s3_output_path,
    # kms_key_arn, vpc_config) and Tinker's optimizer; backends that have no use for them record them.
    session_options: dict[str, Any] = field(default_factory=dict)
    # one per logical create, the same on its retries (the client sets it): a backend that can answers a
    # retry whose first reply was lost with the same session (http:// sends it as ``Idempotency-Key``)
    idempotency_key: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class SamplerSpec:
    """Which weights to sample from: a saved path, or the plain base model."""

    base_model: str | None = None
    model_path: str | None = None
    payload: Any = None  # what Backend.export_sampler returned in another process (see SamplingClient pickling)
    idempotency_key: str = field(default="", compare=False)  # as TrainingSessionSpec's: one per logical create


@dataclass(frozen=True, slots=True)
class SampleRequest:
    prompt: tuple[int, ...]
    num_samples: int
    sampling_params: SamplingParams
    include_prompt_logprobs: bool = False
    request_id: str = ""
    topk_prompt_logprobs: int = 0  # k most likely tokens at every prompt position
    topk_sample_logprobs: int = 0  # k most likely tokens at every sampled position
    target_prompt_logprobs: tuple[tuple[int, ...], ...] | None = None  # [len(prompt)-1][K] ids, -1 = skip

    def check_extras(self, response: SampleResponse) -> None:
        """Raise :class:`UnsupportedError` when ``response`` lacks top-k or target log-probs this request asked for
        (a backend that does not compute them leaves them out)."""
        if (
            (self.topk_prompt_logprobs and response.topk_prompt_logprobs is None)
            or (self.target_prompt_logprobs is not None and response.target_prompt_logprobs is None)
            or (self.topk_sample_logprobs and any(s.topk_logprobs is None for s in response.sequences))
        ):
            raise UnsupportedError(
                "this backend does not return top-k or target log-probs", field="topk_prompt_logprobs", fix="leave them 0 on this backend"
            )


@runtime_checkable
class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the SDK relies on."""

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class Backend(abc.ABC):
    """A compute backend driver. One instance per ``ServiceClient``."""

    scheme: ClassVar[str]
    #: whether :meth:`delete_checkpoint` leaves the checkpoint's files in place (SageMaker: the S3 artifacts stay)
    keeps_artifacts: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: ParsedURL, **options: Any) -> Backend:
        """Build from the parsed URL; ``options`` are the ServiceClient's keyword arguments."""

    async def open(self) -> None:
        """Connect / start resources. Called once by ``ServiceClient.__aenter__``."""

    async def aclose(self) -> None:
        """Release resources. Sessions were already stopped by the client."""

    @abc.abstractmethod
    async def capabilities(self) -> ServerCapabilities: ...

    @abc.abstractmethod
    async def create_training_session(self, spec: TrainingSessionSpec) -> GetInfoResponse:
        """Open a training session (one LoRA model); ``info.model_id`` names it from now on."""

    @abc.abstractmethod
    async def stop_session(self, session_id: str) -> None:
        """Stop a training session or sampler. Idempotent."""

    async def abandon_create(self, idempotency_key: str) -> None:
        """The client gave up on the create (``create_training_session`` or ``create_sampler``) of ``idempotency_key``:
        it failed for good or was cancelled, and no retry will send that key again. A backend whose create may have made
        a session it never answered for stops it here. Run in a background task of the client (cancelled when it
        closes); errors are the backend's to log. Default: nothing to do."""

    @abc.abstractmethod
    async def execute_training(self, session_id: str, op: TrainingOp) -> TrainingResult:
        """Run one ordered op (see the module docstring for the exactly-once contract)."""

    def precheck(self, session_id: str, op: TrainingOp) -> None:
        """Refuse at once what this backend can judge without a round trip (an in-process backend: a load path
        that holds no checkpoint, a save name that holds one without ``overwrite``). The client calls it while numbering ``op``, so a refusal consumes no ``seq``
        and poisons nothing; it raises :class:`~asyncsess.errors.InvalidInputError`. Default: nothing to check
        here (a remote backend refuses on its side)."""

    @abc.abstractmethod
    async def create_sampler(self, spec: SamplerSpec) -> str:
        """Return a sampler id for the given weights."""

    @abc.abstractmethod
    async def sample(self, sampler_id: str, request: SampleRequest) -> SampleResponse: ...

    @abc.abstractmethod
    async def compute_logprobs(self, sampler_id: str, tokens: list[int]) -> list[float | None]: ...

    @abc.abstractmethod
    def get_tokenizer(self, base_model: str) -> Tokenizer: ...

    async def heartbeat(self, session_id: str) -> None:
        """Keep a session alive; raise ``SessionGoneError`` when it is gone. Default: nothing to do."""

    async def list_checkpoints(self, session_id: str | None = None) -> list[Checkpoint]:
        return []

    async def delete_checkpoint(self, path: str) -> None:
        """Delete a saved checkpoint. Default: not offered."""
        raise UnsupportedError("this backend cannot delete checkpoints", field="path", fix="delete it where it is stored")

    def sampler_session(self, sampler_id: str) -> str:
        """The session a sampler runs on (``SamplingClient.training_session_name``). Default: ``sampler_id``, a
        sampler being a session of its own; ``sagemaker://`` names the TrainingSession it samples on."""
        return sampler_id

    def export_sampler(self, sampler_id: str) -> Any:
        """What another process needs to reopen this sampler (passed back as ``SamplerSpec.payload``).

        Default ``None``: the sampler's ``model_path`` alone is enough (a shared store or service).
        """
        return None


# ------------------------------------------------------------------------------------- URLs


@dataclass(frozen=True, slots=True)
class ParsedURL:
    """A backend URL: ``scheme://host[:port][/path]?k=v``."""

    raw: str
    scheme: str
    host: str
    port: int | None
    path: str
    query: dict[str, str]

    def get_float(self, key: str, default: float) -> float:
        return _typed(self, key, default, float)

    def get_int(self, key: str, default: int) -> int:
        return _typed(self, key, default, int)

    def get_str(self, key: str, default: str) -> str:
        return self.query.get(key, default)


def _typed(url: ParsedURL, key: str, default: Any, kind: type) -> Any:
    if key not in url.query:
        return default
    try:
        value = kind(url.query[key])
        if kind is float and not math.isfinite(value):  # ?latency_ms=nan failed in anyio's sleep, =inf slept forever
            raise ValueError
        return value
    except ValueError:
        raise InvalidInputError(
            f"{url.query[key]!r:.60} is not a finite {kind.__name__}", field=f"url ?{key}=", fix=f"e.g. ?{key}={default}"
        ) from None


def parse_url(url: str) -> ParsedURL:
    fix = "use e.g. mock://, local://, http://host:port or sagemaker://region"
    if not isinstance(url, str):  # urlsplit raised AttributeError ('int' object has no attribute 'decode')
        raise InvalidInputError(f"got {type(url).__name__}", field="url", fix=fix)
    parts = urlsplit(url)
    if not parts.scheme:
        raise InvalidInputError(f"{url!r:.200} has no scheme", field="url", fix=fix)
    try:
        port = parts.port
    except ValueError as err:  # a port that is not a number in 0..65535: urlsplit's ValueError
        raise InvalidInputError(f"{url!r:.200}: {err}", field="url", fix="give a port in 1..65535, e.g. http://127.0.0.1:8000") from None
    return ParsedURL(
        raw=url,
        scheme=parts.scheme.lower(),
        host=parts.hostname or "",
        port=port,
        path=parts.path,
        query=dict(parse_qsl(parts.query, keep_blank_values=True)),
    )
