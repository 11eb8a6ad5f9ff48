"""Steps/s of the RL loop on the recipe tests' digit-share task (GRPO, 8 groups × 8 samples, 16 tokens).

Compare two commits side by side, alternating, on the same machine (the 2-core VM is shared, so take the
minimum or median of several runs):

    git archive 5cbff12 | tar -x -C /tmp/rl_old        # the commit before the two RL loops were merged
    for i in 1 2 3 4 5 6 7; do
      PYTHONPATH=/tmp/rl_old/src python bench/rl_loop_speed.py 0 80; python bench/rl_loop_speed.py 0 80
    done
    python bench/rl_loop_speed.py K STEPS [URL BASE_MODEL]   # e.g. 0 12 'local://?device=cpu' tiny-llama
"""

from __future__ import annotations

import sys
import tempfile
import time

import anyio

try:
    from asyncsess.rl import Problem, RLConfig, problem_datasets, train_rl

    MERGED = True
except ImportError:  # the loops before the merge (asyncsess.rl.rl_train)
    from asyncsess.rl.rl_train import RLConfig, train_rl  # type: ignore[no-redef]
    from asyncsess.rl.rollouts import Problem  # type: ignore[no-redef]

    MERGED = False


def grade(problem: Problem, reply: str) -> tuple[float, dict[str, float]]:
    return sum(c.isdigit() for c in reply) / max(1, len(reply)), {"correct": float(reply.strip() == problem.answer)}


def main(argv: list[str]) -> None:
    k, steps = int(argv[0]), int(argv[1])
    url = argv[2] if len(argv) > 2 else "mock://"
    model = argv[3] if len(argv) > 3 else "mock/bigram-tiny"
    problems = [Problem(f"Code {i}:", "0") for i in range(12)]
    cfg = RLConfig(
        url=url, base_model=model, groups_per_batch=8, group_size=8, max_tokens=16, learning_rate=0.5, lora_rank=4,
        normalize_std=False, max_staleness=k, max_steps=steps, seed=1,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        if MERGED:
            result = anyio.run(lambda: train_rl(cfg, problem_datasets(problems, problems[:4], grade, cfg), run_dir, progress=False))
        else:
            result = anyio.run(lambda: train_rl(cfg, problems, problems[:4], grade, run_dir, progress=False))
        wall = time.perf_counter() - t0
    name = "merged" if MERGED else "before"
    print(
        f"{name} k={k} steps={result.steps} train_s={result.train_seconds:.3f} steps/s={result.steps / result.train_seconds:.2f} "
        f"wall_s={wall:.2f} held-out reward {result.before['test/env/all/reward/total']:.3f} -> {result.after['test/env/all/reward/total']:.3f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
