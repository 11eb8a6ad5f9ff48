"""The two botocore service models, loaded once: the source of truth for shapes, enums and limits.

``sagemaker`` (awsJson1.1 control plane) and ``sagemakertrainingsessionruntime`` (rest-json runtime)
first ship in botocore 1.43.112. Nothing here copies a limit by hand; callers read it from the model.
"""

from __future__ import annotations

from functools import cache

import botocore
import botocore.session
from botocore.exceptions import UnknownServiceError
from botocore.model import OperationModel, ServiceModel, Shape

__all__ = [
    "CONTROL",
    "RUNTIME",
    "control_model",
    "runtime_model",
    "operation",
    "enum_values",
    "member_shape",
    "TRAINING_SESSION_OPERATIONS",
    "MODEL_REGISTRY_OPERATIONS",
    "HUB_OPERATIONS",
    "TAG_OPERATIONS",
]

CONTROL = "sagemaker"
RUNTIME = "sagemakertrainingsessionruntime"

TRAINING_SESSION_OPERATIONS = (
    "CreateTrainingSession",
    "DescribeTrainingSession",
    "ListTrainingSessions",
    "StopTrainingSession",
    "DeleteTrainingSession",
)
MODEL_REGISTRY_OPERATIONS = (
    "CreateModelPackageGroup",
    "DescribeModelPackageGroup",
    "DeleteModelPackageGroup",
    "ListModelPackageGroups",
    "DescribeModelPackage",
    "ListModelPackages",
    "DeleteModelPackage",
)
HUB_OPERATIONS = ("ListHubContents", "DescribeHubContent")
TAG_OPERATIONS = ("AddTags", "ListTags", "DeleteTags")


@cache
def _model(name: str) -> ServiceModel:
    try:
        model = botocore.session.get_session().get_service_model(name)
    except UnknownServiceError:
        raise RuntimeError(
            f"botocore {botocore.__version__} does not describe {name!r}; install botocore>=1.43.112 (pip install -U boto3 botocore)"
        ) from None
    if name == CONTROL and "CreateTrainingSession" not in model.operation_names:
        raise RuntimeError(f"botocore {botocore.__version__} has no training-session operations; install botocore>=1.43.112")
    return model


def control_model() -> ServiceModel:
    return _model(CONTROL)


def runtime_model() -> ServiceModel:
    return _model(RUNTIME)


def operation(service: str, name: str) -> OperationModel:
    return _model(service).operation_model(name)


def member_shape(shape: Shape, *path: str) -> Shape:
    """Walk structure members / list members: ``member_shape(op.input_shape, "operationConfig", "forward")``."""
    for part in path:
        if shape.type_name == "list":
            shape = shape.member  # type: ignore[attr-defined]
        shape = shape.members[part]  # type: ignore[attr-defined]
    return shape


def enum_values(service: str, shape_name: str) -> tuple[str, ...]:
    return tuple(_model(service).shape_for(shape_name).enum)
