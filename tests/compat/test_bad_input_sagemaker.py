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


async def test_topk_prompt_logprobs_cross_the_sagemaker_wire(monkeypatch):
    """The wire carries topkPromptLogprobs: the rows equal mock://'s own for the same base model."""
    from asyncsess import ServiceClient, UnsupportedError
    from asyncsess_sagemaker.emulator import EmulatorConfig, running_emulator

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    role = "arn:aws:iam::111122223333:role/TrainingSessionRole"
    prompt = [1, 40, 41, 42]
    async with ServiceClient("mock://") as direct:
        want = (
            await (await direct.create_sampling_client(base_model="mock/bigram-tiny")).sample(prompt, 1, topk_prompt_logprobs=3)
        ).topk_prompt_logprobs
    with running_emulator("mock://", EmulatorConfig()) as emu:
        url = f"sagemaker://us-west-2?endpoint_url={emu.url}&role_arn={role}&s3_output_path=s3://bucket/out&tokenizer_backend=mock://"
        async with ServiceClient(url) as svc:
            tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
            sc = await tc.create_sampling_client()
            got = (await sc.sample(prompt, 1, {"max_tokens": 2}, topk_prompt_logprobs=3)).topk_prompt_logprobs
            with pytest.raises(UnsupportedError):
                await sc.sample(prompt, 1, topk_sample_logprobs=2)
            assert tc.current_sequence_number == 1  # the snapshot for the sampler; sampling is never numbered
    assert got[0] is None and len(got) == len(prompt)
    assert [[t for t, _ in row] for row in got[1:]] == [[t for t, _ in row] for row in want[1:]]
    assert all(abs(a - b) < 1e-6 for r1, r2 in zip(got[1:], want[1:]) for (_, a), (_, b) in zip(r1, r2))


async def test_descriptions_and_model_package_deletion_on_sagemaker(monkeypatch):
    from asyncsess import ServiceClient
    from asyncsess_sagemaker.emulator import EmulatorConfig, running_emulator

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    role = "arn:aws:iam::111122223333:role/TrainingSessionRole"
    with running_emulator("mock://", EmulatorConfig()) as emu:
        url = f"sagemaker://us-west-2?endpoint_url={emu.url}&role_arn={role}&s3_output_path=s3://bucket/out&tokenizer_backend=mock://"
        async with ServiceClient(url) as svc:
            tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4, training_session_name="my-named-run")
            assert tc.model_id == "my-named-run"  # the per-call name was sent
            first = await tc.save_state("final checkpoint")
            second = await tc.save_state(description="after 10 steps")
            rows = {c.path: c for c in await svc.list_model_packages(kind="CHECKPOINT")}
            assert rows[first.path].description == "final checkpoint" and rows[second.path].description == "after 10 steps"
            await svc.delete_model_package(first.model_package_arn)
            assert first.path not in [c.path for c in await svc.list_model_packages()]
            await tc.forward_backward([[1, 40, 41]], "cross_entropy", None, {"target_tokens": [40, 41, 2], "weights": [1.0] * 3})
