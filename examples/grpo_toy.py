"""GRPO in the anchors' shape on a toy task: teach a model to answer with digits.

sample K per prompt -> reward -> group-centred advantages -> forward_backward(..., "ppo") + optim_step
(pipelined) -> save_weights_and_get_sampling_client. On mock:// the mean reward rises within ~15 steps.

    python examples/grpo_toy.py --url mock:// --steps 20
"""

from __future__ import annotations

import argparse

import anyio

from asyncsess import AdamParams, SamplingParams, ServiceClient
from asyncsess.rl.data import center_advantages, rl_datum

try:
    from .toy_task import PROMPTS, reward, sample_seed
except ImportError:  # run as a script
    from toy_task import PROMPTS, reward, sample_seed  # type: ignore[no-redef]


async def train(
    url: str = "mock://", steps: int = 20, group_size: int = 8, lr: float = 0.3, seed: int = 0, base_model: str = "mock/bigram-tiny"
) -> tuple[list[float], str]:
    """Run GRPO; return the mean reward of each step's samples and the final state's path."""
    history = []
    async with ServiceClient(url) as svc:
        tc = await svc.create_lora_training_client(base_model, rank=8)
        tok = tc.get_tokenizer()
        sampler = await tc.save_weights_and_get_sampling_client()
        params = SamplingParams(max_tokens=8, temperature=1.0, stop=[])
        for step in range(steps):
            prompts = [tok.encode(p) for p in PROMPTS]
            futures = [
                sampler.sample(p, group_size, params.model_copy(update={"seed": sample_seed(seed, step, i)})) for i, p in enumerate(prompts)
            ]
            datums, rewards = [], []
            for prompt, fut in zip(prompts, futures):
                result = await fut
                group = [reward(tok.decode(s.tokens)) for s in result.sequences]
                rewards.extend(group)
                for seq, adv in zip(result.sequences, center_advantages(group)):
                    if adv != 0.0:
                        datums.append(rl_datum(prompt, seq.tokens, seq.logprobs or [], adv))
            history.append(sum(rewards) / len(rewards))
            if datums:  # both ops are queued before either is awaited: one round trip
                fb = tc.forward_backward(datums, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
                opt = tc.optim_step(AdamParams(learning_rate=lr))
                sampler = await tc.save_weights_and_get_sampling_client()
                await fb
                await opt
            print(f"step {step:3d}  mean reward {history[-1]:.3f}")
        final = await tc.save_state("final")
    return history, final.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="mock://")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    anyio.run(lambda: train(a.url, a.steps, lr=a.lr, seed=a.seed))


if __name__ == "__main__":
    main()
