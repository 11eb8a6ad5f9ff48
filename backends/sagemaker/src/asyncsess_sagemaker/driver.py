"""``sagemaker://region``: drive Amazon SageMaker AI training sessions through boto3.

Ordering: each session's ops pass through an :class:`asyncsess.backends.sequencer.Sequencer` that only *numbers*
them, in ``op.seq`` order, with the session's own wire counter; each op is then delivered
(``ExecuteTrainingOperation``) without waiting for its predecessors' acknowledgement (unless
``pipeline_submissions`` is off), and results are polled concurrently, so pipelined ops cost one round
trip. The service runs them in number order (an early arrival waits, the session showing ``Blocked``). An op the
service refuses (``ValidationException``, or an unknown package) was never made and its number is used up, as the
official SDK (which never sends a number twice) relies on: the refusal is void, poisons nothing, and the ops numbered
after it run. When a delivery's fate stays unknown after every retry, a gap would remain, so the session is stopped
and reported gone. The client token is derived from ``op.idempotency_key``, so every retry of one op carries the
same token.

Sampling ops run concurrently. Checkpoints are model-package version ARNs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import anyio
import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from asyncsess.backends import (
    Backend,
    ForwardBackwardOp,
    ForwardOp,
    LoadStateOp,
    OptimStepOp,
    ParsedURL,
    SampleRequest,
    SamplerSpec,
    SaveStateOp,
    SaveWeightsOp,
    Tokenizer,
    TrainingOp,
    TrainingSessionSpec,
    require_op,
    unknown_op,
)
from asyncsess.backends.sequencer import Sequencer
from asyncsess.errors import (
    AsyncSessError,
    ConflictError,
    DeadlineExceededError,
    InvalidInputError,
    NotFoundError,
    PoisonedError,
    RetriesExhaustedError,
    ServerError,
    SessionGoneError,
    TransientError,
    UnsupportedError,
)
from asyncsess.types import (
    Checkpoint,
    CheckpointResponse,
    GetInfoResponse,
    LoadWeightsResponse,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    ServerCapabilities,
    SupportedModel,
    TrainingResult,
    Usage,
)

from . import arns
from .calls import AwsCalls, error_code
from .options import SageMakerOptions
from .service_models import CONTROL, RUNTIME, control_model, operation, runtime_model
from .shape_check import ShapeError, check_shape
from .tokenizers import load_tokenizer
from .wire import (
    WIRE_LOSSES,
    adam_to_wire,
    check_operation_config,
    check_sample_config,
    datum_to_wire,
    forward_result_from_wire,
    logprobs_from_wire,
    model_input_to_wire,
    sample_response_from_wire,
    sampling_params_to_wire,
)

__all__ = ["SageMakerBackend"]

log = logging.getLogger("asyncsess_sagemaker")

DEFAULT_GROUP = "sagemaker-default"  # the official SDK's shared default model package group
GONE = frozenset({"Failed", "Stopping", "Stopped", "Expired", "Deleting", "DeletionFailed", "Blocked"})
_TOKEN = re.compile(r"[a-zA-Z0-9-]{1,128}")
_RUNTIME_SHAPES = runtime_model()
_OPERATION_CONFIG = _RUNTIME_SHAPES.shape_for("OperationConfig")
_SAMPLE_CONFIG = _RUNTIME_SHAPES.shape_for("SampleOperationConfig")
_MAX_TOKENS = _RUNTIME_SHAPES.shape_for("SamplingParamsMaxTokensInteger").metadata
_TEMPERATURE = _RUNTIME_SHAPES.shape_for("SamplingParamsTemperatureDouble").metadata
_RANK_MAX = control_model().shape_for("Rank").metadata["max"]


@dataclass
class _Submission:
    """One numbered training op; :meth:`SageMakerBackend._deliver` sends it once (retries reuse the token)."""

    seq: int  # the wire sequence number
    token: str
    config: dict[str, Any]
    step: int  # optimizer steps numbered so far, this op included
    earlier_steps: list[_Submission] = field(default_factory=list)  # optimizer steps numbered before it, then undelivered
    after: _Submission | None = None  # delivered first (pipeline_submissions=False)
    delivered: anyio.Event = field(default_factory=anyio.Event)
    started: bool = False
    refused: bool = False  # the service refused it (ValidationException): it never ran
    op_id: str | None = None
    error: BaseException | None = None

    async def applied_step(self) -> int:
        """:attr:`step` less the optimizer steps numbered before this op that the service refused (each of those
        had counted itself, and a pipelined op was numbered before the refusal came back)."""
        for earlier in self.earlier_steps:
            await earlier.delivered.wait()
        return self.step - sum(earlier.refused for earlier in self.earlier_steps)


@dataclass
class _Session:
    name: str
    base_model: str  # what the caller named (an id or an ARN)
    hub_arn: str
    hf_id: str | None
    rank: int
    alpha: int
    sequencer: Sequencer[_Submission]
    limits: tuple[int | None, int | None] = (None, None)  # (vocab size, context length) its hub document publishes
    next_wire_seq: int = 1
    steps: int = 0
    undelivered: set[int] = field(default_factory=set)  # wire numbers given out and not yet acknowledged
    steps_in_flight: list[_Submission] = field(default_factory=list)  # optimizer steps numbered, maybe not yet delivered
    last_numbered: _Submission | None = None
    gone: SessionGoneError | None = None
    poison: AsyncSessError | None = None
    packages: list[Checkpoint] = field(default_factory=list)


@dataclass(frozen=True)
class _Sampler:
    session: str
    model_package: str | None
    owned: bool


class SageMakerBackend(Backend):
    """A driver for the SageMaker training-session control plane and runtime (boto3)."""

    scheme: ClassVar[str] = "sagemaker"
    keeps_artifacts: ClassVar[bool] = True  # DeleteModelPackage removes the record; the S3 artifacts stay

    def __init__(self, options: SageMakerOptions) -> None:
        self.options = options
        self._calls = AwsCalls(
            threads=options.max_pool_connections,
            retry_base_s=options.retry_base_s,
            retry_budget_s=options.retry_budget_s,
            poll_initial_s=options.poll_initial_s,
            poll_max_s=options.poll_max_s,
        )
        self._control: Any = None
        self._runtime: Any = None
        self._sessions: dict[str, _Session] = {}
        self._samplers: dict[str, _Sampler] = {}
        self._package_session: dict[str, str] = {}  # model package ARN -> the live session that saved it
        self._package_kind: dict[str, str | None] = {}  # ARN -> "state"/"sampler"/"merged" of a save here; None: deleted here
        self._package_lora: dict[str, tuple[int, int]] = {}  # ARN -> (LoRA rank, alpha) of the session here that saved it
        self._hub: dict[str, tuple[str, str | None]] = {}  # base model as given -> (hub content ARN, HF id)
        self._hub_limits: dict[str, tuple[int | None, int | None]] = {}  # hub content ARN -> (vocab size, context length)
        self._tokenizers: dict[str, Tokenizer] = {}
        self._group_arn: str | None = options.model_package_group_arn
        # idempotency key of a create whose CreateTrainingSession reply was never read -> the request it sent
        self._unanswered_creates: dict[str, dict[str, Any]] = {}
        self._abandoned_calls = self._calls.with_budget(options.abandoned_stop_s)  # stopping what such a create made

    @classmethod
    def from_url(cls, url: ParsedURL, **options: Any) -> SageMakerBackend:
        return cls(SageMakerOptions.resolve(url, options))

    # ------------------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        def build() -> tuple[Any, Any]:
            session = boto3.session.Session(region_name=self.options.region, profile_name=self.options.profile)
            no_retries = {"total_max_attempts": 1}  # this driver owns retries (one policy, same client token)
            control = session.client(
                CONTROL, endpoint_url=self.options.endpoint_url, config=Config(retries=no_retries, connect_timeout=10, read_timeout=60)
            )
            runtime = session.client(
                RUNTIME,
                endpoint_url=self.options.runtime_url,
                config=Config(
                    retries=no_retries, max_pool_connections=self.options.max_pool_connections, connect_timeout=10, read_timeout=60
                ),
            )
            return control, runtime

        self._control, self._runtime = await anyio.to_thread.run_sync(build)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for name, sess in list(self._sessions.items()):
                if sess.gone is None:
                    await self._stop_quietly(name)
            for request in list(self._unanswered_creates.values()):
                await self._reap(request, self._calls)
        for client in (self._control, self._runtime):
            if client is not None:
                client.close()

    @property
    def control(self) -> Any:
        if self._control is None:
            raise RuntimeError("SageMakerBackend.open() was not called")
        return self._control

    @property
    def runtime(self) -> Any:
        if self._runtime is None:
            raise RuntimeError("SageMakerBackend.open() was not called")
        return self._runtime

    # ----------------------------------------------------------------------- hub and models

    async def _hub_contents(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"HubName": arns.PUBLIC_HUB, "HubContentType": "Model"}
        while True:
            resp = await self._calls.retried(
                self.control.list_hub_contents, operation="ListHubContents", not_found=InvalidInputError, **kwargs
            )
            rows += resp.get("HubContentSummaries", [])
            if not resp.get("NextToken"):
                return rows
            kwargs["NextToken"] = resp["NextToken"]

    @staticmethod
    def _keyword_id(row: dict[str, Any]) -> str | None:
        for kw in row.get("HubContentSearchKeywords") or []:
            if kw.startswith("@huggingface-id:"):
                return kw.split(":", 1)[1]
        return None

    async def _describe_hub(self, name: str, version: str | None = None) -> tuple[str, str | None]:
        kwargs: dict[str, Any] = {"HubName": arns.PUBLIC_HUB, "HubContentType": "Model", "HubContentName": name}
        if version:
            kwargs["HubContentVersion"] = version
        resp = await self._calls.retried(
            self.control.describe_hub_content, operation="DescribeHubContent", not_found=InvalidInputError, **kwargs
        )
        try:
            doc = json.loads(resp.get("HubContentDocument") or "{}")
        except json.JSONDecodeError:
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        self._hub_limits[resp["HubContentArn"]] = (_count(doc.get("VocabSize")), _count(doc.get("MaxContextLength")))
        return resp["HubContentArn"], doc.get("HuggingfaceId")

    async def _resolve_base_model(self, base_model: str) -> tuple[str, str | None]:
        """(versioned hub content ARN, Hugging Face id) for a model id, a hub content name, or an ARN."""
        if base_model in self._hub:
            return self._hub[base_model]
        ref = arns.parse_hub_content_arn(base_model)
        if ref is not None:
            try:
                resolved = (base_model, (await self._describe_hub(ref.name, ref.version))[1])
            except AsyncSessError:  # the ARN is usable even when the hub cannot be read
                resolved = (base_model, None)
        else:
            wanted = base_model.lower()
            rows = await self._hub_contents()
            match = next(
                (
                    r
                    for r in rows
                    if wanted
                    in (r["HubContentName"].lower(), (self._keyword_id(r) or "").lower(), str(r.get("HubContentDisplayName", "")).lower())
                ),
                None,
            )
            if match is None:
                known = ", ".join(sorted(self._keyword_id(r) or r["HubContentName"] for r in rows)) or "none"
                raise InvalidInputError(
                    f"{base_model!r} is not a SageMaker Public Hub model here",
                    field="base_model",
                    fix=f"use one of: {known}, or a hub content ARN",
                )
            hub_arn, hf_id = await self._describe_hub(match["HubContentName"])
            resolved = (hub_arn, hf_id or self._keyword_id(match))
        self._hub[base_model] = resolved
        return resolved

    async def capabilities(self) -> ServerCapabilities:
        """The hub's trainable models, with the vocabulary size and context length their hub documents publish
        (``VocabSize``, ``MaxContextLength``), so the client checks token ids and lengths before numbering."""
        rows = await self._hub_contents()
        trainable = [r for r in rows if "@capability:training_session" in (r.get("HubContentSearchKeywords") or [])] or rows
        models = []
        for r in trainable:
            vocab, context = self._hub_limits[(await self._describe_hub(r["HubContentName"]))[0]]
            models.append(
                SupportedModel(
                    model_name=self._keyword_id(r) or r["HubContentName"],
                    max_context_length=context or int(_MAX_TOKENS["max"]),
                    vocab_size=vocab,
                )
            )
        return ServerCapabilities(supported_models=models, loss_functions=list(WIRE_LOSSES), max_lora_rank=int(_RANK_MAX))

    def get_tokenizer(self, base_model: str) -> Tokenizer:
        if base_model not in self._tokenizers:
            hf_id = self._hub.get(base_model, (None, None))[1] or base_model
            self._tokenizers[base_model] = load_tokenizer(
                hf_id, tokenizer_path=self.options.tokenizer_path, tokenizer_backend=self.options.tokenizer_backend
            )
        return self._tokenizers[base_model]

    # ----------------------------------------------------------------------- control plane

    async def _model_package_group(self) -> str:
        if self._group_arn is None:
            try:
                resp = await self._calls.retried(
                    self.control.create_model_package_group,
                    operation="CreateModelPackageGroup",
                    ModelPackageGroupName=DEFAULT_GROUP,
                    ModelPackageGroupDescription="Default group for SageMaker training session checkpoints.",
                )
                self._group_arn = resp["ModelPackageGroupArn"]
            except ConflictError:  # ResourceInUse: the group exists
                resp = await self._calls.retried(
                    self.control.describe_model_package_group, operation="DescribeModelPackageGroup", ModelPackageGroupName=DEFAULT_GROUP
                )
                self._group_arn = resp["ModelPackageGroupArn"]
        return self._group_arn

    def _create_request(
        self, name: str, hub_arn: str, rank: int, alpha: int, group_arn: str, per_call: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The CreateTrainingSession request; ``per_call`` options (from create_lora_training_client) win over the client's."""
        per_call = {k: v for k, v in (per_call or {}).items() if k in ("s3_output_path", "kms_key_arn", "vpc_config")}
        opts = self.options.model_copy(update=per_call) if per_call else self.options
        if not opts.role_arn:
            raise InvalidInputError(
                "creating a session needs an execution role",
                field="role_arn",
                fix="pass role_arn=arn:aws:iam::<account>:role/<name> in the URL query or as a keyword",
            )
        s3 = opts.s3_output_path
        if not s3:
            account = arns.account_of(opts.role_arn) or "unknown"
            s3 = f"s3://sagemaker-{opts.region}-{account}/{name}/output"
        location: dict[str, Any] = {"Path": s3}
        if opts.kms_key_arn:
            location["KmsKeyArn"] = opts.kms_key_arn
        request: dict[str, Any] = {
            "TrainingSessionName": name,
            "ModelPackageGroupArn": group_arn,
            "LoraConfig": {"Rank": rank, "Alpha": alpha},
            "RoleArn": opts.role_arn,
            "ModelConfig": {"BaseModelArn": hub_arn},
            "OutputConfig": {"S3Location": location},
        }
        if opts.vpc_config:
            request["VpcConfig"] = opts.vpc_config
        _check("CreateTrainingSession", request, CONTROL)
        return request

    async def _describe(self, name: str, calls: AwsCalls | None = None) -> dict[str, Any]:
        resp = await (calls or self._calls).retried(
            self.control.describe_training_session, operation="DescribeTrainingSession", TrainingSessionName=name
        )
        return resp["TrainingSessionDetail"]

    async def _wait_running(self, name: str) -> None:
        deadline = anyio.current_time() + self.options.create_timeout_s
        started, delay, last = time.monotonic(), 0.05, None
        while True:
            detail = await self._describe(name)
            status = detail["TrainingSessionStatus"]
            if status != last:
                log.info("training session %s: %s (%.1fs)", name, status, time.monotonic() - started)
                last = status
            if status == "Running":
                return
            if status in GONE:
                raise SessionGoneError(
                    f"training session {name} became {status} while starting: {detail.get('ErrorDetails') or 'no details'}",
                    operation="create",
                )
            if anyio.current_time() >= deadline:
                raise DeadlineExceededError(
                    f"training session {name} was still {status} after {self.options.create_timeout_s:g}s", operation="create"
                )
            await anyio.sleep(delay)
            delay = min(delay * 1.5, 10.0)

    async def create_training_session(self, spec: TrainingSessionSpec) -> GetInfoResponse:
        if spec.seed is not None or not (spec.train_mlp and spec.train_attn and spec.train_unembed):
            log.warning("SageMaker training sessions ignore seed and train_mlp/train_attn/train_unembed; the service picks them")
        if spec.rank > _RANK_MAX:
            raise InvalidInputError(
                f"rank {spec.rank} is above the service maximum {_RANK_MAX}", field="rank", fix=f"use a rank <= {_RANK_MAX}"
            )
        rank, alpha = spec.rank, int(round(spec.alpha)) if spec.alpha is not None else 2 * spec.rank
        if spec.from_path:
            self._require_package_arn(spec.from_path, "path")
            # the session takes the LoRA shape of a package saved here (as local:// takes a checkpoint's); of another
            # package the service refuses a rank that is not the package's, naming both
            rank, alpha = self._package_lora.get(spec.from_path, (rank, alpha))
        base_model = spec.base_model
        if not base_model and spec.from_path:
            base_model = await self._base_model_of(spec.from_path)
        if not base_model:
            raise InvalidInputError("no base model", field="base_model", fix="name a base model (or resume from a model package ARN)")
        hub_arn, hf_id = await self._resolve_base_model(base_model)
        per_call = spec.session_options
        key = spec.idempotency_key
        sent = self._unanswered_creates.get(key) if key else None
        unanswered = sent["TrainingSessionName"] if sent else None
        name = per_call.get("training_session_name") or unanswered or f"{self.options.session_name_prefix}-{uuid.uuid4().hex[:8]}"
        group = per_call.get("model_package_group_arn") or await self._model_package_group()
        self._require_here(group, "model_package_group_arn")
        request = self._create_request(name, hub_arn, rank, alpha, group, per_call)
        if key:  # until an answer is read: a retry of this create (same key) names the same session
            self._unanswered_creates[key] = request
        try:
            made_here = not per_call.get("model_package_group_arn") and self.options.model_package_group_arn is None
            created = await self._send_create(request, unanswered is not None, default_group=made_here)
            if "TrainingSessionArn" not in created:  # the name was taken: by an attempt whose reply was lost?
                await self._check_ours(request)
        except TransientError:  # still no answer (cancelled: none either): the session may exist
            raise
        except BaseException as err:
            if not isinstance(err, anyio.get_cancelled_exc_class()):
                self._unanswered_creates.pop(key, None)
            raise
        self._unanswered_creates.pop(key, None)
        sess = _Session(
            name=name,
            base_model=base_model,
            hub_arn=hub_arn,
            hf_id=hf_id,
            rank=rank,
            alpha=alpha,
            sequencer=Sequencer(self._numberer(name), gap_timeout=300.0),
            limits=self._hub_limits.get(hub_arn, (None, None)),
        )
        self._sessions[name] = sess
        try:
            await self._wait_running(name)
            if spec.from_path:
                await self._load_state(sess, spec.from_path, spec.with_optimizer)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop_quietly(name)
            raise
        self._hub.setdefault(hf_id or base_model, (hub_arn, hf_id))
        return GetInfoResponse(
            model_id=name,
            base_model=hf_id or base_model,
            lora_rank=rank,
            lora_alpha=float(alpha),
            seed=spec.seed,
            user_metadata=dict(spec.user_metadata),
            session_options=dict(per_call),
        )

    async def _send_create(self, request: dict[str, Any], unanswered: bool, default_group: bool) -> dict[str, Any]:
        """CreateTrainingSession. Refused for a model package group or base model that is not there (ResourceNotFound):
        the client's default group, deleted since the client made or found it, is made again and ``request`` (changed
        to name it) sent once more (every later create failed); another missing group or base model is a NotFoundError
        naming it (it was an InvalidInputError naming no field)."""

        async def send() -> dict[str, Any]:
            return await self._calls.retried(
                self.control.create_training_session,
                operation="CreateTrainingSession",
                not_found=InvalidInputError,
                replayed=lambda err: {} if error_code(err) == "ResourceInUse" else None,
                unanswered=unanswered,
                **request,
            )

        try:
            return await send()
        except InvalidInputError as err:
            if error_code(err.__cause__) != "ResourceNotFound":
                raise
            group = request["ModelPackageGroupArn"]
            if await self._group_exists(group):
                fix = "use a model of this region's SageMaker Public Hub (get_server_capabilities() lists them)"
                raise NotFoundError(err.message, field="base_model", fix=fix) from err
            if not default_group:
                fix = "create the group first, or leave model_package_group_arn out for the default group"
                raise NotFoundError(f"model package group {group} does not exist", field="model_package_group_arn", fix=fix) from err
        self._group_arn = None
        request["ModelPackageGroupArn"] = await self._model_package_group()
        return await send()

    async def _group_exists(self, group_arn: str) -> bool:
        try:
            await self._calls.retried(
                self.control.describe_model_package_group, operation="DescribeModelPackageGroup", ModelPackageGroupName=group_arn
            )
        except InvalidInputError as err:
            if _says_missing(err):
                return False
            raise
        return True

    async def _check_ours(self, request: dict[str, Any]) -> None:
        """The session a lost Create reply left is this request's (else the name was another's all along: it leaked
        a Running session when the retry's ``ResourceInUse`` was taken as a failure, and must not be adopted)."""
        name = request["TrainingSessionName"]
        if not _made_by(await self._describe(name), request):
            raise ConflictError(
                f"training session {name} already exists", field="training_session_name", fix="pick another name or leave it out"
            )

    async def abandon_create(self, idempotency_key: str) -> None:
        """The client gave up on this create: stop now the session it may have made with no answer read (every reply
        lost, or its attempts cut off), rather than when the client closes; on SageMaker that session is billed, idle,
        until the service's idle timeout. Retried with backoff for up to ``abandoned_stop_s``; a failure is logged and
        the create left for :meth:`aclose` to try again."""
        request = self._unanswered_creates.get(idempotency_key)
        if request is not None and await self._reap(request, self._abandoned_calls, self.options.abandoned_stop_s):
            self._unanswered_creates.pop(idempotency_key, None)

    async def _reap(self, request: dict[str, Any], calls: AwsCalls, limit_s: float | None = None) -> bool:
        """Stop the session of a create given up on, when Describe shows this request's (not there: it was never made;
        another's: the name was taken all along). False, logged, when that could not be done within ``limit_s``."""
        name = request["TrainingSessionName"]
        try:
            with anyio.fail_after(limit_s):
                try:
                    detail = await self._describe(name, calls)
                except SessionGoneError:  # not found
                    log.debug("create of %s left nothing to stop", name)
                    return True
                if not _made_by(detail, request):
                    log.debug("training session %s is not the one a create given up on asked for; left alone", name)
                    return True
                await self._send_stop(name, calls)
        except Exception as err:  # TimeoutError included: best effort, never raised into a caller
            log.warning("could not stop training session %s, made by a create given up on: %r", name, err)
            return False
        log.info("stopped training session %s, made by a create given up on", name)
        return True

    async def _base_model_of(self, model_package_arn: str, field: str = "path") -> str:
        """The base model of a model package (``field`` names the argument that gave it)."""
        self._require_package_arn(model_package_arn, field)
        try:
            desc = await self._calls.retried(
                self.control.describe_model_package,
                operation="DescribeModelPackage",
                not_found=InvalidInputError,
                ModelPackageName=model_package_arn,
            )
        except InvalidInputError as err:  # "does not exist" was an InvalidInputError naming no field
            if _says_missing(err):
                raise NotFoundError(f"no model package {model_package_arn}", field=field, fix="see list_checkpoints()") from err
            raise
        containers = (desc.get("InferenceSpecification") or {}).get("Containers") or [{}]
        base = containers[0].get("BaseModel") or {}
        if not base.get("HubContentName"):
            raise InvalidInputError(f"{model_package_arn} names no base model", field="base_model", fix="pass base_model=...")
        return arns.hub_content_arn(self.options.region, base["HubContentName"], base.get("HubContentVersion") or "1.0.0")

    def precheck(self, session_id: str, op: TrainingOp) -> None:
        """Refuse at once, before the op takes its number, what the service would refuse after: the service model's
        limits (a learning rate above 0.01, a save description a model package cannot hold, ...), token ids and lengths
        past what the base model's hub document publishes (``VocabSize``, ``MaxContextLength``), a ``load_state`` path
        that is no model package version ARN, or a package this client saved as sampler weights (the service refuses to
        load them) or deleted. Refused after numbering, the op would poison the training client for good."""
        sess = self._sessions.get(session_id)
        if sess is not None:
            self._checked_config(sess, op)
        if not isinstance(op, LoadStateOp):
            return
        self._require_package_arn(op.path, "path")
        if sess is not None:
            self._check_rank(op.path, sess.rank)
        if op.path not in self._package_kind:
            return
        kind = self._package_kind[op.path]
        if kind is None:
            raise NotFoundError(f"{op.path} was deleted", field="path", fix="load a model package that exists (list_checkpoints)")
        if kind != "state":
            raise InvalidInputError(
                f"{op.path} holds sampler weights (save_weights_for_sampler), not training state",
                field="path",
                fix="load a path that save_state returned",
            )

    def _check_rank(self, arn: str, rank: int) -> None:
        """A package this client saved holds a LoRA adapter of its session's rank; another rank cannot load it."""
        saved = self._package_lora.get(arn, (None, None))[0]
        if saved is not None and saved != rank:
            raise InvalidInputError(
                f"{arn} holds a LoRA adapter of rank {saved}, not {rank}", field="rank", fix=f"load it into a session of rank={saved}"
            )

    def _require_package_arn(self, arn: str, field: str) -> None:
        if arns.parse_model_package_arn(arn) is None:
            raise InvalidInputError(
                f"{arn!r} is not a model package version ARN",
                field=field,
                fix="use the path a save_state/save_weights call returned (arn:aws:sagemaker:REGION:ACCOUNT:model-package/GROUP/VERSION)",
            )
        self._require_here(arn, field)

    def _require_here(self, arn: str, field: str) -> None:
        """A model package (group) of this client's region and, where the execution role names them, its partition and
        account: the service takes no other (it answered ResourceNotFound or a ValidationException naming no field, and
        a sampler's own session was created first)."""
        region, account = arns.region_of(arn), arns.account_of(arn)
        role = self.options.role_arn or ""
        mine = arns.account_of(role)
        if (
            region != self.options.region
            or (mine is not None and account != mine)
            or arns.partition_of(arn) != (arns.partition_of(role) or arns.partition_of(arn))
        ):
            raise InvalidInputError(
                f"{arn} belongs to account {account} in {region}; this client works in {mine or 'its own account'} in {self.options.region}"
                + (f" ({arns.partition_of(role)})" if mine else ""),
                field=field,
                fix="use a model package of this account and region, or a client of its region",
            )

    async def _stop_quietly(self, name: str) -> None:
        try:
            await self.stop_session(name)
        except Exception as err:  # stopping is best effort on the way out
            log.warning("could not stop training session %s: %r", name, err)

    async def stop_session(self, session_id: str) -> None:
        sampler = self._samplers.pop(session_id, None)
        if sampler is not None:
            if sampler.owned:
                await self.stop_session(sampler.session)
            return
        sess = self._sessions.get(session_id)
        if sess is not None:
            sess.sequencer.stop("stopped")
            sess.gone = sess.gone or SessionGoneError(f"training session {session_id} was stopped")
            for arn in [a for a, s in self._package_session.items() if s == session_id]:
                del self._package_session[arn]
        await self._send_stop(session_id)

    async def _send_stop(self, name: str, calls: AwsCalls | None = None) -> None:
        """StopTrainingSession; a session already stopping or gone is done."""
        try:
            await (calls or self._calls).retried(
                self.control.stop_training_session, operation="StopTrainingSession", TrainingSessionName=name
            )
        except InvalidInputError as err:
            if "invalid session state transition" not in str(err):
                raise
        except SessionGoneError:  # not found: nothing to stop
            pass

    async def heartbeat(self, session_id: str) -> None:
        sampler = self._samplers.get(session_id)
        await self._check_alive(self._sessions.get(sampler.session if sampler else session_id) or _orphan(session_id))

    async def _check_alive(self, sess: _Session) -> None:
        if sess.gone is not None:
            raise sess.gone
        ours_in_flight = bool(sess.undelivered)  # taken before asking: a gap of our own explains "Blocked"
        detail = await self._describe(sess.name)
        status = detail["TrainingSessionStatus"]
        if status == "Blocked" and ours_in_flight:
            return
        if status in GONE:
            sess.gone = SessionGoneError(f"training session {sess.name} is {status}: {detail.get('ErrorDetails') or 'no details'}")
            sess.sequencer.stop(status.lower())
            if status == "Blocked":  # a gap this driver never leaves: another writer; stop rather than wait
                await self._stop_quietly(sess.name)
            raise sess.gone

    async def session_usage(self, session_id: str) -> Usage:
        """The session's billable token totals (``DescribeTrainingSession.BillableTokenUsage``)."""
        usage = (await self._describe(session_id)).get("BillableTokenUsage") or {}
        return Usage(
            training_tokens=usage.get("TrainingTokenCount") or 0,
            prefill_tokens=usage.get("PrefillTokenCount") or 0,
            decode_tokens=usage.get("SampleTokenCount") or 0,
        )

    # ---------------------------------------------------------------------- training ops

    def _operation_config(self, op: TrainingOp) -> dict[str, Any]:
        """The ``OperationConfig`` of ``StartTrainingOperation`` for one op record."""
        match op:
            case ForwardOp() | ForwardBackwardOp():
                if op.loss_fn not in WIRE_LOSSES:
                    raise UnsupportedError(
                        f"SageMaker training sessions offer {', '.join(WIRE_LOSSES)}, not {op.loss_fn!r}",
                        field="loss_fn",
                        fix="use forward_backward_custom, which lowers any loss to cross_entropy",
                    )
                body: dict[str, Any] = {"lossFnName": op.loss_fn, "datumList": [datum_to_wire(d, fill_weights=True) for d in op.data]}
                if op.loss_fn_config:
                    body["lossFnConfig"] = dict(op.loss_fn_config)
                return {_wire_key(op): body}
            case OptimStepOp(adam_params=params):
                return {"optimizerStep": {"adamParamsConfig": adam_to_wire(params)}}
            case SaveWeightsOp():
                body = {"mergeWeights": True} if op.merge_weights else {}
                description = op.description or op.name  # model packages have no names: a name is kept as the description
                if description:
                    body["description"] = description
                return {"saveWeights": body}
            case SaveStateOp():
                description = op.description or op.name
                return {"saveState": {"description": description} if description else {}}
            case LoadStateOp(path=path, with_optimizer=with_optimizer):
                self._require_package_arn(path, "path")
                return {"loadState": {"modelPackageArn": path, "loadOptimizer": with_optimizer}}
            case _:
                unknown_op(op)

    def _numberer(self, name: str) -> Any:
        async def number(op: TrainingOp) -> _Submission:
            """Called in ``op.seq`` order: check the op and give it the session's next wire number."""
            sess = self._sessions[name]
            if sess.poison is not None:
                raise PoisonedError(f"an earlier op failed on this session: {sess.poison}", cause=sess.poison)
            if sess.gone is not None:
                raise sess.gone
            try:
                config = self._checked_config(sess, op)
            except InvalidInputError as err:
                err.void = True  # it takes no wire number: nothing reached the service
                raise
            return self._number(sess, config, _client_token(name, op.idempotency_key))

        return number

    def _checked_config(self, sess: _Session, op: TrainingOp) -> dict[str, Any]:
        """The op's ``OperationConfig``, checked against the service model and the session's published limits."""
        config = self._operation_config(op)
        vocab, context = sess.limits
        _check_config(config, _OPERATION_CONFIG, lambda c: check_operation_config(c, vocab, context))
        return config

    def _number(self, sess: _Session, config: dict[str, Any], token: str) -> _Submission:
        after = None if self.options.pipeline_submissions else sess.last_numbered
        sess.steps_in_flight = [s for s in sess.steps_in_flight if not s.delivered.is_set()]
        optimizer = "optimizerStep" in config
        sess.steps += optimizer
        sub = _Submission(
            seq=sess.next_wire_seq, token=token, config=config, step=sess.steps, earlier_steps=list(sess.steps_in_flight), after=after
        )
        if optimizer:
            sess.steps_in_flight.append(sub)
        sess.next_wire_seq += 1
        sess.undelivered.add(sub.seq)
        sess.last_numbered = sub
        return sub

    async def _deliver(self, sess: _Session, sub: _Submission) -> str:
        """Send a numbered op once (a retried caller waits for the first delivery) and return its operation id.

        Shielded: a number given out must reach the service, or the session is stopped.
        """
        if sub.started:
            await sub.delivered.wait()
        else:
            sub.started = True
            with anyio.CancelScope(shield=True):
                try:
                    if sub.after is not None:
                        await sub.after.delivered.wait()
                        sub.after = None
                    sub.op_id = await self._send(sess, sub)
                except BaseException as err:
                    sub.error = err
                finally:
                    sess.undelivered.discard(sub.seq)
                    sub.delivered.set()
        if sub.error is not None:
            raise sub.error
        assert sub.op_id is not None
        return sub.op_id

    async def _send(self, sess: _Session, sub: _Submission) -> str:
        """``ExecuteTrainingOperation`` for one numbered op, retried with the same token and number."""
        if sess.gone is not None:
            raise sess.gone
        try:
            resp = await self._calls.retried(
                self.runtime.execute_training_operation,
                operation="ExecuteTrainingOperation",
                trainingSessionName=sess.name,
                sequenceNumber=sub.seq,
                clientToken=sub.token,
                operationConfig=sub.config,
            )
        except InvalidInputError as err:  # refused: no operation was made, and its number is used up (no gap)
            if not isinstance(err.__cause__, ClientError):  # refused here (no credentials, ...): the number never left
                await self._end_for_gap(sess, f"sequence number {sub.seq} could not be sent: {err}")
                raise
            err.void = True
            sub.refused = True
            sess.steps -= "optimizerStep" in sub.config
            raise
        except TransientError as err:  # delivered or not, nobody knows: a gap may be open
            await self._end_for_gap(sess, f"sequence number {sub.seq} could not be delivered: {err}")
            raise RetriesExhaustedError(
                f"sequence number {sub.seq} could not be delivered; the session was stopped: {err}", attempts=getattr(err, "attempts", 1)
            ) from err
        except SessionGoneError as err:  # alive, a loadState's unknown package was refused: its number is used up
            await self._unknown_package(sess, err, sub.config.get("loadState", {}).get("modelPackageArn"), "path", void=True)
            raise
        except AsyncSessError as err:  # refused before any work (credentials, permissions, ...): the number never arrived
            await self._end_for_gap(sess, f"sequence number {sub.seq} was refused: {err}")
            raise
        return resp["operationId"]

    async def _unknown_package(self, sess: _Session, err: SessionGoneError, arn: str | None, field: str, **kw: Any) -> None:
        """Raise what a "not found" answer (``err``) to a call naming model package ``arn`` means: the session's end when
        it is gone, else that the service does not know the package, a NotFoundError naming ``field`` (it was a
        SessionGoneError, and the caller took its live session for gone). Returns when neither applies."""
        await self._check_alive(sess)  # raises when the session is gone
        if arn is not None and (error_code(err.__cause__) or "") in ("ResourceNotFound", "ResourceNotFoundException"):
            raise NotFoundError(err.message, field=field, fix="use a model package that exists (list_checkpoints)", **kw) from None

    async def _end_for_gap(self, sess: _Session, why: str) -> None:
        """A number that will never arrive would block the session: stop it rather than leave the gap."""
        sess.gone = sess.gone or SessionGoneError(f"training session {sess.name} was stopped: {why}")
        sess.sequencer.stop("stopped")
        with anyio.CancelScope(shield=True):
            await self._stop_quietly(sess.name)

    async def _training_outcome(self, sess: _Session, op_id: str, operation_name: str) -> dict[str, Any]:
        resp = await self._calls.poll(
            self.runtime.get_training_operation_result,
            operation=operation_name,
            check=lambda: self._check_alive(sess),
            trainingSessionName=sess.name,
            operationId=op_id,
        )
        status = resp["status"]
        if status == "Completed":
            return resp
        details = resp.get("errorDetails") or "no details"
        if status == "Failed":
            await self._check_alive(sess)  # an op cut short by the session's end is "gone", not "failed"
            sess.poison = ServerError(f"operation {op_id} failed: {details}", operation=operation_name, request_id=op_id)
            raise sess.poison
        await self._check_alive(sess)  # Skipped: gone, or behind a failure
        raise PoisonedError(f"operation {op_id} was skipped: {details}", cause=sess.poison, operation=operation_name, request_id=op_id)

    async def execute_training(self, session_id: str, op: TrainingOp) -> TrainingResult:
        op = require_op(op)
        sess = self._sessions.get(session_id)
        if sess is None:
            raise InvalidInputError(f"no training session {session_id!r} on this client", field="session_id")
        sub = await sess.sequencer.execute(op)
        op_id = await self._deliver(sess, sub)
        resp = await self._training_outcome(sess, op_id, op.kind)
        return self._training_result(sess, op, resp, await sub.applied_step())

    def _training_result(self, sess: _Session, op: TrainingOp, resp: dict[str, Any], step: int) -> TrainingResult:
        body = (resp.get("operationResult") or {}).get(_wire_key(op)) or {}
        match op:
            case ForwardOp() | ForwardBackwardOp():
                return forward_result_from_wire(body, resp.get("tokenUsage"))
            case OptimStepOp():
                return OptimStepResponse(metrics=body.get("metrics"), step=step)
            case SaveStateOp() | SaveWeightsOp():
                return self._saved(sess, op, body, step)
            case LoadStateOp(path=path):
                return LoadWeightsResponse(path=path, step=step)
            case _:
                unknown_op(op)

    def _saved(self, sess: _Session, op: SaveStateOp | SaveWeightsOp, body: dict[str, Any], step: int) -> CheckpointResponse:
        """Record the model package a save made (``list_checkpoints`` lists them)."""
        arn = body.get("modelPackageArn")
        if not arn:
            raise ServerError("the service saved the weights but returned no model package ARN", operation=op.kind, seq=op.seq)
        kind: Literal["state", "sampler", "merged"] = (
            "state" if isinstance(op, SaveStateOp) else "merged" if op.merge_weights else "sampler"
        )
        self._package_session[arn] = sess.name
        self._package_kind[arn] = kind
        self._package_lora[arn] = (sess.rank, sess.alpha)
        ref = arns.parse_model_package_arn(arn)
        sess.packages.append(
            Checkpoint(
                checkpoint_id=str(ref.version if ref else arn),
                checkpoint_type="training" if kind == "state" else kind,
                path=arn,
                time=time.time(),
                step=step,
                description=op.description or op.name,
                user_metadata=op.user_metadata,
            )
        )
        return CheckpointResponse(path=arn, kind=kind, step=step)

    async def _load_state(self, sess: _Session, arn: str, with_optimizer: bool) -> None:
        """The resume op of a session created from a checkpoint (wire number 1, before any client op)."""
        self._require_package_arn(arn, "path")
        config = {"loadState": {"modelPackageArn": arn, "loadOptimizer": with_optimizer}}
        op_id = await self._deliver(sess, self._number(sess, config, _client_token(sess.name, "resume")))
        await self._training_outcome(sess, op_id, "load_state")

    async def list_checkpoints(self, session_id: str | None = None) -> list[Checkpoint]:
        if session_id is not None:
            sess = self._sessions.get(session_id)
            return list(sess.packages) if sess else []
        return [c for s in self._sessions.values() for c in s.packages]

    async def delete_checkpoint(self, path: str) -> None:
        """``DeleteModelPackage`` (the record; its S3 artifacts stay where the service wrote them). A package that is
        not there (SageMaker: a ValidationException saying it "does not exist") is a :class:`NotFoundError`."""
        self._require_package_arn(path, "path")
        try:
            await self._calls.retried(
                self.control.delete_model_package,
                operation="DeleteModelPackage",
                not_found=NotFoundError,
                replayed=_gone_on_retry,  # the attempt whose reply was lost deleted it
                ModelPackageName=path,
            )
        except InvalidInputError as err:
            if _says_missing(err):
                raise NotFoundError(f"no model package {path}", field="path", fix="see list_checkpoints()") from err
            raise
        self._package_kind[path] = None
        for sess in self._sessions.values():
            sess.packages[:] = [c for c in sess.packages if c.path != path]

    # -------------------------------------------------------------------------------- sampling

    async def _sampling(self, session: str, config: dict[str, Any], operation_name: str) -> tuple[dict[str, Any], str]:
        """Run one sampling operation: (its ``operationResult``, its operation id)."""
        _check_config(config, _SAMPLE_CONFIG, check_sample_config)
        sess = self._sessions.get(session) or _orphan(session)
        if sess.gone is not None:
            raise sess.gone
        try:
            resp = await self._calls.retried(
                self.runtime.execute_sampling_operation, operation=operation_name, trainingSessionName=session, operationConfig=config
            )
        except SessionGoneError as err:
            await self._unknown_package(sess, err, next(iter(config.values())).get("modelPackageArn"), "model_path")
            raise
        result = await self._calls.poll(
            self.runtime.get_sampling_operation_result,
            operation=operation_name,
            check=lambda: self._check_alive(sess),
            trainingSessionName=session,
            operationId=resp["operationId"],
        )
        if result["status"] == "Completed":
            return result.get("operationResult") or {}, resp["operationId"]
        if result["status"] == "Skipped":
            await self._check_alive(sess)
        raise ServerError(
            f"{operation_name} {result['status'].lower()}: {result.get('errorDetails') or 'no details'}",
            operation=operation_name,
            request_id=resp["operationId"],
        )

    async def create_sampler(self, spec: SamplerSpec) -> str:
        arn = spec.model_path
        if arn is not None:
            self._require_package_arn(arn, "model_path")
        owner = self._package_session.get(arn) if arn else None
        if owner is not None and self._sessions[owner].gone is None:
            session, owned = owner, False
        else:  # like the official SDK: a sampler on a checkpoint from elsewhere, or on the base model, gets its own session
            base = spec.base_model or (await self._base_model_of(arn, "model_path") if arn else "")
            info = await self.create_training_session(TrainingSessionSpec(base_model=base, idempotency_key=spec.idempotency_key))
            session, owned = info.model_id, True
        # Every sample names its checkpoint (the service runs it "against" that package), so loading it first is
        # optional: the official SDK's create_sampling_client(model_package_arn=...) does not; its
        # save_weights_and_get_sampling_client does (option load_weights_for_sampling), at two round trips per refresh.
        if arn is not None and self.options.load_weights_for_sampling:
            try:
                await self._sampling(session, {"loadWeightsForSampling": {"modelPackageArn": arn}}, "load_weights_for_sampling")
            except BaseException:
                if owned:
                    with anyio.CancelScope(shield=True):
                        await self._stop_quietly(session)
                raise
        sampler_id = f"{session}.{uuid.uuid4().hex[:8]}"
        self._samplers[sampler_id] = _Sampler(session=session, model_package=arn, owned=owned)
        return sampler_id

    def sampler_session(self, sampler_id: str) -> str:
        """The training session a sampler samples on: a training client's, or the one it owns."""
        return self._sampler(sampler_id).session

    def _sampler(self, sampler_id: str) -> _Sampler:
        sampler = self._samplers.get(sampler_id)
        if sampler is None:
            raise SessionGoneError(f"sampler {sampler_id} is stopped or unknown")
        return sampler

    @staticmethod
    def _wire_sampling_params(params: SamplingParams) -> dict[str, Any]:
        if params.stop_token_ids():
            raise UnsupportedError(
                "stop token ids", field="sampling_params.stop", fix="SageMaker takes stop strings only; pass stop=['...']"
            )
        if params.temperature > _TEMPERATURE["max"]:
            raise InvalidInputError(
                f"temperature {params.temperature} is above {_TEMPERATURE['max']}",
                field="sampling_params.temperature",
                fix=f"use <= {_TEMPERATURE['max']}",
            )
        lo, hi = int(_MAX_TOKENS["min"]), int(_MAX_TOKENS["max"])
        if params.max_tokens is not None and params.max_tokens > hi:
            raise InvalidInputError(f"max_tokens {params.max_tokens} is above {hi}", field="sampling_params.max_tokens", fix=f"use <= {hi}")
        # The wire minimum is 512: shorter requests are generated at 512 and cut here (billed as generated).
        return sampling_params_to_wire(params, max(lo, params.max_tokens or lo))

    async def sample(self, sampler_id: str, request: SampleRequest) -> SampleResponse:
        sampler = self._sampler(sampler_id)
        body: dict[str, Any] = {
            "prompt": model_input_to_wire(request.prompt),
            "numSamples": request.num_samples,
            "samplingParams": self._wire_sampling_params(request.sampling_params),
        }
        if sampler.model_package:
            body["modelPackageArn"] = sampler.model_package
        if request.include_prompt_logprobs:
            body["includePromptLogprobs"] = True
        if request.topk_sample_logprobs or request.target_prompt_logprobs is not None:
            raise UnsupportedError(
                "the SageMaker wire carries top-k prompt log-probs only", field="topk_sample_logprobs", fix="leave it 0 on sagemaker://"
            )
        if request.topk_prompt_logprobs:
            body["topkPromptLogprobs"] = request.topk_prompt_logprobs
        result, op_id = await self._sampling(sampler.session, {"sample": body}, "sample")
        return sample_response_from_wire(result["sample"], len(request.prompt), request.sampling_params.max_tokens, op_id)

    async def compute_logprobs(self, sampler_id: str, tokens: list[int]) -> list[float | None]:
        sampler = self._sampler(sampler_id)
        body: dict[str, Any] = {"prompt": model_input_to_wire(tokens)}
        if sampler.model_package:
            body["modelPackageArn"] = sampler.model_package
        result, _ = await self._sampling(sampler.session, {"computeLogprobs": body}, "compute_logprobs")
        return logprobs_from_wire(result["computeLogprobs"]["logprobs"], len(tokens))

    # ------------------------------------------------------------------ OpenAI-compatible chat

    def _chat_args(self, session_id: str, body: dict[str, Any], model_package_arn: str | None) -> dict[str, Any]:
        sampler = self._samplers.get(session_id)
        kwargs: dict[str, Any] = {
            "trainingSessionName": sampler.session if sampler else session_id,
            "body": json.dumps(body).encode(),
            "contentType": "application/json",
        }
        package = model_package_arn or (sampler.model_package if sampler else None)
        if package:
            kwargs["modelPackageArn"] = package
        return kwargs

    async def _chat_call(self, fn: Any, operation_name: str, session_id: str, body: dict[str, Any], model_package_arn: str | None) -> Any:
        kwargs = self._chat_args(session_id, body, model_package_arn)
        try:
            return await self._calls.retried(fn, operation=operation_name, **kwargs)
        except SessionGoneError as err:
            session = kwargs["trainingSessionName"]
            field = "model_package_arn" if model_package_arn else "model_path"
            await self._unknown_package(self._sessions.get(session) or _orphan(session), err, kwargs.get("modelPackageArn"), field)
            raise

    async def chat_completion(self, session_id: str, body: dict[str, Any], model_package_arn: str | None = None) -> dict[str, Any]:
        """``SampleTrainingSession``: an OpenAI chat-completions body in, the service's JSON answer out. An answer that
        cannot be read whole (cut short, not JSON) is a lost reply, retried as one (it was a bare JSONDecodeError); the
        chat runs again, as a retried sample does."""

        def answered(**kwargs: Any) -> Any:  # the call and the read of its body, in one attempt
            raw = self.runtime.sample_training_session(**kwargs)["body"].read()
            try:
                return json.loads(raw)
            except ValueError as err:  # bad UTF-8 too
                raise TransientError(f"unreadable chat reply: {err}", operation="chat_completion", lost_response=True) from None

        return await self._chat_call(answered, "chat_completion", session_id, body, model_package_arn)

    async def chat_completion_stream(
        self, session_id: str, body: dict[str, Any], model_package_arn: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """``SampleTrainingSessionWithResponseStream``: yields each SSE chunk; an in-stream error raises ``ServerError``."""
        resp = await self._chat_call(
            self.runtime.sample_training_session_with_response_stream,
            "chat_completion_stream",
            session_id,
            {**body, "stream": True},
            model_package_arn,
        )
        lines = resp["body"].iter_lines()
        done = False
        try:
            while True:
                line = await anyio.to_thread.run_sync(next, lines, None)
                if line is None:
                    break
                text = line.decode().strip()
                if not text.startswith("data:"):
                    continue
                data = text[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ServerError(f"the stream failed: {chunk['error']}", operation="chat_completion_stream")
                yield chunk
        except (BotoCoreError, ValueError) as err:  # the connection broke, or a chunk came cut short: not a bare error
            raise TransientError(f"the stream broke: {err!r:.200}", operation="chat_completion_stream", lost_response=True) from err
        finally:
            resp["body"].close()
        if not done:
            raise TransientError("the stream ended without [DONE]", operation="chat_completion_stream")


def _made_by(detail: dict[str, Any], request: dict[str, Any]) -> bool:
    """Whether a described session is the one a CreateTrainingSession ``request`` asked for (role, LoRA, model, output)."""
    return all(_includes(detail.get(k), request[k]) for k in ("RoleArn", "LoraConfig", "ModelConfig", "OutputConfig"))


def _includes(got: Any, sent: Any) -> bool:
    """Whether a described member holds everything that was sent (the service may add defaults)."""
    if isinstance(sent, dict):
        return isinstance(got, dict) and all(_includes(got.get(k), v) for k, v in sent.items())
    return bool(got == sent)


def _gone_on_retry(err: ClientError) -> dict[str, Any] | None:
    """A delete's retry refused as not found: the attempt whose reply was lost deleted it."""
    message = str(err.response.get("Error", {}).get("Message", ""))
    code = error_code(err)
    return (
        {}
        if code in ("ResourceNotFound", "ResourceNotFoundException") or (code == "ValidationException" and "does not exist" in message)
        else None
    )


def _says_missing(err: AsyncSessError) -> bool:
    """Whether the service refused the call for a resource it does not know (SageMaker's "does not exist")."""
    return isinstance(err.__cause__, ClientError) and _gone_on_retry(err.__cause__) is not None


def _count(value: Any) -> int | None:
    """A positive integer a hub document publishes, else None."""
    return value if type(value) is int and value > 0 else None


def _orphan(name: str) -> _Session:
    """A stand-in record for a session this driver did not create (liveness checks only)."""
    return _Session(name=name, base_model="", hub_arn="", hf_id=None, rank=0, alpha=0, sequencer=Sequencer(_refuse))


def _wire_key(op: TrainingOp) -> str:
    """The op's key in SageMaker's ``OperationConfig`` and ``OperationResult``."""
    return _WIRE_KEYS[type(op)]


_WIRE_KEYS: dict[type[TrainingOp], str] = {
    ForwardOp: "forward",
    ForwardBackwardOp: "forwardBackward",
    OptimStepOp: "optimizerStep",
    SaveStateOp: "saveState",
    SaveWeightsOp: "saveWeights",
    LoadStateOp: "loadState",
}


async def _refuse(op: TrainingOp) -> Any:
    raise InvalidInputError("this session was not created by this client", field="session_id")


def _client_token(session: str, key: str) -> str:
    """One client token per op, stable across retries: the idempotency key when it fits the wire pattern."""
    return key if _TOKEN.fullmatch(key) else hashlib.sha256(f"{session}/{key}".encode()).hexdigest()


def _check(operation_name: str, request: dict[str, Any], service: str) -> None:
    try:
        check_shape(request, operation(service, operation_name).input_shape)
    except ShapeError as err:
        raise InvalidInputError(str(err), field=err.path, fix="see the SageMaker limits in the message") from None


def _check_config(config: dict[str, Any], shape: Any, rules: Any) -> None:
    """The service's limits, checked before sending, so bad input fails with the member's path."""
    try:
        check_shape(config, shape, "operationConfig")
        rules(config)
    except ShapeError as err:
        raise InvalidInputError(str(err), field=err.path, fix="see the SageMaker limits in the message") from None
