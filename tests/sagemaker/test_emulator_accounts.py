"""Two AWS accounts on one emulator, and requests whose SigV4 signature is missing, malformed or wrong.

Before, the emulator read no ``Authorization`` header: an unsigned request was served, and every access key was one
account, so one caller listed, described, stopped and trained another's sessions and read its model packages.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Iterator
from typing import Any

import botocore.auth
import httpx
import pytest
from botocore.exceptions import ClientError

import asyncsess
from asyncsess.errors import AuthenticationError
from asyncsess_sagemaker.emulator import AccountKey, EmulatorConfig, RunningEmulator, running_emulator

from .helpers import OPTIM, SIGNED, SigV4, clients, driver_url, fb, hub_arn, wait_op, wait_status

pytestmark = pytest.mark.sagemaker

ALICE = ("AKIAALICE0000000", "alice-secret", "111122223333")
BOB = ("AKIABOB000000000", "bob-secret", "444455556666")


@pytest.fixture(scope="module")
def two() -> Iterator[RunningEmulator]:
    accounts = {key: AccountKey(account_id=account, secret_access_key=secret) for key, secret, account in (ALICE, BOB)}
    with running_emulator("mock://", EmulatorConfig(check_responses=True, startup_s=0.0, accounts=accounts)) as emu:
        yield emu


def _as(emu: RunningEmulator, who: tuple[str, str, str]) -> tuple[Any, Any]:
    return clients(emu.url, key=who[0], secret=who[1])


def _create(sm: Any, name: str, account: str, path: str) -> None:
    sm.create_training_session(
        TrainingSessionName=name,
        LoraConfig={"Rank": 8, "Alpha": 16},
        RoleArn=f"arn:aws:iam::{account}:role/TrainingSessionRole",
        ModelConfig={"BaseModelArn": hub_arn(sm)},
        OutputConfig={"S3Location": {"Path": path}},
    )
    assert wait_status(sm, name, {"Running"})["TrainingSessionStatus"] == "Running"


def _code(err: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    return err.value.response["Error"]["Code"], err.value.response["ResponseMetadata"]["HTTPStatusCode"]


def test_an_account_never_sees_stops_trains_or_reads_another_s_sessions_and_packages(two):
    (a_sm, a_rt), (b_sm, b_rt) = _as(two, ALICE), _as(two, BOB)
    shared, alices = f"shared-{uuid.uuid4().hex[:6]}", f"alice-{uuid.uuid4().hex[:6]}"
    _create(a_sm, shared, ALICE[2], "s3://alice-bucket/out")
    _create(a_sm, alices, ALICE[2], "s3://alice-bucket/out")
    _create(b_sm, shared, BOB[2], "s3://bob-bucket/out")  # the same name in another account is another session
    a_op = a_rt.execute_training_operation(
        trainingSessionName=shared, sequenceNumber=1, clientToken="t1", operationConfig={"saveState": {}}
    )
    a_pkg = wait_op(a_rt.get_training_operation_result, shared, a_op["operationId"])["operationResult"]["saveState"]["modelPackageArn"]
    assert f":{ALICE[2]}:" in a_pkg

    listed = b_sm.list_training_sessions()["TrainingSessionSummaries"]
    assert [s["TrainingSessionArn"] for s in listed] == [f"arn:aws:sagemaker:us-west-2:{BOB[2]}:training-session/{shared}"]
    alices_token = a_sm.list_training_sessions(MaxResults=1)["NextToken"]  # a token is its caller's (it paged Bob's list)
    with pytest.raises(ClientError, match="another account") as err:
        b_sm.list_training_sessions(MaxResults=1, NextToken=alices_token)
    assert _code(err) == ("ValidationException", 400)
    mine = b_sm.describe_training_session(TrainingSessionName=shared)["TrainingSessionDetail"]
    assert mine["OutputConfig"]["S3Location"]["Path"] == "s3://bob-bucket/out" and "LastReceivedSequenceNumber" not in mine
    for call in (b_sm.describe_training_session, b_sm.stop_training_session, b_sm.delete_training_session):
        with pytest.raises(b_sm.exceptions.ResourceNotFound):
            call(TrainingSessionName=alices)
    with pytest.raises(b_rt.exceptions.ResourceNotFoundException):
        b_rt.execute_training_operation(trainingSessionName=alices, sequenceNumber=1, operationConfig=OPTIM)
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    with pytest.raises(b_rt.exceptions.ResourceNotFoundException):
        b_rt.sample_training_session(trainingSessionName=alices, body=chat, contentType="application/json")
    assert json.loads(a_rt.sample_training_session(trainingSessionName=alices, body=chat, contentType="application/json")["body"].read())
    with pytest.raises(b_rt.exceptions.ResourceNotFoundException):  # Bob's session of that name has no such op
        b_rt.get_training_operation_result(trainingSessionName=shared, operationId=a_op["operationId"])

    assert b_sm.list_model_packages(ModelPackageType="Both")["ModelPackageSummaryList"] == []
    assert [g["ModelPackageGroupArn"] for g in b_sm.list_model_package_groups()["ModelPackageGroupSummaryList"]] == [
        f"arn:aws:sagemaker:us-west-2:{BOB[2]}:model-package-group/sagemaker-default"
    ]
    for call in (b_sm.describe_model_package, b_sm.delete_model_package):
        with pytest.raises(ClientError) as err:
            call(ModelPackageName=a_pkg)
        assert _code(err)[1] == 400
    foreign = [
        {"loadState": {"modelPackageArn": a_pkg, "loadOptimizer": True}},
        {"loadWeightsForSampling": {"modelPackageArn": a_pkg}},
    ]
    with pytest.raises(ClientError) as err:
        b_rt.execute_training_operation(trainingSessionName=shared, sequenceNumber=1, operationConfig=foreign[0])
    assert _code(err) == ("ResourceNotFoundException", 404)
    with pytest.raises(ClientError) as err:
        b_rt.execute_sampling_operation(trainingSessionName=shared, operationConfig=foreign[1])
    assert _code(err) == ("ResourceNotFoundException", 404)

    a_session = a_sm.describe_training_session(TrainingSessionName=alices)["TrainingSessionDetail"]["TrainingSessionArn"]
    a_sm.add_tags(ResourceArn=a_session, Tags=[{"Key": "owner", "Value": "alice"}])
    for call, kwargs in (
        (b_sm.list_tags, {}),
        (b_sm.add_tags, {"Tags": [{"Key": "owner", "Value": "bob"}]}),
        (b_sm.delete_tags, {"TagKeys": ["owner"]}),
    ):
        with pytest.raises(b_sm.exceptions.ResourceNotFound):
            call(ResourceArn=a_session, **kwargs)
    assert a_sm.list_tags(ResourceArn=a_session)["Tags"] == [{"Key": "owner", "Value": "alice"}]

    # Alice's side is as she left it: both sessions Running, her package hers, her op the only one applied
    assert {s["TrainingSessionStatus"] for s in a_sm.list_training_sessions()["TrainingSessionSummaries"]} == {"Running"}
    assert a_sm.describe_model_package(ModelPackageName=a_pkg)["ModelPackageArn"] == a_pkg
    assert two.session_state(shared, account=ALICE[2])["applied"] == [1]
    assert two.session_state(shared, account=BOB[2])["applied"] == []
    for sm, name in ((a_sm, shared), (a_sm, alices), (b_sm, shared)):
        sm.stop_training_session(TrainingSessionName=name)


def test_both_accounts_train_the_same_session_name_at_once_each_on_its_own_engine(two):
    (a_sm, a_rt), (b_sm, b_rt) = _as(two, ALICE), _as(two, BOB)
    name = f"twin-{uuid.uuid4().hex[:6]}"
    _create(a_sm, name, ALICE[2], "s3://alice-bucket/out")
    _create(b_sm, name, BOB[2], "s3://bob-bucket/out")
    ops = []
    for seq in (1, 2):  # interleaved: Alice, Bob, Alice, Bob
        for rt in (a_rt, b_rt):
            config = fb([1, 40, 41, 42]) if seq == 1 else OPTIM
            ops.append((rt, rt.execute_training_operation(trainingSessionName=name, sequenceNumber=seq, operationConfig=config)))
    assert all(wait_op(rt.get_training_operation_result, name, op["operationId"])["status"] == "Completed" for rt, op in ops)
    a_state, b_state = two.session_state(name, account=ALICE[2]), two.session_state(name, account=BOB[2])
    assert a_state["applied"] == b_state["applied"] == [1, 2] and a_state["inner_id"] != b_state["inner_id"]
    for sm in (a_sm, b_sm):
        assert sm.describe_training_session(TrainingSessionName=name)["TrainingSessionDetail"]["LastReceivedSequenceNumber"] == 2
        sm.stop_training_session(TrainingSessionName=name)


def _bad_requests(url: str) -> dict[str, tuple[httpx.Request, str, int]]:
    """CreateTrainingSession requests whose signature AWS refuses: (request, the refusal's code, its status)."""
    body = {
        "TrainingSessionName": "never",
        "LoraConfig": {"Rank": 8, "Alpha": 16},
        "RoleArn": "arn:aws:iam::111122223333:role/R",
        "ModelConfig": {"BaseModelArn": "arn:aws:sagemaker:us-west-2:aws:hub-content/SageMakerPublicHub/Model/mock-bigram-tiny"},
        "OutputConfig": {"S3Location": {"Path": "s3://b/o"}},
    }
    headers = {"X-Amz-Target": "SageMaker.CreateTrainingSession", "Content-Type": "application/x-amz-json-1.1"}
    good = next(SigV4(ALICE[0], ALICE[1]).auth_flow(httpx.Request("POST", url + "/", content=json.dumps(body).encode(), headers=headers)))
    auth = good.headers["authorization"]

    def changed(content: bytes = good.content, **changes: str) -> httpx.Request:
        kept = {k: v for k, v in good.headers.items() if k.lower() not in ("host", "content-length", *changes)}
        return httpx.Request("POST", url + "/", content=content, headers=kept | {k: v for k, v in changes.items() if v})

    return {
        "no Authorization": (changed(authorization=""), "MissingAuthenticationTokenException", 403),
        "another algorithm": (
            changed(authorization=auth.replace("AWS4-HMAC-SHA256", "AWS4-HMAC-SHA1")),
            "IncompleteSignatureException",
            400,
        ),
        "no Signature": (changed(authorization=auth.rsplit(",", 1)[0]), "IncompleteSignatureException", 400),
        "no X-Amz-Date": (changed(**{"x-amz-date": "yesterday"}), "IncompleteSignatureException", 400),
        "another region's scope": (changed(authorization=auth.replace("/us-west-2/", "/eu-west-1/")), "InvalidSignatureException", 403),
        "a body changed after signing": (
            changed(json.dumps(body | {"TrainingSessionName": "other"}).encode()),
            "InvalidSignatureException",
            403,
        ),
        "a forged signature": (changed(authorization=auth[:-8] + "00000000"), "InvalidSignatureException", 403),
    }


@pytest.mark.parametrize(
    "case",
    [
        "no Authorization",
        "another algorithm",
        "no Signature",
        "no X-Amz-Date",
        "another region's scope",
        "a body changed after signing",
        "a forged signature",
    ],
)
def test_a_request_without_a_valid_signature_is_refused_before_any_work(two, case):
    request, code, status = _bad_requests(two.url)[case]
    with httpx.Client() as http:
        r = http.send(request)
    assert (r.status_code, r.json()["__type"]) == (status, code), r.text
    for who in (ALICE, BOB):
        arns = [row["TrainingSessionArn"] for row in _as(two, who)[0].list_training_sessions()["TrainingSessionSummaries"]]
        assert not any(arn.endswith(("/never", "/other")) for arn in arns)


@pytest.mark.parametrize(
    "key, secret, code",
    [("AKIASTRANGER0000", "x", "UnrecognizedClientException"), (ALICE[0], "not-alices-secret", "InvalidSignatureException")],
)
def test_boto3_with_an_unknown_key_or_a_wrong_secret_is_refused_on_both_planes(two, key, secret, code):
    sm, rt = clients(two.url, key=key, secret=secret)
    with pytest.raises(ClientError) as err:
        sm.list_training_sessions()
    assert _code(err) == (code, 403)
    with pytest.raises(ClientError) as err:
        rt.execute_training_operation(trainingSessionName="any", sequenceNumber=1, operationConfig=OPTIM)
    assert _code(err) == (code, 403)


def test_a_signature_older_than_fifteen_minutes_is_refused(two, monkeypatch):
    sm, _ = _as(two, ALICE)
    stale = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None) - datetime.timedelta(minutes=16)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda remove_tzinfo=True: stale)
    with pytest.raises(ClientError) as err:
        sm.list_training_sessions()
    assert _code(err) == ("InvalidSignatureException", 403) and "expired" in err.value.response["Error"]["Message"]


def test_the_default_emulator_takes_any_key_but_no_unsigned_request(sm, emulator):
    """Without configured accounts every access key is the one account; an unsigned request is still refused."""
    other, _ = clients(emulator.url, key="AKIAANYONE", secret="whatever")
    assert other.list_training_sessions()["TrainingSessionSummaries"] == sm.list_training_sessions()["TrainingSessionSummaries"]
    for url, headers in (
        (emulator.url, {"X-Amz-Target": "SageMaker.ListTrainingSessions", "Content-Type": "application/x-amz-json-1.1"}),
        (f"{emulator.url}/v1/training-sessions/any/operations", {"Content-Type": "application/json"}),
    ):
        r = httpx.post(url, content=b"{}", headers=headers)
        assert r.status_code == 403 and "Missing Authentication Token" in r.text, r.text
        signed = httpx.post(url, content=b"{}", headers=headers, auth=SIGNED)
        assert signed.status_code in (200, 400), signed.text  # past authentication: served, or refused for its body


@pytest.mark.anyio
async def test_the_driver_with_a_wrong_secret_is_an_authentication_error_and_creates_nothing(two, monkeypatch):
    """It was a ServerError (an AWS code the driver did not know), as if the service had failed."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ALICE[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-alices-secret")
    before = _as(two, ALICE)[0].list_training_sessions()["TrainingSessionSummaries"]
    async with asyncsess.ServiceClient(driver_url(two)) as svc:
        with pytest.raises(AuthenticationError) as err:
            await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
    assert "InvalidSignatureException" in str(err.value) and "credentials" in str(err.value)
    assert _as(two, ALICE)[0].list_training_sessions()["TrainingSessionSummaries"] == before
