"""Building and reading the ARNs the two services exchange (sessions, model packages, hub content)."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "PUBLIC_HUB",
    "session_arn",
    "name_from_arn",
    "model_package_group_arn",
    "model_package_arn",
    "ModelPackageRef",
    "parse_model_package_arn",
    "hub_content_arn",
    "HubContentRef",
    "parse_hub_content_arn",
    "account_of",
    "region_of",
    "partition_of",
    "hub_content_name_for",
]

PUBLIC_HUB = "SageMakerPublicHub"

_MODEL_PACKAGE = re.compile(r"arn:(aws[a-z\-]*):sagemaker:([a-z0-9\-]+):(\d{12}):model-package/([^/]+)/(\d+)")
_HUB_CONTENT = re.compile(
    r"arn:([a-z0-9\-.]+):sagemaker:([a-zA-Z0-9\-]+):(\d{12}|aws):hub-content/([^/]+)/Model/([^/]+)(?:/(\d+\.\d+\.\d+))?"
)
_ACCOUNT = re.compile(r"arn:(aws[a-z\-]*):[a-z0-9\-]+:([a-z0-9\-]*):(\d{12}):")


def session_arn(region: str, account: str, name: str) -> str:
    return f"arn:aws:sagemaker:{region}:{account}:training-session/{name}"


def name_from_arn(name_or_arn: str) -> str:
    """A session or group name from itself or its ARN (the last ``/`` segment)."""
    return name_or_arn.rsplit("/", 1)[-1] if name_or_arn.startswith("arn:") else name_or_arn


def model_package_group_arn(region: str, account: str, group: str) -> str:
    return f"arn:aws:sagemaker:{region}:{account}:model-package-group/{group}"


def model_package_arn(region: str, account: str, group: str, version: int) -> str:
    return f"arn:aws:sagemaker:{region}:{account}:model-package/{group}/{version}"


@dataclass(frozen=True)
class ModelPackageRef:
    region: str
    account: str
    group: str
    version: int


def parse_model_package_arn(arn: str) -> ModelPackageRef | None:
    """A model package *version* ARN, or None (group ARNs, versions outside ``ModelPackageVersion``'s 1..2**31-1,
    and anything else)."""
    m = _MODEL_PACKAGE.fullmatch(arn)
    if m is None or len(m.group(5)) > 10 or not 1 <= int(m.group(5)) <= 2**31 - 1:  # int() of 5000 digits raises
        return None
    return ModelPackageRef(region=m.group(2), account=m.group(3), group=m.group(4), version=int(m.group(5)))


def hub_content_arn(region: str, name: str, version: str, hub: str = PUBLIC_HUB) -> str:
    return f"arn:aws:sagemaker:{region}:aws:hub-content/{hub}/Model/{name}/{version}"


@dataclass(frozen=True)
class HubContentRef:
    region: str
    hub: str
    name: str
    version: str | None


def parse_hub_content_arn(arn: str) -> HubContentRef | None:
    m = _HUB_CONTENT.fullmatch(arn)
    if m is None:
        return None
    return HubContentRef(region=m.group(2), hub=m.group(4), name=m.group(5), version=m.group(6))


def account_of(arn: str) -> str | None:
    m = _ACCOUNT.match(arn)
    return m.group(3) if m else None


def region_of(arn: str) -> str | None:
    """The region of an account-owned ARN (empty for a global one such as IAM's), else None."""
    m = _ACCOUNT.match(arn)
    return m.group(2) if m else None


def partition_of(arn: str) -> str | None:
    """The partition (``aws``, ``aws-cn``, ...) of an account-owned ARN, else None."""
    m = _ACCOUNT.match(arn)
    return m.group(1) if m else None


def hub_content_name_for(model_id: str) -> str:
    """A hub content name (``[a-zA-Z0-9](-*[a-zA-Z0-9])*``, ≤63) standing for a model id such as ``org/Model-1.5``."""
    name = re.sub(r"[^a-zA-Z0-9]+", "-", model_id).strip("-").lower()
    return name[:63].rstrip("-") or "model"
