"""Recipe tests run on mock:// (torch-free) unless marked; files whose extra dependencies are missing
are not collected, so a torch-free run reports no skips (the nox session that installs them runs them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_NEEDS = {
    "test_preference.py": ("torch",),
    "test_plot.py": ("matplotlib",),
    "test_mlflow.py": ("matplotlib", "mlflow"),
    "test_local_learning.py": ("torch", "asyncsess_local"),
}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    modules = _NEEDS.get(collection_path.name)
    if modules and any(importlib.util.find_spec(m) is None for m in modules):
        return True
    return None
