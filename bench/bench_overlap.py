"""The RL loop overlapped (sampling ``k`` steps ahead, off-policy correction on) vs synchronous (k = 0),
at an equal number of samples, on mock:// with injected latency, in one run.

GRPO on the recipe tests' digit-share task (the share of digits in an 8-token reply, 4 groups x 4 samples
per step). ``mock://?latency_ms=`` delays every backend call: sampling, forward_backward, optim_step,
the sampler refresh, and the proximal ``forward`` the correction adds per sub-batch; each sampling request
also waits ``--sample-ms`` first, standing in for generation time (so sampling is not seeded). Each mode runs the
same steps for each seed; printed: mean wall time per run, final reward (training reward over the last 5
steps and the held-out greedy reward after the last step), the mean sampler-trainer KL, and the ratios
against the synchronous loop.

    python bench/bench_overlap.py [--steps 20] [--k 2] [--latency-ms 20] [--sample-ms 200] [--seeds 3] [--lr 0.5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).parents[1]))  # the repo root: tests/ as a package

from asyncsess.rl import Problem, RLConfig, SamplerCompleter, problem_datasets, train_rl
from asyncsess.runs.metrics import read_metrics
from tests.recipes.helpers import digit_share

PROBLEMS = [Problem(f"Code {i}:", "0") for i in range(12)]


class SlowSampler(SamplerCompleter):
    """Sampling that takes ``delay`` seconds longer, as generation would."""

    delay = 0.0

    async def _sample(self, *args, **kwargs):
        await anyio.sleep(self.delay)
        return await super()._sample(*args, **kwargs)


async def run(cfg: RLConfig, run_dir: Path) -> tuple[float, float, float, float]:
    """Wall seconds, final training reward (last 5 steps), held-out reward after, mean off_policy/kl."""
    t0 = time.perf_counter()
    datasets = problem_datasets(PROBLEMS, PROBLEMS[:4], digit_share, cfg)
    result = await train_rl(cfg, datasets, run_dir, make_completer=SlowSampler, progress=False)
    wall = time.perf_counter() - t0
    records = [r for r in read_metrics(run_dir) if "env/all/reward/total" in r]
    final = statistics.mean(r["env/all/reward/total"] for r in records[-5:])
    kl = statistics.mean(r.get("off_policy/kl", 0.0) for r in records)
    return wall, final, result.after["test/env/all/reward/total"], kl


async def main(args: argparse.Namespace) -> None:
    base = RLConfig(
        url=f"mock://?latency_ms={args.latency_ms}",
        groups_per_batch=4,
        group_size=4,
        max_tokens=8,
        lora_rank=4,
        learning_rate=args.lr,
        max_steps=args.steps,
    )
    modes = {
        "synchronous k=0": {"max_staleness": 0},
        f"overlapped k={args.k}, tis": {"max_staleness": args.k, "off_policy": "tis"},
        f"overlapped k={args.k}, none": {"max_staleness": args.k, "off_policy": "none"},
    }
    SlowSampler.delay = args.sample_ms / 1000
    print(
        f"cores: {os.cpu_count()}  {args.steps} steps x 4 groups x 4 samples, latency {args.latency_ms} ms/call, "
        f"sampling +{args.sample_ms} ms/request, lr {args.lr}, {args.seeds} seeds"
    )
    rows: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for name, update in modes.items():  # alternating, so a busy spell on the machine hits every mode
                cfg = base.model_copy(update={**update, "seed": seed})
                rows[name].append(await run(cfg, Path(tmp) / f"{seed}-{len(rows[name])}-{update['max_staleness']}-{name[-4:]}"))
    print(f"{'mode':>22} {'wall s':>8} {'reward (last 5)':>16} {'held-out':>9} {'kl':>7} {'wall ratio':>11} {'reward ratio':>13}")
    sync_wall = statistics.mean(r[0] for r in rows["synchronous k=0"])
    sync_reward = statistics.mean(r[1] for r in rows["synchronous k=0"])
    for name, rs in rows.items():
        wall, reward, held, kl = (statistics.mean(r[i] for r in rs) for i in range(4))
        print(f"{name:>22} {wall:>8.2f} {reward:>16.3f} {held:>9.3f} {kl:>7.4f} {sync_wall / wall:>10.2f}x {reward / sync_reward:>12.2f}x")
    print("wall ratio: synchronous wall / this mode's (above 1: faster); reward ratio: this mode's / synchronous")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=20)
    parser.add_argument("--sample-ms", type=float, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.5)
    anyio.run(main, parser.parse_args())
