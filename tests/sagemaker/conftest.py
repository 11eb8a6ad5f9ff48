"""Fixtures: one emulator over mock:// on a free 127.0.0.1 port, boto3 clients with dummy credentials.

``test_driver_emulator_local.py`` re-runs some driver tests over local:// by overriding ``emulator``,
``base_model`` and ``sm_url``; it is collected only where torch and the local backend are installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from asyncsess_sagemaker.emulator import EmulatorConfig, RunningEmulator, running_emulator

from .helpers import REGION, clients, driver_url

collect_ignore = [] if all(importlib.util.find_spec(m) for m in ("torch", "asyncsess_local")) else ["test_driver_emulator_local.py"]


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy credentials (the emulator does not check signatures) and no stray endpoint overrides."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    for var in ("AWS_PROFILE", "SAGEMAKER_TRAINING_SESSION_ENDPOINT", "SAGEMAKER_TRAINING_SESSION_RUNTIME_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def emulator() -> Iterator[RunningEmulator]:
    """Strict: every answer is checked against the service model's output shapes."""
    with running_emulator("mock://", EmulatorConfig(check_responses=True)) as emu:
        yield emu


@pytest.fixture(scope="module")
def base_model() -> str:
    """The emulator's model, as the driver names it."""
    return "mock/bigram-tiny"


@pytest.fixture
def sm_url(emulator: RunningEmulator) -> str:
    """``sagemaker://`` URL of the driver against ``emulator``."""
    return driver_url(emulator)


@pytest.fixture(autouse=True)
def clear_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "emulator" in request.fixturenames:
        request.getfixturevalue("emulator").set_faults()


@pytest.fixture
def sm(emulator: RunningEmulator) -> Any:
    return clients(emulator.url)[0]


@pytest.fixture
def rt(emulator: RunningEmulator) -> Any:
    return clients(emulator.url)[1]
