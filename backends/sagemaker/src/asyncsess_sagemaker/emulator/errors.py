"""AWS-shaped errors and how each protocol renders them."""

from __future__ import annotations

import json
import uuid

from starlette.responses import Response

__all__ = ["AwsError", "control_error_response", "runtime_error_response"]

# code -> HTTP status on the runtime (rest-json). The control plane (awsJson1.1) answers 400 for client faults.
_RUNTIME_STATUS = {
    "ValidationException": 400,
    "ResourceNotFoundException": 404,
    "ConflictException": 409,
    "ThrottlingException": 429,
    "InternalServerException": 500,
}


class AwsError(Exception):
    """An error the emulated service answers with. ``code`` is the modelled error name."""

    def __init__(self, code: str, message: str, *, server_fault: bool = False, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.server_fault = server_fault
        self.status = status  # the HTTP status on both planes (authentication errors); None: the plane's own

    # Runtime codes (the control plane names some of these differently; see the adapters).
    @classmethod
    def validation(cls, message: str) -> AwsError:
        return cls("ValidationException", message)

    @classmethod
    def conflict(cls, message: str) -> AwsError:
        return cls("ConflictException", message)

    @classmethod
    def not_found(cls, message: str) -> AwsError:
        return cls("ResourceNotFoundException", message)

    @classmethod
    def throttling(cls, message: str = "Rate exceeded") -> AwsError:
        return cls("ThrottlingException", message)

    @classmethod
    def internal(cls, message: str = "Internal server error") -> AwsError:
        return cls("InternalServerException", message, server_fault=True)


def _request_id() -> dict[str, str]:
    return {"x-amzn-RequestId": str(uuid.uuid4())}


# The control plane names these differently (its modelled shapes are ResourceNotFound, ResourceInUse, ...).
_CONTROL_CODES = {"ResourceNotFoundException": "ResourceNotFound", "InternalServerException": "InternalFailure"}


def control_error_response(err: AwsError) -> Response:
    code = _CONTROL_CODES.get(err.code, err.code)
    body = json.dumps({"__type": code, "Message": err.message})
    status = err.status or (500 if err.server_fault else 400)
    return Response(body, status_code=status, media_type="application/x-amz-json-1.1", headers=_request_id())


def runtime_error_response(err: AwsError) -> Response:
    body = json.dumps({"message": err.message})
    headers = {**_request_id(), "x-amzn-ErrorType": f"{err.code}:http://internal.amazon.com/coral/com.amazonaws.sagemaker/"}
    return Response(
        body,
        status_code=err.status or _RUNTIME_STATUS.get(err.code, 500 if err.server_fault else 400),
        media_type="application/json",
        headers=headers,
    )
