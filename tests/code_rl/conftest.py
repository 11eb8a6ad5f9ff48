"""The local:// test needs torch and the local backend; without them it is not collected (no skips)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name == "test_code_rl_local.py":
        return any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "asyncsess_local")) or None
    return None
