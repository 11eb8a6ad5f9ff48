"""The emulated service: state machines, ordering, deduplication, usage and model packages.

Operations run on an inner asyncsess backend (``mock://``, ``local://``, ...). Training ops of one session
go through an :class:`asyncsess.backends.sequencer.Sequencer`, so they run in sequence-number order, each at most
once; a gap (a missing number with later ones waiting) leaves the session ``Blocked`` until the number
arrives or ``gap_timeout_s`` passes (then the session ``Failed`` and its queue is ``Skipped``). Ops merely
queued behind a running one are not a gap. A failed op fails the session the same way. A refused op takes its
number all the same: its turn passes without running anything, so the ops after it do not wait for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import anyio
from anyio.abc import TaskGroup
from pydantic import ValidationError

from asyncsess.backends import (
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
    unknown_op,
)
from asyncsess.backends.sequencer import Sequencer
from asyncsess.chat import chat_tokens
from asyncsess.errors import AsyncSessError, InvalidInputError, PoisonedError, SessionGoneError
from asyncsess.serve.openai_wire import Message, TokenText, content_pieces, validation_error
from asyncsess.types import MAX_SEED, CheckpointResponse, ForwardBackwardOutput, OptimStepResponse, SamplingParams

from .. import arns
from ..shape_check import INTEGER_RANGE, ShapeError, epoch_seconds
from ..wire import (
    adam_from_wire,
    check_operation_config,
    check_sample_config,
    datum_from_wire,
    forward_result_to_wire,
    logprobs_to_wire,
    model_input_from_wire,
    sample_response_to_wire,
    sampling_params_from_wire,
)
from .config import EmulatorConfig
from .errors import AwsError
from .listing import filtered, page, schema_version
from .state import (
    ACCEPTS_WORK,
    DELETABLE,
    STOPPABLE,
    TERMINAL,
    HubModel,
    ModelPackageGroupRecord,
    ModelPackageRecord,
    OperationRecord,
    SessionRecord,
)

__all__ = ["EmulatedService", "DEFAULT_GROUP", "chat_model", "chat_completion_id"]

log = logging.getLogger("asyncsess_sagemaker.emulator")

DEFAULT_GROUP = "sagemaker-default"
KEPT_SAMPLERS = 4  # engine samplers a session keeps: past this, the least recently used one not in use is stopped
MAX_TAGS = 50  # per resource (the model's TagList maximum)
HUB_VERSION = "1.0.0"


class EmulatedService:
    def __init__(self, inner: Backend, config: EmulatorConfig) -> None:
        self.inner = inner
        self.config = config
        self.sessions: dict[str, SessionRecord] = {}
        self.groups: dict[str, ModelPackageGroupRecord] = {}
        self.packages: dict[str, ModelPackageRecord] = {}
        self.hub: dict[str, HubModel] = {}
        self._tg: TaskGroup | None = None

    # ------------------------------------------------------------------------------- lifecycle

    async def start(self, tg: TaskGroup) -> None:
        """Read the inner backend's models into the public hub, then :meth:`attach`."""
        self._tg = tg
        caps = await self.inner.capabilities()
        for m in caps.supported_models:
            name = arns.hub_content_name_for(m.model_name)
            self.hub[name] = HubModel(
                hub_name=name,
                version=HUB_VERSION,
                model_id=m.model_name,
                arn=arns.hub_content_arn(self.config.region, name, HUB_VERSION),
                max_context_length=m.max_context_length,
                vocab_size=m.vocab_size,
            )

    def attach(self, tg: TaskGroup, hub: dict[str, HubModel]) -> None:
        """Run in ``tg`` with the public ``hub`` another account's service read (the hub is every account's)."""
        self._tg, self.hub = tg, hub

    def _spawn(self, fn: Any, *args: Any) -> None:
        assert self._tg is not None, "EmulatedService.start() was not called"
        self._tg.start_soon(fn, *args)

    def _arn_account(self) -> tuple[str, str]:
        return self.config.region, self.config.account_id

    # --------------------------------------------------------------------------- control plane

    def _session(self, name: str, *, runtime: bool) -> SessionRecord:
        sess = self.sessions.get(name)
        if sess is None:
            raise AwsError.not_found(f"Training session {name} not found")
        self._check_idle(sess)
        if runtime:
            sess.last_activity = time.monotonic()
        return sess

    def _check_idle(self, sess: SessionRecord) -> None:
        idle = self.config.idle_timeout_s
        if idle is not None and sess.status in ACCEPTS_WORK and time.monotonic() - sess.last_activity > idle:
            self._end_session(sess, "Expired", f"The training session expired after {idle:g}s without activity")

    def _hub_model(self, base_model_arn: str) -> HubModel:
        ref = arns.parse_hub_content_arn(base_model_arn)
        model = self.hub.get(ref.name) if ref and ref.region == self.config.region and ref.hub == arns.PUBLIC_HUB else None
        if ref is None or model is None or (ref.version is not None and ref.version != model.version):
            raise AwsError("ResourceNotFound", f"Hub content {base_model_arn} not found")
        return model

    async def create_training_session(self, body: dict[str, Any]) -> dict[str, Any]:
        _check_tags(body.get("Tags"))
        name = body["TrainingSessionName"]
        existing = self.sessions.get(name)
        if existing is not None:
            raise AwsError("ResourceInUse", f"Training session {name} already exists")
        model = self._hub_model(body["ModelConfig"]["BaseModelArn"])
        group_arn = body.get("ModelPackageGroupArn")
        if group_arn is not None:
            group = arns.name_from_arn(group_arn)
            if group not in self.groups or self.groups[group].arn != group_arn:  # another account's or region's is not ours
                raise AwsError("ResourceNotFound", f"Model package group {group_arn} not found")
        else:
            group = self._ensure_group(DEFAULT_GROUP).name
        region, account = self._arn_account()
        sess = SessionRecord(
            name=name,
            arn=arns.session_arn(region, account, name),
            request=body,
            model=model,
            group=group,
            sequencer=Sequencer(self._make_runner(name), gap_timeout=math.inf),  # gaps are timed by _watch_gap
        )
        self.sessions[name] = sess
        if self.config.startup_s == 0:  # Running by the time Create answers
            await self._bring_up(sess)
        else:
            self._spawn(self._bring_up, sess)
        return {"TrainingSessionArn": sess.arn}

    async def _bring_up(self, sess: SessionRecord) -> None:
        if self.config.startup_s:
            await anyio.sleep(self.config.startup_s / 2)
        if sess.status != "Created":
            return
        sess.set_status("Scheduled")
        lora = sess.request["LoraConfig"]
        spec = TrainingSessionSpec(base_model=sess.model.model_id, rank=lora["Rank"], alpha=float(lora["Alpha"]))
        try:
            info = await self.inner.create_training_session(spec)
        except Exception as err:  # the engine refused: the session fails, as a real one would
            sess.set_status("Failed", f"Could not start the training engine: {err}")
            return
        sess.inner_id = info.model_id
        if self.config.startup_s:
            await anyio.sleep(self.config.startup_s / 2)
        if sess.status == "Scheduled":
            sess.last_activity = time.monotonic()
            sess.set_status("Running")
        else:
            await self._stop_inner(sess)

    def _detail(self, sess: SessionRecord) -> dict[str, Any]:
        status = sess.status
        if status == "Running" and sess.is_blocked():
            status = "Blocked"
        out: dict[str, Any] = {
            "TrainingSessionArn": sess.arn,
            "TrainingSessionName": sess.name,
            "TrainingSessionStatus": status,
            "CreationTime": sess.created,
            "LastModifiedTime": sess.last_modified,
            "RoleArn": sess.request["RoleArn"],
            "LoraConfig": sess.request["LoraConfig"],
            "ModelConfig": sess.request["ModelConfig"],
            "OutputConfig": sess.request["OutputConfig"],
            "ModelPackageGroupArn": arns.model_package_group_arn(*self._arn_account(), sess.group),  # the group may be gone
            "BillableTokenUsage": {
                "PrefillTokenCount": sess.prefill_tokens,
                "SampleTokenCount": sess.sample_tokens,
                "TrainingTokenCount": sess.training_tokens,
            },
        }
        for key in ("VpcConfig", "Tags"):
            if key in sess.request:
                out[key] = sess.request[key]
        if sess.end_time is not None:
            out["EndTime"] = sess.end_time
        if sess.error_details is not None:
            out["ErrorDetails"] = sess.error_details
        elif status == "Blocked":
            out["ErrorDetails"] = f"Waiting for the operation with sequence number {sess.sequencer.next_seq}"
        if sess.last_received_seq is not None:
            out["LastReceivedSequenceNumber"] = sess.last_received_seq
        return out

    async def describe_training_session(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"TrainingSessionDetail": self._detail(self._session(body["TrainingSessionName"], runtime=False))}

    async def list_training_sessions(self, body: dict[str, Any]) -> dict[str, Any]:
        rows = []
        for sess in sorted(self.sessions.values(), key=lambda s: s.created, reverse=True):
            self._check_idle(sess)
            detail = self._detail(sess)
            if body.get("NameContains") and body["NameContains"] not in sess.name:
                continue
            if body.get("StatusEquals") and detail["TrainingSessionStatus"] != body["StatusEquals"]:
                continue
            if body.get("CreationTimeAfter") is not None and sess.created <= epoch_seconds(body["CreationTimeAfter"]):
                continue
            if body.get("CreationTimeBefore") is not None and sess.created >= epoch_seconds(body["CreationTimeBefore"]):
                continue
            rows.append(
                {
                    "TrainingSessionArn": sess.arn,
                    "TrainingSessionStatus": detail["TrainingSessionStatus"],
                    "CreationTime": sess.created,
                    "LastModifiedTime": sess.last_modified,
                }
            )
        return page(rows, body, "TrainingSessionSummaries", self.config.account_id)

    async def stop_training_session(self, body: dict[str, Any]) -> dict[str, Any]:
        sess = self._session(body["TrainingSessionName"], runtime=False)
        if sess.status not in STOPPABLE:
            raise AwsError.validation(f"Training session {sess.name}: invalid session state transition from {sess.status} to Stopping")
        self._end_session(sess, "Stopping", None)
        return {}

    async def delete_training_session(self, body: dict[str, Any]) -> dict[str, Any]:
        sess = self._session(body["TrainingSessionName"], runtime=False)
        if sess.status not in DELETABLE:
            raise AwsError.validation(f"Training session {sess.name}: invalid session state transition from {sess.status} to Deleting")
        sess.set_status("Deleting")
        self._spawn(self._finish_delete, sess)
        return {}

    async def _finish_delete(self, sess: SessionRecord) -> None:
        await anyio.sleep(self.config.stop_s)
        self.sessions.pop(sess.name, None)

    def _end_session(self, sess: SessionRecord, status: str, error: str | None) -> None:
        """Leave Running for good: refuse queued ops (``Skipped``) and release the engine."""
        if sess.status in TERMINAL or sess.status == "Stopping":
            return
        sess.set_status(status, error)
        sess.sequencer.stop(status.lower())
        reason = error or f"The training session is {status}"
        for op in sess.pending_training_ops():
            if op.status == "Pending":
                op.finish("Skipped", error=reason)
        self._spawn(self._wind_down, sess, status == "Stopping")

    async def _wind_down(self, sess: SessionRecord, stopping: bool) -> None:
        await self._stop_inner(sess)
        if stopping:
            await anyio.sleep(self.config.stop_s)
            sess.set_status("Stopped")

    async def _stop_inner(self, sess: SessionRecord) -> None:
        if sess.inner_id is None:
            return
        inner_id, sess.inner_id = sess.inner_id, None
        for sampler in list(sess.samplers.values()):  # _sampler adds none once inner_id is None
            await _quietly(self.inner.stop_session(sampler))
        await _quietly(self.inner.stop_session(inner_id))

    def fail_session(self, name: str, reason: str, status: str = "Failed") -> None:
        """Test hook (admin endpoint): fail or expire a session from the service side."""
        self._end_session(self._session(name, runtime=False), status, reason)

    # ------------------------------------------------------------------------- model registry

    def _ensure_group(self, name: str, description: str | None = None, tags: list[dict[str, str]] | None = None) -> ModelPackageGroupRecord:
        group = self.groups.get(name)
        if group is None:
            region, account = self._arn_account()
            arn = arns.model_package_group_arn(region, account, name)
            group = ModelPackageGroupRecord(name=name, arn=arn, description=description, tags=list(tags or []))
            self.groups[name] = group
        return group

    async def create_model_package_group(self, body: dict[str, Any]) -> dict[str, Any]:
        _check_tags(body.get("Tags"))
        name = body["ModelPackageGroupName"]
        if name in self.groups:
            raise AwsError("ResourceInUse", f"Model Package Group already exists: {self.groups[name].arn}")
        return {"ModelPackageGroupArn": self._ensure_group(name, body.get("ModelPackageGroupDescription"), body.get("Tags")).arn}

    def _group(self, name_or_arn: str) -> ModelPackageGroupRecord:
        group = self.groups.get(arns.name_from_arn(name_or_arn))
        if group is None or (name_or_arn.startswith("arn:") and name_or_arn != group.arn):
            raise AwsError.validation(f"ModelPackageGroup {name_or_arn} does not exist.")
        return group

    async def describe_model_package_group(self, body: dict[str, Any]) -> dict[str, Any]:
        g = self._group(body["ModelPackageGroupName"])
        out = {
            "ModelPackageGroupName": g.name,
            "ModelPackageGroupArn": g.arn,
            "CreationTime": g.created,
            "CreatedBy": {},
            "ModelPackageGroupStatus": "Completed",
        }
        if g.description:
            out["ModelPackageGroupDescription"] = g.description
        return out

    async def list_model_package_groups(self, body: dict[str, Any]) -> dict[str, Any]:
        """This account's groups; ``CrossAccountFilterOption=CrossAccount`` lists those other accounts shared with it
        (none: the emulator shares nothing)."""
        shared = body.get("CrossAccountFilterOption") == "CrossAccount"
        rows = [
            {
                "ModelPackageGroupName": g.name,
                "ModelPackageGroupArn": g.arn,
                "CreationTime": g.created,
                "ModelPackageGroupStatus": "Completed",
            }
            for g in ([] if shared else self.groups.values())
        ]
        sort_keys = {"Name": "ModelPackageGroupName", "CreationTime": "CreationTime"}
        listed = filtered(rows, body, "ModelPackageGroupName", sort_keys)
        return page(listed, body, "ModelPackageGroupSummaryList", self.config.account_id)

    async def delete_model_package_group(self, body: dict[str, Any]) -> dict[str, Any]:
        g = self._group(body["ModelPackageGroupName"])
        if any(p.group == g.name for p in self.packages.values()):
            raise AwsError.validation(f"Model package group {g.name} still has model packages")
        users = sorted(sess.name for sess in self.sessions.values() if sess.group == g.name and sess.status not in TERMINAL)
        if users:  # a live session registers its saves there
            raise AwsError.validation(f"Model package group {g.name} is in use by training session {users[0]}; stop it first")
        del self.groups[g.name]
        return {}

    def _package(self, arn: str) -> ModelPackageRecord:
        pkg = self.packages.get(arn)
        if pkg is None:
            raise AwsError.validation(f"Model package {arn} does not exist.")
        return pkg

    async def describe_model_package(self, body: dict[str, Any]) -> dict[str, Any]:
        p = self._package(body["ModelPackageName"])
        container: dict[str, Any] = {
            "BaseModel": {"HubContentName": p.model.hub_name, "HubContentVersion": p.model.version},
            "ModelDataSource": {"S3DataSource": {"S3Uri": p.s3_uri, "S3DataType": "S3Prefix", "CompressionType": "None"}},
        }
        if p.is_checkpoint:
            container["IsCheckpoint"] = True
        out = {
            "ModelPackageName": p.group,
            "ModelPackageGroupName": p.group,
            "ModelPackageVersion": p.version,
            "ModelPackageArn": p.arn,
            "CreationTime": p.created,
            "ModelPackageStatus": "Completed",
            "ModelPackageStatusDetails": {"ValidationStatuses": []},
            "InferenceSpecification": {"Containers": [container]},
        }
        if p.description:
            out["ModelPackageDescription"] = p.description
        return out

    async def list_model_packages(self, body: dict[str, Any]) -> dict[str, Any]:
        """The versioned packages (every one the emulator registers) of a group, or of every group with
        ``ModelPackageType`` ``Versioned`` or ``Both``; the documented default without a group is ``Unversioned``, of
        which there are none (it listed every group's)."""
        group = body.get("ModelPackageGroupName")
        wanted = self._group(group).name if group else None
        kind = body.get("ModelPackageType") or ("Versioned" if group else "Unversioned")
        rows = []
        for p in self.packages.values() if kind != "Unversioned" else ():
            if wanted is not None and p.group != wanted:
                continue
            row: dict[str, Any] = {
                "ModelPackageName": p.group,
                "ModelPackageGroupName": p.group,
                "ModelPackageVersion": p.version,
                "ModelPackageArn": p.arn,
                "CreationTime": p.created,
                "ModelPackageStatus": "Completed",
            }
            if p.description:
                row["ModelPackageDescription"] = p.description
            rows.append(row)
        listed = filtered(rows, body, "ModelPackageName", {"Name": "ModelPackageName", "CreationTime": "CreationTime"})
        return page(listed, body, "ModelPackageSummaryList", self.config.account_id)

    async def delete_model_package(self, body: dict[str, Any]) -> dict[str, Any]:
        arn = self.packages.pop(self._package(body["ModelPackageName"]).arn).arn
        for sess in self.sessions.values():
            if sess.latest_checkpoint == arn:  # samples that name no package run on the newest one left (or the base model)
                mine = [p for p in self.packages.values() if p.session_name == sess.name and p.created >= sess.created]
                sess.latest_checkpoint = max(mine, key=lambda p: (p.created, p.version)).arn if mine else None
        return {}

    # ---------------------------------------------------------------------------------- tags

    def _tags_of(self, arn: str) -> tuple[list[dict[str, str]], Any]:
        """The tags of the training session or model package group ``arn`` names, and how to replace them. Only this
        account's, in this region: another's is not found, whether it exists or not."""
        sess = next((s for s in self.sessions.values() if s.arn == arn and s.status != "Deleting"), None)
        if sess is not None:
            return list(sess.request.get("Tags", [])), lambda tags: sess.request.__setitem__("Tags", tags)
        group = next((g for g in self.groups.values() if g.arn == arn), None)
        if group is not None:
            return list(group.tags), lambda tags: setattr(group, "tags", tags)
        raise AwsError(
            "ResourceNotFound", f"Resource {arn} not found: tags are kept on this account's training sessions and model package groups"
        )

    async def add_tags(self, body: dict[str, Any]) -> dict[str, Any]:
        """Add or overwrite tags (by key), at most 50 on a resource; refused as a whole, changing nothing."""
        _check_tags(body["Tags"])
        tags, replace_tags = self._tags_of(body["ResourceArn"])
        merged = {t["Key"]: t for t in tags} | {t["Key"]: t for t in body["Tags"]}
        if len(merged) > MAX_TAGS:
            raise AwsError.validation(f"Tags: the resource would have {len(merged)} tags; a resource has at most {MAX_TAGS}")
        replace_tags(list(merged.values()))
        return {"Tags": body["Tags"]}

    async def list_tags(self, body: dict[str, Any]) -> dict[str, Any]:
        return page(self._tags_of(body["ResourceArn"])[0], body, "Tags", self.config.account_id)

    async def delete_tags(self, body: dict[str, Any]) -> dict[str, Any]:
        _check_tag_keys(body["TagKeys"], "TagKeys[{}]")
        tags, replace_tags = self._tags_of(body["ResourceArn"])
        replace_tags([t for t in tags if t["Key"] not in set(body["TagKeys"])])
        return {}

    # ----------------------------------------------------------------------------------- hub

    def _hub_info(self, m: HubModel) -> dict[str, Any]:
        return {
            "HubContentName": m.hub_name,
            "HubContentArn": m.arn,
            "HubContentVersion": m.version,
            "HubContentType": "Model",
            "DocumentSchemaVersion": "2.4.0",
            "HubContentDisplayName": m.model_id,
            "HubContentStatus": "Available",
            "CreationTime": 0.0,
            "HubContentSearchKeywords": ["@capability:training_session", f"@huggingface-id:{m.model_id.lower()}"],
        }

    def _is_public_hub(self, name_or_arn: str) -> bool:
        """Whether HubName names this region's public hub, by name or by ARN (another region's is another hub)."""
        return name_or_arn in (arns.PUBLIC_HUB, self._hub_arn())

    def _hub_arn(self) -> str:
        return f"arn:aws:sagemaker:{self.config.region}:aws:hub/{arns.PUBLIC_HUB}"

    async def list_hub_contents(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self._is_public_hub(body["HubName"]) or body["HubContentType"] != "Model":
            return {"HubContentSummaries": []}
        ceiling = schema_version(body.get("MaxSchemaVersion") or "9999.9999.9999")
        rows = [r for r in map(self._hub_info, self.hub.values()) if schema_version(r["DocumentSchemaVersion"]) <= ceiling]
        sort_keys = {key: key for key in ("HubContentName", "CreationTime", "HubContentStatus")}
        return page(filtered(rows, body, "HubContentName", sort_keys), body, "HubContentSummaries", self.config.account_id)

    async def describe_hub_content(self, body: dict[str, Any]) -> dict[str, Any]:
        m = self.hub.get(body["HubContentName"])
        version, kind = body.get("HubContentVersion"), body["HubContentType"]
        if not self._is_public_hub(body["HubName"]) or m is None or kind != "Model" or version not in (None, m.version):
            shown = f"{kind} {body['HubContentName']}" + (f" version {version}" if version else "")
            raise AwsError("ResourceNotFound", f"Hub content {shown} not found in hub {body['HubName']}")
        info = self._hub_info(m)
        info.update(
            HubName=arns.PUBLIC_HUB,
            HubArn=self._hub_arn(),
            HubContentDocument=json.dumps(self._hub_document(m)),
        )
        return info

    def _hub_document(self, m: HubModel) -> dict[str, Any]:
        """What a model's hub document publishes: its Hugging Face id, context length and vocabulary size."""
        doc: dict[str, Any] = {"HuggingfaceId": m.model_id, "MaxContextLength": m.max_context_length}
        if self.config.publish_vocab_size and m.vocab_size is not None:
            doc["VocabSize"] = m.vocab_size
        return doc

    # -------------------------------------------------------------------------------- runtime

    def _accepting(self, name: str) -> SessionRecord:
        sess = self._session(name, runtime=True)
        if sess.status not in ACCEPTS_WORK:
            raise AwsError.conflict(
                f"Training session {name} is {sess.status}; operations are accepted only while it is Running or Blocked"
            )
        return sess

    def _known_package(self, arn: str) -> ModelPackageRecord:
        pkg = self.packages.get(arn)
        if pkg is None:  # another account's is never here: its existence is not told
            raise AwsError.not_found(f"Model package {arn} not found")
        return pkg

    async def execute_training_operation(self, body: dict[str, Any]) -> dict[str, Any]:
        sess = self._accepting(body["trainingSessionName"])
        config = body["operationConfig"]
        seq, token = body["sequenceNumber"], body.get("clientToken")
        try:
            check_operation_config(config, sess.model.vocab_size, sess.model.max_context_length)
        except ShapeError as err:
            self._use_up(sess, seq)
            raise AwsError.validation(str(err)) from None
        kind, op_body = next(iter(config.items()))
        if token is not None and token in sess.by_token:
            op = sess.by_token[token]
            if op.seq != seq or op.config != config:
                self._use_up(sess, seq)  # a refusal all the same: a new number is taken, so the next ones do not wait
                raise AwsError.validation(f"Client token {token} was already used with different parameters")
            return {"operationId": op.id}
        if seq in sess.by_seq:
            raise AwsError.validation(f"Sequence number {seq} was already used by operation {sess.by_seq[seq].id}")
        if seq in sess.refused:
            raise AwsError.validation(f"Sequence number {seq} was already used by a refused operation; send this one as the next number")
        if kind == "loadState":
            try:
                self._checkpoint_of(sess, op_body["modelPackageArn"])
            except AwsError:
                self._use_up(sess, seq)
                raise
        op = OperationRecord(id=str(uuid.uuid4()), kind=kind, config=config, seq=seq, client_token=token)
        sess.training_ops[op.id] = op
        sess.by_seq[seq] = op
        if token is not None:
            sess.by_token[token] = op
        sess.last_received_seq = max(seq, sess.last_received_seq or 0)
        self._spawn(self._run_training, sess, op)
        self._watch_gap(sess)
        return {"operationId": op.id}

    def refused_training_operation(self, body: dict[str, Any]) -> None:
        """An op refused for its shape (before :meth:`execute_training_operation`) takes its number all the same."""
        sess = self.sessions.get(str(body.get("trainingSessionName")))
        seq = body.get("sequenceNumber")
        if sess is not None and sess.status in ACCEPTS_WORK and type(seq) is int and 1 <= seq <= INTEGER_RANGE["integer"][1]:
            self._use_up(sess, seq)

    def _checkpoint_of(self, sess: SessionRecord, arn: str) -> ModelPackageRecord:
        """The package ``loadState`` names: one of this account's, saved by ``saveState`` from this session's base model
        with this session's LoRA rank."""
        pkg = self._known_package(arn)
        if not pkg.is_checkpoint:
            raise AwsError.validation(f"Model package {arn} holds weights for sampling (saveWeights); load a package saved by saveState")
        if pkg.model != sess.model:
            raise AwsError.validation(
                f"Model package {arn} was trained from {pkg.model.model_id}, not this session's {sess.model.model_id}"
            )
        rank = sess.request["LoraConfig"]["Rank"]
        if pkg.rank != rank:  # the adapter's matrices have another shape: the engine would refuse it after numbering
            raise AwsError.validation(
                f"Model package {arn} holds a LoRA adapter of rank {pkg.rank}; this session has rank {rank}: "
                f"load it into a session created with LoraConfig.Rank {pkg.rank}"
            )
        return pkg

    def _use_up(self, sess: SessionRecord, seq: int) -> None:
        """A refused op takes its sequence number all the same (the official SDK never sends a number twice), so the
        ops after it do not wait for it: its turn in the queue passes without running anything (``Sequencer.refuse``)."""
        if seq in sess.by_seq or seq in sess.refused or seq < sess.sequencer.next_seq:
            return
        sess.refused.add(seq)
        sess.last_received_seq = max(seq, sess.last_received_seq or 0)
        with contextlib.suppress(InvalidInputError):
            sess.sequencer.refuse(_Refused(seq), InvalidInputError(f"operation {seq} was refused", field="operationConfig"))
        self._watch_gap(sess)

    def _watch_gap(self, sess: SessionRecord) -> None:
        """Called whenever an op arrives or finishes: time a newly missing sequence number."""
        if sess.is_blocked() and sess.gap_watched != sess.sequencer.next_seq:
            sess.gap_watched = sess.sequencer.next_seq
            self._spawn(self._gap_timer, sess, sess.gap_watched)

    async def _gap_timer(self, sess: SessionRecord, missing: int) -> None:
        await anyio.sleep(self.config.gap_timeout_s)
        if sess.status in ACCEPTS_WORK and sess.sequencer.next_seq == missing and not sess.arrived(missing):
            self._end_session(
                sess, "Failed", f"The operation with sequence number {missing} never arrived within {self.config.gap_timeout_s:g}s"
            )

    def _make_runner(self, name: str) -> Any:
        async def run(top: TrainingOp) -> dict[str, Any]:
            sess = self.sessions[name]
            return await self._apply(sess, sess.by_seq[top.seq], top)

        return run

    async def _run_training(self, sess: SessionRecord, op: OperationRecord) -> None:
        try:
            result = await sess.sequencer.execute(_record(op))
        except (PoisonedError, SessionGoneError) as err:
            op.finish("Skipped", error=str(err))
        except Exception as err:
            op.finish("Failed", error=_details(err))
        else:
            op.finish("Completed", result=result)
        self._watch_gap(sess)

    async def _apply(self, sess: SessionRecord, op: OperationRecord, top: TrainingOp) -> dict[str, Any]:
        """Run one training op on the engine (called by the sequencer, in order)."""
        if sess.inner_id is None or sess.status not in ACCEPTS_WORK:
            raise SessionGoneError(f"session {sess.status}")
        op.status = "InProgress"
        try:
            top = replace(top, seq=sess.engine_seq)  # the engine numbers only what it runs (refused ops take no number)
            sess.engine_seq += 1
            return await self._apply_on_engine(sess, op, top)
        except Exception as err:
            op.finish("Failed", error=_details(err))
            self._end_session(sess, "Failed", f"Operation {op.id} (sequence number {op.seq}) failed: {_details(err)}")
            raise

    async def _apply_on_engine(self, sess: SessionRecord, op: OperationRecord, top: TrainingOp) -> dict[str, Any]:
        assert sess.inner_id is not None
        match top:
            case ForwardOp() | ForwardBackwardOp():
                out = await self.inner.execute_training(sess.inner_id, top)
                assert isinstance(out, ForwardBackwardOutput)
                tokens = sum(d.model_input.length for d in top.data)
                sess.training_tokens += tokens
                op.token_usage = {"trainingTokens": tokens}
                return forward_result_to_wire(out, tokens)
            case OptimStepOp():
                step = await self.inner.execute_training(sess.inner_id, top)
                assert isinstance(step, OptimStepResponse)
                return {"metrics": dict(step.metrics or {})}
            case SaveStateOp() | SaveWeightsOp():
                return await self._save(sess, top)
            case LoadStateOp(path=arn):
                pkg = self._checkpoint_of(sess, arn)
                await self.inner.execute_training(sess.inner_id, replace(top, path=pkg.inner_path))
                return {}
            case _:
                unknown_op(top)

    async def _save(self, sess: SessionRecord, top: SaveStateOp | SaveWeightsOp) -> dict[str, Any]:
        """Save on the engine as the group's next model package version."""
        assert sess.inner_id is not None
        group = self.groups[sess.group]
        version = group.next_version
        group.next_version += 1
        merged = isinstance(top, SaveWeightsOp) and top.merge_weights
        # the engine's name for it: unique within the engine session, and at most 74 characters (with the session's
        # name, a 63-character session saving into a 63-character group passed the engine's 128 and failed the session)
        saved = await self.inner.execute_training(sess.inner_id, replace(top, name=f"{group.name}-{version}"))
        assert isinstance(saved, CheckpointResponse)
        region, account = self._arn_account()
        arn = arns.model_package_arn(region, account, group.name, version)
        output = sess.request["OutputConfig"]["S3Location"]["Path"].rstrip("/")
        self.packages[arn] = ModelPackageRecord(
            arn=arn,
            group=group.name,
            version=version,
            description=top.description,
            is_checkpoint=isinstance(top, SaveStateOp),
            merged=merged,
            inner_path=saved.path,
            model=sess.model,
            rank=sess.request["LoraConfig"]["Rank"],
            session_name=sess.name,
            s3_uri=f"{output}/checkpoints/{version}/" + ("hf_merged/" if merged else ""),
        )
        sess.latest_checkpoint = arn
        return {"modelPackageArn": arn}

    async def get_training_operation_result(self, body: dict[str, Any]) -> dict[str, Any]:
        sess = self._session(body["trainingSessionName"], runtime=True)
        return await self._result(sess.training_ops, body["operationId"], sess.name)

    async def _result(self, ops: dict[str, OperationRecord], op_id: str, name: str) -> dict[str, Any]:
        op = ops.get(op_id)
        if op is None:
            raise AwsError.not_found(f"Operation {op_id} not found in training session {name}")
        if self.config.result_wait_s > 0 and not op.done.is_set():
            with anyio.move_on_after(self.config.result_wait_s):
                await op.done.wait()
        return op.output()

    # ------------------------------------------------------------------------------- sampling

    async def execute_sampling_operation(self, body: dict[str, Any]) -> dict[str, Any]:
        sess = self._accepting(body["trainingSessionName"])
        config = body["operationConfig"]
        kind, op_body = next(iter(config.items()))
        try:
            check_sample_config(config, sess.model.vocab_size, sess.model.max_context_length)
        except ShapeError as err:
            raise AwsError.validation(str(err)) from None
        topk = op_body.get("topkPromptLogprobs")
        if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or not 0 <= topk <= 1024):
            raise AwsError.validation("topkPromptLogprobs must be an integer in 0..1024")
        if op_body.get("modelPackageArn") is not None:
            self._known_package(op_body["modelPackageArn"])
        op = OperationRecord(id=str(uuid.uuid4()), kind=kind, config=config)
        sess.sampling_ops[op.id] = op
        self._spawn(self._run_sampling, sess, op)
        return {"operationId": op.id}

    @contextlib.asynccontextmanager
    async def _sampler(self, sess: SessionRecord, arn: str | None) -> AsyncIterator[str]:
        """The session's engine sampler on ``arn`` (None: the base model), in use until the block ends. Made once per
        package (concurrent first samples each made one and kept the last; the others were never stopped), stopped with
        the session (one made while the session ended was kept), and, past :data:`KEPT_SAMPLERS`, the least recently
        used one not in use is stopped (every sampler refresh of a run kept one, on local:// an adapter on the device)."""
        sampler = sess.samplers.pop(arn, None)
        if sampler is not None:
            sess.samplers[arn] = sampler  # the most recently used last
        else:
            async with sess.sampler_lock:
                sampler = sess.samplers.get(arn)
                if sampler is None:
                    spec = (
                        SamplerSpec(model_path=self._known_package(arn).inner_path) if arn else SamplerSpec(base_model=sess.model.model_id)
                    )
                    sampler = await self.inner.create_sampler(spec)
                    if sess.inner_id is None:  # the session ended meanwhile, and _stop_inner released its samplers
                        await _quietly(self.inner.stop_session(sampler))
                        raise AwsError.conflict(f"Training session {sess.name} is {sess.status}; it ended while this operation started")
                    sess.samplers[arn] = sampler
        sess.sampler_uses[sampler] += 1
        try:
            yield sampler
        finally:
            sess.sampler_uses[sampler] -= 1
            idle = [(a, s) for a, s in sess.samplers.items() if not sess.sampler_uses[s]]
            for a, s in idle[: max(0, len(sess.samplers) - KEPT_SAMPLERS)]:
                del sess.samplers[a], sess.sampler_uses[s]
                await _quietly(self.inner.stop_session(s))

    def _capped(self, params: SamplingParams) -> SamplingParams:
        cap = self.config.sample_max_tokens
        if cap is None or (params.max_tokens is not None and params.max_tokens <= cap):
            return params
        return params.model_copy(update={"max_tokens": cap})

    async def _run_sampling(self, sess: SessionRecord, op: OperationRecord) -> None:
        body = op.config[op.kind]
        op.status = "InProgress"
        try:
            arn = body.get("modelPackageArn")
            async with self._sampler(sess, arn if arn is not None else sess.latest_checkpoint) as sampler:
                result = {} if op.kind == "loadWeightsForSampling" else await self._sample(sess, op.kind, body, sampler, op.id)
            op.finish("Completed", result=result)
        except Exception as err:
            op.finish("Failed", error=_details(err))

    async def _sample(self, sess: SessionRecord, kind: str, body: dict[str, Any], sampler: str, op_id: str) -> dict[str, Any]:
        """The result of a ``sample`` or ``computeLogprobs`` op run on ``sampler``."""
        prompt = model_input_from_wire(body["prompt"]).to_ints()
        if kind == "computeLogprobs":
            return {"logprobs": logprobs_to_wire(await self.inner.compute_logprobs(sampler, prompt))}
        include = bool(body.get("includePromptLogprobs"))
        request = SampleRequest(
            prompt=tuple(prompt),
            num_samples=body["numSamples"],
            sampling_params=self._capped(sampling_params_from_wire(body["samplingParams"])),
            include_prompt_logprobs=include,
            request_id=op_id,
            topk_prompt_logprobs=int(body.get("topkPromptLogprobs") or 0),
        )
        resp = await self.inner.sample(sampler, request)
        sess.prefill_tokens += len(prompt) * len(resp.sequences)
        sess.sample_tokens += sum(len(s.tokens) for s in resp.sequences)
        return sample_response_to_wire(resp, len(prompt), include)

    async def get_sampling_operation_result(self, body: dict[str, Any]) -> dict[str, Any]:
        sess = self._session(body["trainingSessionName"], runtime=True)
        return await self._result(sess.sampling_ops, body["operationId"], sess.name)

    # -------------------------------------------------------------- OpenAI-compatible chat

    async def chat(self, name: str, request: dict[str, Any], model_package: str | None) -> ChatReply:
        """Run one chat completion."""
        sess = self._accepting(name)
        if model_package is not None:
            self._known_package(model_package)
        chat_model(request)
        messages = _chat_messages(request.get("messages"))
        tok = self.inner.get_tokenizer(sess.model.model_id)
        try:
            if hasattr(tok, "apply_chat_template"):
                prompt = chat_tokens(tok, messages, add_generation_prompt=True)  # content as plain text: it forges no turn
            else:
                prompt = tok.encode("".join(f"{m.get('role')}: {m.get('content')}\n" for m in messages) + "assistant: ")
        except Exception as err:  # the messages are the only input: an unknown role, content the template cannot render
            raise AwsError.validation(f"The messages cannot be rendered as a prompt: {err}") from None
        params, top = _chat_params(request), _chat_logprobs(request)
        sample = SampleRequest(prompt=tuple(prompt), num_samples=1, sampling_params=self._capped(params), topk_sample_logprobs=top or 0)
        async with self._sampler(sess, model_package if model_package is not None else sess.latest_checkpoint) as sampler:
            try:
                resp = await self.inner.sample(sampler, sample)
                sample.check_extras(resp)
            except InvalidInputError as err:  # e.g. a prompt longer than the model's context
                raise AwsError.validation(str(err)) from None
        seq = resp.sequences[0]
        sess.prefill_tokens += len(prompt)
        sess.sample_tokens += len(seq.tokens)
        logprobs = None
        if top is not None:
            if seq.logprobs is None:
                raise AwsError.validation("logprobs: the model behind this session returns no log-probs; leave it out")
            rows = seq.topk_logprobs or [None] * len(seq.tokens)
            texts = TokenText(tok)  # (each token id decoded once for the reply's entries)
            logprobs = [texts.entry(t, lp, row or []) for t, lp, row in zip(seq.tokens, seq.logprobs, rows)]
        return ChatReply(prompt, list(seq.tokens), "stop" if seq.stop_reason == "stop" else "length", tok, logprobs)

    async def chat_stream(self, name: str, request: dict[str, Any], model_package: str | None) -> AsyncIterator[bytes]:
        reply = await self.chat(name, request, model_package)
        prompt, completion, lps = reply.prompt, reply.completion, reply.logprobs
        chat_id, model = chat_completion_id(), chat_model(request)

        text = reply.text
        pieces = content_pieces(reply.tok, completion, text, skip_special_tokens=False)  # whole characters; joined, the reply

        async def events() -> AsyncIterator[bytes]:
            for i, piece in enumerate(pieces):
                delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
                choice = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None if lps is None else {"content": lps[i : i + 1]},
                    "finish_reason": None,
                }
                yield _sse(
                    {"id": chat_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model, "choices": [choice]}
                )
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(completion), "total_tokens": len(prompt) + len(completion)}
            yield _sse(
                {
                    "id": chat_id,
                    "object": "chat.completion.chunk",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish}],
                    "usage": usage,
                }
            )
            yield b"data: [DONE]\n\n"

        return events()

    # -------------------------------------------------------------------------------- admin

    def session_state(self, name: str) -> dict[str, Any]:
        sess = self._session(name, runtime=False)
        return {
            "status": self._detail(sess)["TrainingSessionStatus"],
            "applied": list(sess.sequencer.applied),
            "operations": {op.id: {"seq": op.seq, "kind": op.kind, "status": op.status} for op in sess.training_ops.values()},
            "inner_id": sess.inner_id,
        }

    async def shutdown(self) -> None:
        for sess in list(self.sessions.values()):
            await self._stop_inner(sess)


@dataclass(frozen=True)
class ChatReply:
    """One chat completion: its prompt and completion ids, finish reason, the tokenizer, and (when asked for) the
    OpenAI ``logprobs.content`` entries of its tokens."""

    prompt: list[int]
    completion: list[int]
    finish: str
    tok: Any
    logprobs: list[dict[str, Any]] | None

    @property
    def text(self) -> str:
        return str(self.tok.decode(self.completion))


CHAT_MAX_TOKENS = 64  # the completion budget of a chat request that sets none
_CHAT_NUMBERS = {  # name -> (integer?, low, high), as OpenAI's API takes them (top_p 0 as vLLM: refused)
    "max_tokens": (True, 1, 2**31 - 1),
    "max_completion_tokens": (True, 1, 2**31 - 1),
    "n": (True, 1, 1),  # one choice per request here
    "temperature": (False, 0, 2),
    "top_p": (False, 0, 1),
    "top_k": (True, -1, 2**31 - 1),  # vLLM's: -1 is off (0 is refused, as the sampler refuses it)
    "seed": (True, -(2**63), 2**64 - 1),  # OpenAI's 64-bit seeds, folded into the sampler's 0..2**63-1
    "top_logprobs": (True, 0, 20),
}
# what the chat takes; any other parameter that is not null is refused, as it would be ignored. model, user and
# metadata change nothing here; stream is the operation's (the stream always ends with the usage)
_CHAT_TAKEN = {"messages", "model", "user", "metadata", "stream", "stream_options", "stop", "logprobs", *_CHAT_NUMBERS}
_CHAT_NO_OPS = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}  # what clients send by default
# taken members that change nothing are still of OpenAI's types (a "yes" stream or a numeric user was taken)
_CHAT_KINDS: dict[str, tuple[type, str]] = {
    "stream": (bool, "true or false"),
    "stream_options": (dict, "an object"),
    "user": (str, "a string"),
    "metadata": (dict, "an object of strings"),
}


def chat_model(request: dict[str, Any]) -> str:
    """The model a chat reply names: the request's ``model``, a string of valid Unicode (a lone surrogate made the
    reply a 500 after the completion ran; a number or an object was echoed back), else ``training-session``."""
    model = request.get("model")
    if model is None:
        return "training-session"
    if not isinstance(model, str) or not 0 < len(model) <= 256 or model.encode("utf-8", "replace").decode() != model:  # lone surrogate
        raise AwsError.validation(f"model must be a model name (a string of 1..256 characters), not {json.dumps(model)[:64]}")
    return model


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:12]}"


def _chat_messages(messages: Any) -> list[dict[str, str]]:
    """The chat's messages as {role, content} with text content, read as OpenAI's API reads them (the OpenAI
    front's :class:`Message`): content parts are joined, a null content is empty; content that is neither text nor
    text parts, and text with a lone surrogate or a NUL, is a ValidationException naming the message."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise AwsError.validation("The request body must be a JSON chat-completions request with a non-empty 'messages' list of objects")
    out = []
    for i, raw in enumerate(messages):
        try:
            m = Message.model_validate(raw)
        except ValidationError as err:
            raise AwsError.validation(f"messages[{i}]: {validation_error(err).message}") from None
        out.append({"role": "system" if m.role == "developer" else m.role, "content": m.text()})
    return out


def _chat_params(request: dict[str, Any]) -> SamplingParams:
    """The sampling parameters of a chat-completions body; a null one is one not sent. A value of the wrong type
    or out of range is a ValidationException naming it (``max_tokens: 0`` was taken as unset, ``"5"`` as 5), and
    so is a parameter the chat does not implement (``frequency_penalty: 0.5``, ``tools``: they were ignored)."""
    for name, value in request.items():
        if value is not None and name not in _CHAT_TAKEN and (name not in _CHAT_NO_OPS or value != _CHAT_NO_OPS[name]):
            shown = f"{name}: {json.dumps(value)[:64]}" if name in _CHAT_NO_OPS else name[:64]
            raise AwsError.validation(f"{shown} is not supported by this endpoint: leave it out")
    for name, (kind, what) in _CHAT_KINDS.items():
        value = request.get(name)
        strings = not isinstance(value, dict) or name != "metadata" or all(isinstance(v, str) for v in value.values())
        if value is not None and not (isinstance(value, kind) and strings):
            raise AwsError.validation(f"{name} must be {what}, not {json.dumps(value)[:64]}")
    for name, (integer, low, high) in _CHAT_NUMBERS.items():
        value = request.get(name)
        if value is None:
            continue
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
            raise AwsError.validation(f"{name} must be {'an integer' if integer else 'a number'}, not {json.dumps(value)[:64]}")
        if not low <= value <= high or (name == "top_p" and value == 0):
            bounds = "(0, 1]" if name == "top_p" else f"[{low}, {high}]"
            raise AwsError.validation(f"{name}={value} is out of range: send a value in {bounds} or leave it out")
    stop = request.get("stop")
    if stop is not None and not isinstance(stop, str) and not (isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise AwsError.validation(f"stop must be a string or a list of strings, not {json.dumps(stop)[:64]}")
    budget = next((request[k] for k in ("max_tokens", "max_completion_tokens") if request.get(k) is not None), CHAT_MAX_TOKENS)
    try:
        seed = None if request.get("seed") is None else request["seed"] % (MAX_SEED + 1)
        fields = {"max_tokens": budget, "stop": stop, "seed": seed, **{k: request.get(k) for k in ("temperature", "top_p", "top_k")}}
        return SamplingParams.model_validate(fields)  # a null temperature, top_p or top_k is the default
    except ValueError as err:  # a stop string that is empty, too long, or one too many
        raise AwsError.validation(f"Invalid sampling parameters: {err}") from None


def _chat_logprobs(request: dict[str, Any]) -> int | None:
    """How many alternatives each token's ``logprobs`` entry lists (``top_logprobs``), or None when ``logprobs`` is
    not asked for. Called after :func:`_chat_params` checked ``top_logprobs``."""
    wanted, top = request.get("logprobs"), request.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise AwsError.validation(f"logprobs must be true or false, not {json.dumps(wanted)[:64]}")
    if top and not wanted:
        raise AwsError.validation("top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


@dataclass(frozen=True)
class _Refused:
    """A refused op's sequence number, as the session's sequencer takes it (its turn runs nothing)."""

    seq: int
    kind: str = "refused"

    @property
    def idempotency_key(self) -> str:
        return f"refused-{self.seq}"


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _record(op: OperationRecord) -> TrainingOp:
    """The asyncsess op record for a training operation's wire config (checked on arrival)."""
    assert op.seq is not None
    base: dict[str, Any] = {"seq": op.seq, "idempotency_key": op.client_token or op.id}
    body = op.config[op.kind]
    match op.kind:  # SageMaker's OperationConfig member names
        case "forward" | "forwardBackward":
            data = tuple(datum_from_wire(d) for d in body["datumList"])
            record = ForwardOp if op.kind == "forward" else ForwardBackwardOp
            return record(**base, data=data, loss_fn=body["lossFnName"], loss_fn_config=body.get("lossFnConfig"))
        case "optimizerStep":
            return OptimStepOp(**base, adam_params=adam_from_wire(body["adamParamsConfig"]))
        case "saveState":
            return SaveStateOp(**base, description=body.get("description"))
        case "saveWeights":
            return SaveWeightsOp(**base, description=body.get("description"), merge_weights=bool(body.get("mergeWeights")))
        case "loadState":  # the path is the package ARN here; _apply_on_engine swaps in the engine's path
            return LoadStateOp(**base, path=body["modelPackageArn"], with_optimizer=bool(body["loadOptimizer"]))
    raise AssertionError(f"{op.kind} is not a training operation")  # execute_training_operation checked the shape


def _details(err: BaseException) -> str:
    text = err.message if isinstance(err, AsyncSessError) else str(err) or type(err).__name__
    return text[:1024]


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as err:  # releasing an engine session is best effort
        log.debug("ignored while releasing an engine session: %r", err)


def _check_tags(tags: list[dict[str, str]] | None) -> None:
    """A resource's tags (their shape checked) have distinct keys, none in the ``aws:`` prefix AWS keeps for itself."""
    _check_tag_keys([tag["Key"] for tag in tags or []], "Tags[{}].Key")


def _check_tag_keys(keys: list[str], member: str) -> None:
    """Tag keys given (``member`` names the i-th) are distinct and none is in the reserved ``aws:`` prefix."""
    seen: set[str] = set()
    for i, key in enumerate(keys):
        if key in seen:
            raise AwsError.validation(f"{member.format(i)}: {json.dumps(key)[:64]} is given twice; tag keys must be unique")
        if key.lower().startswith("aws:"):
            raise AwsError.validation(f"{member.format(i)}: {json.dumps(key)[:64]} uses the prefix aws:, which is reserved for AWS")
        seen.add(key)
