"""Shared fixtures: the anyio backend under test comes from $ASYNCSESS_ANYIO_BACKEND (asyncio|trio)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(params=[os.environ.get("ASYNCSESS_ANYIO_BACKEND", "asyncio")])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param
