"""Fixtures for the local backend: a tiny offline Llama and an embedded engine on it.

The device is ``$ASYNCSESS_TEST_DEVICE`` (default ``cpu``) in ``$ASYNCSESS_TEST_DTYPE`` (default ``float32``):
see ``helpers.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the suite never reaches a model hub


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncsess_local.testing import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> str:
    """The base model name the tests use: the tiny model's directory."""
    return str(tiny_dir)


@pytest.fixture
def backend_factory(tiny: str, tmp_path: Path):
    """Build LocalBackends on the tiny model; each is closed at teardown (by the test's own event loop)."""
    from asyncsess_local.embedded import LocalBackend

    def make(**kw):
        from .helpers import DEVICE_KW

        return LocalBackend(model=tiny, checkpoint_dir=str(tmp_path / "ckpt"), **{**DEVICE_KW, **kw})

    return make


@pytest.fixture(scope="module")
def c(worker):
    """An HTTP client on the module's own ``worker`` fixture (the server tests each start one)."""
    import httpx

    with httpx.Client(base_url=worker.url, timeout=120) as client:
        yield client
