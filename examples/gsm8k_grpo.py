"""GRPO on GSM8K: K answers per question, reward 1 when the number after ``####`` matches, ``ppo`` loss.

Reads GSM8K through ``datasets`` when online (train/test splits) or from local JSONL files in the
dataset's format (``{"question": ..., "answer": "... #### 42"}``). Held-out greedy accuracy is
reported before and after. Settings are ``key=value`` overrides of :class:`RLConfig`:

    python examples/gsm8k_grpo.py train_path=examples/data/gsm8k_sample.jsonl max_steps=3   # offline
    python examples/gsm8k_grpo.py url=local:// base_model=Qwen/Qwen3-0.6B max_tokens=512 n_test=200
"""

from __future__ import annotations

import sys

import anyio

from asyncsess.rl import RLConfig, RLResult, problem_datasets, train_rl
from asyncsess.runs import parse_overrides, print_before_after
from asyncsess.tasks import gsm8k

DEFAULTS = RLConfig(
    url="mock://",
    base_model="mock/bigram-tiny",
    lora_rank=32,
    lora_alpha=64,
    learning_rate=4e-5,
    groups_per_batch=16,
    group_size=8,
    max_tokens=256,
    temperature=1.0,
    loss_fn="ppo",
    loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    normalize_std=False,
    max_staleness=1,
    max_steps=100,
    eval_every=20,
    save_every=20,
)


async def main(args: list[str]) -> RLResult:
    opts = parse_overrides(args)
    run_dir = opts.pop("run_dir", "runs/gsm8k_grpo")
    train_path, test_path = opts.pop("train_path", None), opts.pop("test_path", None)
    n_test = int(opts.pop("n_test", 100))
    cfg = RLConfig.model_validate({**DEFAULTS.model_dump(), **opts})
    train = gsm8k.load("train", train_path)
    if train_path is not None and test_path is None:  # one local file: hold out its last quarter
        cut = max(1, len(train) * 3 // 4)
        train, test = train[:cut], train[cut:]
    else:
        test = gsm8k.load("test", test_path, limit=n_test)
    result = await train_rl(cfg, problem_datasets(train, test[:n_test], gsm8k.grade, cfg), run_dir)
    print_before_after(result.before, result.after, f"gsm8k_grpo: {result.steps} steps, {result.train_seconds:.0f} s of training")
    return result


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
