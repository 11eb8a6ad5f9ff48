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


def _reset_peak(device: torch.device) -> int:
    """Start a peak-memory window; returns the memory already allocated (CUDA only)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak(device: torch.device, start: int) -> str:
    """Peak extra memory since :func:`_reset_peak` (what the measured step needed on top of resident weights)."""
    if device.type != "cuda":
        return "n/a (CPU)"
    return f"{(torch.cuda.max_memory_allocated(device) - start) / 2**20:.0f} MiB"


async def sample_rates(sc, prompts: list[list[int]], args) -> tuple[float, float]:
    """(unbatched, batched) tokens/s: one request at a time, then all at once."""
    from asyncsess.types import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[], seed=0)
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
    return unbatched / t_unbatched, batched / (time.perf_counter() - t0)


def bench_generate(model, prompts: list[list[int]], args, device) -> float:
    """HF generate, one prompt at a time with num_return_sequences (its usual use)."""
    tokens = 0
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


async def train_rate(tc, tok, args, first_step: int) -> float:
    """tokens/s of ``args.steps`` pipelined forward_backward + optim_step through the client."""
    from asyncsess.types import AdamParams, Datum, ModelInput

    def datums(step):
        return [
            Datum(model_input=ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)})
            for s in _train_batch(tok, args, step)
        ]

    t0 = time.perf_counter()
    for step in range(first_step, first_step + args.steps):
        fb = tc.forward_backward(datums(step), "cross_entropy")
        opt = tc.optim_step(AdamParams(learning_rate=1e-4))
        await fb
        await opt
    return args.steps * args.batch * (args.seq_len - 1) / (time.perf_counter() - t0)


class RawLoop:
    """The hand-written reference: transformers + peft + AdamW on an unpadded batch (equal lengths)."""

    def __init__(self, model_dir: str, tok, args, device, dtype) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from asyncsess_local.adapters import linear_groups, target_modules

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        targets = target_modules(linear_groups(base))
        self.model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets, lora_dropout=0.0))
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        self.tok, self.args, self.device = tok, args, device

    def step(self, i: int) -> None:
        batch = torch.tensor(_train_batch(self.tok, self.args, i), device=self.device)
        logits = self.model(input_ids=batch[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def rate(self, first_step: int) -> float:
        t0 = time.perf_counter()
        for i in range(first_step, first_step + self.args.steps):
            self.step(i)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.args.steps * self.args.batch * (self.args.seq_len - 1) / (time.perf_counter() - t0)


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
    samples: dict[str, list[float]] = {k: [] for k in ("unbatched", "batched", "generate", "train", "raw_train")}
    hf = load_model(source, device, dtype)
    raw = RawLoop(model_dir, tok, args, device, dtype)
    async with asyncsess.ServiceClient(url, heartbeat_interval=0) as svc:
        sc = await svc.create_sampling_client(base_model=model_dir)
        tc = await svc.create_lora_training_client(model_dir, rank=args.rank, seed=0)
        await sample_rates(sc, prompts[:2], args)  # warm-up, every path
        bench_generate(hf, prompts[:1], args, device)
        await train_rate(tc, tok, args, 0)
        raw.rate(0)
        for r in range(args.rounds):  # interleaved rounds: a busy machine slows both sides alike
            u, bt = await sample_rates(sc, prompts, args)
            samples["unbatched"].append(u)
            samples["batched"].append(bt)
            samples["generate"].append(bench_generate(hf, prompts, args, device))
            start = _reset_peak(device)
            samples["train"].append(await train_rate(tc, tok, args, 1000 * (r + 1)))
            peak_engine = _peak(device, start)
            start = _reset_peak(device)
            samples["raw_train"].append(raw.rate(1000 * (r + 1)))
            peak_raw = _peak(device, start)
        await sc.stop()
        await tc.stop()
        results = {f"{k}_tok_s": statistics.median(v) for k, v in samples.items()}
        results.update(await bench_refresh(svc, model_dir, args))

    print(f"\nmodel={args.model or 'tiny-llama (hidden 128, 4 layers)'} device={device} dtype={dtype}")
    print(f"median of {args.rounds} interleaved rounds; training: batch {args.batch} x {args.seq_len} tokens, rank {args.rank}")
    print(f"sampling: {args.requests} requests x {args.num_samples} samples x {args.max_tokens} tokens, prompt {args.prompt_len}")
    print("| measure | asyncsess local | baseline | ratio |")
    print("|---|---|---|---|")
    rows = [
        ("sampling tok/s, batched vs unbatched", results["batched_tok_s"], results["unbatched_tok_s"]),
        ("sampling tok/s, batched vs HF generate", results["batched_tok_s"], results["generate_tok_s"]),
        ("sampling tok/s, unbatched vs HF generate", results["unbatched_tok_s"], results["generate_tok_s"]),
        ("train tok/s (fb+optim) vs raw torch+peft", results["train_tok_s"], results["raw_train_tok_s"]),
    ]
    for name, ours, base in rows:
        print(f"| {name} | {ours:,.0f} | {base:,.0f} | {ours / base:.2f}x |")
    print(f"| sampler refresh, in-memory snapshot (median) | {results['refresh_memory_s'] * 1e3:.1f} ms | | |")
    print(f"| sampler refresh, PEFT dir + new sampler (median) | {results['refresh_disk_s'] * 1e3:.1f} ms | | |")
    print(f"| peak extra device memory, training step | {peak_engine} | {peak_raw} | |")
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
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args()
    out = anyio.run(main, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
