"""The front needs FastAPI (the ``serve`` extra) and the official openai client (the ``test`` extra)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    needs = ("fastapi", "openai")
    if collection_path.name.endswith("_local.py"):
        needs += ("torch", "asyncsess_local")
    if collection_path.name.endswith("_sagemaker.py"):
        needs += ("boto3", "asyncsess_sagemaker")
    if collection_path.suffix == ".py" and any(importlib.util.find_spec(m) is None for m in needs):
        return True
    return None
