"""The driver over the emulator on local:// (the tiny offline Llama, CPU): the GRPO example end to end,
exactly-once through injected throttling and lost replies, and a remote stop as ``SessionGoneError``.

The test bodies are those of ``test_driver_emulator.py``; this module swaps the emulator's engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncsess_sagemaker.emulator import EmulatorConfig, RunningEmulator, running_emulator

from .helpers import driver_url
from .test_driver_emulator import (  # noqa: F401  (collected here again, on this module's fixtures)
    test_a_session_stopped_remotely_surfaces_as_session_gone,
    test_grpo_example_runs_end_to_end,
    test_pipelined_ops_survive_throttling_and_lost_replies_exactly_once,
)

pytestmark = [pytest.mark.sagemaker, pytest.mark.local, pytest.mark.anyio]


@pytest.fixture(scope="module")
def emulator() -> Iterator[RunningEmulator]:
    # The wire asks for >= 512 tokens per sample, which the CPU engine cannot afford here; the driver cuts
    # samples to the caller's max_tokens (8 in these tests) anyway, so generation stops at 8.
    config = EmulatorConfig(check_responses=True, sample_max_tokens=8)
    with running_emulator("local://?model=tiny-llama&device=cpu", config) as emu:
        yield emu


@pytest.fixture(scope="module")
def base_model() -> str:
    return "tiny-llama"


@pytest.fixture
def sm_url(emulator: RunningEmulator) -> str:
    from asyncsess_local.testing import tiny_llama_dir

    return driver_url(emulator, tokenizer_path=str(tiny_llama_dir()))
