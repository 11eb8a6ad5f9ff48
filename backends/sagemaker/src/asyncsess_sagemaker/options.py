"""Driver options: from ``ServiceClient`` keyword arguments, the URL query, then the environment.

Names follow the official SDK's ``ServiceClient`` (``role_arn``, ``model_package_group_arn``,
``s3_output_path``, ``kms_key_arn``, ``vpc_config``, ``session_name_prefix``); the endpoint overrides also
come from ``SAGEMAKER_TRAINING_SESSION_ENDPOINT`` / ``SAGEMAKER_TRAINING_SESSION_RUNTIME_ENDPOINT``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from asyncsess.backends import ParsedURL
from asyncsess.errors import InvalidInputError

__all__ = ["SageMakerOptions", "ENDPOINT_ENV", "RUNTIME_ENDPOINT_ENV"]

ENDPOINT_ENV = "SAGEMAKER_TRAINING_SESSION_ENDPOINT"
RUNTIME_ENDPOINT_ENV = "SAGEMAKER_TRAINING_SESSION_RUNTIME_ENDPOINT"
MAX_POOL = 4096  # connections per boto3 client (the official SDK uses 512)


class SageMakerOptions(BaseModel):
    # no infinite or NaN number: poll_initial_s=inf slept for good before the first poll, retry_budget_s=inf retried for good
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    region: str
    role_arn: str | None = None
    model_package_group_arn: str | None = Field(
        default=None, description="checkpoints land here; default: the SDK's shared 'sagemaker-default' group"
    )
    s3_output_path: str | None = Field(default=None, description="default: s3://sagemaker-{region}-{account of role_arn}/{session}/output")
    kms_key_arn: str | None = None
    vpc_config: dict[str, list[str]] | None = Field(
        default=None, description="{'SecurityGroupIds': [...], 'Subnets': [...]} (snake_case keys accepted)"
    )
    session_name_prefix: str = "asyncsess"
    endpoint_url: str | None = Field(
        default=None, description="control plane (and model registry, hub); also the runtime unless runtime_endpoint_url is set"
    )
    runtime_endpoint_url: str | None = None
    profile: str | None = Field(default=None, description="AWS profile name for credentials")
    tokenizer_path: str | None = Field(default=None, description="a local Hugging Face tokenizer directory (offline use)")
    tokenizer_backend: str | None = Field(default=None, description="an asyncsess backend URL whose tokenizer to use, e.g. mock://")
    create_timeout_s: float = Field(default=1800.0, gt=0, description="how long create waits for Running")
    poll_initial_s: float = Field(default=0.005, gt=0, description="first wait between result polls")
    poll_max_s: float = Field(default=2.0, gt=0, description="the longest wait between result polls (the official SDK's fixed interval)")
    retry_base_s: float = Field(default=0.1, gt=0, description="first backoff of a retried call (full jitter, doubling to 4 s)")
    retry_budget_s: float = Field(default=300.0, gt=0, description="how long one call keeps retrying throttling and 5xx answers")
    abandoned_stop_s: float = Field(
        default=300.0,
        gt=0,
        description="how long the driver keeps trying, in the background, to stop a session that a create the client gave up "
        "on may have made (then closing the client tries again)",
    )
    max_pool_connections: int = Field(
        default=64, ge=1, le=MAX_POOL, description=f"at most {MAX_POOL} (urllib3 fills a pool's queue up front: 10**9 hung the first call)"
    )
    pipeline_submissions: bool = Field(
        default=True,
        description="send each training op without waiting for the previous one's acknowledgement (False: one "
        "ExecuteTrainingOperation in flight, as the official SDK; then a retried delivery never keeps later ops Blocked)",
    )
    load_weights_for_sampling: bool = Field(
        default=False,
        description="send loadWeightsForSampling and wait for it before returning a sampler on a checkpoint, as the official "
        "SDK's save_weights_and_get_sampling_client does (samples name their checkpoint either way)",
    )

    @field_validator("vpc_config", mode="before")
    @classmethod
    def _vpc(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = json.loads(value)
        if isinstance(value, dict):
            names = {"security_group_ids": "SecurityGroupIds", "subnets": "Subnets"}
            value = {names.get(k, k): v for k, v in value.items()}
        return value

    @classmethod
    def resolve(cls, url: ParsedURL, options: dict[str, Any]) -> SageMakerOptions:
        merged: dict[str, Any] = {**url.query, **{k: v for k, v in options.items() if v is not None}}
        merged.setdefault("endpoint_url", os.environ.get(ENDPOINT_ENV) or None)
        merged.setdefault("runtime_endpoint_url", os.environ.get(RUNTIME_ENDPOINT_ENV) or None)
        region = url.host or merged.pop("region", None) or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        merged.pop("region", None)
        if not region:
            import boto3

            region = boto3.session.Session().region_name
        if not region:
            raise InvalidInputError("no AWS region", field="url", fix="use sagemaker://us-west-2 (or set AWS_REGION)")
        try:
            return cls(region=region, **merged)
        except ValidationError as err:
            e = err.errors()[0]
            known = ", ".join(sorted(cls.model_fields))
            raise InvalidInputError(
                e["msg"], field=f"sagemaker option {'.'.join(map(str, e['loc']))}", fix=f"options are: {known}"
            ) from None

    @property
    def runtime_url(self) -> str | None:
        return self.runtime_endpoint_url or self.endpoint_url
