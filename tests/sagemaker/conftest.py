"""Fixtures: one emulator over mock:// on a free 127.0.0.1 port, boto3 clients with dummy credentials."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from smhelpers import REGION, clients

from asyncsess_sagemaker.emulator import EmulatorConfig, RunningEmulator, running_emulator


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
    with running_emulator("mock://", EmulatorConfig(check_responses=True, gap_timeout_s=1.0)) as emu:
        yield emu


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
