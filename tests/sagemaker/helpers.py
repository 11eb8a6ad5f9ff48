"""Helpers shared by the SageMaker tests (a plain module: ``conftest`` names collide across suites)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import boto3
import httpx
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials

from asyncsess_sagemaker.emulator import RunningEmulator

ROLE = "arn:aws:iam::111122223333:role/TrainingSessionRole"
REGION = "us-west-2"


def clients(url: str, *, validate: bool = True, key: str = "testing", secret: str = "testing") -> tuple[Any, Any]:
    """(control plane, runtime) boto3 clients without botocore retries; ``validate=False`` skips client-side checks."""
    cfg = Config(retries={"total_max_attempts": 1}, parameter_validation=validate)
    session = boto3.session.Session(aws_access_key_id=key, aws_secret_access_key=secret, region_name=REGION)
    return (
        session.client("sagemaker", endpoint_url=url, config=cfg),
        session.client("sagemakertrainingsessionruntime", endpoint_url=url, config=cfg),
    )


class SigV4(httpx.Auth):
    """Signs a raw httpx request as botocore signs its own (SigV4, signing name ``sagemaker``), so tests can send
    bodies boto3 would never serialize. Signed: host, content-type and the x-amz-* headers."""

    requires_request_body = True

    def __init__(self, key: str = "testing", secret: str = "testing", region: str = REGION) -> None:
        self.signer = SigV4Auth(Credentials(key, secret), "sagemaker", region)

    def auth_flow(self, request: httpx.Request) -> Iterator[httpx.Request]:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "content-type" or k.lower().startswith("x-amz")}
        aws = AWSRequest(method=request.method, url=str(request.url), data=request.content, headers=headers)
        self.signer.add_auth(aws)
        request.headers["Authorization"], request.headers["X-Amz-Date"] = aws.headers["Authorization"], aws.headers["X-Amz-Date"]
        yield request


SIGNED = SigV4()


def driver_url(emu: RunningEmulator, **extra: str) -> str:
    """The driver's URL for ``emu``; the tokenizer is mock://'s unless ``tokenizer_path`` names one."""
    query = {"endpoint_url": emu.url, "role_arn": ROLE, "s3_output_path": "s3://bucket/out", **extra}
    if "tokenizer_path" not in query:
        query["tokenizer_backend"] = "mock://"
    return f"sagemaker://{REGION}?" + "&".join(f"{k}={v}" for k, v in query.items())


def wait_status(sm: Any, name: str, wanted: set[str], timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        detail = sm.describe_training_session(TrainingSessionName=name)["TrainingSessionDetail"]
        if detail["TrainingSessionStatus"] in wanted or time.monotonic() > deadline:
            return detail
        time.sleep(0.01)


def wait_op(get: Any, name: str, op_id: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        resp = get(trainingSessionName=name, operationId=op_id)
        if resp["status"] in ("Completed", "Failed", "Skipped") or time.monotonic() > deadline:
            return resp
        time.sleep(0.005)


def hub_arn(sm: Any) -> str:
    return sm.list_hub_contents(HubName="SageMakerPublicHub", HubContentType="Model")["HubContentSummaries"][0]["HubContentArn"]


def new_session(sm: Any, name: str, *, rank: int = 8) -> dict[str, Any]:
    """Create a session over the emulator's first hub model and wait until it is Running."""
    sm.create_training_session(
        TrainingSessionName=name,
        LoraConfig={"Rank": rank, "Alpha": 2 * rank},
        RoleArn=ROLE,
        ModelConfig={"BaseModelArn": hub_arn(sm)},
        OutputConfig={"S3Location": {"Path": "s3://bucket/out"}},
    )
    return wait_status(sm, name, {"Running", "Failed"})


def ce_datum(tokens: list[int]) -> dict[str, Any]:
    """A wire cross-entropy datum: input ``tokens[:-1]``, targets ``tokens[1:]``, unit weights."""
    n = len(tokens) - 1
    return {
        "modelInput": {"chunks": [{"tokens": tokens[:-1], "type": "encoded_text"}]},
        "lossFnInputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
            "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]},
        },
    }


def fb(tokens: list[int]) -> dict[str, Any]:
    return {"forwardBackward": {"lossFnName": "cross_entropy", "datumList": [ce_datum(tokens)]}}


OPTIM = {"optimizerStep": {"adamParamsConfig": {"learningRate": 0.001}}}
