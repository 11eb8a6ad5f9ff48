"""The bad-input suite on sagemaker:// (the driver against the local emulator over mock://)."""

from __future__ import annotations

import pytest

from .cases import CASES
from .loop_cases import run_all

pytestmark = [pytest.mark.sagemaker, pytest.mark.anyio]

# The service publishes no vocabulary size or per-model context length, so an out-of-vocabulary id or an
# over-long datum is caught only by the service, after
# numbering (documented in docs/compatibility.md); every other case is rejected before numbering here too.
NOT_BEFORE_NUMBERING = frozenset({"fb-token-outside-vocab", "fwd-too-long"})


async def test_every_bad_input_case_on_sagemaker(monkeypatch):
    from asyncsess_sagemaker.emulator import EmulatorConfig, running_emulator

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    role = "arn:aws:iam::111122223333:role/TrainingSessionRole"
    with running_emulator("mock://", EmulatorConfig()) as emu:
        url = f"sagemaker://us-west-2?endpoint_url={emu.url}&role_arn={role}&s3_output_path=s3://bucket/out&tokenizer_backend=mock://"
        assert await run_all(url, "mock/bigram-tiny", skip=NOT_BEFORE_NUMBERING) == len(CASES) - len(NOT_BEFORE_NUMBERING)
