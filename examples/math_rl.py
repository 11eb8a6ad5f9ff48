"""GRPO on offline arithmetic: "What is 23 + 45? Reply with only the number." (reward 1 when it matches).

Problems with 1–2 digit operands are generated in code; 100 held-out problems measure greedy accuracy
before and after. Settings are ``key=value`` overrides of :class:`asyncsess.rl.RLConfig`:

    python examples/math_rl.py                                   # mock://, seconds
    python examples/math_rl.py url='local://?dtype=bfloat16' base_model=smollm2 max_minutes=5 run_dir=runs/math
"""

from __future__ import annotations

import sys

import anyio

from asyncsess.rl import RLConfig, RLResult, problem_datasets, train_rl
from asyncsess.runs import parse_overrides, print_before_after
from asyncsess.tasks import arithmetic

DEFAULTS = RLConfig(
    url="mock://",
    base_model="mock/bigram-tiny",
    lora_rank=16,
    lora_alpha=32,
    learning_rate=1e-4,
    groups_per_batch=8,
    group_size=8,
    max_tokens=16,
    temperature=1.0,
    loss_fn="ppo",
    normalize_std=True,
    remove_constant_reward_groups=True,
    max_steps=75,
    save_every=25,
)


async def main(args: list[str]) -> RLResult:
    opts = parse_overrides(args)
    run_dir = opts.pop("run_dir", "runs/math_rl")
    n_test = int(opts.pop("n_test", 100))
    cfg = RLConfig.model_validate({**DEFAULTS.model_dump(), **opts})
    train, test = arithmetic.split(n_train=5_000, n_test=n_test, seed=cfg.seed)
    result = await train_rl(cfg, problem_datasets(train, test, arithmetic.grade, cfg), run_dir)
    print_before_after(result.before, result.after, f"math_rl: {result.steps} steps, {result.train_seconds:.0f} s of training")
    return result


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
