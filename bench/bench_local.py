"""Local backend benchmarks, each side by side with its baseline in one run (same model, batch, machine).

1. sampling: the engine batched (concurrent requests) vs unbatched (one request at a time) vs HF ``generate``;
2. training: ``forward_backward`` + ``optim_step`` through ``local://`` vs a hand-written torch + peft loop;
3. sampler refresh: ``save_weights_and_get_sampling_client`` (in-memory snapshot) and a saved PEFT dir + new sampler.

Runs on CPU (a tiny Llama built offline) or unchanged on CUDA (bf16). Peak memory is reported on CUDA.

    python bench/bench_local.py                       # tiny model, CPU
    python bench/bench_local.py --model /path/to/hf-model --device cuda --requests 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from urllib.parse import quote

import anyio
import torch


def _peak(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a"
    return f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB"


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


async def bench_sampling(svc, base_model: str, prompts: list[list[int]], args) -> dict[str, float]:
    from asyncsess.types import SamplingParams

    sc = await svc.create_sampling_client(base_model=base_model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[], seed=0)
    await sc.sample(prompts[0], num_samples=1, sampling_params=params)  # warm-up

    t0 = time.perf_counter()
    unbatched = 0
    for p in prompts:
        out = await sc.sample(p, num_samples=args.num_samples, sampling_params=params)
        unbatched += sum(len(s.tokens) for s in out.sequences)
    t_unbatched = time.perf_counter() - t0

    batched = 0

    async def one(p):
        nonlocal batched
        out = await sc.sample(p, num_samples=args.num_samples, sampling_params=params)
        batched += sum(len(s.tokens) for s in out.sequences)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for p in prompts:
            tg.start_soon(one, p)
    t_batched = time.perf_counter() - t0
    await sc.stop()
    return {"unbatched_tok_s": unbatched / t_unbatched, "batched_tok_s": batched / t_batched}


def bench_generate(model, prompts: list[list[int]], args, device) -> float:
    """HF generate, one prompt at a time with num_return_sequences (its usual use)."""
    tokens = 0
    model.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=2, do_sample=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(
                ids,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                num_return_sequences=args.num_samples,
                pad_token_id=0,
            )
            tokens += (out.shape[1] - ids.shape[1]) * out.shape[0]
    return tokens / (time.perf_counter() - t0)


def _train_batch(tok, args, step: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(step)
    vocab = len(tok)
    return [torch.randint(10, vocab, (args.seq_len,), generator=g).tolist() for _ in range(args.batch)]


async def bench_training(svc, base_model: str, tok, args) -> float:
    from asyncsess.types import AdamParams, Datum, ModelInput

    tc = await svc.create_lora_training_client(base_model, rank=args.rank, seed=0)

    def datums(step):
        return [
            Datum(model_input=ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)})
            for s in _train_batch(tok, args, step)
        ]

    await tc.forward_backward(datums(0), "cross_entropy")
    await tc.optim_step(AdamParams(learning_rate=1e-4))
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        fb = tc.forward_backward(datums(step), "cross_entropy")
        opt = tc.optim_step(AdamParams(learning_rate=1e-4))
        await fb
        await opt
    tokens = args.steps * args.batch * (args.seq_len - 1)
    rate = tokens / (time.perf_counter() - t0)
    await tc.stop()
    return rate


def bench_raw_training(model_dir: str, tok, args, device, dtype) -> float:
    """The hand-written reference: transformers + peft + AdamW, one padded-free batch (equal lengths)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from asyncsess_local.adapters import linear_groups, target_modules

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    targets = target_modules(linear_groups(base))
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95), eps=1e-12)

    def step(i):
        batch = torch.tensor(_train_batch(tok, args, i), device=device)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return args.steps * args.batch * (args.seq_len - 1) / (time.perf_counter() - t0)


async def bench_refresh(svc, base_model: str, args) -> dict[str, float]:
    tc = await svc.create_lora_training_client(base_model, rank=args.rank, seed=0)
    mem, disk = [], []
    for i in range(5):
        t0 = time.perf_counter()
        sc = await tc.save_weights_and_get_sampling_client()
        mem.append(time.perf_counter() - t0)
        await sc.stop()
        t0 = time.perf_counter()
        saved = await tc.save_weights_for_sampler(f"refresh-{i}")
        sc = await svc.create_sampling_client(model_path=saved.path)
        disk.append(time.perf_counter() - t0)
        await sc.stop()
    await tc.stop()
    return {"refresh_memory_s": statistics.median(mem), "refresh_disk_s": statistics.median(disk)}


async def main(args) -> dict[str, float]:
    import asyncsess
    from asyncsess_local.models import load_model, load_tokenizer, pick_device, pick_dtype, resolve_model
    from asyncsess_local.testing import build_tiny_llama

    model_dir = args.model or str(build_tiny_llama(tempfile.mkdtemp(), hidden_size=128, num_heads=2, num_layers=4))
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    source = resolve_model(model_dir)
    tok = load_tokenizer(source)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, len(tok), (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    url = f"local://?model={quote(model_dir)}&device={device.type}&dir={quote(tempfile.mkdtemp())}"
    if args.dtype:
        url += f"&dtype={args.dtype}"
    results: dict[str, float] = {}
    async with asyncsess.ServiceClient(url, heartbeat_interval=0) as svc:
        _reset_peak(device)
        results.update(await bench_sampling(svc, model_dir, prompts, args))
        _reset_peak(device)
        results["train_tok_s"] = await bench_training(svc, model_dir, tok, args)
        peak_engine = _peak(device)
        results.update(await bench_refresh(svc, model_dir, args))
    hf = load_model(source, device, dtype)
    results["hf_generate_tok_s"] = bench_generate(hf, prompts, args, device)
    del hf
    _reset_peak(device)
    results["raw_train_tok_s"] = bench_raw_training(model_dir, tok, args, device, dtype)
    peak_raw = _peak(device)

    print(f"\nmodel={args.model or 'tiny-llama (hidden 128, 4 layers)'} device={device} dtype={dtype}")
    print(f"sampling: {args.requests} requests x {args.num_samples} samples x {args.max_tokens} tokens, prompt {args.prompt_len}")
    print("| measure | asyncsess local | baseline | ratio |")
    print("|---|---|---|---|")
    rows = [
        ("sampling tok/s, batched vs unbatched", results["batched_tok_s"], results["unbatched_tok_s"]),
        ("sampling tok/s, batched vs HF generate", results["batched_tok_s"], results["hf_generate_tok_s"]),
        ("train tok/s (fb+optim) vs raw torch+peft", results["train_tok_s"], results["raw_train_tok_s"]),
    ]
    for name, ours, base in rows:
        print(f"| {name} | {ours:,.0f} | {base:,.0f} | {ours / base:.2f}x |")
    print(f"| sampler refresh, in-memory snapshot (median) | {results['refresh_memory_s'] * 1e3:.1f} ms | | |")
    print(f"| sampler refresh, PEFT dir + new sampler (median) | {results['refresh_disk_s'] * 1e3:.1f} ms | | |")
    print(f"| peak device memory, training | {peak_engine} | {peak_raw} | |")
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: a tiny Llama built offline)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args()
    out = anyio.run(main, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
