"""One HTTP worker, many clients: throughput and op latency at 1, 4 and 16 concurrent clients (tiny model, CPU).

Each client has its own API key and LoRA session and runs GRPO-shaped steps: ``forward_backward`` +
``optim_step`` queued together, a sampler refresh, and a sample of 2 completions. The 1-client run is the
baseline of the ratios. Prints a Markdown table (docs/benchmarks.md).

    python bench/bench_worker_clients.py [--steps 4] [--clients 1 4 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import anyio

from asyncsess import AdamParams, SamplingParams, ServiceClient
from asyncsess.types import Datum, ModelInput, TensorData


def _datum(tokens: list[int]) -> Datum:
    n = len(tokens) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": TensorData.from_list(tokens[1:]), "weights": TensorData.from_list([1.0] * n)},
    )


async def run(url: str, model: str, keys: list[str], steps: int) -> tuple[float, list[float]]:
    """(steps per second over all clients, per-op latencies in seconds)."""
    latencies: list[float] = []

    async def timed(aw):
        t0 = time.perf_counter()
        out = await aw
        latencies.append(time.perf_counter() - t0)
        return out

    async def client(i: int) -> None:
        async with ServiceClient(url, api_key=keys[i], heartbeat_interval=0) as svc:
            tc = await svc.create_lora_training_client(model, rank=8, seed=i)
            datum = _datum(list(range(3 + i, 67 + i)))
            for _ in range(steps):
                fb = tc.forward_backward([datum] * 4, "cross_entropy")
                opt = tc.optim_step(AdamParams(learning_rate=1e-3))
                sampler = await timed(tc.save_weights_and_get_sampling_client())
                await timed(sampler.sample(datum.model_input.to_ints()[:16], 2, SamplingParams(max_tokens=8, seed=i)))
                await timed(fb)
                await timed(opt)
            await tc.stop()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(keys)):
            tg.start_soon(client, i)
    return len(keys) * steps / (time.perf_counter() - t0), latencies


def main() -> None:
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread
    from asyncsess_local.testing import build_tiny_llama

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_llama(f"{tmp}/tiny"))
        keys = [f"bench-{i}" for i in range(max(args.clients))]
        worker = serve_in_thread(LocalBackend(model=model, device="cpu", checkpoint_dir=f"{tmp}/ckpt"), keys)
        try:
            anyio.run(run, worker.url, model, keys[:1], 1)  # warm-up
            rows = []
            for n in args.clients:
                rate, lat = anyio.run(run, worker.url, model, keys[:n], args.steps)
                q = statistics.quantiles(lat, n=100)
                rows.append((n, rate, q[49], q[98]))
        finally:
            worker.stop()
    base = rows[0][1]
    print("| clients | steps/s (all clients) | vs 1 client | op latency p50 | op latency p99 |")
    print("|---|---|---|---|---|")
    for n, rate, p50, p99 in rows:
        print(f"| {n} | {rate:.2f} | {rate / base:.2f}× | {p50 * 1000:.0f} ms | {p99 * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
