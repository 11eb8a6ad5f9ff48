"""code_rl step time, overlapped (staleness bound k) vs synchronous (k = 0), on mock:// in the same run.

The policy is scripted (tests/code_rl/scripted.py: tool calls, right and wrong programs) and every reply
waits ``--sample-ms`` first, standing in for generation time; ``mock://?latency_ms=`` delays every backend
call (training ops, sampler refreshes, the log-prob calls that score the scripted replies). Programs are
graded for real by LocalSandbox. Both loops run the same settings; the first step of each is left out of
the mean (warm-up).

    python bench/bench_code_rl.py [--steps 6] [--k 2] [--sample-ms 500] [--latency-ms 50]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).parents[1]))  # the repo root: examples/ and tests/ as packages

from asyncsess.rl import ScriptedCompleter, StopCondition, TokensWithLogprobs
from asyncsess.runs.metrics import read_metrics
from asyncsess.sandbox import LocalSandbox
from asyncsess.tasks import code
from asyncsess.types import ModelInput
from examples import code_rl
from tests.code_rl.scripted import code_policy


class SlowScripted(ScriptedCompleter):
    """A scripted reply that takes ``delay`` seconds to "generate"."""

    def __init__(self, *args, delay: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay

    async def __call__(self, model_input: ModelInput, stop: StopCondition) -> TokensWithLogprobs:
        await anyio.sleep(self.delay)
        return await super().__call__(model_input, stop)


async def run(k: int, args: argparse.Namespace, run_dir: Path) -> tuple[list[float], list[dict]]:
    script = code_policy(code.load(code_rl.BUNDLED), seed=0)

    def make_completer(sampler, max_tokens, temperature, context_window):
        return SlowScripted(
            sampler, script, max_tokens=max_tokens, temperature=temperature, context_window=context_window, delay=args.sample_ms / 1000
        )

    overrides = [
        f"url=mock://?max_context=8192&latency_ms={args.latency_ms}",
        f"groups_per_batch={args.groups}",
        f"group_size={args.group_size}",
        f"num_minibatches={args.minibatches}",
        f"max_staleness={k}",
        f"max_steps={args.steps}",
        "n_test=0",
        "eval_every=0",
        "save_every=0",
        f"sandbox_concurrency={args.sandbox_concurrency}",
        f"run_dir={run_dir}",
    ]
    with contextlib.redirect_stdout(io.StringIO()):  # the recipe's progress bar and before/after table
        await code_rl.main(overrides, make_completer=make_completer)
    records = [r for r in read_metrics(run_dir) if "time/step" in r]
    return [r["time/step"] for r in records], records


async def main(args: argparse.Namespace) -> None:
    isolation = await LocalSandbox().isolation()
    print(f"cores: {os.cpu_count()}  sandbox namespaces: {isolation.namespaces}  privilege drop: {isolation.privilege_drop}")
    print(
        f"{args.steps} steps x {args.groups} groups x {args.group_size} episodes, 2 turns, sample {args.sample_ms} ms/turn, "
        f"backend latency {args.latency_ms} ms/call, {args.minibatches} forward_backward sub-batches per step"
    )
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for k in (0, args.k):
            t0 = time.perf_counter()
            times, records = await run(k, args, Path(tmp) / f"k{k}")
            results[k] = (statistics.mean(times[1:]), time.perf_counter() - t0, records)
    print(f"{'mode':>16} {'step s (mean)':>14} {'wall s':>8} {'staleness':>10} {'reward':>8}")
    for k, (step, wall, records) in results.items():
        stale = statistics.mean(r["async/staleness_mean"] for r in records)
        reward = statistics.mean(r["env/all/reward/total"] for r in records)
        name = "synchronous" if k == 0 else f"overlapped k={k}"
        print(f"{name:>16} {step:>14.2f} {wall:>8.1f} {stale:>10.2f} {reward:>8.3f}")
    print(f"step time ratio synchronous / overlapped: {results[0][0] / results[args.k][0]:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--sample-ms", type=float, default=500)
    parser.add_argument("--latency-ms", type=float, default=50)
    parser.add_argument("--sandbox-concurrency", type=int, default=8)
    anyio.run(main, parser.parse_args())
