"""A short GRPO run on local:// with the tiny model: the mean reward rises."""

from __future__ import annotations

from urllib.parse import quote

import pytest

torch = pytest.importorskip("torch")

import asyncsess  # noqa: E402
from asyncsess.types import AdamParams, Datum, ModelInput, SamplingParams  # noqa: E402

from .helpers import DEVICE_QUERY  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.anyio]


async def test_grpo_raises_mean_reward(tiny, tmp_path):
    async with asyncsess.ServiceClient(f"local://?model={quote(tiny)}&{DEVICE_QUERY}&dir={quote(str(tmp_path))}") as svc:
        tc = await svc.create_lora_training_client(tiny, rank=8, seed=0)
        tok = tc.get_tokenizer()
        prompt = tok.encode("what is 2 plus 3? the answer is")
        params = SamplingParams(max_tokens=8, temperature=1.0, stop=[])
        rewards = []
        for step in range(8):
            sc = await tc.save_weights_and_get_sampling_client()
            groups = [
                sc.sample(prompt, num_samples=8, sampling_params=params.model_copy(update={"seed": 100 * step + g})) for g in range(2)
            ]
            data, step_rewards = [], []
            for fut in groups:
                res = await fut
                r = [sum(t % 2 == 0 for t in s.tokens) / len(s.tokens) for s in res.sequences]  # reward: share of even token ids
                mean = sum(r) / len(r)
                step_rewards += r
                for s, ri in zip(res.sequences, r):
                    tokens = prompt + s.tokens
                    n_prompt = len(prompt) - 1
                    data.append(
                        Datum(
                            model_input=ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={
                                "target_tokens": tokens[1:],
                                "logprobs": [0.0] * n_prompt + s.logprobs,
                                "advantages": [0.0] * n_prompt + [ri - mean] * len(s.tokens),
                            },
                        )
                    )
            rewards.append(sum(step_rewards) / len(step_rewards))
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(AdamParams(learning_rate=3e-2))
            await fb
            await opt
            await sc.stop()
        first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
        assert last > first + 0.2, rewards
