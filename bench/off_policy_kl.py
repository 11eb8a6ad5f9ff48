"""The sampler-trainer KL at staleness ``k`` with and without off-policy correction, per seed, over a grid.

GRPO on the share of digits in the reply (``--task digits``; ``--task binary``: 1 when every character is a
digit), LoRA rank 8, on local:// (the tiny random Llama on CPU, the default) or mock://. Each arm is
``loss:off_policy``; the first arm is the baseline (default ``importance_sampling:none``, the cookbook's
unclipped IS: its datums keep the sampler's log-probs as anchor, so the loss multiplies by the raw ratio
``p/q``). Every list-valued option is swept (their product). Printed per setting, seed and arm: the mean
``off_policy/kl`` over the run and over its last third, its max, the largest raw ratio, the training reward
of the first and last 5 steps, and the baseline's three KLs over the arm's; per setting, the smallest of
those ratios over the seeds and the mean final reward. Findings: docs/recipes.md, "Off-policy correction".

    python bench/off_policy_kl.py [--url local] [--lr 3e-3 1e-2] [--seeds 0 1 2] [--steps 30] [--k 3]
        [--arms importance_sampling:none importance_sampling:tis ppo:none] [--groups 4] [--group-size 8]
        [--max-tokens 8] [--minibatches 1] [--normalize-std 0] [--adam-beta1 0.9] [--adam-beta2 0.95] [--adam-eps 1e-8]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))  # the repo root: tests/ as a package

from asyncsess.rl import Problem, RLConfig, problem_datasets, train_rl
from asyncsess.runs.metrics import read_metrics
from tests.recipes.helpers import digit_share
from tests.recipes.test_rl_loop import PROBLEMS

GRID = ("lr", "k", "steps", "groups", "group_size", "max_tokens", "minibatches", "normalize_std", "adam_beta1", "adam_beta2", "adam_eps")


def all_digits(problem: Problem, reply: str) -> tuple[float, dict[str, float]]:
    """A sharper grader: 1 when the reply is all digits, else 0."""
    return float(bool(reply) and all(c.isdigit() for c in reply)), {"correct": 0.0}


async def arm(args: argparse.Namespace, s: dict, seed: int, loss: str, mode: str) -> dict[str, float]:
    """The KL and reward figures of one run."""
    local = args.url == "local"
    cfg = RLConfig(
        url="local://?device=cpu" if local else "mock://",
        base_model="tiny-llama" if local else "mock/bigram-tiny",
        lora_rank=8,
        lora_alpha=16,
        learning_rate=s["lr"],
        adam_beta1=s["adam_beta1"],
        adam_beta2=s["adam_beta2"],
        adam_eps=s["adam_eps"],
        groups_per_batch=s["groups"],
        group_size=s["group_size"],
        max_tokens=s["max_tokens"],
        num_minibatches=s["minibatches"],
        normalize_std=bool(s["normalize_std"]),
        max_steps=s["steps"],
        max_staleness=s["k"],
        loss_fn=loss,
        off_policy=mode,  # type: ignore[arg-type]  # checked by RLConfig
        seed=seed,
        verify_refresh=False,  # the probe changes no weights; off to save time
    )
    if local:
        from tests.recipes.test_local_learning import questions  # needs torch

        problems = [Problem(q, "0") for q in questions(200, seed=0, exclude=set(questions(50, seed=1)))]
    else:
        problems = PROBLEMS
    grader = all_digits if args.task == "binary" else digit_share
    with tempfile.TemporaryDirectory() as d:
        await train_rl(cfg, problem_datasets(problems, [], grader, cfg), d, progress=False)
        records = [r for r in read_metrics(d) if "env/all/reward/total" in r]
    kl = [r["off_policy/kl"] for r in records if "off_policy/kl" in r]
    rewards = [r["env/all/reward/total"] for r in records]
    return {
        "mean": float(np.mean(kl)) if kl else 0.0,
        "last": float(np.mean(kl[-max(1, len(kl) // 3) :])) if kl else 0.0,
        "max": max(kl, default=0.0),
        "ratio": max((r["off_policy/ratio_max"] for r in records if "off_policy/ratio_max" in r), default=1.0),
        "r0": float(np.mean(rewards[:5])),
        "r1": float(np.mean(rewards[-5:])),
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", choices=["local", "mock"], default="local")
    p.add_argument("--task", choices=["digits", "binary"], default="digits")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=["importance_sampling:none", "importance_sampling:tis", "ppo:none"])
    for name, kind, default in [
        ("lr", float, 3e-3),
        ("k", int, 3),
        ("steps", int, 30),
        ("groups", int, 4),
        ("group_size", int, 8),
        ("max_tokens", int, 8),
        ("minibatches", int, 1),
        ("normalize_std", int, 0),
        ("adam_beta1", float, 0.9),
        ("adam_beta2", float, 0.95),
        ("adam_eps", float, 1e-8),
    ]:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, nargs="+", default=[default])
    args = p.parse_args()
    for values in itertools.product(*(getattr(args, g) for g in GRID)):
        s = dict(zip(GRID, values))
        print("#", args.task, " ".join(f"{g}={v}" for g, v in s.items()), flush=True)
        print("seed  arm                         meanKL  lastKL   maxKL   max ratio  reward0 reward1  base/arm mean   last    max")
        worst: dict[str, list[float]] = {}
        final: dict[str, list[float]] = {}
        for seed in args.seeds:
            base = None
            for a in args.arms:
                r = await arm(args, s, seed, *a.split(":"))
                base = r if base is None else base
                q = [base[x] / max(r[x], 1e-12) for x in ("mean", "last", "max")]
                w = worst.setdefault(a, [np.inf] * 3)
                w[:] = [min(x, y) for x, y in zip(w, q)]
                final.setdefault(a, []).append(r["r1"])
                print(
                    f"{seed:<5} {a:<27} {r['mean']:7.3f} {r['last']:7.3f} {r['max']:7.3f} {r['ratio']:10.3g} {r['r0']:7.2f}"
                    f" {r['r1']:7.2f}  {q[0]:8.2f}x {q[1]:6.2f}x {q[2]:6.2f}x",
                    flush=True,
                )
        summary = ", ".join(f"{a} {w[0]:.2f}x {w[1]:.2f}x {w[2]:.2f}x (reward {np.mean(final[a]):.2f})" for a, w in worst.items())
        print("# min over seeds (mean, last third, max), mean final reward:", summary, flush=True)


if __name__ == "__main__":
    anyio.run(main)
