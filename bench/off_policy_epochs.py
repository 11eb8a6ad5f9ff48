"""Several optimizer steps (epochs) over each stale batch on mock://: the sampler-trainer KL per seed and arm.

``train_rl`` does this with ``epochs_per_batch`` (docs/recipes.md has its figures); this small loop of its own
pins the staleness exactly: at step ``s`` a batch of digit-share GRPO groups is sampled from the weights
after ``max(0, s - k)`` steps, corrected as ``off_policy`` says (``correct_batch``, the loop's code), then
trained ``--epochs`` times (``forward_backward`` + AdamW step each). ``off_policy/kl`` is taken from the
first epoch's log-probs, as in ``train_rl``. Printed per seed and arm: the mean KL over the last third of the
steps and its max, the training reward of the first and last 5 steps, and the first arm's KLs over the arm's.
Findings: docs/recipes.md, "Off-policy correction".

    python bench/off_policy_epochs.py [--lr 10] [--adam-eps 1] [--epochs 8] [--k 3] [--seeds 0 1 2 3 4 5 6 7]
        [--arms importance_sampling:none importance_sampling:tis ppo:none]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))  # the repo root: tests/ as a package

from asyncsess import ServiceClient
from asyncsess.rl import RLConfig, problem_datasets
from asyncsess.rl.data import group_datums, is_constant
from asyncsess.rl.off_policy import correct_batch, off_policy_metrics
from asyncsess.rl.rollouts import SamplerCompleter, do_group_rollout
from asyncsess.types import AdamParams
from tests.recipes.helpers import digit_share
from tests.recipes.test_rl_loop import PROBLEMS


async def arm(a: argparse.Namespace, seed: int, loss: str, mode: str) -> dict[str, float]:
    """The KL and reward figures of one run."""
    cfg = RLConfig(groups_per_batch=a.groups, group_size=a.group_size, max_tokens=a.max_tokens, seed=seed)
    adam = AdamParams(learning_rate=a.lr, eps=a.adam_eps)
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client(base_model="mock/bigram-tiny", rank=8)
        train, _ = problem_datasets(PROBLEMS, [], digit_share, cfg)(tc.get_tokenizer())
        samplers = [await tc.save_weights_and_get_sampling_client()]
        kls: list[float] = []
        rewards: list[float] = []
        for step in range(a.steps):
            version = max(0, step - a.k)
            pairs = []
            for i, builder in enumerate(train.get_batch(step % len(train))):
                policy = SamplerCompleter(samplers[version], a.max_tokens, 1.0, None, seed * 1_000_003 + step * 1_000 + i)
                group = await do_group_rollout(builder, policy, version)
                rewards.append(float(np.mean(group.total_rewards)))
                if not is_constant(group.total_rewards):
                    pairs.extend(group_datums(group))
            if pairs:
                behaviour, masks = [d.loss_fn_inputs["logprobs"].data for d, _ in pairs], [m for _, m in pairs]
                if mode != "none" and a.k > 0:
                    pairs, _ = await correct_batch(tc, pairs, mode, cap=2.0, low=0.5, high=2.0)  # type: ignore[arg-type]
                for epoch in range(a.epochs):
                    out = await tc.forward_backward([d for d, _ in pairs], loss)
                    if epoch == 0:
                        trainer = [o["logprobs"].data for o in out.loss_fn_outputs]
                        kls.append(off_policy_metrics(behaviour, trainer, masks)["off_policy/kl"])
                    await tc.optim_step(adam)
            samplers.append(await tc.save_weights_and_get_sampling_client())
    per_step = [float(np.mean(rewards[i : i + a.groups])) for i in range(0, len(rewards), a.groups)]
    return {
        "last": float(np.mean(kls[-max(1, len(kls) // 3) :])) if kls else 0.0,
        "max": max(kls, default=0.0),
        "r0": float(np.mean(per_step[:5])),
        "r1": float(np.mean(per_step[-5:])),
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lr", type=float, default=10.0)
    p.add_argument("--adam-eps", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    p.add_argument("--arms", nargs="+", default=["importance_sampling:none", "importance_sampling:tis", "ppo:none"])
    a = p.parse_args()
    print("#", " ".join(f"{k}={v}" for k, v in vars(a).items() if k not in ("seeds", "arms")))
    print("seed  arm                         lastKL   maxKL  reward0 reward1  base/arm last  max")
    for seed in a.seeds:
        base = None
        for name in a.arms:
            r = await arm(a, seed, *name.split(":"))
            base = r if base is None else base
            q_last, q_max = base["last"] / max(r["last"], 1e-12), base["max"] / max(r["max"], 1e-12)
            print(
                f"{seed:<5} {name:<27} {r['last']:7.3f} {r['max']:7.3f} {r['r0']:7.2f} {r['r1']:7.2f}  {q_last:8.2f}x {q_max:6.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    anyio.run(main)
