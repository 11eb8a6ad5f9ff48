"""Sandbox throughput: LocalSandbox executions per second at concurrency 1 vs 8, in the same run (a ratio).

Each execution is a small grading-style program (read stdin, compute, print) through the full isolation path
(supervisor, namespaces and uid drop where available, cleanup). The ratio is bounded by this machine's cores:
process start-up and the program itself are CPU work.

    python bench/bench_sandbox.py [--executions 64] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import os
import time

import anyio

from asyncsess.sandbox import LocalSandbox

PROGRAM = "n = int(input())\nprint(sum(i * i for i in range(n)))\n"


async def throughput(concurrency: int, executions: int) -> float:
    sandbox = LocalSandbox(max_concurrency=concurrency, timeout_s=10.0, memory_mb=256)
    await sandbox.isolation()  # probe outside the timed region
    expected = str(sum(i * i for i in range(20_000)))

    async def one() -> None:
        result = await sandbox.run(PROGRAM, stdin="20000\n")
        assert result.status == "ok" and result.stdout.strip() == expected, result

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(executions):
            tg.start_soon(one)
    return executions / (time.perf_counter() - started)


async def main(executions: int, concurrency: int) -> None:
    isolation = await LocalSandbox().isolation()
    print(f"cores: {os.cpu_count()}  isolation: {isolation.model_dump(exclude={'notes'})}")
    await throughput(concurrency, min(executions, 16))  # warm the page cache
    serial = await throughput(1, executions)
    parallel = await throughput(concurrency, executions)
    print(f"{'concurrency':>12} {'exec/s':>8}")
    print(f"{1:>12} {serial:>8.1f}")
    print(f"{concurrency:>12} {parallel:>8.1f}")
    print(f"ratio {concurrency} vs 1: {parallel / serial:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    anyio.run(main, args.executions, args.concurrency)
