"""The sampler-trainer KL at staleness ``k`` with and without off-policy correction, per seed, in one run.

GRPO on the share of digits in an 8-token reply (4 groups x 8 samples per step), LoRA rank 8, on local://
(the tiny random Llama on CPU, the default) or mock://. Each arm is ``loss:off_policy``; the first arm is
the baseline (default ``importance_sampling:none``, the cookbook's unclipped IS: its datums keep the
sampler's log-probs as anchor, so the loss multiplies by the raw ratio ``p/q``). Printed per seed and arm:
mean and max ``off_policy/kl`` over the trained steps, the largest raw ratio, the final training reward,
and the baseline's mean KL over the arm's. Findings: docs/recipes.md, "Off-policy correction".

    python bench/off_policy_kl.py [--url local] [--lr 3e-3] [--seeds 0 1 2] [--steps 30] [--k 3]
        [--arms importance_sampling:none importance_sampling:tis ppo:none] [--adam-beta2 0.95] [--adam-eps 1e-8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))  # the repo root: tests/ as a package

from asyncsess.rl import Problem, RLConfig, problem_datasets, train_rl
from asyncsess.runs.metrics import read_metrics
from tests.recipes.helpers import digit_share
from tests.recipes.test_local_learning import questions
from tests.recipes.test_rl_loop import PROBLEMS


async def arm(args: argparse.Namespace, seed: int, loss: str, mode: str) -> tuple[float, float, float, float]:
    """(mean KL, max KL, max raw ratio, final reward) of one run."""
    local = args.url == "local"
    cfg = RLConfig(
        url="local://?device=cpu" if local else "mock://",
        base_model="tiny-llama" if local else "mock/bigram-tiny",
        lora_rank=8,
        lora_alpha=16,
        learning_rate=args.lr,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        groups_per_batch=4,
        group_size=8,
        max_tokens=8,
        max_steps=args.steps,
        max_staleness=args.k,
        loss_fn=loss,
        off_policy=mode,  # type: ignore[arg-type]  # checked by RLConfig
        seed=seed,
        verify_refresh=False,  # the probe changes no weights; off to save time
    )
    problems = [Problem(q, "0") for q in questions(200, seed=0, exclude=set(questions(50, seed=1)))] if local else PROBLEMS
    with tempfile.TemporaryDirectory() as d:
        await train_rl(cfg, problem_datasets(problems, [], digit_share, cfg), d, progress=False)
        records = [r for r in read_metrics(d) if "off_policy/kl" in r]
    kl = [r["off_policy/kl"] for r in records]
    return float(np.mean(kl)), max(kl), max(r["off_policy/ratio_max"] for r in records), records[-1]["env/all/reward/total"]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", choices=["local", "mock"], default="local")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--arms", nargs="+", default=["importance_sampling:none", "importance_sampling:tis", "ppo:none"])
    p.add_argument("--adam-beta2", type=float, default=0.95)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    args = p.parse_args()
    print("seed  arm                         mean KL   max KL   max ratio  reward  baseline/arm")
    for seed in args.seeds:
        base = None
        for a in args.arms:
            mean, top, ratio, reward = await arm(args, seed, *a.split(":"))
            base = mean if base is None else base
            print(f"{seed:<5} {a:<27} {mean:8.3f} {top:8.2f} {ratio:11.3g} {reward:7.2f} {base / mean:8.2f}x", flush=True)


if __name__ == "__main__":
    anyio.run(main)
