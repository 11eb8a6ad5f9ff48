"""The OpenAI front over sagemaker:// (the boto3 driver against the local emulator over mock://)."""

from __future__ import annotations

import pytest

from asyncsess import ServiceClient
from asyncsess.rl.capture import build_trajectory
from asyncsess.serve.openai_front import OpenAIFront
from asyncsess_sagemaker.emulator import EmulatorConfig, running_emulator

pytestmark = [pytest.mark.sagemaker, pytest.mark.anyio]
ROLE = "arn:aws:iam::111122223333:role/TrainingSessionRole"


@pytest.fixture
def sm_url(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    with running_emulator("mock://", EmulatorConfig()) as emu:
        yield f"sagemaker://us-west-2?endpoint_url={emu.url}&role_arn={ROLE}&s3_output_path=s3://bucket/out&tokenizer_backend=mock://"


async def test_sagemaker_captures_match_compute_logprobs_over_two_turns(sm_url):
    async with ServiceClient(sm_url) as svc:
        tc = await svc.create_lora_training_client(base_model="mock/bigram-tiny", rank=4)
        sampler = await tc.save_weights_and_get_sampling_client()
        front = OpenAIFront(sampler, version=1)
        async with front.openai_client("sm") as client:
            messages = [{"role": "user", "content": "hi"}]
            for seed in (1, 2):
                reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=seed, n=2)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "more"}]
        calls = front.captures.calls("sm")
        assert [c.weight_version for c in calls] == [1, 1] and all(len(c.choices) == 2 for c in calls)
        for call in calls:
            for choice in call.choices:
                scored = await sampler.compute_logprobs(call.prompt_tokens + choice.tokens)
                assert choice.logprobs == pytest.approx(scored[len(call.prompt_tokens) :], abs=1e-6)
        traj = build_trajectory("sm", calls, 1.0)
        trained = [t for s in traj.segments() for t, m in zip(s["tokens"], s["mask"]) if m]
        assert trained == [t for c, k in zip(calls, traj.chosen) for t in c.choices[k].tokens]
