"""The SageMaker launch example's GRPO loop, unchanged but for its imports and the ServiceClient line.

Blocking style: submit every sample future, then ``.result()`` each; ``forward_backward(..., loss_fn="ppo")``;
``optim_step``; ``save_weights_and_get_sampling_client``; finally save merged weights and state, and stop.

    python examples/sagemaker_grpo_sync.py            # on mock://
"""

from __future__ import annotations

import sys

from asyncsess.rl.data import center_advantages, rl_datum  # was: the recipe's own helpers
from asyncsess.sync import AdamParams, SamplingParams, ServiceClient  # was: from sagemaker.train.training_session import ...

try:
    from .toy_task import PROMPTS, reward, sample_seed
except ImportError:  # run as a script
    from toy_task import PROMPTS, reward, sample_seed  # type: ignore[no-redef]

BASE_MODEL = "mock/bigram-tiny"
NUM_STEPS = 20
GROUP_SIZE = 8


def run(url: str = "mock://", num_steps: int = NUM_STEPS, learning_rate: float = 0.3, seed: int = 0) -> str:
    service_client = ServiceClient(url)  # was: ServiceClient(region="us-west-2", role_arn=ROLE_ARN)
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=32, alpha=64)
    tokenizer = training_client.get_tokenizer()
    sampling_client = training_client.create_sampling_client()

    for step in range(num_steps):
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        futures = [
            sampling_client.sample(
                prompt=p,
                num_samples=GROUP_SIZE,
                sampling_params=SamplingParams(max_tokens=8, temperature=1.0, stop=[], seed=sample_seed(seed, step, i)),
            )
            for i, p in enumerate(prompts)
        ]
        datums, rewards = [], []
        for prompt, future in zip(prompts, futures):
            result = future.result()
            group = [reward(tokenizer.decode(s.tokens)) for s in result.sequences]
            rewards.extend(group)
            for seq, adv in zip(result.sequences, center_advantages(group)):
                if adv != 0.0:
                    datums.append(rl_datum(prompt, seq.tokens, seq.logprobs or [], adv))
        print(f"step {step:3d}  mean reward {sum(rewards) / len(rewards):.3f}")
        if datums:
            training_client.forward_backward(datums, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
            training_client.optim_step(AdamParams(learning_rate=learning_rate)).result()
            sampling_client = training_client.save_weights_and_get_sampling_client()

    merged = training_client.save_weights_for_sampler(merge_weights=True).result()
    state = training_client.save_state("final").result()
    print("merged weights:", merged.model_package_arn, " state:", state.model_package_arn)
    training_client.stop()
    service_client.close()
    return state.path


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "mock://")
