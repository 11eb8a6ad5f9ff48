"""Both anchors' error names are one hierarchy here: ``except`` clauses written for either SDK catch real failures."""

from __future__ import annotations

import pickle

import pytest

import asyncsess.errors as E
from asyncsess import ServiceClient

pytestmark = pytest.mark.anyio

# The error names of sagemaker.train.training_session 1.27.0 and tinker 0.38.0 (tests/compat/test_matrix.py
# checks these lists against the installed packages).
SAGEMAKER_ERRORS = ["TrainingSessionError", "OperationError", "ResultMismatchError", "ArtifactDeletionError"]
TINKER_ERRORS = [
    "TinkerError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "APIConnectionError",
    "APIResponseValidationError",
    "RequestFailedError",
    "BadRequestError",
    "AuthenticationError",
    "BillingError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "UnprocessableEntityError",
    "RateLimitError",
    "InternalServerError",
]


@pytest.mark.parametrize("name", SAGEMAKER_ERRORS + TINKER_ERRORS)
def test_every_anchor_error_name_is_an_asyncsess_error(name):
    cls = getattr(E, name)
    assert issubclass(cls, E.AsyncSessError)
    assert getattr(__import__("asyncsess"), name) is cls


def test_status_codes_follow_http():
    codes = {
        "BadRequestError": 400,
        "AuthenticationError": 401,
        "BillingError": 402,
        "PermissionDeniedError": 403,
        "NotFoundError": 404,
        "ConflictError": 409,
        "RateLimitError": 429,
        "InternalServerError": 500,
    }
    for name, code in codes.items():
        assert getattr(E, name).status_code == code
        assert issubclass(getattr(E, name), E.APIStatusError)


async def test_bad_input_is_caught_by_either_anchors_clauses():
    async with ServiceClient("mock://") as svc:
        sc = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        for clause in (ValueError, E.BadRequestError, E.APIStatusError, E.APIError, E.TinkerError, E.TrainingSessionError):
            with pytest.raises(clause) as info:
                sc.sample([1, 2], 0)
            assert info.value.status_code == 400 and info.value.category == "user"


async def test_a_failed_op_is_caught_as_operation_error_and_request_failed_error():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        await tc.stop()
        sc = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        await sc.stop()
        for clause in (E.OperationError, E.RequestFailedError, E.TrainingSessionError):
            with pytest.raises(clause) as info:
                await sc.sample([1, 2], 1)
            assert info.value.category == "server"
            assert info.value.operation_type == "sample"


def test_is_retryable_follows_sagemaker():
    assert E.is_retryable(E.RateLimitError("slow down"))
    assert E.is_retryable(E.APITimeoutError("timed out"))
    assert E.is_retryable(ConnectionResetError())
    assert not E.is_retryable(E.BadRequestError("no", field="x"))
    assert not E.is_retryable(E.ServerError("boom"))
    assert not E.is_retryable(ValueError("x"))


@pytest.mark.parametrize(
    "err",
    [
        E.ResultMismatchError("compute_logprobs", 5, 4),
        E.ArtifactDeletionError("arn:aws:sagemaker:r:1:model-package/g/1", "s3://b/p", ["a", "b"]),
        E.NotFoundError("gone", field="path", fix="look"),
        E.RateLimitError("slow", retry_after=2.0),
    ],
)
def test_errors_survive_pickling(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__
